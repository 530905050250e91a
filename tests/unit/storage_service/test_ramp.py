"""giaannd.ramp (pure) and the client's read ramp with a fake clock (no sockets)."""

import math

import numpy as np
import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.ramp import HintPacer, RampTracker, ramp_fraction, read_weight, row_draws


@pytest.mark.parametrize("elapsed, ramp, frac", [
    (0.0, 10.0, 0.0), (5.0, 10.0, 0.5), (10.0, 10.0, 1.0), (99.0, 10.0, 1.0), (-1.0, 10.0, 0.0),
    (0.0, 0.0, 1.0),
])
def test_ramp_fraction_table(elapsed, ramp, frac):
    assert ramp_fraction(elapsed, ramp) == frac


def test_ramp_read_weight_goes_from_floor_to_one():
    assert read_weight(0, 10, 0.1) == pytest.approx(0.1)
    assert read_weight(5, 10, 0.1) == pytest.approx(0.55)
    assert read_weight(10, 10, 0.1) == 1.0


def test_ramp_tracker_restarts_and_forgets():
    t = RampTracker(10.0, floor=0.2)
    assert t.weights(["a", "b"], 0.0) is None
    t.start("a", 0.0)
    assert t.weight("a", 5.0) == pytest.approx(0.6) and t.weight("b", 5.0) == 1.0
    w = t.weights(["a", "b"], 5.0)
    assert w is not None and w.tolist() == pytest.approx([0.6, 1.0])
    t.start("a", 8.0)  # down and up again: the ramp restarts
    assert t.weight("a", 8.0) == pytest.approx(0.2)
    t.forget("a")
    assert t.weight("a", 9.0) == 1.0 and t.ramping(9.0) == {}
    t.start("a", 0.0)
    assert t.weight("a", 10.0) == 1.0 and t.weights(["a"], 10.0) is None  # ramp over
    off = RampTracker(0.0)
    off.start("a", 0.0)
    assert off.weight("a", 0.0) == 1.0


def test_ramp_row_draws_fixed_and_spread():
    rng = np.random.default_rng(1)
    cols = rng.integers(0, 2**63, 20000, dtype=np.uint64)
    feats = rng.integers(0, 50, 20000, dtype=np.uint64)
    u = row_draws(cols, feats)
    assert np.array_equal(u, row_draws(cols.copy(), feats.copy()))
    assert u.min() >= 0.0 and u.max() < 1.0
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert hist.min() > 1600 and hist.max() < 2400  # about uniform (2000 per bin)


def _deliver_all(pacer, sizes, start=0.0):
    """Simulate the service: each hint waits ``reserve`` then is sent; returns send times."""
    now, times = start, []
    for n in sizes:
        now += pacer.reserve(now, n)
        times.append(now)
    return times


def test_hint_pacer_rate_grows_and_never_drops():
    pacer = HintPacer(1000.0, ramp_s=10.0, started_at=0.0, factor=16.0, burst_s=1.0)
    assert pacer.rate(0.0) == 1000.0 and pacer.rate(5.0) == pytest.approx(8500.0)
    assert math.isinf(pacer.rate(10.0))
    sizes = [500] * 200  # 100 kB
    times = _deliver_all(pacer, sizes)
    assert len(times) == 200 and times == sorted(times)
    # never faster than the ramp allows: bytes sent by t <= burst + integral of the rate
    sent = np.cumsum(sizes)
    for t, b in zip(times, sent):
        if t < 10.0:
            integral = 1000.0 * t + 15 * 1000.0 * t * t / (2 * 10.0)
            assert b <= integral + pacer.rate(t) * 1.0 + 500
    # it did ramp: the second half of the first 5 s sends more than the first half
    t = np.array(times)
    assert (t < 2.5).sum() < ((t >= 2.5) & (t < 5.0)).sum()
    # after the ramp (plus what was already booked) everything goes at once
    late = t[t > 10.0]
    assert late.size > 0 and np.all(late == late[0]) and late[0] <= 10.0 + 1.0


def test_hint_pacer_big_hint_goes_alone_then_pays():
    pacer = HintPacer(100.0, ramp_s=100.0, started_at=0.0, factor=1.0, burst_s=0.0)
    assert pacer.reserve(0.0, 1000) == 0.0  # larger than any bucket: still sent
    assert pacer.reserve(0.0, 10) == pytest.approx(10.0)  # the next waits for its bytes
    done = HintPacer(100.0, ramp_s=0.0, started_at=0.0)
    assert done.done(0.0) and done.reserve(0.0, 10**9) == 0.0


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _client(ramp_s=10.0, names=("s0", "s1", "s2")):
    topo = ClusterView(replicas=3)
    clock = _Clock()
    client = StorageClient(topo, {}, read_ramp_s=ramp_s, read_ramp_floor=0.1, clock=clock)
    topo.set_members([StorageNode(n, f"mem://{n}") for n in names])
    served: dict[str, list] = {}

    async def read_from(node, cols, feats, timeout_s=None, busy_ok=False):
        served.setdefault(node, []).append(cols.copy())
        return RowBatch.empty()

    client.read_from = read_from
    return topo, client, clock, served


def _first_choice(topo, cols, name):
    """Rows whose first owner (no ramp, all live) is ``name``."""
    p = topo.placement
    return p.owner_indices(cols)[:, 0] == p.names.index(name)


@pytest.mark.asyncio
async def test_client_read_share_of_a_returning_member_ramps():
    topo, client, clock, served = _client()
    rng = np.random.default_rng(3)
    cols = rng.integers(0, 2**63, 30000, dtype=np.uint64)
    feats = rng.integers(0, 50, 30000, dtype=np.uint64)
    mine = _first_choice(topo, cols, "s1")

    async def share():
        served.clear()
        await client.read_rows(cols, feats)
        got = np.concatenate(served.get("s1", [np.zeros(0, np.uint64)]))
        return got.size / mine.sum(), set(got.tolist())

    assert (await share())[0] == pytest.approx(1.0)  # initial members: no ramp
    topo.mark_down("s1")
    assert (await share())[0] == 0.0
    clock.t = 100.0
    topo.mark_up("s1")
    fractions, sets = [], []
    for dt in (0.0, 2.5, 5.0, 7.5, 10.0):
        clock.t = 100.0 + dt
        f, s = await share()
        fractions.append(f)
        sets.append(s)
    assert fractions[0] == pytest.approx(0.1, abs=0.02)
    assert fractions[2] == pytest.approx(0.55, abs=0.03)
    assert fractions[-1] == 1.0
    assert fractions == sorted(fractions)
    assert all(a <= b for a, b in zip(sets, sets[1:]))  # a row once sent to it stays with it
    # the others took the rest: every row was still read exactly once
    total = sum(c.size for cs in served.values() for c in cs)
    assert total == cols.size
    # down and up again restarts the ramp
    topo.mark_down("s1")
    topo.mark_up("s1")
    assert (await share())[0] == pytest.approx(0.1, abs=0.02)


@pytest.mark.asyncio
async def test_client_read_ramp_for_a_new_member_and_off_switch():
    topo, client, clock, served = _client()
    topo.add(StorageNode("s3", "mem://s3"))  # new in the placement after the client knew members
    assert set(client.read_ramp.ramping(clock.t)) == {"s3"}
    topo2, client2, _, _ = _client(ramp_s=0.0)
    topo2.mark_down("s1")
    topo2.mark_up("s1")
    assert client2.read_ramp.ramping(0.0) == {}
