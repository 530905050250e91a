"""Repair of a replica that holds only part of a batch (docs/topology.md, "Repair", step 2).

A training writer's batch ids are idempotent per (batch id, column) (applied_set.py, "Which
columns"): after a placement change a node can hold a batch id for some of the columns it owns and
receive the rest later as another share. If that share is lost (a hint dropped), the node's applied
set names the id although rows of it are missing. Repair compares (batch id, columns) for tracked
writers, so the missing columns' part is shipped (in process: ``repair.local.repair``; across
processes: ``repair_self``), and a column already applied is never applied twice."""

import msgspec
import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.repair.local import repair
from giaannd.storage.repair.wire import LoggedFor, owned_mask
from giaannd.storage.streaming.sender import wait_durable
from tests.integration.test_repair_remote import CountingServer, RepairCluster
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(11).integers(1, 2**63, 60, dtype=np.uint64)
WRITER = 0xC0FFEE


async def apply_tracked(svc, bid: BatchId, share: RowBatch) -> None:
    """Apply ``share`` as a training writer's (tracked: idempotent per column), durably."""
    result = svc.store.apply(bid, share, track=True)
    assert result.applied
    await wait_durable(svc, result.seq)


async def partial_batch(cluster, dst: str, seed: int) -> tuple[BatchId, RowBatch]:
    """One batch every owner applied its whole share of, except ``dst``: only the rows of some of
    its columns (its second share, with the rest, was lost). Counts in the reference whole."""
    placement = cluster.client_topology.placement
    mine = COLUMNS[owned_mask(placement, dst)(COLUMNS)]
    assert mine.shape[0] >= 4
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, 16, 4, rng.choice(mine[:8], 16))
    bid = BatchId(WRITER, 1)
    held = np.unique(batch.row_column)[:2]  # the columns of dst's first share
    for name, svc in cluster.services.items():
        share = batch.select_rows(owned_mask(placement, name)(batch.row_column))
        if name == dst:
            share = share.select_rows(np.isin(share.row_column, held))
        await apply_tracked(svc, bid, share)
    cluster.reference.apply(bid, batch)
    cluster.written.append((bid, batch))
    applied = cluster.services[dst].store.store.applied
    assert bid in applied and np.array_equal(applied.columns(bid), held)
    return bid, batch.select_rows(~np.isin(batch.row_column, held))


async def assert_repaired(cluster, report, dst: str, bid: BatchId, lacking: RowBatch, again) -> None:
    assert report["unrecoverable"] == {} and report["batches_shipped"] == 1
    assert report["rows_shipped"] == lacking.num_rows and report["rows_divergent"] == []
    assert cluster.mismatches() == []  # the missing columns' rows equal the reference, the others not doubled
    applied = cluster.services[dst].store.store.applied
    assert np.array_equal(applied.columns(bid), np.unique(cluster.written[-1][1].row_column))
    second = await again()  # nothing left to ship
    assert second["batches_shipped"] == 0 and second["rows_divergent"] == []
    assert cluster.mismatches() == []


async def test_repair_ships_the_missing_columns_of_a_batch_held_in_part(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        await cluster.write_many(np.random.default_rng(1), 5, COLUMNS)
        await cluster.client.flush()
        bid, lacking = await partial_batch(cluster, "s2", 2)
        assert any("s2" in m for m in cluster.mismatches())  # s2 really lacks rows of it
        report = await repair(cluster.control())
        await assert_repaired(cluster, report, "s2", bid, lacking, lambda: repair(cluster.control()))
    finally:
        await cluster.close()


@pytest.mark.parametrize("page_bytes", [1 << 23, 1])
async def test_repair_self_ships_the_missing_columns_of_a_batch_held_in_part(tmp_path, page_bytes):
    cluster = await RepairCluster(tmp_path, 4, replicas=3).start()
    try:
        await cluster.write_many(np.random.default_rng(3), 5, COLUMNS)
        await cluster.client.flush()
        bid, lacking = await partial_batch(cluster, "s1", 4)
        assert any("s1" in m for m in cluster.mismatches())
        report = await cluster.repair("s1", page_bytes=page_bytes)
        assert report["peers_failed"] == {}
        await assert_repaired(cluster, report, "s1", bid, lacking, lambda: cluster.repair("s1"))
    finally:
        await cluster.close()


async def test_repair_reports_a_batch_held_in_part_whose_record_left_a_peers_log(tmp_path):
    """A peer applied the batch and snapshotted its record away: the rest of the batch may hold
    rows only that peer knew, so nothing of it is applied (unrecoverable), as for a missing id."""
    cluster = await Cluster(tmp_path, 3, replicas=3).start()
    try:
        bid, _ = await partial_batch(cluster, "s1", 5)
        await cluster.services["s0"].snapshot()
        report = await repair(cluster.control(), ["s1"])
        assert report["batches_shipped"] == 0
        assert report["unrecoverable"] == {"s1": [f"{WRITER:#x}/1: applied on s0 but no longer in its log"]}
    finally:
        await cluster.close()


async def test_repair_self_with_a_peer_from_before_applied_columns_applies_nothing_of_a_batch_held_in_part(
        tmp_path, monkeypatch):
    """A peer from before ``LoggedFor.applied_columns`` ignores it (simulated: the field dropped)
    and lists no id the node applied: the id then counts as applied whole, as before (not shipped;
    not reported unrecoverable either, although that peer applied it and does not list it), and the
    comparison reports the rows the node lacks."""
    real = CountingServer.handle

    async def s0_from_before(self, msg, bulk):
        if self.service.node_name == "s0" and isinstance(msg, LoggedFor):
            msg = msgspec.structs.replace(msg, applied_columns=None)
        return await real(self, msg, bulk)

    monkeypatch.setattr(CountingServer, "handle", s0_from_before)
    cluster = await RepairCluster(tmp_path, 3, replicas=3).start()
    try:
        await partial_batch(cluster, "s1", 6)
        report = await cluster.repair("s1")
        assert report["peers_failed"] == {} and report["batches_shipped"] == 0
        assert report["unrecoverable"] == {} and report["rows_divergent_count"] > 0
    finally:
        await cluster.close()
