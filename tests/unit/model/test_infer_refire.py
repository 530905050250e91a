"""A row fired again in a LIF session (issue 14 item 6): its slots are checked, not mapped again, and the
state stays what the previous step gives, bit for bit, whatever changed in between (another Row
object with the same content, other targets under the same node, strengths or keys written in
place); the records are bounded."""

import numpy as np
import pytest

from giaannd.model.infer import TEST_SET, TRAIN_SET, LifSession, NoDelimiters
from giaannd.model.rows import Row
from giaannd.rowengine import KeyIndex
from tests.unit.model.test_infer_step import _assert_same_state
from tools.bench.baseline_lif import BaselineLifSession
from tools.bench.lif import synthetic_row

_N = 5_000  # above infer._MEMO_MIN_ENTRIES


def _copy(row: Row) -> Row:
    return Row(row.segment.copy(), row.target_column.copy(), row.target_feature.copy(), row.strength.copy())


class _CountingIndex(KeyIndex):
    """A session's slot index that counts the targets it maps (``ids_of``)."""

    mapped = 0

    def ids_of(self, a, b):
        self.mapped += int(np.asarray(a).shape[0])
        return super().ids_of(a, b)


def _sessions(targets, constants, **kwargs):
    new = LifSession(targets, NoDelimiters(), constants, **kwargs)
    counted = _CountingIndex(max_load=new._slots._max_load)
    counted.ids_of(*new._slots.keys())  # the same ids (first appearance order)
    new._slots = counted
    return new, BaselineLifSession(targets, NoDelimiters(), constants)


def _run(new, old, rows):
    """Step both sessions through ``rows`` (one per step), checking the state after each; the number
    of targets the new session mapped per step."""
    mapped = []
    for row in rows:
        before = new._slots.mapped
        assert new.step(row) == old.step(row)
        _assert_same_state(new, old)
        mapped.append(new._slots.mapped - before)
    return mapped


@pytest.mark.parametrize("constants", [TRAIN_SET, TEST_SET])
def test_a_row_fired_again_is_not_mapped_again(constants):
    # The same node three times: the row object again, then a fresh copy (a store's get_row makes a
    # new Row each time): only the first fire maps its targets.
    row = synthetic_row(_N, seed=7)
    new, old = _sessions([(1, 1)] * 4, constants)
    assert _run(new, old, [row, row, _copy(row)]) == [_N, 0, 0]


def test_a_test_set_row_fired_again_reuses_its_exp_values():
    row = synthetic_row(_N, seed=8)
    session = LifSession([(1, 1)] * 3, NoDelimiters(), TEST_SET)
    session.step(row)
    first = session._fired[(1, 1)].value
    session.step(_copy(row))
    assert first is not None and session._fired[(1, 1)].value is first


@pytest.mark.parametrize("constants", [TRAIN_SET, TEST_SET])
def test_a_changed_row_under_the_same_node_is_mapped_again(constants):
    # Same node, same length, other content each time: the remembered slots or exp values must not
    # be used for it. Written in place too (the same array objects), as a buggy caller might.
    a = synthetic_row(_N, seed=9)
    b = synthetic_row(_N, seed=10)
    strength = a.strength.copy()
    strength[::3] *= 2.0
    restrengthened = Row(a.segment, a.target_column, a.target_feature, strength)
    inplace = _copy(a)
    new, old = _sessions([(1, 1)] * 8, constants)
    mapped = _run(new, old, [a, b, restrengthened, inplace])
    assert mapped[:3] == [_N, _N, _N] and mapped[3] == 0
    for mine, other in zip((inplace.segment, inplace.target_column, inplace.target_feature), (b.segment,
                           b.target_column, b.target_feature)):
        mine[:] = other  # b's targets (a canonical row), in the same array objects
    assert _run(new, old, [inplace]) == [_N]
    inplace.strength[1::2] += 1.0  # and strengths written in place: the exp values are not reused
    assert _run(new, old, [inplace]) == [0]


def test_short_rows_are_not_remembered_and_a_long_record_goes_when_its_node_fires_short():
    long_row = synthetic_row(_N, seed=11)
    short = synthetic_row(100, seed=12)
    new, old = _sessions([(1, 1)] * 4, TEST_SET)
    _run(new, old, [long_row])
    assert list(new._fired) == [(1, 1)]
    _run(new, old, [short])
    assert new._fired == {} and new._fired_bytes == 0
    assert _run(new, old, [long_row]) == [_N]


def test_the_records_are_bounded_least_recently_fired_first():
    rows = [synthetic_row(_N, seed=20 + i) for i in range(4)]
    record = _N * (8 + 4 + 8)  # slots, strengths, exp values
    keys = [(i, i) for i in range(4)]
    order = [0, 1, 0, 2, 3, 0, 3]  # at most two remembered: 0 is kept by firing it again
    new, old = _sessions([keys[i] for i in order] + [keys[0]], TEST_SET, remember_bytes=2 * record)
    source = dict(zip(keys, rows))
    held = []
    while (key := new.needs_row()) is not None:
        _run(new, old, [source[key]])
        held.append(list(new._fired))
        assert new._fired_bytes == sum(f.nbytes for f in new._fired.values()) <= 2 * record
    assert held == [[(0, 0)], [(0, 0), (1, 1)], [(1, 1), (0, 0)], [(0, 0), (2, 2)], [(2, 2), (3, 3)],
                    [(3, 3), (0, 0)], [(0, 0), (3, 3)]]
    for remember in (record - 1, 0):  # one row alone does not fit; nothing remembered at all
        new, old = _sessions([(5, 5)] * 3, TEST_SET, remember_bytes=remember)
        assert _run(new, old, [rows[0], rows[0]]) == [_N, _N]
        assert new._fired == {} and new._fired_bytes == 0


def test_keyindex_holds_checks_every_id_against_its_key():
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2**63, 1000, dtype=np.uint64), rng.integers(0, 2**63, 1000, dtype=np.uint64)
    index = KeyIndex()
    ids = index.ids_of(a, b)
    assert index.holds(a, b, ids)
    assert index.holds(a[::-1].copy(), b[::-1].copy(), ids[::-1].copy())
    swapped = ids.copy()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert not index.holds(a, b, swapped)
    other = b.copy()
    other[999] ^= np.uint64(1)
    assert not index.holds(a, other, ids)
    for bad in (-1, len(index), 2**40):
        out = ids.copy()
        out[5] = bad
        assert not index.holds(a, b, out)
    assert index.holds(a[:0], b[:0], ids[:0])
    with pytest.raises(ValueError):
        index.holds(a, b, ids[:-1])
    with pytest.raises(ValueError):
        index.holds(a, b, ids.astype(np.int32))
