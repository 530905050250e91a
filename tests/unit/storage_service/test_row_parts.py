"""Chunked reads of rows of any size (protocol "Rows of any size", client/row_parts.py): the storage
node's request core driven directly by the client's part reader, no transport, no loop timing."""

import asyncio

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.errors import ReadFailed, raise_for_reply
from giaannd.client.row_parts import MAX_READ_RESTARTS, join_disjoint, read_chunked
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.regions import new_region
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests
from peers.errors import LocalProtocolError


def big_row(n, column=7, feature=3, seed=0):
    """A canonical row of ``n`` entries as (region, batch)."""
    rng = np.random.default_rng(seed)
    region, row = new_region(n)
    row.segment[:] = 0
    row.target_column[:] = np.arange(n, dtype=np.uint64) * 2
    row.target_feature[:] = 1
    row.strength[:] = rng.random(n, dtype=np.float32)
    batch = RowBatch(np.array([column], np.uint64), np.array([feature], np.uint64), np.array([0, n], np.int64),
                     row.segment.copy(), row.target_column.copy(), row.target_feature.copy(), row.strength.copy())
    return region, batch


@pytest.fixture
def core(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 30)
    hints = HintStore.open(tmp_path / "hints")
    c = StorageRequests(store, hints, "", lambda: None, read_chunk_bytes=4096)  # 195 entries a part
    yield c
    store.close()
    hints.close()


class FakeCall:
    """A NodeCall served by the request core; ``after_part(i)`` runs after the i-th ReadRowPart."""

    def __init__(self, core, after_part=None):
        self.core, self.after_part, self.sent = core, after_part, []

    async def __call__(self, node, msg, bulk=(), timeout_s=None, *, recv_into=None):
        self.sent.append(type(msg).__name__)
        step = self.core.serve(msg, [np.asarray(b) for b in bulk])
        assert isinstance(step, Answer)
        raise_for_reply(node, step.reply)
        if isinstance(msg, p.ReadRowPart) and self.after_part is not None:
            self.after_part(self.sent.count("ReadRowPart"), msg)  # (before the bulk is "sent")
        await asyncio.sleep(0)  # let the other part workers interleave
        out = [np.array(b) for b in step.bulk]
        if recv_into is not None:  # as the transport does: exactly matching buffers, else refused
            if len(recv_into) != len(out) or any(d.nbytes != b.nbytes for d, b in zip(recv_into, out)):
                raise LocalProtocolError("response did not fit recv_into")
            for d, b in zip(recv_into, out):
                d[...] = b
            out = list(recv_into)
        return step.reply, out


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def read(call, cols, feats, chunk_entries=195):
    return asyncio.run(read_chunked(call, "s0", np.asarray(cols, np.uint64), np.asarray(feats, np.uint64),
                                    chunk_entries=chunk_entries, epoch=""))


