"""A token bucket in its GCRA form: pure rate limiting with the clock passed in.

Theory of operation
-------------------
A bucket of ``rate · burst_s`` tokens refilled at ``rate`` per second, where a send of ``n`` units
takes ``n`` tokens, is the generic cell rate algorithm (ITU-T I.371; the form Redis rate limiters
and the Linux ``tc`` policer use) with one number of state: ``tat``, the *theoretical arrival
time*, when everything booked so far is paid for. A send may start once ``tat`` is at most
``burst_s`` ahead of it, then pushes ``tat`` by ``n / rate``:

    start = max(now, tat - burst_s)          # wait start - now first
    tat   = max(tat, start) + n / rate

So idle time earns at most ``burst_s`` seconds of credit; a send larger than the whole bucket is
never refused, it goes alone and the next send waits for its bytes to be paid; and ``rate`` may
change between sends (what is already booked keeps the rate it was booked at), which is how the
hint pacer ramps (giaannd/ramp.py). ``reserve`` books the send and returns the wait, so the caller
sleeps *before* sending and the time a send itself takes counts towards the rate.

Pure: every method takes ``now`` (any monotonic clock, seconds); no I/O, no sleeping.
"""

from __future__ import annotations

import math

__all__ = ["TokenBucket"]


class TokenBucket:
    """GCRA token bucket (module docstring).

    Args:
        rate: units per second (bytes/s for the callers here); > 0, may be ``math.inf``.
        now: the caller's clock at creation: the bucket starts empty of credit, so a first send goes
            at once and the one after waits for it.
        burst_s: idle credit kept, in seconds of ``rate``.
    """

    def __init__(self, rate: float, now: float, *, burst_s: float = 0.0) -> None:
        if not rate > 0 or burst_s < 0 or math.isnan(burst_s):
            raise ValueError("token bucket rate must be > 0 and burst_s >= 0")
        self.rate = rate
        self.burst_s = burst_s
        self.tat = now

    def start_at(self, now: float) -> float:
        """When the next send may start (``now`` when it may go at once)."""
        return max(now, self.tat - self.burst_s)

    def reserve(self, now: float, amount: float) -> float:
        """Book ``amount`` units to send as soon as allowed; returns the seconds to wait first (>= 0).

        Raises:
            ValueError: a negative amount, or a rate changed to one that is not > 0.
        """
        if amount < 0 or not self.rate > 0:
            raise ValueError("token bucket: amount must be >= 0 and rate > 0")
        start = self.start_at(now)
        self.tat = max(self.tat, start) + amount / self.rate
        return start - now
