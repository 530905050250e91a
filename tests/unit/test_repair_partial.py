"""Repair of batches a replica holds in part (repair/plan.py step 2, repair/wire.py
``applied_columns``): a tracked (training) writer's ids are idempotent per (batch id, column), so
repair compares (batch id, columns) for them and ships only the columns a node lacks under an id."""

import msgspec
import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.update_log import KIND_BATCH, LogRecord
from giaannd.storage.repair.plan import plan_repair
from giaannd.storage.repair.wire import (
    AppliedColumns,
    LoggedFor,
    LoggedPage,
    applied_arrays,
    applied_columns_of,
    applied_from_bulk,
    decode_repair,
    decode_repair_reply,
    select_log_page,
    spec_of,
)
from peers.placement import Member, Placement
from tools.cluster_harness import make_batch

ENC = msgspec.msgpack.Encoder()
W = 0xC0FFEE
BID = BatchId(W, 5)
COLUMNS = np.array([11, 22, 33, 44], np.uint64)
SPEC = spec_of(Placement(tuple(Member(f"s{i}") for i in range(3)), replicas=3))


def everything(cols):
    return np.ones(cols.shape[0], np.bool_)


def the_batch(seed=1):
    rng = np.random.default_rng(seed)
    return make_batch(rng, 12, 3, rng.choice(COLUMNS, 12))


def held(columns, writer_promise=0, bid=BID):
    """An applied set holding ``bid`` for ``columns`` only (its writer tracked, promised
    ``writer_promise``)."""
    applied = AppliedSet()
    applied.promise(bid.writer, writer_promise)
    applied.add(bid, np.array(columns, np.uint64))
    return applied


def whole(bid=BID):
    applied = AppliedSet()
    applied.add(bid)
    return applied


def rows_in(batch, columns):
    return batch.select_rows(np.isin(batch.row_column, np.array(columns, np.uint64)))


def same(a: RowBatch, b: RowBatch) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


# -- the plan -------------------------------------------------------------------------------------------
def test_plan_repair_ships_only_the_columns_a_node_lacks_under_an_id_it_holds_in_part():
    batch = the_batch()
    plan = plan_repair(held([11, 22]), everything, {"p": {BID: batch}}, {"p": whole()}, set())
    assert list(plan.shares) == [BID] and not plan.unrecoverable
    assert same(plan.shares[BID], rows_in(batch, [33, 44]))
    # owned restricts as before: a node owning 11 and 33 only lacks 33
    owns = lambda cols: np.isin(cols, np.array([11, 33], np.uint64))  # noqa: E731
    plan = plan_repair(held([11]), owns, {"p": {BID: batch}}, {"p": whole()}, set())
    assert same(plan.shares[BID], rows_in(batch, [33]))


def test_plan_repair_assembles_the_missing_columns_from_every_peers_record():
    batch = the_batch(2)
    logs = {"p": {BID: rows_in(batch, [11, 33])}, "q": {BID: rows_in(batch, [22, 44])}}
    plan = plan_repair(held([11, 22]), everything, logs, {"p": whole(), "q": whole()}, set())
    assert same(plan.shares[BID], rows_in(batch, [33, 44]))


def test_plan_repair_counts_an_id_whole_where_its_columns_are_not_known():
    """Untracked writers (stream items, the rule before), ids at or below the writer's promised
    floor (their columns forgotten), and peers from before ``LoggedPage.by_column``."""
    batch = the_batch()
    logs, peers = {"p": {BID: batch}}, {"p": whole()}
    untracked = AppliedSet()
    untracked.add(BID, np.array([11], np.uint64))  # (columns are kept for tracked writers only)
    for applied in (untracked, held([11], writer_promise=BID.seq)):
        plan = plan_repair(applied, everything, logs, peers, set())
        assert not plan.shares and not plan.unrecoverable
    plan = plan_repair(held([11]), everything, logs, peers, set(), by_column=False)
    assert not plan.shares and not plan.unrecoverable
    plan = plan_repair(AppliedSet(), everything, logs, peers, set(), by_column=False)  # (lacking it: as ever)
    assert same(plan.shares[BID], batch)


def test_plan_repair_of_an_id_held_in_all_its_columns_reports_nothing():
    """Held whole in the node's columns: no candidate, so a peer that lost its record of the id
    (snapshotted) makes it neither shipped nor unrecoverable; held in part, it is unrecoverable."""
    batch = the_batch()
    logs = {"p": {BID: batch}}
    peers = {"p": whole(), "gone": whole()}  # "gone" applied it, no longer logs it
    plan = plan_repair(held(np.unique(batch.row_column)), everything, logs, peers, set())
    assert not plan.shares and not plan.unrecoverable and not plan.unlogged
    plan = plan_repair(held([11]), everything, logs, peers, set())
    assert not plan.shares and plan.unrecoverable == {BID: "applied on gone but no longer in its log"}


