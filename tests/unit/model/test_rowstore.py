import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from tests.oracle.sentences import synthetic_corpus


def _dict(batch):
    out = {}
    for (c, f), r in batch:
        for s, tc, tf, v in zip(r.segment.tolist(), r.target_column.tolist(), r.target_feature.tolist(),
                                r.strength.tolist()):
            out[(c, f, s, tc, tf)] = v
    return out


def test_rowstore_apply_merges_by_add_in_any_order():
    sents = synthetic_corpus(90, seed=2)
    parts = [train_batch(sents[i:i + 30]).rows for i in range(0, 90, 30)]
    a, b = RowStore(), RowStore()
    for p in parts:
        a.apply(p)
    for p in reversed(parts):
        b.apply(p)
    whole = train_batch(sents).rows
    da, db, dw = _dict(a.export()), _dict(b.export()), _dict(whole)
    assert da.keys() == db.keys() == dw.keys()
    assert all(abs(da[k] - dw[k]) <= 1e-5 * dw[k] and abs(db[k] - dw[k]) <= 1e-5 * dw[k] for k in dw)
    a.export().validate()
    assert a.num_entries == whole.num_entries and len(a) == whole.num_rows
    assert a.nbytes == whole.nbytes - whole.row_column.nbytes - whole.row_feature.nbytes - whole.offsets.nbytes


def test_rowstore_get_missing_row_is_empty_and_rows_are_copies():
    b = RowBatch.from_entries([1], [2], [8], [3], [4], np.array([1.5], np.float32))
    s = RowStore.from_batch(b)
    assert len(s.get((9, 9))) == 0 and (9, 9) not in s
    r = s.get((1, 2))
    assert r.strength.tolist() == [1.5]
    b.strength[0] = 100.0  # the store does not alias the batch it applied
    assert s.get_row(1, 2).strength.tolist() == [1.5]
    s.apply(b)
    assert s.get((1, 2)).strength.tolist() == pytest.approx([101.5])
    assert s.batches_applied == 2 and s.num_columns == 1


def test_rowstore_neuron_strengths():
    out = train_batch(synthetic_corpus(5, seed=1), neuron_strengths=True)
    s = RowStore()
    assert out.neurons is not None
    s.apply_neurons(out.neurons)
    total = sum(float(v.sum()) for _, v in s.neuron_items())
    assert total == pytest.approx(float(out.neurons.strength.sum()))
