"""A training job's timeline: its cumulative counters sampled over its life (issue 21).

``GET /v1/jobs/{id}`` carries ``"timeline": {"t": [...], "done": [...], "trained": [...],
"bytes_sent": [...]}``: wall-clock unix seconds, ascending, and the counters' cumulative values at
those times (what a report plots as progress and rate curves).

Theory of operation
-------------------
* **Sampling.** A point is taken at the job's start, then at most once per interval (initially
  ``TIMELINE_INTERVAL_S``) when a counter changes, and at the end. The caller checks the time
  (``Timeline.due``) when it adds to a counter: no task, no timer, one float comparison per batch.
* **Bound.** At most ``max_points`` points. When full, every other point is dropped and the
  interval doubles, so a point stays at most ``2 * interval`` from its neighbours and a week-long
  job still has an even timeline over its whole life (the first point is kept).
* **Wall clock** (``time.time()``, given by the caller): timelines of different nodes merge.
* **Register timelines** (cluster jobs): each node's record in a lease shard
  (``lease_table.Tally``) carries its own points, bounded by ``MAX_REGISTER_TIMELINE_POINTS``
  because a register value is at most ``protocol.MAX_REGISTER_VALUE_BYTES``. A row has no "end of
  job" moment to add a final point, so ``step_points`` keeps the row's *last* point equal to its
  current totals: a new point replaces the last one while the one before it is younger than the
  interval (the spacing rule then holds for every point but the last).
* **Merge** (``merge_timelines``): the sum of cumulative step functions: the union of the time
  points, each timeline's value carried forward from its own latest point at or before each time
  (0 before its first).

Pure: no I/O, no clock (times are arguments), no logging.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "MAX_REGISTER_TIMELINE_POINTS",
    "MAX_TIMELINE_POINTS",
    "SERIES",
    "TIMELINE_INTERVAL_S",
    "Timeline",
    "merge_timelines",
    "step_points",
]

#: Seconds between two samples of a young job: fine enough to draw a minute-long job's rate curve.
TIMELINE_INTERVAL_S: Final = 1.0
#: Points of a job's in-memory timeline: 512 x 4 numbers is ~23 KiB of JSON per job document,
#: enough to draw a curve at a report's resolution.
MAX_TIMELINE_POINTS: Final = 512
#: Points of one node's timeline in one lease shard row: ~16 bytes each in msgpack, so 64 are
#: ~1.1 KiB per node and shard (measured); a 256 KiB register then holds the tallies of ~230 nodes.
MAX_REGISTER_TIMELINE_POINTS: Final = 64
#: The counters a timeline samples, in the order of its points' values.
SERIES: Final = ("done", "trained", "bytes_sent")

Point = tuple[float, int, int, int]


class Timeline:
    """The bounded in-memory timeline of one job (module docstring, "Sampling", "Bound")."""

    __slots__ = ("interval_s", "max_points", "points")

    def __init__(self, interval_s: float = TIMELINE_INTERVAL_S, max_points: int = MAX_TIMELINE_POINTS) -> None:
        if interval_s <= 0 or max_points < 2:
            raise ValueError("a timeline needs interval_s > 0 and max_points >= 2")
        self.interval_s = interval_s
        self.max_points = max_points
        self.points: list[Point] = []

    def due(self, now: float) -> bool:
        """Whether a sample at ``now`` is due (the interval passed since the last point)."""
        return not self.points or now >= self.points[-1][0] + self.interval_s

    def record(self, now: float, done: int, trained: int, bytes_sent: int) -> None:
        """Add a point (the caller checked ``due``, or it is the start or the end); a point at the
        last point's time replaces it. Halves the points and doubles the interval when full."""
        point = (now, done, trained, bytes_sent)
        if self.points and now <= self.points[-1][0]:
            self.points[-1] = (self.points[-1][0], done, trained, bytes_sent)
            return
        if len(self.points) >= self.max_points:
            del self.points[1::2]  # keeps the first (the start) and every other one after it
            self.interval_s *= 2
        self.points.append(point)

    def as_dict(self) -> dict[str, list[Any]]:
        """The document's ``timeline`` (``t`` rounded to the millisecond)."""
        return {"t": [round(p[0], 3) for p in self.points], "done": [p[1] for p in self.points],
                "trained": [p[2] for p in self.points], "bytes_sent": [p[3] for p in self.points]}


def step_points(points: tuple[tuple[float, int, int], ...], interval_s: float, point: tuple[float, int, int],
                max_points: int = MAX_REGISTER_TIMELINE_POINTS) -> tuple[tuple[tuple[float, int, int], ...], float]:
    """A register timeline (``(t, windows, units)`` points) with ``point`` added, and its interval
    (module docstring, "Register timelines"): ``point`` replaces the last one while the one before
    is younger than ``interval_s``; when more than ``max_points``, every other point is dropped
    counting back from the newest (which is always kept) and the interval doubles."""
    if points and point[0] <= points[-1][0]:  # a clock that stepped back: the totals still move on
        return (*points[:-1], (points[-1][0], point[1], point[2])), interval_s
    if len(points) >= 2 and point[0] - points[-2][0] < interval_s:
        return (*points[:-1], point), interval_s
    out = (*points, point)
    if len(out) > max_points:
        out = out[(len(out) - 1) % 2::2]
        interval_s *= 2
    return out, interval_s


def merge_timelines(timelines: Sequence[Mapping[str, ArrayLike]]) -> dict[str, list[Any]]:
    """The sum of cumulative step timelines (module docstring, "Merge"): ``t`` is the sorted union
    of their times, and each series the sum of every timeline's value carried forward."""
    parts = [tl for tl in timelines if np.size(tl["t"])]
    if not parts:
        return {"t": [], **{name: [] for name in SERIES}}
    t = np.unique(np.concatenate([np.asarray(tl["t"], dtype=np.float64) for tl in parts]))
    sums = {name: np.zeros(len(t), dtype=np.int64) for name in SERIES}
    for tl in parts:
        # index of each timeline's latest point at or before every union time (-1: before its first)
        at = np.searchsorted(np.asarray(tl["t"], dtype=np.float64), t, side="right") - 1
        seen = at >= 0
        for name in SERIES:
            values = np.asarray(tl[name], dtype=np.int64)
            sums[name][seen] += values[at[seen]]
    return {"t": np.round(t, 3).tolist(), **{name: sums[name].tolist() for name in SERIES}}
