"""Stream core (streaming/stream.py): exact copies under concurrent writes, checksums, durable resume."""

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.streaming.stream import (
    Accept,
    Duplicate,
    ItemKind,
    Refuse,
    StreamReceiver,
    StreamSender,
    StreamTooSlow,
    item_checksum,
    stream_writer,
)

CAP = 256 << 20
COLUMNS = np.arange(1, 41, dtype=np.uint64)


def batch(rng, columns=COLUMNS, rows=12, per_row=6):
    n = rows * per_row
    sc = np.repeat(rng.choice(columns, rows), per_row)
    sf = np.repeat(rng.integers(0, 30, rows, dtype=np.uint64), per_row)
    return RowBatch.from_entries(sc, sf, rng.integers(0, 9, n).astype(np.uint8),
                                 rng.integers(1, 500, n, dtype=np.uint64), rng.integers(0, 500, n, dtype=np.uint64),
                                 rng.random(n).astype(np.float32))  # non-integer: order matters


def source_with_rows(tmp_path, rng, batches=40):
    src = DurableStore.open(tmp_path / "src", CAP)
    for s in range(1, batches + 1):
        src.apply(BatchId(7, s), batch(rng, np.arange(1, 61, dtype=np.uint64)))
    return src


def open_sender(src, stream_id=99, chunk_bytes=3000, **kw):
    keys = [k for k in src.store.keys() if k[0] in set(COLUMNS.tolist())]
    cols = np.array([k[0] for k in keys], np.uint64)
    feats = np.array([k[1] for k in keys], np.uint64)
    sizes = np.array([len(src.store.row_region(k)) for k in keys], np.int64)
    return StreamSender(stream_id, COLUMNS, cols, feats, sizes, chunk_bytes=chunk_bytes, **kw)


class Writer:
    """The source's own writes while the stream runs, each offered to the sender after applying."""

    def __init__(self, src, sender, rng):
        self.src, self.sender, self.rng, self.seq = src, sender, rng, 1000

    def write(self):
        self.seq += 1
        b = batch(self.rng, np.arange(1, 61, dtype=np.uint64))
        bid = BatchId(8, self.seq)
        assert self.src.apply(bid, b).applied
        self.sender.offer_delta(bid, b)


def deliver(sender, rx, dst, item):
    d = rx.check(item.index, int(item.kind), item.checksum, item.batch)
    if isinstance(d, Accept):
        dst.apply(d.batch_id, item.batch)
        dst.sync()
        rx.applied(d.index)
        return rx.next_index
    assert isinstance(d, Duplicate)
    return d.next_index


def pump(sender, rx, dst, src, writer=None, steps=10_000):
    for _ in range(steps):
        if writer is not None and writer.rng.random() < 0.5:
            writer.write()
        item = sender.next_to_send()
        if item is None and sender.in_flight == 0 and sender.chunks_left:
            sender.read_chunk(src.store.read_rows)
            item = sender.next_to_send()
        if item is None:
            if not sender.chunks_left and sender.idle:
                return
            continue
        sender.on_position(deliver(sender, rx, dst, item))
    raise AssertionError("stream did not finish")


def assert_same_rows(src, dst, columns=COLUMNS):
    keep = set(columns.tolist())
    a = [k for k in src.store.keys() if k[0] in keep]
    assert a == [k for k in dst.store.keys() if k[0] in keep]
    for k in a:
        a_, b_ = src.store.digest(k), dst.store.digest(k)
        assert (a_.keys, a_.strength) == (b_.keys, b_.strength)  # bit for bit


def test_stream_copies_rows_exactly_while_source_writes(tmp_path):
    rng = np.random.default_rng(1)
    src = source_with_rows(tmp_path, rng)
    dst = DurableStore.open(tmp_path / "dst", CAP)
    sender = open_sender(src)
    rx = StreamReceiver(99, 0)
    writer = Writer(src, sender, rng)
    pump(sender, rx, dst, src, writer)
    assert sender.deltas > 0 and sender.next_index > 10
    for _ in range(30):  # caught up: writes keep flowing as deltas
        writer.write()
    pump(sender, rx, dst, src)
    sender.close()
    assert sender.done
    assert_same_rows(src, dst)
    assert dst.store.applied.floor(stream_writer(99)) == sender.next_index


