"""Streams of rows larger than a chunk (streaming/stream.py, "A row larger than a chunk"): the row is
cut into parts, applied on the receiver as appends, bit for bit; the parts do not trip the
slow-receiver abort; deltas come after every part."""

import numpy as np
import pytest

from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.regions import new_region, row_from_region
from giaannd.storage.engine.row_merge import merge_into, plan_merge
from giaannd.storage.streaming.stream import ItemKind, StreamReceiver, StreamSender, cut_row, stream_writer
from tests.unit.topology.test_streaming import deliver

CAP = 1 << 30


def big_region(n, seed=0):
    rng = np.random.default_rng(seed)
    region, row = new_region(n)
    row.segment[:] = np.sort(rng.integers(0, 9, n)).astype(np.uint8)
    row.target_column[:] = np.arange(n, dtype=np.uint64) // 3
    row.target_feature[:] = np.arange(n, dtype=np.uint64) % 3
    row.strength[:] = rng.random(n, dtype=np.float32)
    return region


def source(tmp_path, n):
    src = DurableStore.open(tmp_path / "src", CAP)
    src.store.load_row((5, 1), big_region(n), 3)
    small = RowBatch.from_entries([5, 6], [0, 2], [0, 0], [1, 2], [0, 0], [1.0, 2.0])
    src.apply(BatchId(7, 1), small)
    return src


def sender_for(src, chunk_bytes, **kw):
    keys = src.store.keys()
    cols = np.array([k[0] for k in keys], np.uint64)
    feats = np.array([k[1] for k in keys], np.uint64)
    sizes = np.array([len(src.store.row_region(k)) for k in keys], np.int64)
    return StreamSender(42, np.array([5, 6], np.uint64), cols, feats, sizes, chunk_bytes=chunk_bytes, **kw)


def run(sender, src, dst, before_send=None):
    rx = StreamReceiver(42, 0)
    items = []
    while True:
        item = sender.next_to_send()
        if item is None and sender.in_flight == 0 and sender.chunks_left:
            sender.read_chunk(src.store.read_rows)
            if before_send is not None:
                before_send()
            item = sender.next_to_send()
        if item is None:
            return items
        items.append(item)
        sender.on_position(deliver(sender, rx, dst, item))


def same_store_rows(src, dst):
    assert src.store.keys() == dst.store.keys()
    for k in src.store.keys():
        assert bytes(src.store.row_region(k)) == bytes(dst.store.row_region(k))  # bit for bit


def test_stream_big_row_is_sent_in_parts_and_applied_exactly(tmp_path):
    src = source(tmp_path, 100_000)  # 2.1 MB; 4 KiB chunks
    dst = DurableStore.open(tmp_path / "dst", CAP)
    sender = sender_for(src, 4096, max_pending_bytes=64 << 10)  # the row is 32x the abort limit
    items = run(sender, src, dst)
    parts = [i for i in items if i.part]
    assert len(parts) >= 8 and all(p.batch.num_rows == 1 for p in parts)
    sizes = [p.batch.num_entries for p in parts]
    assert sizes[0] == 4096 // 21 and sizes[1] == sizes[0] and sizes[2] == 2 * sizes[0]  # geometric
    assert sum(sizes) == 100_000
    same_store_rows(src, dst)
    assert dst.store.applied.floor(stream_writer(42)) == sender.next_index


def test_stream_big_row_delta_comes_after_every_part(tmp_path):
    src = source(tmp_path, 20_000)
    dst = DurableStore.open(tmp_path / "dst", CAP)
    sender = sender_for(src, 4096)
    delta = RowBatch.from_entries([5], [1], [0], [0], [0], [0.5])  # a stored entry of the big row
    done = []

    def write_after_cut():
        if not done and sender.parts:
            done.append(1)
            bid = BatchId(9, 1)
            src.apply(bid, delta)
            assert sender.offer_delta(bid, delta)

    items = run(sender, src, dst, write_after_cut)
    kinds = [(i.kind, i.part) for i in items]
    last_part = max(k for k, (_, part) in enumerate(kinds) if part)
    assert kinds.index((ItemKind.DELTA, False)) > last_part
    same_store_rows(src, dst)


def test_stream_cut_row_parts_cover_the_row_in_order():
    region = big_region(1000)
    row = RowBatch(np.array([5], np.uint64), np.array([1], np.uint64), np.array([0, 1000], np.int64),
                   *[np.asarray(a) for a in _fields(region)])
    parts = cut_row(row, 10, 300)
    assert [p.num_entries for p in parts] == [10, 10, 20, 40, 80, 160, 300, 300, 80]
    for p in parts:
        p.validate()
    assert np.array_equal(np.concatenate([p.strength for p in parts]), row.strength)


def _fields(region):
    r = row_from_region(region)
    return r.segment, r.target_column, r.target_feature, r.strength


@pytest.mark.parametrize("n, m", [(1, 1), (50, 7), (1000, 1)])
def test_row_merge_append_fast_path_equals_general_merge(n, m):
    region = big_region(n + m, seed=n)
    whole = Row(*_fields(region))
    base = Row(whole.segment[:n], whole.target_column[:n], whole.target_feature[:n], whole.strength[:n])
    delta = Row(whole.segment[n:], whole.target_column[n:], whole.target_feature[n:], whole.strength[n:])
    plan = plan_merge(base, delta)
    assert plan.new_count == m and (plan.pos == n).all() and not plan.found.any()
    _, out = new_region(n + m)
    merge_into(base, delta, plan, out)
    assert out.equals(whole)
