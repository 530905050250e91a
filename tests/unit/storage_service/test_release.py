"""release.py: which columns a node no longer owns (pure), and release_unowned on one service."""

from pathlib import Path

import numpy as np
import pytest

from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import DropResult
from giaannd.storage.rebalance.release import release_unowned, unowned_columns
from giaannd.storage.replication.service import StorageService
from peers.placement import Member, Placement
from peers.transport import Identity, make_transport
from peers.transport.memory import MemoryNetwork
from tests.integration.storage_cluster import make_batch

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


async def _service(tmp_path: Path, topology: ClusterView | None, name: str = "a") -> StorageService:
    transport = make_transport("mem", Identity(name, "t", [b"k" * 32]), network=MemoryNetwork())
    svc = StorageService(tmp_path / name, 1 << 30, [f"mem://{name}"], transports={"mem": transport},
                         topology=topology, node_name=name)
    await svc.open()
    return svc


@pytest.mark.asyncio
async def test_release_unowned_drops_durably_through_the_service(tmp_path):
    topology = ClusterView(local="a", replicas=1)
    topology.set_members([StorageNode(n, f"mem://{n}") for n in "abc"])
    svc = await _service(tmp_path, topology)
    try:
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
    finally:
        await svc.stop(graceful=False)
    again = await _service(tmp_path, topology)  # restart: log replay repeats the drop
    try:
        assert again.store.store.held_columns().tolist() == mine.tolist()
        got = again.store.store.read_all()
        assert all(np.array_equal(x, y) for x, y in zip(got.buffers(), kept.buffers()))
        assert all(BatchId(9, i) in again.store.store.applied for i in range(1, 11))
    finally:
        await again.stop(graceful=False)


@pytest.mark.asyncio
async def test_release_unowned_standalone_keeps_everything_and_outsider_is_refused(tmp_path):
    svc = await _service(tmp_path, None)
    try:
        svc.store.apply(BatchId(1, 1), make_batch(np.random.default_rng(2), 5, 2, COLUMNS[:5]))
        assert await release_unowned(svc) == DropResult(0, 0) and len(svc.store.store) == 5
        svc.topology = ClusterView(local="a", replicas=1)
        svc.topology.set_members([StorageNode("b", "mem://b")])  # "a" is not in the placement
        with pytest.raises(LookupError):
            await release_unowned(svc)
        assert len(svc.store.store) == 5
    finally:
        await svc.stop(graceful=False)
