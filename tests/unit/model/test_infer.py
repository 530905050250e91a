import math

import numpy as np
import pytest

from giaannd.model.infer import TEST_SET, TRAIN_SET, LifSession, NoDelimiters, activation, run_session
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from tests.oracle.plain import plain_lif
from tests.oracle.sentences import SetFlags, synthetic_corpus
from tests.unit.rowengine.collide import on_home

TUPLES = {TRAIN_SET: (0.004, True, 1.0, 1.0, True), TEST_SET: (0.008, False, 0.75, 0.75, False)}


class AllProbabilistic:
    """No column constraint anywhere (mode 'none')."""

    def is_deterministic(self, f):
        return False

    def is_probabilistic(self, f):
        return True


def _store(entries):
    cols = list(zip(*entries))
    return RowStore.from_batch(RowBatch.from_entries(*cols[:5], np.array(cols[5], np.float32)))


def test_activation_function():
    assert activation(0.0) == 0.0
    assert activation(1.0) == pytest.approx(2 / (1 + math.exp(-0.01)) - 1)
    assert activation(1.0) > TRAIN_SET.theta and activation(1.0) < TEST_SET.theta


def test_infer_direct_successor_is_predicted():
    # a -> b on the soma (distance 1); b -> c on the soma. Seed = 1 token.
    store = _store([(1, 10, 8, 1, 20, 5.0), (1, 20, 8, 1, 30, 5.0)])
    s = run_session(LifSession([(1, 10), (1, 20), (1, 30)], AllProbabilistic(), TRAIN_SET, seed_tokens=1), store)
    assert s.predictions == {1: (1, 20), 2: (1, 30)}


def test_infer_propagated_arrival_is_not_eligible_alone():
    # a -> x at segment 7 (distance 2) only: x's soma fills at step 2 but x is not a direct successor
    # of b, so step 2 has no prediction; b -> y on the soma is predicted instead when present.
    store = _store([(1, 10, 7, 1, 99, 5.0), (1, 10, 8, 1, 20, 5.0)])
    s = run_session(LifSession([(1, 10), (1, 20), (1, 99)], AllProbabilistic(), TRAIN_SET, seed_tokens=1), store)
    assert s.predictions[2] is None
    store2 = _store([(1, 10, 7, 1, 99, 5.0), (1, 10, 8, 1, 20, 5.0), (1, 20, 8, 1, 98, 5.0),
                     (1, 20, 8, 1, 99, 5.0)])
    s2 = run_session(LifSession([(1, 10), (1, 20), (1, 99)], AllProbabilistic(), TRAIN_SET, seed_tokens=1), store2)
    assert s2.predictions[2] == (1, 99)  # tie on the soma broken by the earlier segment-7 arrival


def test_infer_ties_go_to_lowest_column_then_feature():
    store = _store([(1, 10, 8, 5, 3, 5.0), (1, 10, 8, 4, 7, 5.0), (1, 10, 8, 4, 6, 5.0)])
    s = run_session(LifSession([(1, 10), (4, 6)], AllProbabilistic(), TRAIN_SET, seed_tokens=1), store)
    assert s.predictions[1] == (4, 6)


def test_infer_internal_mode_vetoes_other_column():
    store = _store([(1, 10, 8, 2, 0, 9.0), (1, 10, 8, 1, 30, 1.0)])
    targets = [(1, 10), (2, 0)]
    vetoed = run_session(LifSession(targets, NoDelimiters(), TEST_SET, seed_tokens=1), store)
    assert vetoed.predictions[1] is None  # arg-max is in column 2, current column is 1
    free = run_session(LifSession(targets, AllProbabilistic(), TEST_SET, seed_tokens=1), store)
    assert free.predictions[1] == (2, 0)


def test_infer_column_segment_needs_column_transitions():
    # source (1,10) deposits into segment 2 of (3,50) (column distance 1) and soma of (3,50) and (3,51).
    # After one column change the segment-2 value reaches segment 3 and adds to (3,50)'s score.
    store = _store([(1, 10, 8, 2, 11, 5.0), (1, 10, 2, 3, 50, 5.0),
                    (2, 11, 8, 3, 50, 5.0), (2, 11, 8, 3, 51, 5.0)])
    s = run_session(LifSession([(1, 10), (2, 11), (3, 50)], AllProbabilistic(), TEST_SET, seed_tokens=2), store)
    assert s.predictions[2] == (3, 50)


