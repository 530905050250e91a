import numpy as np
import pytest

from giaannd.model.ids import column_id, feature_id
from giaannd.model.rows import RowBatch
from giaannd.model.train import proximity, train_batch, train_sentence
from tests.oracle.plain import plain_neurons, plain_train
from tests.oracle.sentences import make_sentence, synthetic_corpus, worked_example

CAT, MAT = column_id("cat"), column_id("mat")
THE, SAT, ON, DOT = feature_id("the"), feature_id("sat"), feature_id("on"), feature_id(".")


def _entries(batch: RowBatch) -> dict:
    out = {}
    for (c, f), r in batch:
        for s, tc, tf, v in zip(r.segment.tolist(), r.target_column.tolist(), r.target_feature.tolist(),
                                r.strength.tolist()):
            out[(c, f, s, tc, tf)] = v
    return out


def test_train_worked_example_rows_from_the_spec_table():
    e = _entries(train_sentence(worked_example()).rows)
    # the(0) -> cat(1): d=1, cd=0
    assert e[(CAT, THE, 8, CAT, 0)] == pytest.approx(5.0)
    assert e[(CAT, THE, 3, CAT, 0)] == pytest.approx(5.0)
    # the(0) -> mat(5): d=5, cd=1
    assert e[(CAT, THE, 4, MAT, 0)] == pytest.approx(10 / 6)
    assert e[(CAT, THE, 2, MAT, 0)] == pytest.approx(10 / 6)
    # the(0) -> .(6): d=6, cd=1: column entry only
    assert e[(CAT, THE, 2, MAT, DOT)] == pytest.approx(10 / 7)
    assert not any(k[:2] == (CAT, THE) and k[3:] == (MAT, DOT) and k[2] >= 4 for k in e)
    # on(3) -> the(4): d=1, cd=1
    assert e[(CAT, ON, 8, MAT, THE)] == pytest.approx(5.0)
    assert e[(CAT, ON, 2, MAT, THE)] == pytest.approx(5.0)
    # cat(1) -> sat(2): d=1, cd=0
    assert e[(CAT, 0, 8, CAT, SAT)] == pytest.approx(5.0)
    assert e[(CAT, 0, 3, CAT, SAT)] == pytest.approx(5.0)


def test_train_worked_example_exact_entry_set():
    # all 21 pairs of 7 tokens, every pair within 3 columns -> 21 column entries;
    # feature entries for d <= 5: 6+5+4+3+2 = 20 -> 41 entries (no key repeats in this sentence).
    e = _entries(train_sentence(worked_example()).rows)
    assert len(e) == 41
    assert e == pytest.approx(plain_train(worked_example()))


def test_train_output_is_canonical_and_batching_is_additive():
    sents = synthetic_corpus(60, seed=3)
    whole = train_batch(sents).rows
    whole.validate()
    parts = RowBatch.concat([train_batch(sents[:25]).rows, train_batch(sents[25:]).rows])
    a, b = _entries(whole), _entries(parts)
    assert a.keys() == b.keys()
    assert all(abs(a[k] - b[k]) <= 1e-5 * b[k] for k in a)


def test_train_repeated_pairs_add_up():
    # "the the the" inside one column: (the -> the) at d=1 twice and d=2 once.
    s = make_sentence(["x", "the", "the", "the", "y", "on", "z", "a", "b"], [0, 4, 6],
                      [(0, 4), (4, 6), (6, 9)])
    e = _entries(train_sentence(s).rows)
    cx = column_id("x")
    assert e[(cx, THE, 8, cx, THE)] == pytest.approx(2 * proximity(1))
    assert e[(cx, THE, 7, cx, THE)] == pytest.approx(proximity(2))
    assert e[(cx, THE, 3, cx, THE)] == pytest.approx(2 * proximity(1) + proximity(2))


def test_train_far_pairs_produce_nothing():
    # 5 instances: tokens 0 and 8 are d=8 apart and 4 columns apart -> no entry.
    words = ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
    s = make_sentence(words, [0, 2, 4, 6, 8], [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9)])
    e = _entries(train_sentence(s).rows)
    assert not any(k[0] == column_id("a") and k[3] == column_id("i") for k in e)
    assert (column_id("a"), 0, 0, column_id("g"), 0) in e  # cd=3, d=6 -> segment 0


def test_train_empty_inputs():
    out = train_batch([])
    assert out.rows.num_entries == 0 and out.tokens == 0


def test_train_neuron_strengths_match_plain():
    sents = synthetic_corpus(40, seed=5)
    nb = train_batch(sents, neuron_strengths=True).neurons
    assert nb is not None
    got = {(c, f, s): v for c, f, s, v in zip(nb.column.tolist(), nb.feature.tolist(),
                                              nb.segment.tolist(), nb.strength.tolist())}
    want: dict = {}
    for s in sents:
        plain_neurons(s, want)
    assert got == want
    assert train_batch(sents).neurons is None


def test_train_matches_plain_on_synthetic_corpus():
    sents = synthetic_corpus(300, seed=9)
    got = _entries(train_batch(sents).rows)
    want: dict = {}
    for s in sents:
        plain_train(s, want)
    assert got.keys() == want.keys()
    assert max(abs(got[k] - want[k]) / want[k] for k in want) < 1e-5
    assert np.isfinite(list(got.values())).all()


def test_train_backends_agree_exactly():
    sents = synthetic_corpus(120, seed=11)
    a = train_batch(sents, backend="torch").rows
    b = train_batch(sents, backend="numpy").rows
    for x, y in zip(a.buffers(), b.buffers()):
        assert np.array_equal(x, y)
    with pytest.raises(ValueError, match="backend"):
        train_batch(sents, backend="jax")  # type: ignore[arg-type]
