"""Retries: capped exponential backoff with full jitter, as pure maths and three small async forms.

Theory of operation
-------------------
After failed attempt ``a`` (0-based) the caller waits ``U(0, min(cap_s, base_s · 2^a))`` before the
next one: the AWS architecture blog's "full jitter" (dask ``comm/core.py`` does the same), so nodes
that failed together do not retry in lock-step against a peer that is restarting. The mean wait is
half the ceiling; a caller that wants the old mean of a fixed doubling doubles its base.

- ``backoff_delay`` / ``RetryPolicy.delay``: the delay, a pure function of the attempt and an
  injected ``random.Random`` (seeded in tests and simulations: the same seed, the same delays).
- ``next_wait``: the whole decision after a failure, pure (``now`` passed in): the delay clipped to
  an optional deadline, or None when no attempt is left (``max_attempts`` used, deadline passed).
- ``retry(fn, policy, retry_on=...)``: call ``fn`` until it returns, retrying the listed exceptions;
  the last one is re-raised when attempts or time run out.
- ``attempts(policy)``: ``async for attempt in attempts(...)`` for loops whose failure is a result,
  not an exception (a join round nobody answered, hints still held after a delivery).
- ``Backoff``: the attempt counter of a long-running loop that retries *between* successes (a
  stream's reconnects): ``next_delay()`` after a failure, ``reset()`` after a success.

Deadlines are in the event loop's clock (``loop.time()``); a deadline bounds when an attempt may
*start*: the last wait is cut short at the deadline and no attempt starts after it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Attempts", "Backoff", "RetryPolicy", "attempts", "backoff_delay", "backoff_delays", "next_wait",
           "retry"]

T = TypeVar("T")
#: Exponents above this add nothing (2^62 · any sane base is past any cap) and would overflow floats
#: eventually; attempts are unbounded in loops that retry forever.
_MAX_EXPONENT = 62


def backoff_delay(attempt: int, rng: random.Random, *, base_s: float, cap_s: float) -> float:
    """Full-jitter delay after failed attempt ``attempt`` (0-based): U(0, min(cap, base·2^attempt)). Pure."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, _MAX_EXPONENT)))


def backoff_delays(n: int, rng: random.Random, *, base_s: float, cap_s: float) -> list[float]:
    """The delays after the first ``n`` failed attempts (for tests and docs)."""
    return [backoff_delay(i, rng, base_s=base_s, cap_s=cap_s) for i in range(n)]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a retry loop waits and when it gives up.

    Attributes:
        base_s: ceiling of the first wait; doubles per failed attempt (0: retry at once).
        cap_s: the ceiling never grows past this.
        max_attempts: attempts in all, the first included; None: until the deadline, or forever.
    """

    base_s: float
    cap_s: float
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < 0:
            raise ValueError("backoff base_s and cap_s must be >= 0")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (or None)")

    def delay(self, attempt: int, rng: random.Random) -> float:
        return backoff_delay(attempt, rng, base_s=self.base_s, cap_s=self.cap_s)


def next_wait(policy: RetryPolicy, attempt: int, rng: random.Random, *, now: float = 0.0,
              deadline: float | None = None) -> float | None:
    """Seconds to wait after failed attempt ``attempt`` (0-based) before the next, or None when none
    is left: ``max_attempts`` reached, or ``deadline`` (same clock as ``now``) passed. The wait is
    cut short at the deadline. Pure: draws from ``rng`` only when another attempt follows."""
    if policy.max_attempts is not None and attempt + 1 >= policy.max_attempts:
        return None
    if deadline is not None and now >= deadline:
        return None
    delay = policy.delay(attempt, rng)
    return delay if deadline is None else min(delay, deadline - now)


async def retry(fn: Callable[[], Awaitable[T]], policy: RetryPolicy, *,
                retry_on: type[BaseException] | tuple[type[BaseException], ...],
                give_up: Callable[[BaseException], bool] | None = None,
                on_retry: Callable[[int, BaseException, float], None] | None = None,
                deadline: float | None = None, rng: random.Random | None = None) -> T:
    """Await ``fn()`` until it returns, waiting ``policy``'s backoff after each failure in ``retry_on``.

    Args:
        fn: one attempt.
        policy: backoff and attempt limit.
        retry_on: the exceptions worth another attempt; anything else propagates at once.
        give_up: an exception of ``retry_on`` for which it returns True propagates at once.
        on_retry: told (failed attempts so far, the exception, the wait) before each wait.
        deadline: no attempt starts at or after this ``loop.time()``.
        rng: the jitter's source (seed it for reproducible waits).

    Raises:
        The last exception of ``fn`` once no attempt is left, or any it raised that is not retried.
    """
    rng = rng or random.Random()
    loop = asyncio.get_running_loop()
    attempt = 0
    while True:
        try:
            return await fn()
        except retry_on as exc:
            if give_up is not None and give_up(exc):
                raise
            wait = next_wait(policy, attempt, rng, now=loop.time(), deadline=deadline)
            if wait is None:
                raise
            if on_retry is not None:
                on_retry(attempt + 1, exc, wait)
            last = exc
        await asyncio.sleep(wait)
        if deadline is not None and loop.time() >= deadline:
            raise last
        attempt += 1


class Attempts:
    """Async iterator of attempt numbers 0, 1, 2, ..., waiting the backoff between two (see
    :func:`attempts`). The loop body decides success and ``break``s; running out ends the loop."""

    def __init__(self, policy: RetryPolicy, deadline: float | None, rng: random.Random) -> None:
        self.policy, self.deadline, self._rng = policy, deadline, rng
        self._next = 0

    def __aiter__(self) -> Attempts:
        return self

    async def __anext__(self) -> int:
        attempt = self._next
        if attempt > 0:
            loop = asyncio.get_running_loop()
            wait = next_wait(self.policy, attempt - 1, self._rng, now=loop.time(), deadline=self.deadline)
            if wait is None:
                raise StopAsyncIteration
            await asyncio.sleep(wait)
            if self.deadline is not None and loop.time() >= self.deadline:
                raise StopAsyncIteration
        self._next = attempt + 1
        return attempt


def attempts(policy: RetryPolicy, *, deadline: float | None = None, rng: random.Random | None = None) -> Attempts:
    """``async for attempt in attempts(policy): ...``: the first attempt at once, each later one after
    the backoff; ends after ``policy.max_attempts`` or once ``deadline`` (``loop.time()``) passed."""
    return Attempts(policy, deadline, rng or random.Random())


class Backoff:
    """Backoff of a loop that keeps running across failures and successes (a stream's reconnects):
    ``next_delay()`` after each failure, ``reset()`` after a success. Never gives up by itself.

    Args:
        base_s / cap_s: as in :class:`RetryPolicy`.
        rng: the jitter's source.
    """

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        self.policy = RetryPolicy(base_s, cap_s)
        self._rng = rng or random.Random()
        #: failures since the last success (or the start)
        self.failures = 0

    def next_delay(self) -> float:
        """The wait after one more failure."""
        delay = self.policy.delay(self.failures, self._rng)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0
