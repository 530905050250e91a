"""A live progress bar on stderr for long jobs (training), TTY-aware.

On a terminal the bar redraws in place (``\\r``) at most every ``MIN_REDRAW_S``; when stderr is a
file or pipe (CI logs, journald) it prints a plain line per ``LOG_EVERY_PERCENT`` of progress
instead, so logs are not flooded with carriage returns. ``render_bar`` is pure for testing.
"""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["ProgressBar", "render_bar"]

MIN_REDRAW_S = 0.1
LOG_EVERY_PERCENT = 10
BAR_WIDTH = 30


def render_bar(done: int, total: int | None, unit: str, elapsed_s: float,
               width: int = BAR_WIDTH, *, done_before: int = 0) -> str:
    """One status line: ``[#####.....]  50% 500/1000 sentences 123.4/s eta 4s``.

    An unknown or zero ``total`` shows the count and rate without a bar. ``done_before``: what was
    already done when the ``elapsed_s`` began (a job resumed, or followed late), left out of the rate.
    """
    rate = max(done - done_before, 0) / elapsed_s if elapsed_s > 0 else 0.0
    if not total:
        return f"{done} {unit} {rate:.1f}/s"
    frac = min(max(done / total, 0.0), 1.0)
    filled = int(frac * width)
    eta = f" eta {int((total - done) / rate)}s" if 0 < rate and done < total else ""
    return (f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:3.0f}% "
            f"{done}/{total} {unit} {rate:.1f}/s{eta}")


class ProgressBar:
    """Draws job progress to ``stream``; call ``update`` as status arrives and ``close`` at the end."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self._stream = stream
        self._label = label
        self._tty = stream.isatty()
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_logged_pct = -LOG_EVERY_PERCENT
        self._line = ""
        #: the count at the first update: done before it was followed, not in the rate
        self._done_before: int | None = None

    def update(self, done: int, total: int | None, unit: str) -> None:
        """Show ``done`` of ``total`` ``unit``."""
        now = time.monotonic()
        if self._done_before is None:
            self._done_before = done
        self._line = render_bar(done, total, unit, now - self._start, done_before=self._done_before)
        if self._tty:
            if now - self._last_draw >= MIN_REDRAW_S:
                self._stream.write(f"\r{self._label} {self._line}\x1b[K")
                self._stream.flush()
                self._last_draw = now
            return
        pct = int(100 * done / total) if total else 0
        if pct >= self._last_logged_pct + LOG_EVERY_PERCENT:
            self._stream.write(f"{self._label} {self._line}\n")
            self._stream.flush()
            self._last_logged_pct = pct - pct % LOG_EVERY_PERCENT

    def close(self, final: str) -> None:
        """Finish the bar with a final line (e.g. ``succeeded``)."""
        if self._tty:
            self._stream.write(f"\r{self._label} {self._line} {final}\x1b[K\n")
        else:
            self._stream.write(f"{self._label} {final}\n")
        self._stream.flush()
