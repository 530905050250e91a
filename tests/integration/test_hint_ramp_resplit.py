"""In-process cluster: a returning node's read share and hint delivery ramp up; hints carry their
writer's placement epoch and are re-split when the placement moved on (hint_delivery.py)."""

import asyncio

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.storage_client import StorageClient
from giaannd.ramp import HINT_BURST_S, HINT_RAMP_FACTOR
from tools.cluster_harness import Cluster, make_batch

pytestmark = pytest.mark.integration


async def _wait_for(pred, timeout_s=20.0, step_s=0.02):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(step_s)


async def _restart_recording_epochs(cluster, name):
    """Restart ``name`` and record the placement epoch of every ApplyBatch it serves (recording
    from before the views hear it is up)."""
    svc = await cluster.restart_node(name, noticed=False)
    seen = []
    serve = svc.core.serve

    def recording(msg, bulk):
        if isinstance(msg, p.ApplyBatch):
            seen.append((msg.writer, msg.seq, msg.placement_epoch, msg.hint_for))
        return serve(msg, bulk)

    svc.core.serve = recording
    cluster.notice_up(name)
    return svc, seen


def _holders(cluster, target):
    return {n: s for n, s in cluster.services.items() if s.hints is not None and s.hints.pending(target)}


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


@pytest.mark.asyncio
async def test_hint_delivery_sends_the_writers_epoch(tmp_path):
    cluster = await Cluster(tmp_path, n=3, replicas=4).start()  # every node owns every row
    try:
        e1 = cluster.client_topology.epoch
        await cluster.stop_node("s1")
        res = await cluster.client.write(make_batch(np.random.default_rng(1), 20))
        await cluster.client.flush()
        holders = _holders(cluster, "s1")
        assert holders and all(h.epoch == e1 for s in holders.values() for h in s.hints.pending("s1"))
        for name in holders:  # the holders' placement moves on (a member the target never heard of)
            await cluster.nodes[name].runtime.commit_ring(cluster.ring.with_active("s9"))
            assert not cluster.topologies[name].is_live("s9")
            assert cluster.topologies[name].epoch != e1
        _, seen = await _restart_recording_epochs(cluster, "s1")
        await _wait_for(lambda: not _holders(cluster, "s1"))
        delivered = [s for s in seen if (s[0], s[1]) == tuple(res.batch_id)]
        assert delivered and all(epoch == e1 and hint_for is None for *_, epoch, hint_for in delivered)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_hint_refused_as_not_owner_is_resplit_to_the_new_owners(tmp_path):
    cluster = await Cluster(tmp_path, n=3, replicas=2, write_quorum=1).start()
    try:
        await cluster.stop_node("s1")
        batch = make_batch(np.random.default_rng(7), 400)
        res = await cluster.client.write(batch)
        await cluster.client.flush()
        old = cluster.client_topology.placement
        s1 = old.names.index("s1")
        share = batch.select_rows((old.owner_indices(batch.row_column) == s1).any(axis=1))
        holders = _holders(cluster, "s1")
        assert len(holders) == 1
        (holder_name, holder), = holders.items()
        # s3 joins the placement while s1 is down (no stream: s3 starts empty)
        await cluster.add_node("s3")
        await cluster.commit_ring(cluster.ring.with_active("s3"))
        assert not cluster.topologies["s3"].is_live("s1")
        new = cluster.client_topology.placement
        lost = ~(new.owner_indices(share.row_column) == new.names.index("s1")).any(axis=1)
        assert lost.any() and (~lost).any()  # s1 keeps some rows and loses others to s3
        _, seen = await _restart_recording_epochs(cluster, "s1")
        await _wait_for(lambda: not _holders(cluster, "s1"))
        assert holder.delivery.resplit == 1

        async def check_every_owner_holds_the_rows_once():
            # rows s1 lost: every current owner (s3, and the old owner that got the write
            # directly) holds them exactly once; rows s1 kept: s1 holds them
            owners = new.owner_indices(share.row_column)
            checks = [("s1", ~lost)]
            checks += [(new.names[m], lost & (owners == m).any(axis=1)) for m in np.unique(owners[lost]).tolist()]
            for node, rows in checks:
                want = share.select_rows(rows)
                got = await cluster.client.read_from(node, want.row_column, want.row_feature)
                assert _same(got, want), node
            assert {n for n, _ in checks} >= {"s1", "s3"}

        await check_every_owner_holds_the_rows_once()
        assert any((w, s) == tuple(res.batch_id) for w, s, *_ in seen)  # s1's kept part, same id
        # a crash between delivery and forgetting: the hint comes back and is delivered again
        holder.hints.add("s1", res.batch_id, share, old.epoch)
        assert await holder.deliver_hints_to("s1") == 1
        assert not _holders(cluster, "s1")
        await check_every_owner_holds_the_rows_once()  # nothing applied twice
    finally:
        await cluster.close()


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _pacer_bound(t, rate, ramp, biggest):
    """Bytes one holder may have sent ``t`` s after the target came up (ramp.py's bucket)."""
    if t >= ramp:
        return float("inf")
    integral = rate * t + (HINT_RAMP_FACTOR - 1) * rate * t * t / (2 * ramp)
    return integral + rate * (1 + (HINT_RAMP_FACTOR - 1) * t / ramp) * HINT_BURST_S + biggest


