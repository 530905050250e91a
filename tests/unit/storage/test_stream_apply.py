"""A stream receiver's applies (``ColumnStore.append_writers``): the rows a stream item brings that
the store does not hold go straight into the engine's base, the rows it holds (dual writes made
them) merge as any batch's. Against the general path (the same store without the writer
registered), bit for bit: rows, strengths, touches, row ids, the applied set, the row-size counts,
the accounted bytes; and through the update log, a restart replays to the same store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, DurableStore, StoreFullError

BIG = 1 << 40
STREAM, TRAINING = 0x5EED, 7


def _rows(rng: np.random.Generator, columns: list[int], rows: int, per_row: int) -> RowBatch:
    n = rows * per_row
    return RowBatch.from_entries(
        np.repeat(rng.choice(np.array(columns, np.uint64), rows), per_row),
        np.repeat(rng.integers(0, 50, rows).astype(np.uint64), per_row),
        rng.integers(0, 3, n), rng.integers(0, 1000, n), rng.integers(0, 1000, n),
        rng.random(n, dtype=np.float32) + np.float32(0.01))


def _state(store: ColumnStore) -> tuple[object, ...]:
    keys, _, ids = store._sorted_keys()  # noqa: SLF001 (row ids must match too)
    return (list(store.iter_slots()), ids.tolist(), store.used_bytes, store.row_size_log2(),
            [a.tolist() for a in store.applied.to_arrays()], store.engine.num_entries, keys.tolist())


def _items(seed: int) -> tuple[list[tuple[BatchId, RowBatch]], list[tuple[BatchId, RowBatch]]]:
    """(training writes made before and between the stream's items: the dual writes, stream items)."""
    rng = np.random.default_rng(seed)
    cols = [3, 4, 5, 6]
    direct = [(BatchId(TRAINING, i + 1), _rows(rng, cols, 6, 3)) for i in range(4)]
    items = [(BatchId(STREAM, i + 1), _rows(rng, cols, 30, int(rng.integers(1, 40)))) for i in range(8)]
    return direct, items


@pytest.mark.parametrize("seed", range(6))
def test_stream_items_mixing_held_and_new_rows_equal_the_general_path(seed: int) -> None:
    direct, items = _items(seed)
    straight, general = ColumnStore(BIG), ColumnStore(BIG)
    straight.append_writers.add(STREAM)
    straight.reserve(sum(b.nbytes for _, b in items))  # as the receiver does (StreamHello.expected_bytes)
    for i, (bid, batch) in enumerate(items):
        for store in (straight, general):
            if i < len(direct):
                store.apply(*direct[i])
            assert store.apply(bid, batch)
            assert not store.apply(bid, batch)  # a re-sent item (a stream cut and resumed): ignored
        assert _state(straight) == _state(general)


def test_stream_chunk_of_new_rows_lands_in_the_base_without_a_delta_run() -> None:
    rng = np.random.default_rng(1)
    items = []
    for i in range(8):  # chunks of rows the store does not hold (each its own features)
        b = _rows(rng, [3, 4, 5], 30, 20)
        items.append((BatchId(STREAM, i + 1), RowBatch(b.row_column, b.row_feature + np.uint64(100 * i),
                                                       b.offsets, b.segment, b.target_column,
                                                       b.target_feature, b.strength)))
    store = ColumnStore(BIG)
    store.append_writers.add(STREAM)
    store.reserve(sum(b.nbytes for _, b in items))
    for bid, batch in items:
        store.apply(bid, batch)
        assert store.engine.num_deltas == 0
    assert store.engine.stats.folds == 0 and store.engine.stats.delta_merges == 0
    # a held row's item merges as before (an in-place add, no new row)
    bid, batch = items[0]
    before = store.engine.num_rows
    store.apply(BatchId(STREAM, 99), batch)
    assert store.engine.num_rows == before


def test_stream_apply_refused_when_full_changes_nothing() -> None:
    _, items = _items(2)
    store = ColumnStore(BIG)
    store.append_writers.add(STREAM)
    store.apply(*items[0])
    store.capacity_bytes = store.used_bytes + 10
    state = _state(store)
    with pytest.raises(StoreFullError):
        store.apply(*items[1])
    assert _state(store) == state


def test_stream_items_replay_to_the_same_store(tmp_path: Path) -> None:
    """Through the update log: a receiver restarted mid-stream replays to what it held, then the
    stream resumes (the items after the floor) as if never cut."""
    direct, items = _items(3)
    live = DurableStore.open(tmp_path / "a", BIG)
    live.store.append_writers.add(STREAM)
    reference = ColumnStore(BIG)
    for i, (bid, batch) in enumerate(items[:5]):
        if i < len(direct):
            live.apply(*direct[i])
            reference.apply(*direct[i])
        live.apply(bid, batch)
        reference.apply(bid, batch)
    live.sync()
    live.close()
    again = DurableStore.open(tmp_path / "a", BIG)
    assert _state(again.store) == _state(reference)
    again.store.append_writers.add(STREAM)
    for bid, batch in items[3:]:  # the window's last items again, then the rest
        again.apply(bid, batch)
        reference.apply(bid, batch)
    assert _state(again.store) == _state(reference)
    again.close()


@pytest.mark.parametrize("per_row", [1, 30, 600, 10_000])
def test_read_rows_equals_rows_one_by_one(per_row: int) -> None:
    """A stream's page (``ColumnStore.read_rows``: the engine's gather) is each requested row read
    alone (``ColumnStore.row``), bit for bit, in key order: rows in the base, rows partly in delta
    runs, absent keys left out; then with every row in the base."""
    rng = np.random.default_rng(per_row)
    store = ColumnStore(BIG)
    for i in range(12):
        if i == 8:
            store.engine.base_ratio = 1  # the last batches' new keys stay in delta runs
        rows = (20 if i < 8 else 16 >> (i - 8)) if per_row < 10_000 else 2
        store.apply(BatchId(TRAINING, i + 1), _rows(rng, [3, 4, 5, 6, 7], rows, per_row))
    assert store.engine.num_deltas
    keys = store.rows_of_columns(np.array([3, 4, 5, 6, 7], np.uint64))
    cols = np.append(keys[0], np.uint64(99))  # (an absent key)
    feats = np.append(keys[1], np.uint64(1))
    for compact in (False, True):
        if compact:
            store.engine.compact()
        for lo, hi in ((0, cols.size), (3, 17), (5, 6), (cols.size - 1, cols.size)):
            page = store.read_rows(cols[lo:hi][::-1], feats[lo:hi][::-1])  # (any order in: key order out)
            want = [(k, store.row(k)) for k in sorted(zip(cols[lo:hi].tolist(), feats[lo:hi].tolist()))]
            want = [(k, r) for k, r in want if r is not None]
            assert [k for k, _ in page] == [k for k, _ in want]
            for (_, got), (_, row) in zip(page, want):
                assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(
                    (got.segment, got.target_column, got.target_feature, got.strength.view(np.uint32)),
                    (row.segment, row.target_column, row.target_feature, row.strength.view(np.uint32))))
            page.validate()
