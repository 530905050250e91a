"""Pure suspicion-timeout maths (Lifeguard, memberlist `suspicion.go`).

A member suspected by one accuser is given a long time to refute (the maximum);
each *independent* accuser that also suspects it shortens the remaining time,
logarithmically, down to the minimum once k confirmations are in. Suspicion
raised by a lone, possibly unhealthy, node therefore rarely becomes a death.
"""

from __future__ import annotations

import math

__all__ = ["Suspicion", "push_pull_scale", "remaining_suspicion_s", "suspicion_timeout_s"]


def suspicion_timeout_s(mult: int, n: int, probe_interval_s: float) -> float:
    """Minimum suspicion timeout: ``mult * max(1, log10(max(1, n))) * interval``.

    memberlist's `suspicionTimeout`; n is the estimated member count. The node
    scale is truncated to milliseconds as memberlist does, so tables match it.
    """
    node_scale = max(1.0, math.log10(max(1.0, float(n))))
    return mult * math.floor(node_scale * 1000.0) * probe_interval_s / 1000.0


def remaining_suspicion_s(confirmations: int, k: int, elapsed_s: float,
                          min_s: float, max_s: float) -> float:
    """Time left before a suspect is declared dead (memberlist `remainingSuspicionTime`).

    ``timeout = max - (max - min) * log(c + 1) / log(k + 1)``, floored at min and
    rounded down to the millisecond, minus what has already elapsed. With k < 1
    no confirmations are expected and the timeout is the minimum.
    """
    if k < 1:
        return min_s - elapsed_s
    frac = math.log(confirmations + 1.0) / math.log(k + 1.0)
    raw = max_s - frac * (max_s - min_s)
    timeout = math.floor(1000.0 * raw) / 1000.0
    return max(timeout, min_s) - elapsed_s


def push_pull_scale(interval_s: float, n: int) -> float:
    """Push-pull period grows with N beyond 32 members (memberlist `pushPullScale`)."""
    threshold = 32
    if n <= threshold:
        return interval_s
    multiplier = math.ceil(math.log2(n) - math.log2(threshold)) + 1.0
    return interval_s * multiplier


class Suspicion:
    """One suspicion timer: start time, bounds, and the distinct confirmers seen.

    Invariant: ``confirmers`` holds the accusers other than the first; their
    count never exceeds k (later ones change nothing and are not re-gossiped).
    """

    __slots__ = ("confirmers", "first_accuser", "k", "max_s", "min_s", "start")

    def __init__(self, first_accuser: str, k: int, min_s: float, max_s: float,
                 start: float) -> None:
        self.first_accuser = first_accuser
        self.k = k
        self.min_s = min_s
        self.max_s = max_s if k >= 1 else min_s
        self.start = start
        self.confirmers: set[str] = set()

    def confirm(self, accuser: str) -> bool:
        """Record an independent accuser; True when it is new (and so worth gossiping)."""
        if len(self.confirmers) >= self.k or accuser == self.first_accuser:
            return False
        if accuser in self.confirmers:
            return False
        self.confirmers.add(accuser)
        return True

    def deadline(self) -> float:
        """Absolute time at which the suspect is declared dead."""
        return self.start + remaining_suspicion_s(len(self.confirmers), self.k, 0.0,
                                                  self.min_s, self.max_s)
