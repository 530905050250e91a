"""RowStore on the row engine == the store it replaced (tools/bench/baseline_rowstore.py), bit for bit."""

import itertools

import numpy as np

from giaannd.model.columns import ColumnAssigner
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from giaannd.rowengine import RowEngine
from tools.bench.baseline_rowstore import RowStore as OldRowStore
from tools.bench.zipf_stream import ZipfStream


def _same_batch(x: RowBatch, y: RowBatch) -> bool:
    return all(np.array_equal(u.view(np.uint8), v.view(np.uint8)) and u.dtype == v.dtype
               for u, v in zip(x.buffers(), y.buffers()))


def test_rowstore_matches_the_old_store_bit_for_bit_on_the_zipf_stream():
    assigner = ColumnAssigner()
    sentences = list(assigner.encode_many(itertools.islice(ZipfStream(11), 3000)))
    new, old, tiny = RowStore(), OldRowStore(), RowStore(RowEngine(fanout=2, base_ratio=1))
    for i in range(0, len(sentences), 100):
        batch = train_batch(sentences[i:i + 100]).rows
        for store in (new, old, tiny):
            store.apply(batch)
        if i % 700 == 0:  # reads mid-stream, with delta runs in the engine
            for key, _ in old.largest_rows(5) + [(k, 0) for k in list(old.keys())[::997]]:
                a, b = new.get(key), old.get(key)
                assert a.equals(b) and np.array_equal(a.strength.view(np.uint32), b.strength.view(np.uint32))
    want = old.export()
    assert _same_batch(new.export(), want) and _same_batch(tiny.export(), want)
    assert new.keys() == old.keys() and len(new) == len(old) and new.num_entries == old.num_entries
    assert new.nbytes == old.nbytes and new.num_columns == old.num_columns
    assert [n for _, n in new.largest_rows(3)] == [n for _, n in old.largest_rows(3)]
    assert [k for k, _ in new] == old.keys()


def test_rowstore_contains_compact_and_views():
    b = RowBatch.from_entries([1, 1, 5], [2, 2, 0], [8, 3, 0], [3, 3, 9], [4, 4, 9],
                              np.array([1.5, 2.0, 1.0], np.float32))
    s = RowStore.from_batch(b)
    assert (1, 2) in s and (5, 0) in s and (1, 3) not in s and "x" not in s and (-1, 2) not in s
    s.apply(RowBatch.from_entries([1], [2], [4], [0], [0], np.array([1.0], np.float32)))
    s.compact()
    row = s.get((1, 2))
    assert row.segment.tolist() == [3, 4, 8] and row.strength.base is not None  # a view after compact
    assert s.engine.num_deltas == 0 and s.batches_applied == 2
