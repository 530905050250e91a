"""release.py: which columns a node no longer owns (pure), and release_unowned on one service."""

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore, DropResult
from giaannd.storage.rebalance.join_generation import JoinGeneration
from giaannd.storage.rebalance.release import abandoned_stream_columns, release_unowned, unowned_columns
from peers.placement import Member, Placement
from tools.cluster_harness import Cluster, make_batch

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 200, dtype=np.uint64)


def test_unowned_columns_is_the_complement_of_the_owner_lists():
    placement = Placement(tuple(Member(n) for n in "abcd"), 2)
    owners = placement.owner_indices(COLUMNS)
    for i, name in enumerate(placement.names):
        got = unowned_columns(placement, name, COLUMNS)
        want = COLUMNS[~(owners == i).any(axis=1)]
        assert got.tolist() == want.tolist()
        assert 0.35 < got.size / COLUMNS.size < 0.65  # R=2 of 4: each node owns about half
    assert unowned_columns(placement, "a", np.empty(0, np.uint64)).size == 0
    everyone = Placement(tuple(Member(n) for n in "ab"), 3)  # fewer members than R: all own all
    assert unowned_columns(everyone, "b", COLUMNS).size == 0
    with pytest.raises(LookupError, match="'z' is not in the placement"):
        unowned_columns(placement, "z", COLUMNS)


def test_an_abandoned_streams_columns_are_the_unowned_ones_no_other_open_stream_brings():
    placement = Placement(tuple(Member(n) for n in "abcd"), 2)
    others = COLUMNS[:20]
    for name in placement.names:
        got = abandoned_stream_columns(placement, name, COLUMNS[::-1], others)  # any order in
        want = np.sort(unowned_columns(placement, name, COLUMNS[20:]))
        assert got.tolist() == want.tolist()
    # a node outside the placement (a joining node) owns nothing: all but the other streams' columns
    assert abandoned_stream_columns(placement, "z", COLUMNS, others).tolist() == np.sort(COLUMNS[20:]).tolist()
    assert abandoned_stream_columns(placement, "z", COLUMNS, np.empty(0, np.uint64)).size == COLUMNS.size
    assert abandoned_stream_columns(placement, "a", np.empty(0, np.uint64), others).size == 0


def test_join_generation_starts_at_zero_goes_up_durably_and_refuses_garbage(tmp_path):
    gen = JoinGeneration(tmp_path)
    assert gen.current() == 0
    assert gen.advance() == 1 and gen.advance() == 2
    assert JoinGeneration(tmp_path).current() == 2 and not list(tmp_path.glob("*.tmp"))
    (tmp_path / "join-generation").write_text("two\n")
    with pytest.raises(ValueError, match="expected a non-negative integer"):
        gen.current()


async def _node_a(tmp_path: Path, *others: str) -> Cluster:
    """Storage node "a" (in this process, over mem://), with ``others`` in its ring but not running."""
    cluster = await Cluster(tmp_path, names=["a"], replicas=1).start()
    ring = cluster.ring
    for name in others:
        ring = ring.with_active(name)
    await cluster.commit_ring(ring)
    return cluster


