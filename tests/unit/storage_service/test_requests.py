"""giaannd.storage.replication.requests: the storage node's request core, without a transport or a loop."""

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests, WaitDurable, WaitHintSynced
from giaannd.storage.streaming.sender import AppliedTee


def _batch(cols, seed=0):
    rng = np.random.default_rng(seed)
    cols = np.asarray(cols, np.uint64)
    n = cols.size * 3
    return RowBatch.from_entries(np.repeat(cols, 3), np.zeros(n, np.uint64), np.zeros(n, np.uint8),
                                 rng.integers(1, 99, n, dtype=np.uint64), np.arange(n, dtype=np.uint64),
                                 np.ones(n, np.float32))


@pytest.fixture
def core(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 20)
    hints = HintStore.open(tmp_path / "hints")
    counts = []
    c = StorageRequests(store, hints, "", lambda: None, lambda k, n: counts.append((k, n)))
    c.counts = counts
    yield c
    store.close()
    hints.close()


def test_requests_apply_then_read_then_duplicate(core):
    b = _batch([5, 7])
    step = core.handle(p.encode(p.ApplyBatch(1, 1, 0)), b.buffers())
    assert isinstance(step, WaitDurable) and step.seq == 2 and step.ack.applied  # 1: writer tracked
    again = core.handle(p.encode(p.ApplyBatch(1, 1, 0)), b.buffers())
    assert isinstance(again, WaitDurable) and not again.ack.applied
    read = core.handle(p.encode(p.ReadRows()), [b.row_column, b.row_feature])
    assert isinstance(read, Answer) and isinstance(read.reply, p.RowsReply)
    got = RowBatch.from_buffers(list(read.bulk))
    assert all(np.array_equal(x, y) for x, y in zip(got.buffers(), b.buffers()))
    assert ("applies", 1) in core.counts and core.counters.applies_duplicate == 1


def test_requests_floor_is_logged_only_when_it_moves(core):
    b = _batch([5])
    step = core.handle(p.encode(p.ApplyBatch(1, 10, 8)), b.buffers())
    assert step.seq == 3  # tracking record 1 (the writer's first batch), batch 2, floor 3
    assert core.store.store.applied.floor(1) == 8
    step = core.handle(p.encode(p.ApplyBatch(1, 11, 8)), _batch([6]).buffers())
    assert step.seq == 4  # no second floor record
    assert core.store.store.applied.floor(1) == 8


def _read_all(core, b):
    read = core.handle(p.encode(p.ReadRows()), [b.row_column, b.row_feature])
    return RowBatch.from_buffers(list(read.bulk))


def test_requests_second_share_of_a_batch_applies_only_the_columns_it_lacks(core, tmp_path):
    """After a placement change a node gets more rows of a batch id it applied a share of (a hint
    re-split, a writer retry): the new columns apply, the ones it had are not counted twice
    (the replace-during-training defect: the whole second share was ignored)."""
    full = _batch([5, 7, 9])
    first = full.select_rows(full.row_column == 5)
    assert core.handle(p.encode(p.ApplyBatch(1, 1, 0)), first.buffers()).ack.applied
    step = core.handle(p.encode(p.ApplyBatch(1, 1, 0)), full.buffers())
    assert isinstance(step, WaitDurable) and step.ack.applied
    got = _read_all(core, full)
    assert all(np.array_equal(x, y) for x, y in zip(got.buffers(), full.buffers()))  # 5 once, 7 and 9 added
    again = core.handle(p.encode(p.ApplyBatch(1, 1, 0)), full.select_rows(full.row_column != 9).buffers())
    assert not again.ack.applied
    # the columns survive a restart by replay, and by a snapshot
    store = core.store
    store.close()
    for snapshot in (False, True):
        reopened = DurableStore.open(tmp_path / "store", 1 << 20)
        if snapshot:
            assert reopened.store.applied.columns((1, 1)).tolist() == [5, 7, 9]
        else:
            reopened.snapshot()
        assert not reopened.apply((1, 1), full).applied
        reopened.close()
    # the writer's promise ("never sent again") forgets them: the id is then whole
    reopened = DurableStore.open(tmp_path / "store", 1 << 20)
    reopened.store.applied.promise(1, 1)
    assert reopened.store.applied.columns((1, 1)) is None
    reopened.close()


