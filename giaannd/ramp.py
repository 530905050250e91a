"""Ramp-up: a storage member that has just come (back) up gets its share of work gradually.

Theory of operation
-------------------
A node back from an outage (or new in the placement) starts cold: its page cache and row cache
are empty, its hint holders want to hand it every write it missed, and it takes its full share of
new writes at once. If readers also sent it every read it is first in line for, it would be
flooded exactly when it is slowest (issue 8, "a rejoining empty node is not flooded"). Two knobs
spread the load over ``ramp_s`` seconds from the moment the member came up:

- **Reads** (``RampTracker``, used by ``StorageClient.read_rows``): the member is chosen with a
  *weight* that grows linearly from ``floor`` to 1 (``read_weight``). Each row has a fixed pseudo
  random *draw* ``u`` in [0, 1) (``row_draws``, a hash of its key); while ``u >= weight`` the
  ramping member is moved behind the other live replicas of that row, which serve it instead. So a
  fraction ``weight`` of the rows it would serve goes to it, and as the weight grows the set of
  its rows only grows (a row once sent to it stays with it: its cache warms monotonically).
  Deterministic: the same rows at the same instant always go to the same replica.
- **Hint delivery** (``HintPacer``, used by ``StorageService``): hints for the member are sent
  through a token bucket (``peers.token_bucket.TokenBucket``, GCRA form) whose rate grows
  linearly from ``start_bytes_per_s`` to ``HINT_RAMP_FACTOR`` times that over ``ramp_s``; after the
  ramp, delivery is unpaced. Pacing only delays: every hint is still delivered, in order, and a
  hint larger than the bucket goes alone (the next one waits until its bytes are paid for).

Both restart when the member goes down and comes up again. Pure: no clock of its own (every
method takes ``now``), no I/O; the client and the service own the clocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

from peers.token_bucket import TokenBucket

__all__ = [
    "HINT_BURST_S",
    "HINT_RAMP_FACTOR",
    "READ_RAMP_FLOOR",
    "HintPacer",
    "RampTracker",
    "ramp_fraction",
    "read_weight",
    "row_draws",
]

#: Share of its reads a member gets the moment it comes up: not 0, so its cache starts warming
#: at once and a ramp over a cluster of ramping members still spreads reads.
READ_RAMP_FLOOR: Final = 0.1
#: Hint delivery ends the ramp at this multiple of its start rate (then goes unpaced).
HINT_RAMP_FACTOR: Final = 16.0
#: Seconds of idle credit the hint bucket keeps (a burst of small hints after a pause goes at once).
HINT_BURST_S: Final = 1.0


def ramp_fraction(elapsed_s: float, ramp_s: float) -> float:
    """How far through the ramp: 0 at the start, 1 at ``ramp_s`` and after (1 when disabled)."""
    if ramp_s <= 0 or elapsed_s >= ramp_s:
        return 1.0
    return max(0.0, elapsed_s / ramp_s)


def read_weight(elapsed_s: float, ramp_s: float, floor: float = READ_RAMP_FLOOR) -> float:
    """The member's read weight ``elapsed_s`` after it came up: ``floor`` → 1 linearly over ``ramp_s``."""
    return floor + (1.0 - floor) * ramp_fraction(elapsed_s, ramp_s)


_M1: Final = np.uint64(0xBF58476D1CE4E5B9)
_M2: Final = np.uint64(0x94D049BB133111EB)
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)


def row_draws(row_column: NDArray[np.uint64], row_feature: NDArray[np.uint64]) -> NDArray[np.float64]:
    """A fixed pseudo-random number in [0, 1) per row key (splitmix64 finaliser of the key)."""
    with np.errstate(over="ignore"):
        x = row_column * _GOLDEN ^ row_feature
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class RampTracker:
    """Read weights of members that came up recently (module docstring).

    Args:
        ramp_s: length of the ramp; 0 disables it (every weight is 1).
        floor: the weight at the start.
    """

    def __init__(self, ramp_s: float, floor: float = READ_RAMP_FLOOR) -> None:
        if not 0.0 < floor <= 1.0:
            raise ValueError("floor must be in (0, 1]")
        self.ramp_s = ramp_s
        self.floor = floor
        self._since: dict[str, float] = {}

    def start(self, name: str, now: float) -> None:
        """``name`` came up at ``now``: (re)start its ramp."""
        if self.ramp_s > 0:
            self._since[name] = now

    def forget(self, name: str) -> None:
        """``name`` went down or left: no ramp until it comes up again."""
        self._since.pop(name, None)

    def weight(self, name: str, now: float) -> float:
        since = self._since.get(name)
        if since is None:
            return 1.0
        if now - since >= self.ramp_s:
            del self._since[name]  # ramp over
            return 1.0
        return read_weight(now - since, self.ramp_s, self.floor)

    def weights(self, names: Sequence[str], now: float) -> NDArray[np.float64] | None:
        """Per member weight, or None when nobody is ramping (the common case: no work)."""
        if not self._since:
            return None
        out = np.array([self.weight(n, now) for n in names], np.float64)
        return out if bool((out < 1.0).any()) else None

    def ramping(self, now: float) -> dict[str, float]:
        """Members still ramping and their weights (for logs and tests)."""
        return {n: self.weight(n, now) for n in list(self._since) if self.weight(n, now) < 1.0}


class HintPacer:
    """Paces hint bytes to one member that came up at ``started_at`` (module docstring).

    ``reserve(now, nbytes)`` books a send and returns how long to wait before it; the caller sends
    after that wait. The bucket is the shared GCRA one; this class only sets its rate for each send
    (the ramp's rate at the send's start) and stops pacing once the ramp is over.

    Args:
        start_bytes_per_s: rate at ``started_at``.
        ramp_s: after this many seconds delivery is unpaced (0: never paced).
        started_at: when the member came up (the caller's clock).
        factor: the rate at the end of the ramp, as a multiple of the start rate.
        burst_s: idle credit kept, in seconds of the current rate.
    """

    def __init__(self, start_bytes_per_s: float, ramp_s: float, started_at: float,
                 factor: float = HINT_RAMP_FACTOR, burst_s: float = HINT_BURST_S) -> None:
        if start_bytes_per_s <= 0 or factor < 1 or burst_s < 0:
            raise ValueError("start rate must be > 0, factor >= 1, burst >= 0")
        self.start_bytes_per_s = start_bytes_per_s
        self.ramp_s = ramp_s
        self.started_at = started_at
        self.factor = factor
        self.burst_s = burst_s
        self._bucket = TokenBucket(start_bytes_per_s, started_at, burst_s=burst_s)

    def rate(self, now: float) -> float:
        """Bytes per second allowed at ``now`` (infinite once the ramp is over)."""
        if self.done(now):
            return math.inf
        frac = ramp_fraction(now - self.started_at, self.ramp_s)
        return self.start_bytes_per_s * (1.0 + (self.factor - 1.0) * frac)

    def done(self, now: float) -> bool:
        return self.ramp_s <= 0 or now - self.started_at >= self.ramp_s

    def reserve(self, now: float, nbytes: int) -> float:
        """Book ``nbytes`` to send as soon as allowed; returns the seconds to wait first (>= 0)."""
        start = self._bucket.start_at(now)
        if self.done(start):
            return max(0.0, start - now)
        self._bucket.rate = self.rate(start)
        return self._bucket.reserve(now, nbytes)
