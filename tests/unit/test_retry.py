"""peers/retry.py: the full-jitter maths in tables, and the async forms with waits of zero."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from peers.retry import Backoff, RetryPolicy, attempts, backoff_delay, backoff_delays, next_wait, retry


@pytest.mark.parametrize(("attempt", "base_s", "cap_s", "ceiling"), [
    (0, 0.1, 5.0, 0.1),
    (1, 0.1, 5.0, 0.2),
    (3, 0.1, 5.0, 0.8),
    (5, 0.1, 2.0, 2.0),      # 3.2 capped
    (6, 0.05, 1.0, 1.0),     # 3.2 capped
    (100, 0.01, 1.0, 1.0),   # no overflow for loops that retry forever
    (10**6, 0.01, 1.0, 1.0),
    (4, 0.0, 1.0, 0.0),      # base 0: retry at once
    (0, 1.0, 0.0, 0.0),      # cap 0: retry at once
    (2, 3.0, 1.0, 1.0),      # base above cap: the cap from the start
])
def test_retry_backoff_delay_is_full_jitter_under_the_capped_ceiling(attempt: int, base_s: float, cap_s: float,
                                                                     ceiling: float) -> None:
    for seed in range(20):
        d = backoff_delay(attempt, random.Random(seed), base_s=base_s, cap_s=cap_s)
        assert 0.0 <= d <= ceiling
        # exactly one uniform draw over [0, ceiling]: the same as drawing it by hand from the same seed
        assert d == pytest.approx(random.Random(seed).uniform(0.0, ceiling), rel=1e-12, abs=0.0)


@pytest.mark.parametrize(("attempt", "ceiling"), [(0, 0.1), (2, 0.4), (9, 3.0)])
def test_retry_jitter_spreads_over_the_whole_range(attempt: int, ceiling: float) -> None:
    rng = random.Random(7)
    draws = [backoff_delay(attempt, rng, base_s=0.1, cap_s=3.0) for _ in range(4000)]
    assert min(draws) < 0.02 * ceiling and max(draws) > 0.98 * ceiling
    assert statistics.fmean(draws) == pytest.approx(ceiling / 2, rel=0.05)  # full jitter: mean is half


def test_retry_delays_are_reproducible_with_a_seeded_rng() -> None:
    a = backoff_delays(30, random.Random(42), base_s=0.01, cap_s=1.0)
    assert a == backoff_delays(30, random.Random(42), base_s=0.01, cap_s=1.0)
    assert a != backoff_delays(30, random.Random(43), base_s=0.01, cap_s=1.0)
    policy = RetryPolicy(0.01, 1.0)
    rng = random.Random(42)
    assert [policy.delay(i, rng) for i in range(30)] == a


@pytest.mark.parametrize(("max_attempts", "attempt", "now", "deadline", "expect"), [
    (3, 0, 0.0, None, "draw"),
    (3, 1, 0.0, None, "draw"),
    (3, 2, 0.0, None, None),         # the third attempt was the last
    (1, 0, 0.0, None, None),
    (None, 50, 0.0, None, "draw"),   # no limit
    (None, 0, 10.0, 10.0, None),     # deadline reached
    (None, 0, 11.0, 10.0, None),
    (None, 3, 9.9, 10.0, 0.1),       # ceiling 8 s cut at the deadline
    (None, 0, 0.0, 10.0, "draw"),    # ceiling 1 s, far from the deadline
])
def test_retry_next_wait_table(max_attempts: int | None, attempt: int, now: float, deadline: float | None,
                               expect: float | str | None) -> None:
    policy = RetryPolicy(1.0, 60.0, max_attempts)
    got = next_wait(policy, attempt, random.Random(3), now=now, deadline=deadline)
    if expect is None:
        assert got is None
    elif expect == "draw":
        assert got == policy.delay(attempt, random.Random(3))
    else:
        assert got == pytest.approx(expect)


@pytest.mark.parametrize("kwargs", [{"base_s": -0.1, "cap_s": 1.0}, {"base_s": 0.1, "cap_s": -1.0},
                                    {"base_s": 0.1, "cap_s": 1.0, "max_attempts": 0}])
def test_retry_policy_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_retry_backoff_counts_failures_and_resets() -> None:
    b = Backoff(0.05, 1.0, random.Random(9))
    first = [b.next_delay() for _ in range(8)]
    assert first == backoff_delays(8, random.Random(9), base_s=0.05, cap_s=1.0)
    assert b.failures == 8
    b.reset()
    assert b.failures == 0 and b.next_delay() <= 0.05  # back to the first ceiling


class _Flaky:
    """Fails ``failures`` times with ``exc`` then returns ``"ok"``."""

    def __init__(self, failures: int, exc: BaseException) -> None:
        self.failures, self.exc, self.calls = failures, exc, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "ok"


@pytest.mark.asyncio
async def test_retry_succeeds_after_failures_and_reports_each_wait() -> None:
    fn = _Flaky(2, OSError("down"))
    seen: list[tuple[int, str, float]] = []
    got = await retry(fn, RetryPolicy(0.0, 0.0, 5), retry_on=OSError,
                      on_retry=lambda n, exc, wait: seen.append((n, str(exc), wait)))
    assert got == "ok" and fn.calls == 3
    assert seen == [(1, "down", 0.0), (2, "down", 0.0)]


@pytest.mark.asyncio
async def test_retry_gives_up_after_max_attempts_with_the_last_error() -> None:
    fn = _Flaky(10, TimeoutError("slow"))
    with pytest.raises(TimeoutError, match="slow"):
        await retry(fn, RetryPolicy(0.0, 0.0, 4), retry_on=(OSError, TimeoutError))
    assert fn.calls == 4


@pytest.mark.asyncio
async def test_retry_other_errors_and_give_up_propagate_at_once() -> None:
    fn = _Flaky(10, KeyError("k"))
    with pytest.raises(KeyError):
        await retry(fn, RetryPolicy(0.0, 0.0, 4), retry_on=OSError)
    assert fn.calls == 1
    fn = _Flaky(10, PermissionError("no"))
    with pytest.raises(PermissionError):
        await retry(fn, RetryPolicy(0.0, 0.0, 4), retry_on=OSError,
                    give_up=lambda exc: isinstance(exc, PermissionError))
    assert fn.calls == 1


@pytest.mark.asyncio
async def test_retry_deadline_bounds_the_attempts() -> None:
    loop = asyncio.get_running_loop()
    fn = _Flaky(10, OSError("down"))
    with pytest.raises(OSError):
        await retry(fn, RetryPolicy(0.0, 0.0), retry_on=OSError, deadline=loop.time() - 1.0)
    assert fn.calls == 1  # the first attempt always runs; none starts after the deadline


@pytest.mark.asyncio
async def test_retry_attempts_iterator_limits() -> None:
    assert [a async for a in attempts(RetryPolicy(0.0, 0.0, 3))] == [0, 1, 2]
    loop = asyncio.get_running_loop()
    assert [a async for a in attempts(RetryPolicy(0.0, 0.0), deadline=loop.time() - 1.0)] == [0]
    got = []
    async for a in attempts(RetryPolicy(0.0, 0.0)):  # unbounded: the body decides
        got.append(a)
        if a == 5:
            break
    assert got == [0, 1, 2, 3, 4, 5]
