"""The LIF step of issue 14 item 6 against the step before it (tools/bench/baseline_lif.py): the same
state, bit for bit, after every step; and the per-step dense work without copies of segment rows."""

import tracemalloc

import numpy as np
import pytest

from giaannd.model.infer import TEST_SET, TRAIN_SET, LifSession, NoDelimiters
from giaannd.model.rows import NUM_SEGMENTS, Row
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from giaannd.rowengine import KeyIndex
from tests.oracle.sentences import SetFlags, synthetic_corpus
from tests.unit.rowengine.collide import grouped_table
from tools.bench.baseline_lif import BaselineLifSession
from tools.bench.lif import synthetic_row


def _state(session):
    """{neuron key: its 9 segment values} as (keys, float64[neurons, 9]) sorted by key."""
    ka, kb = session._slots.keys()
    order = np.lexsort((kb, ka))
    lanes = getattr(session, "_lane", list(range(NUM_SEGMENTS)))
    act = session._act[lanes][:, : ka.shape[0]]
    return ka[order], kb[order], act[:, order]


def _assert_same_state(new, old):
    na, nb, nact = _state(new)
    oa, ob, oact = _state(old)
    assert np.array_equal(na, oa) and np.array_equal(nb, ob)
    assert np.array_equal(nact.view(np.uint64), oact.view(np.uint64))  # bits, signed zeros included


def _lockstep(targets, source, flags, constants, teacher=True, length=None):
    new = LifSession(targets, flags, constants, teacher_forced=teacher, length=length)
    old = BaselineLifSession(targets, flags, constants, teacher_forced=teacher, length=length)
    steps = 0
    while (key := new.needs_row()) is not None:
        assert old.needs_row() == key
        row = source(key)
        assert new.step(row) == old.step(row)
        _assert_same_state(new, old)
        steps += 1
    assert old.needs_row() is None and new.predictions == old.predictions
    return steps


@pytest.mark.parametrize("constants", [TRAIN_SET, TEST_SET])
@pytest.mark.parametrize("teacher", [True, False])
def test_lif_step_state_equals_the_previous_step_on_a_corpus(constants, teacher):
    sents = synthetic_corpus(300, seed=11)
    store = RowStore.from_batch(train_batch(sents).rows)
    flags = SetFlags()
    steps = 0
    for sent in sents[:40]:
        targets = list(zip(sent.column.tolist(), sent.feature.tolist()))
        steps += _lockstep(targets, lambda k: store.get_row(*k), flags, constants, teacher,
                           None if teacher else len(targets) + 5)
    assert steps > 200


@pytest.mark.parametrize("constants", [TRAIN_SET, TEST_SET])
def test_lif_step_state_equals_the_previous_step_on_long_overlapping_rows(constants):
    # Five long rows with Zipf targets (they share many neurons), a zero-strength entry among them
    # (the boolean path's g(0) = 0), fired in turn across column changes: each step's state as before.
    rows = {}
    for i in range(5):
        r = synthetic_row(20_000 + 3_000 * i, seed=i)
        strength = r.strength.copy()
        strength[7 * i] = 0.0
        fields = [r.segment, r.target_column, r.target_feature, strength]
        if i % 2:  # read-only, as rows decoded from a log or the wire are
            fields = [f.copy() for f in fields]
            for f in fields:
                f.flags.writeable = False
        rows[(10 + i % 3, 100 + i)] = Row(*fields)
    keys = list(rows)
    targets = [keys[i % 5] for i in (0, 1, 2, 0, 3, 4, 4, 1, 2, 3, 0, 4)]
    assert _lockstep(targets, rows.__getitem__, NoDelimiters(), constants) == len(targets) - 1


def test_lif_dense_step_copies_no_segment_rows():
    # After a long row fired, every step propagates the feature segments and shifts the column ones
    # over every neuron. The old step copied three segment rows through a temporary (24 bytes per
    # neuron per step); relabelling the rows does it in place.
    session = LifSession([(1, 1), (1, 1), (2, 2), (3, 3)], NoDelimiters(), TEST_SET)
    session.step(synthetic_row(100_000, seed=3))
    neurons = len(session._slots)
    assert neurons > 50_000
    tracemalloc.start()
    try:
        session.step(Row.empty())  # a column change too: (1, 1) -> (2, 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < neurons  # under one byte per neuron: no row-sized temporary


@pytest.mark.parametrize("max_load", [0.5, 0.25])
@pytest.mark.parametrize("collide", [False, True])
def test_keyindex_ids_of_matches_a_dict_with_repeats_and_growth(collide, max_load):
    # collide: every key of a column group (a % 7) on one home slot (long probe walks)
    table = grouped_table(60, 300) if collide else None
    rng = np.random.default_rng(2)
    index, ref = KeyIndex(max_load=max_load), {}

    def keys(a, b):
        return (a, table[a.astype(np.int64), b.astype(np.int64)]) if collide else (a, b)

    for _ in range(40):
        k = int(rng.integers(0, 3000))
        a, b = keys(rng.integers(0, 50, k, dtype=np.uint64), rng.integers(0, 300, k, dtype=np.uint64))
        ids = index.ids_of(a, b)
        assert ids.dtype == np.int64
        for x, y, i in zip(a.tolist(), b.tolist(), ids.tolist()):
            assert ref.setdefault((x, y), i) == i  # one id per key, kept across calls and growth
        assert list(ref.values()) == list(range(len(ref))) and len(index) == len(ref)  # dense, in order
    ka, kb = index.keys()
    assert {(x, y): i for i, (x, y) in enumerate(zip(ka.tolist(), kb.tolist()))} == ref
    probe_a, probe_b = keys(rng.integers(0, 60, 500, dtype=np.uint64), rng.integers(0, 300, 500, dtype=np.uint64))
    assert index.lookup(probe_a, probe_b).tolist() == [ref.get(k, -1) for k in zip(probe_a.tolist(),
                                                                                    probe_b.tolist())]
    assert index.ids_of(np.empty(0, np.uint64), np.empty(0, np.uint64)).shape == (0,)


def test_keyindex_max_load_is_checked():
    for bad in (0.0, 0.6, -1.0):
        with pytest.raises(ValueError):
            KeyIndex(max_load=bad)


def test_keyindex_ids_of_keys_already_there_do_not_grow_the_table():
    # A row fired again in a session: every key is there. Making room for all of them as new ones
    # would double the table and re-place every id for nothing.
    row = synthetic_row(50_000, seed=4)
    index = KeyIndex(max_load=0.25)
    first = index.ids_of(row.target_column, row.target_feature)
    size = index._slots.shape[0]
    again = index.ids_of(row.target_column, row.target_feature)
    assert np.array_equal(first, again) and index._slots.shape[0] == size


@pytest.mark.parametrize("sort", [True, False])
def test_lif_step_refuses_a_row_with_a_segment_past_the_soma(sort):
    # Bounds checks are off in the deposit kernel: a segment >= 9 must be refused, not written
    # past the state (sorted: found by the segment search; unsorted: by the kernel).
    r = synthetic_row(100, seed=5)
    seg = r.segment.copy()
    seg[-1 if sort else 0] = NUM_SEGMENTS
    session = LifSession([(1, 1), (1, 1)], NoDelimiters(), TEST_SET)
    with pytest.raises(ValueError, match="segments"):
        session.step(Row(seg, r.target_column, r.target_feature, r.strength))