@pytest.mark.asyncio
async def test_release_unowned_drops_durably_through_the_service(tmp_path):
    cluster = await _node_a(tmp_path, "b", "c")
    try:
        svc, topology = cluster.services["a"], cluster.topologies["a"]
        rng = np.random.default_rng(1)
        for i in range(1, 11):  # as a stream would: every column, bypassing the ownership check
            svc.store.apply(BatchId(9, i), make_batch(rng, 20, 3, rng.choice(COLUMNS, 20)))
        held = svc.store.store.held_columns()
        mine = held[(topology.placement.owner_indices(held)[:, 0] == 0)]
        before = svc.usage()
        result = await release_unowned(svc)
        assert svc.store.log.durable_seq == svc.store.log.last_seq  # synced before returning
        assert svc.store.store.held_columns().tolist() == mine.tolist()
        assert result.rows == before.num_rows - svc.usage().num_rows > 0
        assert result.bytes == before.used_bytes - svc.usage().used_bytes
        assert await release_unowned(svc) == DropResult(0, 0)  # nothing left to release
        kept = svc.store.store.read_all()
        await cluster.kill("a")
        again = await cluster.restart_node("a")  # restart: log replay repeats the drop
        assert again.store.store.held_columns().tolist() == mine.tolist()
        got = again.store.store.read_all()
        assert all(np.array_equal(x, y) for x, y in zip(got.buffers(), kept.buffers()))
        assert all(BatchId(9, i) in again.store.store.applied for i in range(1, 11))
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_release_unowned_outside_the_placement_is_refused_and_keeps_everything(tmp_path):
    """(Formerly also: a standalone service, no topology, keeps everything. Through the daemon's
    construction a node always has the ring's view: outside the placement it is refused.)"""
    cluster = await Cluster(tmp_path, 0, replicas=1).start()
    try:
        svc = await cluster.add_node("a")  # standby: the ring is empty
        svc.store.apply(BatchId(1, 1), make_batch(np.random.default_rng(2), 5, 2, COLUMNS[:5]))
        with pytest.raises(LookupError):
            await release_unowned(svc)
        await cluster.commit_ring(cluster.ring.with_active("b"))  # "a" is not in the placement
        with pytest.raises(LookupError):
            await release_unowned(svc)
        assert len(svc.store.store) == 5
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_release_drops_in_a_worker_thread_and_keeps_writes_made_meanwhile(tmp_path, monkeypatch):
    """Before Nov 30 the listing and the drop ran on the event loop (7.9 s at 8.6·10^7 entries, the
    node deaf to gossip meanwhile); now in worker threads behind the store's fold gate, and a write
    that comes meanwhile is logged, acknowledged and applied after the drop, in log order."""
    cluster = await _node_a(tmp_path, "b", "c")
    release = threading.Event()
    try:
        svc, topology = cluster.services["a"], cluster.topologies["a"]
        rng = np.random.default_rng(4)
        reference = ColumnStore(1 << 30)
        for i in range(1, 11):
            batch = make_batch(rng, 20, 3, rng.choice(COLUMNS, 20))
            svc.store.apply(BatchId(9, i), batch)
            reference.apply(BatchId(9, i), batch)
        held = svc.store.store.held_columns()
        mine = held[(topology.placement.owner_indices(held)[:, 0] == 0)]
        inside, threads = threading.Event(), []
        real = ColumnStore.drop_columns

        def paused(self, columns):  # type: ignore[no-untyped-def]
            if self is svc.store.store:
                threads.append(threading.current_thread())
                inside.set()
                release.wait(10)
            return real(self, columns)

        monkeypatch.setattr(ColumnStore, "drop_columns", paused)
        releasing = asyncio.create_task(release_unowned(svc))
        for _ in range(500):
            if inside.is_set():
                break
            await asyncio.sleep(0.01)
        assert inside.is_set() and svc.folds is not None and svc.folds.running
        during = make_batch(rng, 20, 3, rng.choice(mine, 20))  # owned columns: this node takes it
        await asyncio.wait_for(cluster.client.write(during), 5.0)  # acknowledged while the drop runs
        assert len(svc.store.deferred) == 1
        release.set()
        result = await releasing
        assert threads and all(t is not threading.main_thread() for t in threads)
        real(reference, held[~np.isin(held, mine)])
        reference.apply(BatchId(7, 1), during)
        assert result.rows > 0 and len(svc.store.deferred) == 0
        assert svc.store.store.held_columns().tolist() == reference.held_columns().tolist()
        want = reference.read_all()
        got = svc.store.store.read_all()
        assert all(np.array_equal(x, y) for x, y in zip(got.buffers(), want.buffers()))
        await cluster.kill("a")
        again = await cluster.restart_node("a")  # the log replays the drop, then the write
        got = again.store.store.read_all()
        assert all(np.array_equal(x, y) for x, y in zip(got.buffers(), want.buffers()))
    finally:
        release.set()
        await cluster.close()
