"""Progress bar rendering (pure) and its non-TTY output."""

from __future__ import annotations

import io

import pytest

from giaannd.sdk.progress import ProgressBar, render_bar


@pytest.mark.parametrize(("done", "total", "elapsed", "expected"), [
    (0, 10, 0.0, "[..........]   0% 0/10 s 0.0/s"),
    (5, 10, 1.0, "[#####.....]  50% 5/10 s 5.0/s eta 1s"),
    (10, 10, 2.0, "[##########] 100% 10/10 s 5.0/s"),
    (12, 10, 2.0, "[##########] 100% 12/10 s 6.0/s"),
    (7, None, 2.0, "7 s 3.5/s"),
    (7, 0, 2.0, "7 s 3.5/s"),
])
def test_progress_render_bar(done: int, total: int | None, elapsed: float, expected: str) -> None:
    assert render_bar(done, total, "s", elapsed, width=10) == expected


def test_progress_non_tty_logs_each_tenth_once() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, "job 1")
    for done in range(0, 101, 5):
        bar.update(done, 100, "sentences")
    bar.close("succeeded")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 12  # 0%, 10%, ..., 100%, then the final line
    assert lines[-1] == "job 1 succeeded"


def test_progress_rate_counts_only_what_was_done_while_following(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train wait`` on a job resumed at 900, or ``node topology watch`` joined late: the rate
    and ETA were the whole count over the time followed (900/s and no ETA after 1 s at 10/s;
    hundreds of thousands per second on the first poll)."""
    now = [100.0]
    monkeypatch.setattr("giaannd.sdk.progress.time.monotonic", lambda: now[0])
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    bar = ProgressBar(out, "job 1")
    bar.update(900, 1000, "s")
    now[0] += 1.0
    bar.update(910, 1000, "s")
    bar.close("succeeded")
    first, second, last = out.getvalue().split("\r")[1:]
    assert first == "job 1 [###########################...]  90% 900/1000 s 0.0/s\x1b[K"
    assert second == "job 1 [###########################...]  91% 910/1000 s 10.0/s eta 9s\x1b[K"
    assert last == "job 1 [###########################...]  91% 910/1000 s 10.0/s eta 9s succeeded\x1b[K\n"
