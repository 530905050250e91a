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


def _raw(rc, rf, offsets, seg, tc, tf, st):
    """A batch of the given arrays as they are (RowBatch's constructor checks nothing)."""
    u = lambda x: np.array(x, np.uint64)  # noqa: E731
    return RowBatch(u(rc), u(rf), np.array(offsets, np.int64), np.array(seg, np.uint8), u(tc), u(tf),
                    np.array(st, np.float32))


_NON_CANONICAL = {
    "a new row twice": _raw([7, 7], [0, 0], [0, 1, 2], [0, 0], [5, 5], [1, 1], [1, 2]),
    "a held row twice": _raw([1, 1], [2, 2], [0, 1, 2], [3, 3], [4, 4], [4, 4], [1, 2]),
    "an entry twice": _raw([1], [2], [0, 2], [3, 3], [4, 4], [4, 4], [1, 2]),
    "entries out of order": _raw([1], [2], [0, 2], [8, 3], [4, 4], [4, 4], [1, 2]),
    "a NaN strength": _raw([1], [2], [0, 1], [3], [4], [4], [np.nan]),
    "an infinite strength": _raw([1], [2], [0, 1], [3], [4], [4], [-np.inf]),
    "segment 9": _raw([1], [2], [0, 1], [9], [4], [4], [1]),
    "offsets short of the entries": _raw([1], [2], [0, 1], [3, 8], [4, 4], [4, 4], [1, 1]),
}


@pytest.mark.parametrize("fold_thread", [False, True])
@pytest.mark.parametrize("name", sorted(_NON_CANONICAL))
def test_rowstore_refuses_a_non_canonical_batch_and_changes_nothing(name, fold_thread):
    """The engine takes canonical batches only (it does not check: a repeated row got two ids, a
    repeated key lost an increment or was held twice, unsorted keys broke every later search):
    the store checks each batch as the storage role's column store does, so such a batch is
    refused at the call and leaves the rows as they were, instead of a store whose own export
    (and so its snapshot) is no longer canonical."""
    good = RowBatch.from_entries([1, 1, 5], [2, 2, 0], [8, 3, 0], [3, 3, 9], [4, 4, 9],
                                 np.array([1.5, 2.0, 1.0], np.float32))
    store = RowStore(fold_thread=fold_thread)
    store.apply(good)
    before = store.export()
    with pytest.raises(ValueError, match="row batch"):
        store.apply(_NON_CANONICAL[name])
    after = store.export()
    after.validate()
    assert all(np.array_equal(u, v) for u, v in zip(before.buffers(), after.buffers()))
    assert len(store) == 2 and store.batches_applied == 1


def test_rowstore_contains_numpy_integer_keys_as_get_finds_them():
    """``key in store`` answers as ``get`` (and the dict of the store before the engine) does for a
    key of numpy integers (ids read from arrays): it said False for a row ``get`` returned."""
    s = RowStore.from_batch(RowBatch.from_entries([1, 2**64 - 1], [0, 2**64 - 1], [8, 0], [3, 0], [4, 0],
                                                  np.array([1.5, 1.0], np.float32)))
    for key in [(np.uint64(1), np.uint64(0)), (np.int64(1), 0), (np.uint64(2**64 - 1), np.uint64(2**64 - 1))]:
        assert len(s.get(key)) == 1
        assert key in s
    assert (np.uint64(2), np.uint64(0)) not in s and (np.int64(-1), 0) not in s and (np.float64(1), 0) not in s