def test_untracked_writers_stay_whole(tmp_path):
    """Stream items and markers (writers that never wrote through the request path) keep the old
    rule, and cost no per-batch memory: an applied id ignores any later share."""
    store = DurableStore.open(tmp_path / "store", 1 << 20)
    full = _batch([5, 7])
    assert store.apply((3, 1), full.select_rows(full.row_column == 5)).applied
    assert not store.apply((3, 1), full).applied
    assert store.store.applied.column_arrays()[2].shape == (0,)
    store.close()


def test_requests_hint_is_held_not_applied(core):
    b = _batch([5])
    step = core.handle(p.encode(p.ApplyBatch(1, 1, 0, "", "other")), b.buffers())
    assert isinstance(step, WaitHintSynced) and step.target == "other" and step.ack.hinted
    assert core.hints.held == 1 and core.store.store.usage().num_rows == 0
    # the hint owns its arrays: scribbling on the receive buffers does not change it
    for buf in b.buffers():
        buf[...] = 0
    assert core.hints.pending("other")[0].batch.row_column[0] == 5


def test_requests_errors_are_typed_and_change_nothing(core, tmp_path):
    b = _batch([5])
    assert isinstance(core.handle(b"\x90", []).reply, p.BadRequest)  # msgpack [] is no request
    assert isinstance(core.handle(p.encode(p.ApplyBatch(1, 1)), b.buffers()[:2]).reply, p.BadRequest)
    assert isinstance(core.handle(p.encode(p.ApplyBatch(1, 1, 0, "", "x" * 300)), b.buffers()).reply,
                      p.BadRequest)
    big = _batch(np.arange(1, 20000))
    full = core.handle(p.encode(p.ApplyBatch(1, 1)), big.buffers())
    assert isinstance(full.reply, p.StoreFull) and full.reply.capacity_bytes == 1 << 20
    core.refuse_writes = True
    assert isinstance(core.handle(p.encode(p.ApplyBatch(1, 1)), b.buffers()).reply, p.Unavailable)
    assert core.store.log.last_seq == 0 and core.hints.held == 0
    assert core.counters.errors == {"BadRequest": 3, "StoreFull": 1, "Unavailable": 1}
    assert isinstance(core.handle(p.encode(p.GetUsage()), []).reply, p.UsageReply)  # reads still served


def test_requests_not_owner_under_this_nodes_placement(core):
    topo = ClusterView(replicas=1)
    topo.set_members([StorageNode(n, f"mem://{n}") for n in ("a", "b", "c")])
    core.node_name = "a"
    core._topology = lambda: topo
    cols = np.arange(1, 200, dtype=np.uint64)
    mine = cols[[topo.placement.owners(int(c))[0] == "a" for c in cols]]
    theirs = cols[[topo.placement.owners(int(c))[0] != "a" for c in cols]]
    ok = core.handle(p.encode(p.ApplyBatch(1, 1)), _batch(mine).buffers())
    assert isinstance(ok, WaitDurable)
    no = core.handle(p.encode(p.ReadRows()), [theirs, np.zeros_like(theirs)])
    assert isinstance(no.reply, p.NotOwner) and no.reply.epoch == topo.epoch