def test_stream_resumes_after_receiver_crash_resending_at_most_one_item(tmp_path):
    rng = np.random.default_rng(2)
    src = source_with_rows(tmp_path, rng)
    dst = DurableStore.open(tmp_path / "dst", CAP)
    sender = open_sender(src)
    rx = StreamReceiver(99, 0)
    writer = Writer(src, sender, rng)
    for crash_after_apply in (True, False):
        for _ in range(4):  # a few items normally
            item = sender.next_to_send() or sender.read_chunk(src.store.read_rows) and sender.next_to_send()
            sender.on_position(deliver(sender, rx, dst, item))
            writer.write()
        item = sender.next_to_send() or (sender.read_chunk(src.store.read_rows) and sender.next_to_send())
        if crash_after_apply:  # applied and synced, but the ack never reached the sender
            d = rx.check(item.index, int(item.kind), item.checksum, item.batch)
            dst.apply(d.batch_id, item.batch)
            dst.sync()
        dst.close()
        dst = DurableStore.open(tmp_path / "dst", CAP)  # restart: recover from the log
        rx = StreamReceiver(99, dst.store.applied.floor(stream_writer(99)))
        sent_before = sender.sent_upto
        sender.rewind(rx.next_index)
        assert sent_before - rx.next_index == (0 if crash_after_apply else 1)  # at most one re-sent
    pump(sender, rx, dst, src, writer)
    sender.close()
    pump(sender, rx, dst, src)
    assert_same_rows(src, dst)


def test_receiver_refuses_bad_checksum_gap_and_kind_without_change(tmp_path):
    rx = StreamReceiver(5, 3)
    b = batch(np.random.default_rng(3))
    good = item_checksum(5, 3, ItemKind.CHUNK, b)
    assert isinstance(rx.check(3, ItemKind.CHUNK, good ^ 1, b), Refuse)
    assert isinstance(rx.check(4, ItemKind.CHUNK, item_checksum(5, 4, ItemKind.CHUNK, b), b), Refuse)
    assert isinstance(rx.check(3, 9, item_checksum(5, 3, 9, b), b), Refuse)
    assert isinstance(rx.check(2, ItemKind.CHUNK, 0, b), Duplicate)
    assert rx.next_index == 3 and rx.items_refused == 3
    ok = rx.check(3, ItemKind.CHUNK, good, b)
    assert isinstance(ok, Accept) and ok.batch_id == BatchId(stream_writer(5), 4)
    # a checksum covers the stream id and index too: an item of another stream never applies
    assert item_checksum(6, 3, ItemKind.CHUNK, b) != good


def test_sender_resends_refused_item_and_rejects_impossible_positions(tmp_path):
    rng = np.random.default_rng(4)
    src = source_with_rows(tmp_path, rng, 10)
    sender = open_sender(src)
    first = sender.read_chunk(src.store.read_rows)
    assert sender.next_to_send() is first and sender.next_to_send() is None  # window of one
    sender.rewind(0)  # refused (bad checksum on the wire): send it again
    assert sender.next_to_send() is first
    sender.on_position(1)
    with pytest.raises(ValueError):
        sender.on_position(5)  # the receiver claims items that do not exist
    with pytest.raises(ValueError):
        sender.rewind(0)  # receiver lost acknowledged state


