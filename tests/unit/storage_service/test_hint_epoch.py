"""Hints keep their writer's placement epoch (hints.py) and split by owner (hint_delivery.py)."""

import asyncio

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.update_log import UpdateLog
from giaannd.storage.replication.hint_delivery import split_by_owner
from giaannd.storage.replication.hints import HintStore, decode_epoch, encode_epoch
from giaannd.storage.replication.requests import StorageRequests, WaitHintSynced
from peers.placement import Member, Placement
from tools.cluster_harness import Cluster, make_batch


def _batch(seed, rows=3):
    rng = np.random.default_rng(seed)
    n = rows * 2
    return RowBatch.from_entries(np.repeat(rng.integers(1, 2**63, rows, dtype=np.uint64), 2),
                                 np.zeros(n, np.uint64), np.zeros(n, np.uint8),
                                 rng.integers(1, 9, n, dtype=np.uint64), np.arange(n, dtype=np.uint64),
                                 np.ones(n, np.float32))


E1 = Placement(tuple(Member(n) for n in ("a", "b", "c")), 2).epoch
E2 = Placement(tuple(Member(n) for n in ("a", "b", "c", "d")), 2).epoch


def test_hint_epoch_codec_round_trips_and_rejects_foreign():
    assert decode_epoch(*encode_epoch(E1)) == E1 and len(E1) == 32
    assert encode_epoch("") == (0, 0) and encode_epoch("not-hex-" * 4) == (0, 0)
    assert encode_epoch("abc") == (0, 0) and decode_epoch(0, 0) == ""


def test_hints_keep_their_epoch_across_reopen(tmp_path):
    hs = HintStore.open(tmp_path)
    hs.add("t", BatchId(1, 1), _batch(1), E1)
    hs.add("t", BatchId(1, 2), _batch(2), E1)
    hs.add("t", BatchId(1, 3), _batch(3), E2)
    hs.add("t", BatchId(1, 4), _batch(4), "")
    hs.add("t", BatchId(1, 5), _batch(5), "foreign")
    hs.add("u", BatchId(1, 6), _batch(6), E2)
    hs.sync("t")
    hs.sync("u")
    assert [h.epoch for h in hs.pending("t")] == [E1, E1, E2, "", ""]
    hs.close()
    again = HintStore.open(tmp_path)
    assert [h.epoch for h in again.pending("t")] == [E1, E1, E2, "", ""]
    assert [h.epoch for h in again.pending("u")] == [E2]
    again.add("t", BatchId(1, 7), _batch(7), E2)  # appends after recovery keep the right epoch
    again.close()
    assert [h.epoch for h in HintStore.open(tmp_path).pending("t")][-1] == E2


def test_hints_old_format_without_epoch_records_reads_as_unknown(tmp_path):
    sub = tmp_path / ("t-" + b"t".hex())
    sub.mkdir()
    log = UpdateLog(sub, 1)  # what the previous HintStore wrote: batch records only
    log.append_batch(BatchId(9, 1), _batch(1))
    log.append_batch(BatchId(9, 2), _batch(2))
    log.close()
    hs = HintStore.open(tmp_path)
    assert [(h.batch_id, h.epoch) for h in hs.pending("t")] == [(BatchId(9, 1), ""), (BatchId(9, 2), "")]


def test_requests_hold_hint_records_the_writers_epoch(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 26)
    hints = HintStore.open(tmp_path / "hints")
    core = StorageRequests(store, hints, "me", lambda: None)
    b = _batch(1)
    step = core.handle(p.encode(p.ApplyBatch(5, 1, 0, E1, "other")), b.buffers())
    assert isinstance(step, WaitHintSynced)
    assert hints.pending("other")[0].epoch == E1
    store.close()
    hints.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_split_by_owner_partitions_the_lost_rows(seed):
    new = Placement(tuple(Member(n) for n in ("a", "b", "c", "d")), 2)
    batch = _batch(seed, rows=200)
    split = split_by_owner(new, "b", batch)
    owners = new.owner_indices(batch.row_column)
    b = new.names.index("b")
    kept = (owners == b).any(axis=1)
    assert split.kept is not None and np.array_equal(split.kept.row_column, batch.row_column[kept])
    assert "b" not in split.moved
    for node, part in split.moved.items():
        m = new.names.index(node)
        want = ~kept & (owners == m).any(axis=1)
        assert np.array_equal(part.row_column, batch.row_column[want])
    # every lost row reaches each of its current owners
    got = sum(part.num_rows for part in split.moved.values())
    assert got == int((~kept).sum()) * 2
    # a target that owns everything: nothing moves
    old = Placement(tuple(Member(n) for n in ("a", "b")), 2)
    assert split_by_owner(old, "b", batch).moved == {}


async def _wait_for(pred, timeout_s=30.0, step_s=0.02):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(step_s)


@pytest.mark.asyncio
async def test_resplit_hint_whose_target_kept_no_row_lets_the_writers_floor_pass(tmp_path):
    """A hint re-split after a placement change in which its target lost *every* row of it: the
    rows go to their new owners and the target gets an empty part under the same id, so the
    writer's ``confirm_hints`` (BatchesApplied on the target) settles the seq. Before, the target
    got nothing, answered no forever, and the writer's floor never passed the seq (every node's
    applied set then kept every later batch id of that writer)."""
    cluster = await Cluster(tmp_path, n=3, replicas=2, write_quorum=1).start()
    try:
        client = cluster.client
        old = cluster.client_topology.placement
        grown = Placement(tuple(Member(n) for n in (*old.names, "s3")), 2)  # the placement s3 joins into
        cand = np.arange(1, 5000, dtype=np.uint64)
        owned_before = (old.owner_indices(cand) == old.names.index("s1")).any(axis=1)
        owned_after = (grown.owner_indices(cand) == grown.names.index("s1")).any(axis=1)
        columns = cand[owned_before & ~owned_after][:20]
        assert columns.size
        await cluster.stop_node("s1")
        batch = make_batch(np.random.default_rng(7), columns.size, columns=columns)
        res = await client.write(batch)
        await client.flush()
        assert client.writer_floor < res.batch_id.seq  # s1's share is a hint: unsettled
        (holder,) = [s for s in cluster.services.values() if s.hints.pending("s1")]
        await cluster.add_node("s3")
        await cluster.commit_ring(cluster.ring.with_active("s3"))
        new = cluster.client_topology.placement
        assert not (new.owner_indices(columns) == new.names.index("s1")).any()  # s1 kept no row
        await cluster.restart_node("s1")
        await _wait_for(lambda: not holder.hints.pending("s1"))
        assert holder.delivery.resplit == 1
        got = await client.read_from("s3", batch.row_column, batch.row_feature)  # the rows reached s3
        assert got.num_rows == batch.num_rows
        await client.flush()
        await client.confirm_hints()
        assert client.writer_floor >= res.batch_id.seq
    finally:
        await cluster.close()
