"""When a storage node snapshots: the waits of its snapshot timer (issue 14 item 3), pure.

Replicas of a column must not snapshot at the same moment: before snapshots stopped blocking
writes, all replicas of a column pausing together failed a training job's quorum (QuorumNotReached),
and even now a snapshot costs disk bandwidth and some apply latency. Nodes of a cluster usually
start together, so a plain ``snapshot-interval-s`` timer would keep them in lock step for ever.
Two things spread them:

- a *phase* from the node's name: the first snapshot comes after ``interval * (0.5 + phase)``,
  phase in [0, 1) from a hash of the name — nodes started together are spread over a whole
  interval, the same way at every start (deterministic: tests and operators can predict it);
- *jitter* on every later wait: ``interval * (1 + jitter * (2u - 1))``, u uniform in [0, 1) from a
  generator seeded by the name, so two nodes whose phases happen to be close drift apart instead
  of colliding at every interval. The mean wait stays ``interval``.

At each turn the timer writes a snapshot only when one is due (``snapshot_due``): something was
logged since the last one, and at least ``storage.snapshot-min-log-ratio`` of the store's size. A
snapshot rewrites the whole store, so on the timer alone its cost per second grows with the node;
with the ratio it is paid once per that share of the store logged, and a restart replays at most
about that share of log plus one interval's.

No clock, no I/O: the service's timer loop (service.py) takes the waits from ``snapshot_waits`` and
asks ``snapshot_due``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import xxhash

__all__ = ["snapshot_due", "snapshot_waits"]


def snapshot_waits(node_name: str, interval_s: float, jitter: float) -> Iterator[float]:
    """The seconds to wait before each snapshot of ``node_name`` (module docstring), for ever.

    Args:
        node_name: seeds the phase and the jitter (each node its own, stable across restarts).
        interval_s: the mean wait (``storage.snapshot-interval-s``), > 0.
        jitter: the largest relative deviation of a wait after the first (``storage.snapshot-jitter``),
            in [0, 1).

    Raises:
        ValueError: an interval <= 0 or a jitter outside [0, 1).
    """
    if interval_s <= 0 or not 0 <= jitter < 1:
        raise ValueError(f"snapshot waits need interval_s > 0 and 0 <= jitter < 1, got {interval_s}, {jitter}")
    rng = random.Random(xxhash.xxh3_64_intdigest(node_name.encode()))
    yield interval_s * (0.5 + rng.random())
    while True:
        yield interval_s * (1 + jitter * (2 * rng.random() - 1))


def snapshot_due(anything_logged: bool, logged_bytes: int, store_bytes: int, min_log_ratio: float) -> bool:
    """Whether a turn of the timer writes a snapshot (module docstring): ``anything_logged`` since
    the last one, ``logged_bytes`` of log since it (what a restart would replay) against the store's
    ``store_bytes`` and ``storage.snapshot-min-log-ratio`` (0: whenever anything was logged)."""
    return anything_logged and logged_bytes >= min_log_ratio * store_bytes
