"""RowEngine.reserve: room in the base for the entries a stream is about to append (run.with_room)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.rowengine import Entries, RowEngine
from tests.unit.rowengine.test_engine import POOL64, DictReference, apply, random_batch, same


def _new_rows_batch(rng, first_col, rows, per_row):
    pool = [(first_col + j, 7) for j in range(rows)]
    return random_batch(rng, pool, POOL64, POOL64, rows, per_row)


def test_engine_reserve_makes_appends_of_new_rows_write_into_one_buffer():
    """Reserved for all the entries up front: every fold appends into the same buffers (no regrowth)."""
    rng = np.random.default_rng(5)
    batches = [_new_rows_batch(rng, 100 * i, 50, 8) for i in range(30)]
    engine = RowEngine(fanout=2, base_ratio=2)
    engine.reserve(sum(b.num_entries for b in batches) + 10)
    buffers = set()
    for b in batches:
        apply(engine, b)
        engine.compact()
        buffers.add(id(engine._base.st.base))  # noqa: SLF001 - the property under test
    assert len(buffers) == 1
    engine.reserve(10)  # room left: nothing changes
    assert id(engine._base.st.base) in buffers  # noqa: SLF001


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 25), base_ratio=st.integers(1, 5),
       reserve_every=st.integers(1, 7), room=st.sampled_from([0, 1, 50, 10_000]))
def test_engine_reserve_between_applies_keeps_rows_and_views_exact(seed, batches, base_ratio, reserve_every, room):
    """Reserving at any point (empty engine, deltas pending, adds to old rows mixed in) changes no
    row, and views read before stay what they were."""
    rng = np.random.default_rng(seed)
    engine, ref = RowEngine(fanout=2, base_ratio=base_ratio), DictReference()
    held = []
    col = 0
    for i in range(batches):
        if i % reserve_every == 0:
            engine.reserve(room)
        if i % 4 == 3 and ref.rows:
            pool = [tuple(int(x) for x in k) for k in list(ref.rows)[:10]]
            batch = random_batch(rng, pool, POOL64, POOL64, 5, 4)
        else:
            batch = _new_rows_batch(rng, col, 10, 6)
            col += 10
        apply(engine, batch)
        ref.apply(batch)
        for key in list(ref.rows)[-2:]:
            held.append((engine.read(engine.row_id(*key)), ref.row(key)))
    for got, want in held:
        assert got.seg.tolist() == want[0] and got.tc.tolist() == want[1] and got.tf.tolist() == want[2]
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 20), base_ratio=st.integers(1, 5),
       per_row=st.sampled_from([1, 6, 300]), max_pieces=st.sampled_from([1, 3, 10_000]))
def test_engine_pieces_concatenate_to_the_gathered_rows(seed, batches, base_ratio, per_row, max_pieces):
    """Whatever the layout (rows in the base, in delta runs, both; ids in any order, repeated),
    the pieces are the gathered entries, cut; None only past ``max_pieces``."""
    rng = np.random.default_rng(seed)
    engine = RowEngine(fanout=2, base_ratio=base_ratio)
    col = 0
    for i in range(batches):
        if i % 3 == 2 and engine.num_rows:
            a, b = engine.keys()
            pick = rng.choice(a.shape[0], min(4, a.shape[0]), replace=False)
            pool = [(int(a[j]), int(b[j])) for j in pick]
            batch = random_batch(rng, pool, POOL64, POOL64, 4, per_row)
        else:
            batch = _new_rows_batch(rng, col, 8, per_row)
            col += 8
        apply(engine, batch)
    ids = np.arange(engine.num_rows, dtype=np.int64)
    for order in (ids, rng.permutation(ids), ids[engine.num_rows // 2:], np.repeat(ids[:3], 2)):
        _, want = engine.gather(order)
        got = engine.pieces(order, max_pieces)
        if got is None:
            continue
        assert len(got) <= max_pieces
        for f in ("seg", "tc", "tf", "st"):
            cat = np.concatenate([getattr(p, f) for p in got]) if got else getattr(want, f)[:0]
            assert np.array_equal(cat, getattr(want, f))


def test_engine_copy_base_lets_go_of_the_arrays_it_was_built_from():
    """``copy_base`` (a base loaded as views of a mapped snapshot): afterwards no base array shares
    memory with the arrays given to ``from_arrays``, every row reads the same, views read before
    keep their entries, and applies go on as on an engine that never copied."""
    rng = np.random.default_rng(11)
    ref_engine, ref = RowEngine(fanout=2, base_ratio=4), DictReference()
    for _ in range(6):
        batch = _new_rows_batch(rng, 0, 40, 6) if not ref.rows else random_batch(
            rng, [tuple(int(x) for x in k) for k in list(ref.rows)[:40]], POOL64, POOL64, 20, 5)
        apply(ref_engine, batch)
        ref.apply(batch)
    a, b, offsets, entries = ref_engine.export()
    given = [offsets, entries.seg, entries.tc, entries.tf, entries.st]
    for arr in given[:4]:
        arr.flags.writeable = False  # as a mapped snapshot's views are
    engine = RowEngine.from_arrays(a, b, offsets, entries)
    before = engine.read(0)
    kept = (before.tc.copy(), before.st.copy())
    engine.copy_base()
    base = engine._base  # noqa: SLF001 - the property under test
    for arr in (base.offsets, base.seg, base.tc, base.tf, base.st):
        assert not any(np.shares_memory(arr, g) for g in given)
        assert arr.flags.writeable
    assert np.array_equal(before.tc, kept[0]) and np.array_equal(before.st, kept[1])
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))
    batch = random_batch(rng, [tuple(int(x) for x in k) for k in list(ref.rows)[:30]], POOL64, POOL64, 30, 6)
    apply(engine, batch)
    ref.apply(batch)
    engine.compact()
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


def test_engine_reserve_does_not_copy_a_base_larger_than_the_room_asked_for():
    """Making room copies the base in the caller's thread (a storage node's event loop): done for a
    base no larger than the room (a joining node), not for one that holds more (its new rows become
    delta runs, folded off that thread); nothing changes either way but the buffers."""
    from unittest import mock

    from giaannd.rowengine import engine as engine_mod

    rng = np.random.default_rng(9)
    with mock.patch.object(engine_mod, "INLINE_MERGE_ENTRIES", 100):
        engine, ref = RowEngine(), DictReference()
        first = _new_rows_batch(rng, 0, 200, 8)
        apply(engine, first)
        ref.apply(first)
        engine.compact()
        held = engine.num_entries
        assert held > 200
        before = engine._base.st  # noqa: SLF001 - the property under test
        engine.reserve(held // 2)  # the base holds more than that (and than the inline bound): no copy
        assert engine._base.st is before  # noqa: SLF001
        engine.reserve(2 * held)  # more room than the base holds: made
        assert engine._base.st is not before and engine._base.spare  # noqa: SLF001
        nxt = _new_rows_batch(rng, 1000, 10, 5)
        ids = engine.append_new_rows(nxt.row_column, nxt.row_feature, np.diff(nxt.offsets),
                                     [Entries(nxt.segment, nxt.target_column, nxt.target_feature, nxt.strength)])
        assert ids is not None and engine.num_deltas == 0  # into the room
        ref.apply(nxt)
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))