def test_delta_filter_forwards_read_rows_and_new_rows_only(tmp_path):
    rng = np.random.default_rng(5)
    src = source_with_rows(tmp_path, rng, 10)
    sender = open_sender(src, chunk_bytes=1)  # one row per chunk
    sender.read_chunk(src.store.read_rows)
    first_key = (int(sender._keys_c[0]), int(sender._keys_f[0]))
    later_key = (int(sender._keys_c[-1]), int(sender._keys_f[-1]))
    one = lambda key, f=0: RowBatch.from_entries(  # noqa: E731
        np.array([key[0]], np.uint64), np.array([key[1]], np.uint64), np.zeros(1, np.uint8),
        np.ones(1, np.uint64), np.array([f], np.uint64), np.ones(1, np.float32))
    assert sender.offer_delta(BatchId(1, 1), one(first_key))  # already read: forwarded
    assert not sender.offer_delta(BatchId(1, 2), one(later_key))  # a later chunk reads it
    assert sender.offer_delta(BatchId(1, 3), one((int(COLUMNS[0]), 10**6)))  # a new row
    assert not sender.offer_delta(BatchId(1, 4), one((10**9, 1)))  # another column
    # one batch of all four: only the read row and the new row are forwarded
    keys = [first_key, later_key, (int(COLUMNS[0]), 10**6), (10**9, 1)]
    mixed = RowBatch.from_entries(np.array([k[0] for k in keys], np.uint64), np.array([k[1] for k in keys], np.uint64),
                                  np.zeros(4, np.uint8), np.ones(4, np.uint64), np.zeros(4, np.uint64),
                                  np.ones(4, np.float32))
    assert sender.offer_delta(BatchId(1, 5), mixed)
    sent = sender._pending[-1].batch
    assert set(zip(sent.row_column.tolist(), sent.row_feature.tolist())) == {first_key, keys[2]}


def test_sender_aborts_when_receiver_is_too_slow(tmp_path):
    rng = np.random.default_rng(6)
    src = source_with_rows(tmp_path, rng, 10)
    sender = open_sender(src, max_pending_bytes=20_000)
    while sender.chunks_left:
        sender.read_chunk(src.store.read_rows)
        if sender.pending_bytes > 10_000:
            break
    with pytest.raises(StreamTooSlow):
        for s in range(1, 1000):
            sender.offer_delta(BatchId(3, s), batch(rng))


def test_receiver_applies_a_window_ahead_and_acknowledges_only_durable_items():
    """Pipelining (stream.py): items are applied in order ahead of the durable resume point; a
    re-sent item that is applied but not durable is a duplicate (never applied twice) answered with
    the durable position; a gap is measured from the apply point."""
    rx = StreamReceiver(5, 0)
    b = batch(np.random.default_rng(9))
    for i in range(3):  # three items on the wire: each applied as it arrives, none durable yet
        d = rx.check(i, ItemKind.CHUNK, item_checksum(5, i, ItemKind.CHUNK, b), b)
        assert isinstance(d, Accept) and d.batch_id == BatchId(stream_writer(5), i + 1)
        rx.accepted(i)
    assert (rx.next_apply, rx.next_index) == (3, 0)
    again = rx.check(1, ItemKind.CHUNK, item_checksum(5, 1, ItemKind.CHUNK, b), b)
    assert isinstance(again, Duplicate) and again.next_index == 0  # applied, not acknowledged
    assert isinstance(rx.check(4, ItemKind.CHUNK, item_checksum(5, 4, ItemKind.CHUNK, b), b), Refuse)
    rx.applied(1)  # the log is fsynced in order: items 0 and 1 are durable
    assert (rx.next_apply, rx.next_index) == (3, 2)
    rx.applied(0)  # a late acknowledgement of an earlier item changes nothing
    assert rx.next_index == 2
    rx.applied(2)
    assert (rx.next_apply, rx.next_index) == (3, 3)


def _one_row(col, feat, n=3, target=7):
    return RowBatch.from_entries(np.full(n, col, np.uint64), np.full(n, feat, np.uint64), np.zeros(n, np.uint8),
                                 np.arange(target, target + n, dtype=np.uint64), np.zeros(n, np.uint64),
                                 np.ones(n, np.float32))