@pytest.mark.asyncio
async def test_returning_node_read_share_and_hint_delivery_ramp(tmp_path):
    ramp, rate = 3.0, 40_000.0
    cluster = await Cluster(tmp_path, n=3, replicas=3).start(ramp_up_s=ramp, hint_ramp_start_bytes_per_s=rate)
    clock = _Clock()
    reader = StorageClient(cluster.client_topology, cluster.client.transports, read_ramp_s=10.0,
                           clock=clock, connect_timeout_s=0.5)
    try:
        rng = np.random.default_rng(5)
        base = make_batch(rng, 2000)
        await cluster.client.write(base)
        await cluster.stop_node("s1")
        for _ in range(30):  # ~15 kB of hints per batch for s1
            await cluster.client.write(make_batch(rng, 100, columns=rng.choice(base.row_column, 100)))
        await cluster.client.flush()
        holders = _holders(cluster, "s1")
        held = {n: s.hints.held_bytes for n, s in holders.items()}
        biggest = max(h.batch.nbytes for s in holders.values() for h in s.hints.pending("s1"))
        assert sum(held.values()) > 5 * rate * HINT_BURST_S

        clock.t = 1000.0
        svc, _ = await _restart_recording_epochs(cluster, "s1")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        samples = []
        while any(s.hints.held for s in holders.values()):
            t = loop.time() - t0
            for n, s in holders.items():
                samples.append((t, n, held[n] - s.hints.held_bytes))
            assert t < 60, "hints not delivered"
            await asyncio.sleep(0.05)
        # paced: no holder ever got ahead of its bucket; and delivery did complete
        for t, n, sent in samples:
            assert sent <= _pacer_bound(t, rate, ramp, biggest), (t, n, sent)
        assert any(sent < held[n] for t, n, sent in samples if t > 0.2)  # it took a while
        assert svc.counters.applies >= 30

        # reads: s1's share of the rows it is first in line for grows from 10 % to all
        placement = cluster.client_topology.placement
        first = placement.owner_indices(base.row_column)[:, 0] == placement.names.index("s1")
        shares = []
        for dt in (0.0, 5.0, 10.0):
            clock.t = 1000.0 + dt
            before = svc.counters.rows_read
            got = await reader.read_rows(base.row_column, base.row_feature)
            assert got.num_rows == base.num_rows
            shares.append((svc.counters.rows_read - before) / int(first.sum()))
        assert shares[0] == pytest.approx(0.1, abs=0.05)
        assert shares[1] == pytest.approx(0.55, abs=0.08)
        assert shares[2] == 1.0
    finally:
        await reader.close()
        await cluster.close()