def test_store_applies_a_repair_share_only_in_the_columns_it_lacks():
    """What the plan relies on: a column already applied under an id is never applied again
    (``ColumnStore.prepare``), whether the planner left it out or a late hint raced the repair."""
    batch = the_batch(3)
    reference = ColumnStore(1 << 26)
    reference.apply(BID, batch)
    dst = ColumnStore(1 << 26)
    dst.applied.promise(W, 0)
    assert dst.apply(BID, rows_in(batch, [11, 22]))
    plan = plan_repair(dst.applied, everything, {"p": {BID: batch}}, {"p": whole()}, set())
    assert dst.apply(BID, rows_in(batch, [33]))  # a late share of one lacking column, meanwhile
    assert dst.apply(BID, plan.shares[BID])  # the repair: only 44 is new
    assert not dst.apply(BID, plan.shares[BID]) and not dst.apply(BID, batch)  # everything is there
    assert dst.keys() == reference.keys()
    assert all(dst.row(k).equals(reference.row(k)) for k in reference.keys())
    assert np.array_equal(dst.applied.columns(BID), COLUMNS[np.isin(COLUMNS, batch.row_column)])


# -- the server's page ----------------------------------------------------------------------------------
def test_select_log_page_restricts_an_id_held_in_part_to_the_columns_lacking():
    batch, other = the_batch(4), the_batch(5)
    everything_held = BatchId(W, 6)
    node = held([11, 22])
    node.add(everything_held, np.unique(other.row_column))
    records = [LogRecord(1, KIND_BATCH, BID, batch), LogRecord(2, KIND_BATCH, everything_held, other)]
    page = select_log_page(records, 0, 10, everything, node, set(), 1 << 30)
    assert page.ids == [BID, everything_held]  # (both listed: logged here, held in part or whole there)
    assert [b for b, _ in page.records] == [BID] and same(page.records[0][1], rows_in(batch, [33, 44]))
    # the applied set alone (an asker from before applied_columns): both applied whole
    page = select_log_page(records, 0, 10, everything, applied_from_bulk(applied_arrays(node)), set(), 1 << 30)
    assert page.ids == [] and page.records == []


def test_applied_columns_travel_with_the_applied_set_and_are_checked():
    node = held([11, 22])
    node.add(BatchId(W, 7), np.array([33], np.uint64))
    node.add(BatchId(W, 1))  # (a seq applied without columns: whole)
    back = applied_from_bulk(applied_arrays(node), applied_columns_of(node))
    assert back == node and back.tracked(W)
    for bid in (BID, BatchId(W, 7), BatchId(W, 1), BatchId(W, 2)):
        assert np.array_equal(back.columns(bid), node.columns(bid)) if node.columns(bid) is not None \
            else back.columns(bid) is None
    # an asker's columns of an id its applied set lacks: refused (RepairRefused by the server)
    with pytest.raises(ValueError, match="not applied above a tracked floor"):
        applied_from_bulk(applied_arrays(AppliedSet()), applied_columns_of(node))
    sent = applied_columns_of(node)
    wrapping = msgspec.structs.replace(sent, counts=[2**64 - 1, 1 + len(sent.columns)])  # (sum mod 2^64 fits)
    with pytest.raises(ValueError, match="column count does not match"):
        applied_from_bulk(applied_arrays(node), wrapping)


def test_applied_columns_of_sends_the_ids_whose_columns_fit():
    node = held([11, 22])
    node.add(BatchId(W, 7), np.array([33, 44], np.uint64))
    node.add(BatchId(W, 9), np.array([11], np.uint64))
    sent = applied_columns_of(node, limit=3)
    assert (sent.writers, sent.seqs, sent.counts, sent.columns) == ([W], [5], [2], [11, 22])
    back = applied_from_bulk(applied_arrays(node), sent)
    assert back.columns(BatchId(W, 7)) is None  # not sent: applied whole, as before the field
    assert applied_columns_of(node, limit=5).seqs == [5, 7, 9]
    assert applied_columns_of(node, limit=0).seqs == []


# -- the wire, both ways across versions ----------------------------------------------------------------
class LoggedForBefore(msgspec.Struct, frozen=True, tag=200):
    """``LoggedFor`` as a server from before ``applied_columns`` decodes it."""

    node: str
    placement: object
    after_seq: int = 0
    max_bytes: int = 1
    stream_writers: list[int] = []


class LoggedPageBefore(msgspec.Struct, frozen=True, tag=230):
    server: str
    records: list[tuple[int, int, int]]
    next_after_seq: int
    done: bool
    stream_writers: list[int] = []


def test_logged_for_and_page_new_fields_are_optional_both_ways():
    columns = applied_columns_of(held([11, 22]))
    new = LoggedFor("s1", SPEC, 3, 100, [9], columns)
    assert decode_repair(ENC.encode(new)) == new
    old = msgspec.msgpack.decode(ENC.encode(new), type=LoggedForBefore)  # (an old server ignores it)
    assert (old.node, old.after_seq, old.stream_writers) == ("s1", 3, [9])
    from_old = decode_repair(ENC.encode(LoggedForBefore("s1", SPEC, 3, 100, [9])))
    assert isinstance(from_old, LoggedFor) and from_old.applied_columns is None
    assert decode_repair(ENC.encode(LoggedFor("s1", SPEC, applied_columns=AppliedColumns()))).applied_columns \
        == AppliedColumns()
    page = decode_repair_reply(ENC.encode(LoggedPageBefore("s0", [], 4, True)))
    assert isinstance(page, LoggedPage) and page.by_column is False
    assert decode_repair_reply(ENC.encode(LoggedPage("s0", [], 4, True, [], True))).by_column is True