def test_chunks_name_the_batches_in_their_rows_a_share_may_still_come_for_once(tmp_path):
    """The first chunk names the source's ids a share may still come for among the stream's
    columns (``AppliedSet.touching``, streaming/dedupe.py "Chunks"); a batch applied later whose
    rows were left for a chunk is named by the next chunk, one forwarded whole only by its delta;
    each id once per stream, on the first part of a row cut into parts; a sender without
    ``origins_of`` names none."""
    rng = np.random.default_rng(11)
    src = DurableStore.open(tmp_path / "src", CAP)
    src.store.applied.promise(7, 0)  # a training writer: its columns are recorded
    for s in range(1, 41):
        src.apply(BatchId(7, s), batch(rng, np.arange(1, 61, dtype=np.uint64)))
    sender = open_sender(src, origins_of=src.store.applied.touching)
    first = sender.read_chunk(src.store.read_rows)
    assert first is not None and set(first.origins) == set(src.store.applied.touching(COLUMNS)) != set()
    sender.on_position(first.index + 1)
    cols, feats = sender.keys
    ahead, behind = sender.cursor + 1, sender.cursor - 1  # a row left for a chunk, a row read
    for seq, at in ((41, ahead), (42, behind)):
        b = _one_row(cols[at], feats[at])
        src.apply(BatchId(7, seq), b)
        sender.offer_delta(BatchId(7, seq), b)
    delta = sender.next_to_send()
    assert delta is not None and delta.kind == ItemKind.DELTA and delta.origin == BatchId(7, 42)
    sender.on_position(delta.index + 1)
    second = sender.read_chunk(src.store.read_rows)
    assert second is not None and second.origins == (BatchId(7, 41),)
    sender.on_position(second.index + 1)
    while sender.chunks_left:
        item = sender.read_chunk(src.store.read_rows)
        assert item is not None and item.origins == ()
        sender.on_position(item.index + 1)
    assert open_sender(src).read_chunk(src.store.read_rows).origins == ()
    big = DurableStore.open(tmp_path / "big", CAP)  # one row of 2,000 entries: cut into parts
    big.store.applied.promise(7, 0)
    big.apply(BatchId(7, 1), _one_row(5, 0, n=2000))
    parts = open_sender(big, chunk_bytes=4096, origins_of=big.store.applied.touching)
    first = parts.read_chunk(big.store.read_rows)
    assert first is not None and first.part and first.origins == (BatchId(7, 1),) and parts.parts > 1
    later = []
    while (item := parts.next_to_send()) is not None:
        later.append(item)
        parts.on_position(item.index + 1)
    assert len(later) == parts.parts and all(it.origins == () for it in later[1:])


def test_stream_data_without_origins_decodes_as_none_named():
    """An older sender's item (no ``origins`` field) decodes with none; a newer one round-trips."""
    import msgspec

    from giaannd.storage.streaming.stream import StreamData

    class OldData(msgspec.Struct, frozen=True, tag=2):
        stream_id: int
        index: int
        kind: int
        checksum: int
        origin_writer: int = 0
        origin_seq: int = 0

    dec = msgspec.msgpack.Decoder(StreamData)
    assert dec.decode(msgspec.msgpack.encode(OldData(1, 2, 1, 3))).origins == ()
    new = StreamData(1, 2, 1, 3, origins=((7, 4), (8, 1)))
    assert dec.decode(msgspec.msgpack.encode(new)) == new


def test_a_chunk_names_at_most_the_cap_and_the_next_chunk_the_rest(tmp_path, monkeypatch):
    """More ids waiting than one item may carry (``MAX_CHUNK_ORIGINS``, the receiver's decode
    limit): the rest wait for the next chunk, none named twice."""
    from giaannd.storage.streaming import stream as stream_mod

    rng = np.random.default_rng(12)
    src = DurableStore.open(tmp_path / "src", CAP)
    src.store.applied.promise(7, 0)
    for s in range(1, 41):
        src.apply(BatchId(7, s), batch(rng, np.arange(1, 61, dtype=np.uint64)))
    monkeypatch.setattr(stream_mod, "MAX_CHUNK_ORIGINS", 3)
    sender = open_sender(src, origins_of=src.store.applied.touching)
    named = []
    while sender.chunks_left:
        item = sender.read_chunk(src.store.read_rows)
        assert item is not None and len(item.origins) <= 3
        named += item.origins
        sender.on_position(item.index + 1)
    want = src.store.applied.touching(COLUMNS)
    assert len(named) == len(set(named)) == min(len(want), 3 * sender.next_index) > 3
