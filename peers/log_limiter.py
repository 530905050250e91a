"""Rate-limited logging: at most one line per kind of event every ``interval_s``, with a count of
the lines held back in between.

Why: an error that repeats on every request (a full disk refusing every write, a peer sending
garbage on every probe) must stay visible without flooding the journal; a hostile run logged 102
identical ERROR lines in 2 s. Each kind (a key the caller picks: a reason token, an operation) gets
its own window, so a rare error is never hidden behind a frequent one.

Sans-IO (STYLE.md item 1): the caller passes ``now`` (monotonic seconds) and does the logging::

    held = limiter.admit("enospc", time.monotonic())
    if held is not None:
        log.error("write failed reason=enospc suppressed=%d ...", held)

Memory is bounded: at most ``max_keys`` kinds are remembered; beyond that the least recently
logged kind is forgotten (its next line is then logged at once, never lost).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final

__all__ = ["DEFAULT_MAX_KEYS", "LogLimiter"]

#: Kinds remembered at once: callers key by a reason token or an operation (a handful); the bound
#: only matters if a caller keys by something peer-controlled.
DEFAULT_MAX_KEYS: Final = 256


class LogLimiter:
    """One line per key every ``interval_s`` (module docstring).

    Args:
        interval_s: the least time between two lines of one key (0: every line is logged).
        max_keys: kinds remembered at once.
    """

    def __init__(self, interval_s: float, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if interval_s < 0 or max_keys < 1:
            raise ValueError("interval_s must be >= 0 and max_keys >= 1")
        self.interval_s = interval_s
        self.max_keys = max_keys
        #: key -> (time of its last logged line, lines held back since)
        self._keys: dict[Hashable, tuple[float, int]] = {}

    def admit(self, key: Hashable, now: float) -> int | None:
        """Whether to log this occurrence of ``key`` now.

        Returns:
            None: hold it back (counted). Otherwise log it; the value is how many occurrences
            were held back since the last logged one (0 the first time).
        """
        last = self._keys.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        held = 0 if last is None else last[1]
        self._keys.pop(key, None)  # re-inserted last: dict order is logging order
        if len(self._keys) >= self.max_keys:
            del self._keys[next(iter(self._keys))]
        self._keys[key] = (now, 0)
        return held

    def held(self, key: Hashable) -> int:
        """Occurrences of ``key`` held back since its last logged line."""
        last = self._keys.get(key)
        return 0 if last is None else last[1]

    def forget(self, key: Hashable) -> int:
        """Reset ``key`` (the condition ended: its next occurrence is logged at once); returns the
        occurrences held back and never logged, for a closing line."""
        last = self._keys.pop(key, None)
        return 0 if last is None else last[1]