@pytest.mark.parametrize("constants", [TRAIN_SET, TEST_SET])
@pytest.mark.parametrize("teacher", [True, False])
def test_infer_matches_plain_lif_on_synthetic(constants, teacher):
    sents = synthetic_corpus(400, seed=4)
    store = RowStore.from_batch(train_batch(sents).rows)
    rows = {k: [(int(a), int(b), int(c), float(v)) for a, b, c, v in
                zip(r.segment, r.target_column, r.target_feature, r.strength)] for k, r in store}
    flags = SetFlags()
    total = 0
    for sent in sents[:60]:
        targets = list(zip(sent.column.tolist(), sent.feature.tolist()))
        fast = run_session(LifSession(targets, flags, constants, teacher_forced=teacher), store)
        plain = plain_lif(targets, rows, flags.is_deterministic, flags.is_probabilistic, TUPLES[constants],
                          teacher=teacher)
        assert fast.predictions == plain
        total += len(plain)
    assert total > 100


def test_infer_bad_arguments():
    with pytest.raises(ValueError):
        LifSession([], NoDelimiters(), TRAIN_SET)
    with pytest.raises(ValueError):
        LifSession([(1, 1)], NoDelimiters(), TRAIN_SET, length=3)
    s = LifSession([(1, 1)], NoDelimiters(), TRAIN_SET)
    assert s.done and s.needs_row() is None
    with pytest.raises(RuntimeError):
        s.step(RowStore().get((1, 1)))


def test_infer_generation_runs_past_the_prompt_and_stops_without_prediction():
    store = _store([(1, 10, 8, 1, 20, 5.0), (1, 20, 8, 1, 30, 5.0)])
    s = run_session(LifSession([(1, 10)], AllProbabilistic(), TRAIN_SET, length=10, seed_tokens=1,
                               teacher_forced=False), store)
    assert s.predictions == {1: (1, 20), 2: (1, 30), 3: None}
    assert s.done


def test_infer_slot_hash_collisions_do_not_change_results():
    # Every feature id replaced by one whose slot hash puts all neurons of a column group (column
    # % 7) on one home slot (long probe walks). Results must not change: slots are found by
    # comparing whole keys. The plain reference runs on the same renamed ids.
    sents = synthetic_corpus(200, seed=8)
    store = RowStore.from_batch(train_batch(sents).rows)
    columns: dict[int, int] = {}
    features: dict[tuple[int, int], int] = {}

    def rename(c, f):
        if f == 0:  # the prime neuron keeps feature 0
            return c, 0
        small = columns.setdefault(c, len(columns))
        key = features.setdefault((c, f), on_home(c, small % 7, len(features) + 1))
        return c, key

    back: dict[int, int] = {}
    entries = []
    for (c, f), r in store:
        src = rename(c, f)
        back[src[1]] = f
        for seg, tc, tf, v in zip(r.segment.tolist(), r.target_column.tolist(), r.target_feature.tolist(),
                                  r.strength.tolist()):
            dst = rename(tc, tf)
            back[dst[1]] = tf
            entries.append((*src, seg, *dst, v))
    renamed = _store(entries)
    rows = {k: [(int(a), int(b), int(c), float(v)) for a, b, c, v in
                zip(r.segment, r.target_column, r.target_feature, r.strength)] for k, r in renamed}
    inner = SetFlags()

    class Flags:
        def is_deterministic(self, f):
            return inner.is_deterministic(back.get(f, f))

        def is_probabilistic(self, f):
            return inner.is_probabilistic(back.get(f, f))

    flags = Flags()
    for sent in sents[:20]:
        targets = [rename(c, f) for c, f in zip(sent.column.tolist(), sent.feature.tolist())]
        fast = run_session(LifSession(targets, flags, TEST_SET), renamed)
        assert fast.predictions == plain_lif(targets, rows, flags.is_deterministic, flags.is_probabilistic,
                                             TUPLES[TEST_SET])