def test_requests_fuzz_never_raises_and_only_valid_writes_change_state(core):
    import msgspec

    rng = np.random.default_rng(99)
    dtypes = [np.uint64, np.int64, np.uint8, np.float32, np.float64, np.int8]
    values = [0, 1, -1, 2**63, "x", None, [1, 2], {"a": 1}, 1.5, b"\x00", True]
    applied = 0
    for i in range(400):
        fields = {"type": int(rng.choice([1, 2, 3, 4, 5, 6, 64]))}
        for name in ("writer", "seq", "writer_floor", "placement_epoch", "hint_for", "seqs"):
            if rng.random() < 0.6:
                fields[name] = values[int(rng.integers(len(values)))]
        payload = msgspec.msgpack.encode(fields)
        if rng.random() < 0.3:  # a valid apply header with a mangled batch
            payload = p.encode(p.ApplyBatch(1, i + 1))
        b = _batch(rng.integers(1, 50, int(rng.integers(1, 4))), seed=i) if rng.random() < 0.5 else None
        if b is not None and len(set(b.row_column.tolist())) == b.num_rows:
            bulk = [x.copy() for x in b.buffers()]
            j = int(rng.integers(len(bulk)))
            if rng.random() < 0.7 and bulk[j].size:
                bulk[j] = bulk[j][::-1].copy() if rng.random() < 0.5 else bulk[j][:-1].copy()
        else:
            bulk = [rng.integers(0, 9, int(rng.integers(0, 5))).astype(rng.choice(dtypes))
                    for _ in range(int(rng.integers(0, 8)))]
        before = core.store.log.last_seq
        step = core.handle(payload, bulk)
        assert isinstance(step, (Answer, WaitDurable, WaitHintSynced))
        if isinstance(step, WaitDurable):
            applied += 1
        elif isinstance(step, Answer) and isinstance(step.reply, p.ErrorReply.__args__):
            assert core.store.log.last_seq == before  # refused: nothing logged
    assert core.counters.errors.get("BadRequest", 0) > 100


def test_requests_usage_answers_the_row_size_distribution(core):
    usage = core.handle(p.encode(p.GetUsage()), []).reply
    assert isinstance(usage, p.UsageReply) and usage.row_size_log2 == []
    core.handle(p.encode(p.ApplyBatch(1, 1, 0)), _batch([5, 7, 9]).buffers())  # three rows of 3 entries
    usage = core.handle(p.encode(p.GetUsage()), []).reply
    assert usage.row_size_log2 == [0, 3] and usage.num_rows == 3


def test_applied_tee_forwards_only_the_part_applied(tmp_path):
    """A source streaming a column forwards what it applies; a second share of a batch id must be
    forwarded without the columns forwarded with the first (the target would count them twice)."""
    store = DurableStore.open(tmp_path / "store", 1 << 20)
    tee = AppliedTee(store)
    seen = []
    tee.observers.append(lambda bid, batch, epoch: seen.append(np.unique(batch.row_column).tolist()))
    full = _batch([5, 7])
    assert tee.apply((1, 1), full.select_rows(full.row_column == 5), track=True).applied
    assert tee.apply((1, 1), full, track=True).applied
    assert not tee.apply((1, 1), full, track=True).applied
    assert seen == [[5], [7]]
    store.close()


def test_requests_during_a_fold(core):
    """``serve_during_fold``: what goes on while a fold moves the rows and what waits for it (None)."""
    b = _batch([5, 7])
    keys = [b.row_column, b.row_feature]
    assert core.serve_during_fold(p.ReadRows(), keys) is None  # no other replica to ask: waits
    refused = core.serve_during_fold(p.ReadRows(busy_ok=True), keys)
    assert isinstance(refused, Answer) and isinstance(refused.reply, p.Unavailable)
    assert refused.reply.message.startswith("folding") and core.counters.reads_redirected == 1
    assert core.serve_during_fold(p.GetUsage(), []) is None
    assert core.serve_during_fold(p.ReadRowPart(5, 0, 0, 10), []) is None
    got = core.serve_during_fold(p.GetVocab([1], [2]), [])  # not rows: served as ever
    assert got is not None and got == core.serve(p.GetVocab([1], [2]), [])
    held = core.serve_during_fold(p.ApplyBatch(1, 1), b.buffers())  # logged, applied when the fold ends
    assert isinstance(held, WaitDurable) and held.ack.applied and len(core.store.deferred) == 1
    assert core.store.store.read_all().num_rows == 0
    core.store.apply_deferred()
    assert core.store.store.read_all().num_rows == 2
