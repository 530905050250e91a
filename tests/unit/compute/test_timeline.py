"""Job timelines (giaannd/compute/timeline.py): sampling, halving, final point, merge, bounds."""

from __future__ import annotations

import pytest

from giaannd.compute import jobs as jobs_mod
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.timeline import (
    MAX_REGISTER_TIMELINE_POINTS,
    TIMELINE_INTERVAL_S,
    Timeline,
    merge_timelines,
    step_points,
)


class _Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(jobs_mod.time, "time", c)
    return c


def test_progress_timeline_samples_at_most_once_per_interval(clock: _Clock) -> None:
    p = TrainProgress()
    assert p.as_dict()["timeline"] == {"t": [1000.0], "done": [0], "trained": [0], "bytes_sent": [0]}
    for _ in range(10):  # ten adds within the first interval: no point
        clock.now += TIMELINE_INTERVAL_S / 20
        p.add(done=2, trained=1, bytes_sent=10)
    assert len(p.timeline.points) == 1
    clock.now = 1000.0 + TIMELINE_INTERVAL_S
    p.add(done=2, trained=1, bytes_sent=10)
    tl = p.as_dict()["timeline"]
    assert tl == {"t": [1000.0, 1001.0], "done": [0, 22], "trained": [0, 11], "bytes_sent": [0, 110]}


def test_progress_timeline_final_point_on_finish(clock: _Clock) -> None:
    p = TrainProgress()
    clock.now += 0.25
    p.add(done=5, trained=4)  # not due: not sampled
    clock.now += 0.25
    p.finish()
    tl = p.as_dict()["timeline"]
    assert tl["t"] == [1000.0, 1000.5]
    assert tl["done"][-1] == 5 and tl["trained"][-1] == 4


def test_progress_timeline_resumed_starts_at_resumed_from(clock: _Clock) -> None:
    p = TrainProgress(total=100)
    p.resume_at(40)
    assert p.as_dict()["timeline"]["done"] == [40]


def test_timeline_halves_and_doubles_the_interval() -> None:
    tl = Timeline(interval_s=1.0, max_points=8)
    for i in range(8):
        tl.record(float(i), i, i, i)
    assert len(tl.points) == 8 and tl.interval_s == 1.0
    tl.record(8.0, 8, 8, 8)  # full: every other point kept (the first too), interval doubled
    assert [p[0] for p in tl.points] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert tl.interval_s == 2.0
    assert not tl.due(9.0) and tl.due(10.0)


def test_timeline_stays_bounded_and_even_over_a_long_life() -> None:
    tl = Timeline(interval_s=1.0, max_points=16)
    for second in range(100_000):
        if tl.due(float(second)):
            tl.record(float(second), second, second, 0)
    ts = [p[0] for p in tl.points]
    assert len(ts) <= 16
    assert ts[0] == 0.0  # the start is kept
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert max(gaps) <= 2 * min(gaps)  # even over the whole life
    assert ts[-1] > 100_000 - 2 * tl.interval_s


def test_step_points_replace_last_within_the_interval() -> None:
    pts, every = step_points((), 1.0, (10.0, 1, 5))
    pts, every = step_points(pts, every, (10.4, 2, 9))  # only one point before: appended
    assert pts == ((10.0, 1, 5), (10.4, 2, 9))
    pts, every = step_points(pts, every, (10.8, 3, 12))  # the one before last is younger than 1 s: replaced
    assert pts == ((10.0, 1, 5), (10.8, 3, 12))
    pts, every = step_points(pts, every, (11.2, 4, 15))
    assert pts == ((10.0, 1, 5), (10.8, 3, 12), (11.2, 4, 15))
    assert every == 1.0


def test_step_points_bounded_keeps_newest() -> None:
    pts: tuple[tuple[float, int, int], ...] = ()
    every = 1.0
    for i in range(1000):
        pts, every = step_points(pts, every, (float(i), i, i))
        assert len(pts) <= MAX_REGISTER_TIMELINE_POINTS
        assert pts[-1] == (float(i), i, i)  # the row's totals are always its last point
    assert every > 1.0


def test_merge_two_nodes_step_timelines() -> None:
    a = {"t": [1.0, 3.0, 5.0], "done": [10, 20, 30], "trained": [5, 10, 15], "bytes_sent": [0, 0, 0]}
    b = {"t": [2.0, 3.0, 6.0], "done": [1, 2, 4], "trained": [1, 1, 3], "bytes_sent": [100, 200, 300]}
    merged = merge_timelines([a, b])
    # by hand: t=1 a only; t=2 a(10)+b(1); t=3 20+2; t=5 30+2; t=6 30+4
    assert merged == {"t": [1.0, 2.0, 3.0, 5.0, 6.0], "done": [10, 11, 22, 32, 34],
                      "trained": [5, 6, 11, 16, 18], "bytes_sent": [0, 100, 200, 200, 300]}


def test_merge_of_nothing_is_empty() -> None:
    assert merge_timelines([]) == {"t": [], "done": [], "trained": [], "bytes_sent": []}
    assert merge_timelines([{"t": [], "done": [], "trained": [], "bytes_sent": []}])["t"] == []