def test_row_parts_row_read_in_many_chunks(core):
    region, want = big_row(10_000)
    core.store.store.load_row((7, 3), region, 1)
    small = RowBatch.from_entries([9], [0], [0], [5], [5], [1.0])
    core.store.apply(BatchId(1, 1), small)
    call = FakeCall(core)
    got = read(call, [9, 7, 8], [0, 3, 0])  # unsorted, one absent
    assert call.sent.count("ReadRowPart") == -(-10_000 // 195) + 1  # the parts, then the version check
    assert same(got, join_disjoint([want, small]))
    assert got.num_rows == 2 and [*got.row_column.tolist()] == [7, 9]


def test_row_parts_reply_is_bounded_and_resumes_after_cursor(core):
    rows = RowBatch.from_entries(np.repeat(np.arange(10), 100), np.zeros(1000), np.zeros(1000),
                                 np.tile(np.arange(100), 10), np.zeros(1000), np.ones(1000))
    core.store.apply(BatchId(1, 1), rows)
    call = FakeCall(core)
    got = read(call, rows.row_column, rows.row_feature)
    assert same(got, rows)
    assert call.sent.count("ReadRows") == 10  # 195-entry replies: one 100-entry row each
    assert "ReadRowPart" not in call.sent


def test_row_parts_row_changing_between_chunks_is_read_again(core):
    region, _ = big_row(2_000)
    core.store.store.load_row((7, 3), region, 1)
    first = region[16 * 2000 : 16 * 2000 + 4].view(np.float32)[0]
    delta = RowBatch.from_entries([7], [3], [0], [0], [1], [0.5])  # an existing target: in-place add

    def write_once(i, msg):
        if i == 3:
            core.store.apply(BatchId(2, 1), delta)

    call = FakeCall(core, write_once)
    got = read(call, [7], [3])
    assert same(got, core.store.store.read_rows([7], [3]))  # the row after the write, not a mix
    assert got.strength[0] == first + np.float32(0.5)  # (load_row copies the region: it is unchanged)
    assert call.sent.count("ReadRowPart") > -(-2_000 // 195)  # the read started again


def test_row_parts_row_growing_between_chunks_is_read_again(core):
    region, _ = big_row(2_000)
    core.store.store.load_row((7, 3), region, 1)
    grow = RowBatch.from_entries([7], [3], [0], [1], [1], [2.0])  # a new target: the row grows

    def write_once(i, msg):
        if i == 2:
            core.store.apply(BatchId(2, 1), grow)

    got = read(FakeCall(core, write_once), [7], [3])
    assert got.num_entries == 2_001
    assert same(got, core.store.store.read_rows([7], [3]))


def test_row_parts_change_to_a_part_waiting_to_be_sent_is_caught(core):
    """Parts are views of the row: a merge-add after the node answered the last part, before its
    bytes left (FakeCall copies the bulk after the hook), changes what the reader gets of that part
    but not of the parts it already has. The version check after the last part catches it; without
    it the row would be torn (entry 0 old, the last part's entry new)."""
    region, _ = big_row(2_000)
    core.store.store.load_row((7, 3), region, 1)
    parts = -(-2_000 // 195)

    def write_into_last_part(i, msg):
        if i == parts:  # the last data part (the check comes after all of them)
            e = min(msg.offset, 1_999)  # one batch: an entry of a part already read, one of this part
            core.store.apply(BatchId(2, 1), RowBatch.from_entries([7, 7], [3, 3], [0, 0], [0, 2 * e], [1, 1],
                                                                  [0.5, 0.5]))

    call = FakeCall(core, write_into_last_part)
    got = read(call, [7], [3])
    assert same(got, core.store.store.read_rows([7], [3]))
    assert call.sent.count("ReadRowPart") == 2 * (parts + 1)  # read again, whole


def test_row_parts_row_changing_on_every_read_fails(core):
    region, _ = big_row(2_000)
    core.store.store.load_row((7, 3), region, 1)
    seq = iter(range(1, 1000))

    def write_always(i, msg):
        core.store.apply(BatchId(3, next(seq)), RowBatch.from_entries([7], [3], [0], [0], [1], [0.5]))

    call = FakeCall(core, write_always)
    with pytest.raises(ReadFailed, match="changed during each"):
        read(call, [7], [3])
    assert call.sent.count("ReadRows") == 1 and call.sent.count("ReadRowPart") <= 4 * (MAX_READ_RESTARTS + 2)


def test_row_parts_row_dropped_between_chunks_is_absent(core):
    region, _ = big_row(2_000)
    core.store.store.load_row((7, 3), region, 1)
    got = read(FakeCall(core, lambda i, msg: core.store.store.drop_columns([7]) if i == 2 else None), [7], [3])
    assert got.num_rows == 0


def test_row_parts_unchunked_request_still_answers_whole_rows(core):
    region, want = big_row(1_000)
    core.store.store.load_row((7, 3), region, 1)
    step = core.serve(p.ReadRows(), [np.array([7], np.uint64), np.array([3], np.uint64)])
    assert isinstance(step.reply, p.RowsReply) and not step.reply.large
    assert same(RowBatch.from_buffers(list(step.bulk)), want)


# -- malformed messages ---------------------------------------------------------------------------
def _part(k, offset=0, entries=1000):
    return p.RowPart(entries, 1, 0, offset), [np.zeros(k, np.uint8), np.arange(k, dtype=np.uint64),
                                              np.zeros(k, np.uint64), np.ones(k, np.float32)]


@pytest.mark.parametrize("mangle, message", [
    (lambda r, b: (r, b[:3]), "4 buffers"),
    (lambda r, b: (r, [b[0], b[1].astype(np.int64), b[2], b[3]]), "target_column: expected 1-d uint64"),
    (lambda r, b: (r, [b[0][:5], b[1], b[2], b[3]]), "differ in length"),
    (lambda r, b: (p.RowPart(1000, 1, 0, 195), b), "offset 195, asked for 0"),
    (lambda r, b: (p.RowPart(5, 1, 0, 0), b), "of a 5-entry row"),
    (lambda r, b: (r, [x[:0] for x in b]), "0 entries"),
])
def test_row_parts_malformed_part_is_rejected(mangle, message):
    reply, bulk = mangle(*_part(10))
    with pytest.raises(p.ProtocolViolation, match=message):
        p.check_part(reply, bulk, 0, 10)
    p.check_part(*_part(10), 0, 10)  # the unmangled part passes


def test_row_parts_part_larger_than_asked_is_rejected():
    with pytest.raises(p.ProtocolViolation, match="asked for at most 8"):
        p.check_part(*_part(10), 0, 8)


def test_row_parts_bad_part_request_is_a_bad_request(core):
    for bad in (p.encode(p.ReadRowPart(7, 3, 0, 1)).replace(b"\x01", b"\x00", 1), b"\x85garbage"):
        step = core.handle(bad, [])
        assert isinstance(step, Answer) and isinstance(step.reply, p.BadRequest)


def test_row_parts_reply_cursor_must_advance():
    async def call(node, msg, bulk=(), timeout_s=None):
        return p.RowsReply(True, 0, 0), RowBatch.empty().buffers()

    with pytest.raises(p.ProtocolViolation, match="cursor is before every key"):
        asyncio.run(read_chunked(call, "s0", np.array([5], np.uint64), np.array([5], np.uint64),
                                 chunk_entries=10, epoch=""))


def test_row_parts_large_row_not_asked_for_is_rejected():
    async def call(node, msg, bulk=(), timeout_s=None):
        return p.RowsReply(large=[(1, 2, 100, 1, 0)]), RowBatch.empty().buffers()

    with pytest.raises(p.ProtocolViolation, match="was not asked for"):
        asyncio.run(read_chunked(call, "s0", np.array([5], np.uint64), np.array([5], np.uint64),
                                 chunk_entries=10, epoch=""))


def test_row_parts_join_disjoint_orders_runs_and_refuses_overlap():
    a = RowBatch.from_entries([1, 3, 5], [0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 2, 3])
    b = RowBatch.from_entries([2, 4], [0, 0], [0, 0], [1, 2], [0, 0], [4, 5])
    joined = join_disjoint([a, b])
    assert same(joined, RowBatch.concat([a, b]))
    with pytest.raises(ValueError, match="two parts"):
        join_disjoint([a, a])


def test_row_parts_parts_out_of_order_across_an_edge_are_rejected(core):
    region, _ = big_row(1_000)
    core.store.store.load_row((7, 3), region, 1)

    class Tamper(FakeCall):
        async def __call__(self, node, msg, bulk=(), timeout_s=None, *, recv_into=None):
            reply, out = await super().__call__(node, msg, bulk, timeout_s, recv_into=recv_into)
            if isinstance(msg, p.ReadRowPart) and msg.offset == 195 and out[1].size:
                out[1][0] = 0  # still sorted within the part, not after the part before it
            return reply, out

    with pytest.raises(p.ProtocolViolation, match="not sorted and unique"):
        read(Tamper(core), [7], [3])


def test_row_parts_a_failing_part_raises_its_own_error(core):
    region, _ = big_row(1_000)
    core.store.store.load_row((7, 3), region, 1)

    class Broken(FakeCall):
        async def __call__(self, node, msg, bulk=(), timeout_s=None, *, recv_into=None):
            if isinstance(msg, p.ReadRowPart) and msg.offset == 390:
                raise ConnectionResetError("part lost")
            return await super().__call__(node, msg, bulk, timeout_s, recv_into=recv_into)

    with pytest.raises(ConnectionResetError, match="part lost"):  # not an ExceptionGroup
        read(Broken(core), [7], [3])


def _same_batch(a, b):
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


@pytest.mark.parametrize("seed", range(12))
def test_row_parts_join_gather_agrees_with_run_slicing(seed, monkeypatch):
    """The vectorised gather (small joins, many runs) and the run-by-run slicing give the same
    canonical batch, equal to coalescing the parts (RowBatch.concat); overlap is still refused."""
    import giaannd.client.row_parts as rp

    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 200))
    sizes = rng.integers(1, 40, n)
    keys = np.unique(rng.integers(0, 500, (n, 2)).astype(np.uint64), axis=0)
    sizes = sizes[: keys.shape[0]]
    whole = RowBatch.from_entries(np.repeat(keys[:, 0], sizes), np.repeat(keys[:, 1], sizes),
                                  rng.integers(0, 4, int(sizes.sum())), rng.integers(0, 9, int(sizes.sum())),
                                  rng.integers(0, 1 << 40, int(sizes.sum())), rng.random(int(sizes.sum())))
    owner = rng.integers(0, int(rng.integers(2, 5)), whole.num_rows)
    parts = []
    for k in range(int(owner.max()) + 1):
        rows = [(whole.key(i), whole.row(i)) for i in np.flatnonzero(owner == k).tolist()]
        parts.append(RowBatch.from_rows(dict(rows)) if rows else RowBatch.empty())
    gathered = join_disjoint(parts)
    assert gathered.validate() is None and _same_batch(gathered, whole)
    monkeypatch.setattr(rp, "JOIN_GATHER_ENTRIES", 0)  # the slicing path (or gather for many runs)
    assert _same_batch(join_disjoint(parts), whole)
    monkeypatch.setattr(rp, "MAX_JOIN_RUNS", 10**9)  # slicing, however many runs
    assert _same_batch(join_disjoint(parts), whole)
    assert _same_batch(RowBatch.concat(parts), whole)
    with pytest.raises(ValueError):
        join_disjoint([*parts, parts[int(owner[0])]])
