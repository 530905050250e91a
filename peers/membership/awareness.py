"""Lifeguard local health (memberlist `awareness.go`).

A node that misses acks it should have received, or that is accused by others,
is probably the slow one (overloaded, paused, lossy NIC). It then probes less
often and waits longer, instead of accusing healthy peers.
"""

from __future__ import annotations

__all__ = ["Awareness"]


class Awareness:
    """Health score clamped to ``[0, max_score]``; timeouts scale by ``score + 1``."""

    __slots__ = ("max_score", "score")

    def __init__(self, max_score: int) -> None:
        self.max_score = max_score
        self.score = 0

    def apply_delta(self, delta: int) -> int:
        """Move the score by delta (clamped); returns the new score."""
        self.score = min(self.max_score, max(0, self.score + delta))
        return self.score

    def scale(self, timeout_s: float) -> float:
        """The given timeout stretched by the current health multiplier."""
        return timeout_s * (self.score + 1)
