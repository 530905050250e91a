"""peers.log_limiter: one line per key per interval, with the count held back."""

import pytest

from peers.log_limiter import LogLimiter


def test_log_limiter_one_line_per_interval_with_the_count_held_back() -> None:
    lim = LogLimiter(10.0)
    assert lim.admit("enospc", 0.0) == 0  # the first is logged at once
    assert [lim.admit("enospc", t) for t in (1.0, 2.0, 9.9)] == [None, None, None]
    assert lim.held("enospc") == 3
    assert lim.admit("enospc", 10.0) == 3  # the next line says how many were held back
    assert lim.admit("enospc", 10.5) is None


def test_log_limiter_keys_are_independent_and_forget_resets() -> None:
    lim = LogLimiter(10.0)
    assert lim.admit("a", 0.0) == 0 and lim.admit("b", 0.1) == 0
    assert lim.admit("a", 0.2) is None
    assert lim.forget("a") == 1  # never logged: for a closing line
    assert lim.admit("a", 0.3) == 0  # the condition came back: logged at once


def test_log_limiter_bounded_keys_and_zero_interval() -> None:
    lim = LogLimiter(10.0, max_keys=2)
    for i, key in enumerate("abc"):
        assert lim.admit(key, float(i)) == 0
    assert lim.admit("a", 3.0) == 0  # forgotten (oldest), so logged again rather than lost
    assert all(LogLimiter(0.0).admit("x", 0.0) == 0 for _ in range(3))
    with pytest.raises(ValueError):
        LogLimiter(-1.0)
