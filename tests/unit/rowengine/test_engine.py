"""RowEngine against plain references: exact strengths (bit for bit), canonical order, any tiering.

The reference is the sequential left fold of every key's increments, each batch's sum rounded to
float32 (float64 add, then round: what ``rows.merge_rows`` and the old ``RowStore`` computed).
"""

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.model.rows import RowBatch
from giaannd.rowengine import Entries, RowEngine, inorder

KEY = np.dtype([("seg", "u1"), ("tc", ">u8"), ("tf", ">u8")])


def apply(engine, batch):
    engine.apply(batch.row_column, batch.row_feature, batch.offsets,
                 Entries(batch.segment, batch.target_column, batch.target_feature, batch.strength))


def random_batch(rng, row_pool, tc_pool, tf_pool, rows, per_row):
    r = rng.choice(len(row_pool), size=min(rows, len(row_pool)), replace=False)
    n = rng.integers(0, per_row + 1, r.shape[0])
    rk = np.repeat(np.asarray(row_pool, np.uint64)[r], n, axis=0)
    total = int(n.sum())
    return RowBatch.from_entries(
        rk[:, 0], rk[:, 1], rng.integers(0, 9, total), rng.choice(tc_pool, total), rng.choice(tf_pool, total),
        rng.random(total, dtype=np.float32) * np.float32(5.0) + np.float32(0.01),
    )


class DictReference:
    def __init__(self):
        self.rows = {}

    def apply(self, batch):
        for (c, f), r in batch:
            row = self.rows.setdefault((c, f), {})
            for s, tc, tf, v in zip(r.segment.tolist(), r.target_column.tolist(), r.target_feature.tolist(),
                                    r.strength.tolist()):
                old = row.get((s, tc, tf))
                row[(s, tc, tf)] = np.float32(v) if old is None else np.float32(float(old) + v)

    def row(self, key):
        items = sorted(self.rows.get(key, {}).items())
        return ([k[0] for k, _ in items], [k[1] for k, _ in items], [k[2] for k, _ in items],
                np.array([v for _, v in items], np.float32))


def same(entries, want):
    seg, tc, tf, strength = want
    return (entries.seg.tolist() == seg and entries.tc.tolist() == tc and entries.tf.tolist() == tf
            and np.array_equal(entries.st.view(np.uint32), strength.view(np.uint32)))


POOL64 = np.array([0, 1, 2, 3, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1], np.uint64)  # high bits decide the order


def assert_frozen_views_hold(frozen):
    """Every frozen view (``engine.freeze()``, the rows it was taken with) still reads those rows
    (a lazy one's copies made now, after every later write: cow.py)."""
    for view, rows in frozen:
        view.materialize()
        if view.num_entries == 0:
            continue
        fields = [np.concatenate([p.copy() for p in view.field_chunks(f, 1 << 20)]) for f in ("seg", "tc", "tf", "st")]
        off = view.offsets()
        for i in range(view.num_rows):
            got = Entries(*(f[off[i]:off[i + 1]] for f in fields))
            assert same(got, rows[(int(view.a[i]), int(view.b[i]))])


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 40), fanout=st.integers(2, 5),
       base_ratio=st.integers(1, 6), per_row=st.sampled_from([1, 5, 40]))
def test_engine_equals_sequential_fold_after_every_batch(seed, batches, fanout, base_ratio, per_row):
    rng = np.random.default_rng(seed)
    row_pool = [(a, b) for a in POOL64[:5].tolist() for b in (0, 1, 2**64 - 1)]
    engine, ref = RowEngine(fanout, base_ratio), DictReference()
    for _ in range(batches):
        batch = random_batch(rng, row_pool, POOL64, POOL64[:4], int(rng.integers(0, 10)), per_row)
        apply(engine, batch)
        ref.apply(batch)
        for key in [row_pool[i] for i in rng.choice(len(row_pool), 4, replace=False)]:
            rid = engine.row_id(*key)
            assert (rid >= 0) == (key in ref.rows)
            if rid >= 0:
                assert same(engine.read(rid), ref.row(key))
    a, b, offsets, entries = engine.export()
    keys = sorted(ref.rows)
    assert list(zip(a.tolist(), b.tolist())) == keys
    assert engine.num_rows == len(keys) and engine.num_entries == sum(len(r) for r in ref.rows.values())
    for i, key in enumerate(keys):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        assert same(Entries(entries.seg[lo:hi], entries.tc[lo:hi], entries.tf[lo:hi], entries.st[lo:hi]),
                    ref.row(key))
    assert engine.num_deltas == 0  # export compacts
    assert sorted(engine.lengths().tolist()) == sorted(len(r) for r in ref.rows.values())


def test_engine_order_of_batches_changes_only_rounding():
    rng = np.random.default_rng(1)
    pool = [(a, b) for a in range(20) for b in range(3)]
    batches = [random_batch(rng, pool, np.arange(50, dtype=np.uint64), POOL64, 15, 30) for _ in range(12)]
    one, two = RowEngine(2, 2), RowEngine(3, 5)
    for batch in batches:
        apply(one, batch)
    for batch in reversed(batches):
        apply(two, batch)
    x, y = one.export(), two.export()
    for u, v in zip(x[:3], y[:3]):
        assert np.array_equal(u, v)
    assert np.array_equal(x[3].seg, y[3].seg) and np.array_equal(x[3].tc, y[3].tc)
    assert np.allclose(x[3].st, y[3].st, rtol=1e-6, atol=0)


def test_engine_registers_empty_rows_and_reads_missing_ones():
    engine = RowEngine()
    empty = RowBatch(np.array([7, 9], np.uint64), np.array([1, 1], np.uint64), np.zeros(3, np.int64),
                     np.empty(0, np.uint8), np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.float32))
    apply(engine, empty)
    apply(engine, RowBatch.empty())
    assert engine.num_rows == 2 and engine.num_entries == 0
    assert len(engine.read(engine.row_id(7, 1))) == 0 and engine.row_id(8, 1) == -1
    a, b, offsets, entries = engine.export()
    assert a.tolist() == [7, 9] and offsets.tolist() == [0, 0, 0] and len(entries) == 0


class PackedReference:
    """One row as sorted packed keys (S17, big-endian: byte order = key order) and float32 strengths."""

    def __init__(self):
        self.keys = np.empty(0, "S17")
        self.st = np.empty(0, np.float32)

    def apply(self, seg, tc, tf, st):
        k = np.empty(seg.shape[0], KEY)
        k["seg"], k["tc"], k["tf"] = seg, tc, tf
        k = k.view("S17")
        pos = np.searchsorted(self.keys, k)
        found = np.zeros(k.shape[0], bool)
        if self.keys.shape[0]:
            found = self.keys[np.minimum(pos, self.keys.shape[0] - 1)] == k
        self.st[pos[found]] = (self.st[pos[found]].astype(np.float64) + st[found]).astype(np.float32)
        self.keys = np.insert(self.keys, pos[~found], k[~found])
        self.st = np.insert(self.st, pos[~found], st[~found])

    def matches(self, e):
        k = np.empty(len(e), KEY)
        k["seg"], k["tc"], k["tf"] = e.seg, e.tc, e.tf
        return np.array_equal(k.view("S17"), self.keys) and np.array_equal(e.st.view(np.uint32),
                                                                           self.st.view(np.uint32))


def test_engine_row_of_a_million_entries_takes_small_deltas_exactly():
    rng = np.random.default_rng(7)
    engine, ref = RowEngine(fanout=2, base_ratio=8), PackedReference()
    big = 1_000_000

    def delta(n, known):
        seg = rng.integers(0, 9, n).astype(np.uint8)
        tc = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
        tf = rng.integers(0, 4, n).astype(np.uint64)
        if known and ref.keys.shape[0]:  # a third of the keys are stored ones
            pick = rng.integers(0, ref.keys.shape[0], n // 3)
            old = ref.keys[pick].view(KEY)
            seg[: n // 3], tc[: n // 3], tf[: n // 3] = old["seg"], old["tc"], old["tf"]
        return RowBatch.from_entries(np.full(n, 11, np.uint64), np.zeros(n, np.uint64), seg, tc, tf,
                                     rng.random(n, dtype=np.float32) + np.float32(0.5))

    for i in range(40):
        batch = delta(big if i == 0 else int(rng.integers(1, 20_000)), known=i > 0)
        small = random_batch(rng, [(a, 0) for a in range(12, 40)], POOL64, POOL64, 6, 20)
        apply(engine, RowBatch.concat([batch, small]))
        ref.apply(batch.segment, batch.target_column, batch.target_feature, batch.strength)
        if i % 13 == 0 or i == 39:
            assert ref.matches(engine.read(engine.row_id(11, 0)))
    assert engine.stats.folds >= 2 and engine.stats.delta_merges >= 1
    engine.compact()
    row = engine.read(engine.row_id(11, 0))
    assert ref.matches(row) and row.st.base is not None  # views into the base after compaction
    assert engine.largest(1).tolist() == [engine.row_id(11, 0)]


@pytest.mark.parametrize("fanout,base_ratio", [(2, 1), (4, 8)])
def test_engine_reads_are_views_without_deltas_and_copies_with_them(fanout, base_ratio):
    rng = np.random.default_rng(3)
    engine = RowEngine(fanout, base_ratio)
    pool = [(a, 0) for a in range(30)]
    for _ in range(6):
        apply(engine, random_batch(rng, pool, POOL64, POOL64, 30, 50))
    engine.compact()
    rid = engine.row_id(3, 0)
    view = engine.read(rid)
    before = view.st.copy()
    batch = RowBatch.from_entries([3], [0], [int(view.seg[0])], [int(view.tc[0])], [int(view.tf[0])],
                                  np.array([1.0], np.float32))
    apply(engine, batch)  # an in-place add: the live view sees it
    assert view.st[0] == np.float32(float(before[0]) + 1.0)
    assert np.array_equal(view.st[1:], before[1:])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(2, 30), base_ratio=st.integers(1, 5))
def test_engine_new_rows_appended_into_spare_room_leave_views_and_frozen_views_alone(seed, batches, base_ratio):
    """Batches of new rows only (a stream's chunks, a replay): planned without searches and folded
    by appending into the base's spare room (run.fold_into_base). Views read before, frozen views,
    and adds to old rows mixed in stay exact against the dict reference."""
    rng = np.random.default_rng(seed)
    engine, ref = RowEngine(fanout=2, base_ratio=base_ratio), DictReference()
    held = []  # (entries view or copy read then, what it was then)
    frozen = []
    next_col = 0
    for i in range(batches):
        if i % 5 == 4 and ref.rows:  # now and then, adds to rows already there
            pool = [tuple(int(x) for x in k) for k in list(ref.rows)[:20]]
            batch = random_batch(rng, pool, POOL64, POOL64, 5, 4)
        else:
            rows = int(rng.integers(1, 20))
            pool = [(next_col + j, 7) for j in range(rows)]
            next_col += rows
            batch = random_batch(rng, pool, POOL64, POOL64, rows, 6)
        apply(engine, batch)
        ref.apply(batch)
        for key in list(ref.rows)[-2:]:  # (an empty batch adds none)
            held.append((engine.read(engine.row_id(*key)), ref.row(key), key))
        if i % 3 == 0:
            frozen.append((engine.freeze(lazy=bool(rng.integers(2))), {k: ref.row(k) for k in ref.rows}))
    for got, want, _ in held:  # appends never wrote under an entry handed out (adds may: live views)
        assert got.seg.tolist() == want[0] and got.tc.tolist() == want[1] and got.tf.tolist() == want[2]
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))
    assert_frozen_views_hold(frozen)


def _parts(batch, cuts):
    """The batch's entries as consecutive parts cut at ``cuts`` (entry indexes)."""
    edges = [0, *sorted(cuts), batch.num_entries]
    return [Entries(batch.segment[x:y], batch.target_column[x:y], batch.target_feature[x:y], batch.strength[x:y])
            for x, y in zip(edges, edges[1:])]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(2, 30), base_ratio=st.integers(1, 5),
       inline=st.sampled_from([None, 0, 40]))
def test_engine_append_new_rows_equals_apply_with_deltas_views_and_frozen_views(seed, batches, base_ratio, inline):
    """``append_new_rows`` (a replay's new rows, straight into the base) against ``apply`` of the
    same batches in a second engine and the dict reference: the same ids, rows and lengths, while
    adds to old rows leave delta runs whose base positions must stay right across the appends;
    views read before and frozen views stay what they were; a batch with a held key is refused
    with nothing changed; appends never fold. ``inline``: ``INLINE_MERGE_ENTRIES`` lowered, so a
    base without room past it takes the rows as a delta run and is not copied (None: as shipped,
    every base here is small enough to regrow)."""
    from giaannd.rowengine import engine as engine_mod

    with mock.patch.object(engine_mod, "INLINE_MERGE_ENTRIES", engine_mod.INLINE_MERGE_ENTRIES if inline is None
                           else inline):
        _append_new_rows_against_apply(seed, batches, base_ratio)


def _append_new_rows_against_apply(seed, batches, base_ratio):
    from giaannd.rowengine import engine as engine_mod

    rng = np.random.default_rng(seed)
    engine, plain, ref = RowEngine(fanout=2, base_ratio=base_ratio), RowEngine(2, base_ratio), DictReference()
    held, frozen = [], []
    next_col = 0
    for i in range(batches):
        if i % 3 == 2 and ref.rows:  # adds to rows already there (in place, or new keys: delta runs)
            pool = [tuple(int(x) for x in k) for k in list(ref.rows)[:20]]
            batch = random_batch(rng, pool, POOL64, POOL64, 5, 4)
            apply(engine, batch)
            if batch.num_rows:
                folds = engine.stats.folds
                assert engine.append_new_rows(batch.row_column, batch.row_feature, np.diff(batch.offsets),
                                              _parts(batch, [])) is None
                assert engine.stats.folds == folds
        else:
            rows = int(rng.integers(1, 20))
            pool = [(next_col + j, 7) for j in range(rows)]
            next_col += rows
            batch = random_batch(rng, pool, POOL64, POOL64, rows, 6)
            cuts = rng.integers(0, batch.num_entries + 1, int(rng.integers(0, 3))).tolist()
            folds, deltas = engine.stats.folds, engine.num_deltas
            base = engine._base  # noqa: SLF001 - the property under test
            in_place = (engine._base_room() >= base.num_entries + batch.num_entries  # noqa: SLF001
                        or base.num_entries <= engine_mod.INLINE_MERGE_ENTRIES)
            ids = engine.append_new_rows(batch.row_column, batch.row_feature, np.diff(batch.offsets),
                                         _parts(batch, cuts), room=int(rng.integers(0, 50)))
            assert ids is not None and ids.tolist() == list(range(engine.num_rows - batch.num_rows, engine.num_rows))
            assert engine.stats.folds == folds
            if in_place:
                assert engine.num_deltas == deltas
            else:  # a delta run of the new rows; the base's arrays not copied
                assert engine._base is base and engine.num_deltas >= 1  # noqa: SLF001
        apply(plain, batch)
        ref.apply(batch)
        for key in list(ref.rows)[-2:]:
            held.append((engine.read(engine.row_id(*key)), ref.row(key)))
        if i % 3 == 0:
            frozen.append((engine.freeze(lazy=bool(rng.integers(2))), {k: ref.row(k) for k in ref.rows}))
        assert engine.num_entries == plain.num_entries
    for got, want in held:
        assert got.seg.tolist() == want[0] and got.tc.tolist() == want[1] and got.tf.tolist() == want[2]
    assert [x.tolist() for x in engine.keys()] == [x.tolist() for x in plain.keys()]  # the same ids
    assert engine.lengths().tolist() == plain.lengths().tolist()
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))
    assert_frozen_views_hold(frozen)
    a, b, offsets, entries = engine.export()  # compacts: the deltas fold into the appended base
    pa, pb, poff, pentries = plain.export()
    assert np.array_equal(a, pa) and np.array_equal(b, pb) and np.array_equal(offsets, poff)
    for f in ("seg", "tc", "tf", "st"):
        assert np.array_equal(getattr(entries, f).view(np.uint8), getattr(pentries, f).view(np.uint8))


def _engine_state(engine):
    a, b = engine.keys()
    offsets, e = engine.read_many(np.arange(engine.num_rows, dtype=np.int64))
    return (a.tolist(), b.tolist(), engine.lengths().tolist(), offsets.tolist(), e.seg.tolist(), e.tc.tolist(),
            e.tf.tolist(), e.st.view(np.uint32).tolist(), engine.num_entries)


def _group(rng, rows, tc_pool, per_row):
    """A batch of a group: keys repeat across batches, zero strengths of both signs."""
    batch = random_batch(rng, rows, tc_pool, POOL64[:4], 6, per_row)
    st_ = batch.strength.copy()
    st_[rng.random(st_.shape[0]) < 0.05] = np.float32(-0.0)
    st_[rng.random(st_.shape[0]) < 0.05] = np.float32(0.0)
    st_[rng.random(st_.shape[0]) < 0.2] *= np.float32(-3e3)  # mixed magnitudes and signs: the order matters
    return RowBatch(batch.row_column, batch.row_feature, batch.offsets, batch.segment, batch.target_column,
                    batch.target_feature, st_)


def _as_parts(batches):
    return [(b.row_column, b.row_feature, b.offsets,
             Entries(b.segment, b.target_column, b.target_feature, b.strength)) for b in batches]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), before=st.integers(0, 12), windows=st.lists(st.integers(0, 12), min_size=1,
       max_size=4), base_ratio=st.integers(1, 5), per_row=st.sampled_from([2, 6, 30]), spare=st.booleans(),
       threads=st.sampled_from([1, 2, 3, 7]))
def test_apply_in_order_equals_applying_the_batches_one_by_one(seed, before, windows, base_ratio, per_row, spare,
                                                               threads):
    """Windows of batches sharing rows and keys (a small key space: keys repeat within a window and
    across windows, new rows and new keys of held rows arrive mid-window and are added to again
    later in it, increments of mixed magnitudes and signs whose float32 sums depend on their order,
    zeros of both signs) as ``apply_in_order`` calls: the engine's rows, ids, lengths and strengths
    bit for bit as one ``apply`` per batch, on an engine that holds a base and delta runs (folded
    first), or a base loaded with spare room (filled in place by the windows' merges); in one
    thread or several (every window split between them, however small: more threads than rows
    leaves some with none)."""
    rng = np.random.default_rng(seed)
    rows = [(int(c), int(f)) for c in range(6) for f in range(3)]
    tc_pool = POOL64[: 3 if per_row < 10 else 8]
    x, y = RowEngine(base_ratio=base_ratio), RowEngine(base_ratio=base_ratio)
    for _ in range(before):
        batch = random_batch(rng, rows[: 12], tc_pool, POOL64[:4], 5, per_row)
        apply(x, batch)
        apply(y, batch)
    if spare:  # as a snapshot's load with room for a replay (ColumnStore.load_bulk)
        a, b, offsets, e = y.export()
        room = int(rng.integers(0, 200))
        fields = []
        for f in (e.seg, e.tc, e.tf, e.st):
            buf = np.empty(f.shape[0] + room, f.dtype)
            buf[: f.shape[0]] = f
            fields.append(buf[: f.shape[0]])
        y = RowEngine.from_arrays(a, b, offsets, Entries(*fields), base_ratio=base_ratio, spare=True)
        x_order = x.row_ids(a, b)
        x = RowEngine.from_arrays(a, b, offsets, x.read_many(x_order)[1], base_ratio=base_ratio)
    for size in windows:
        group = [_group(rng, rows, tc_pool, per_row) for _ in range(size)]
        for batch in group:
            apply(x, batch)
        want_ids = [x.row_ids(b.row_column, b.row_feature) for b in group]
        with mock.patch.object(inorder, "PARALLEL_MIN_ENTRIES", 0):
            lengths_before = y.lengths().copy()
            done = y.apply_in_order(_as_parts(group), threads)
            ids = done.ids
            grew = y.lengths()[: lengths_before.shape[0]] != lengths_before
            new_rows = np.arange(lengths_before.shape[0], y.num_rows)
            want_grown = np.concatenate([np.flatnonzero(grew), new_rows[y.lengths()[new_rows] > 0]])
            assert done.grown.tolist() == want_grown.tolist()  # the rows that gained keys, and how many
            assert done.added.tolist() == (y.lengths()[want_grown] - np.append(lengths_before, np.zeros(
                y.num_rows - lengths_before.shape[0], np.int64))[want_grown]).tolist()
        assert ids.tolist() == (np.concatenate(want_ids).tolist() if want_ids else [])
        assert y.num_deltas <= 1  # the window's new keys, left as a delta run unless a fold was due
        assert _engine_state(y) == _engine_state(x)


@pytest.mark.parametrize("threads", [1, 2])
def test_apply_in_order_of_long_rows_touched_by_many_batches(threads):
    """Rows whose window blocks hold many occurrences (the natural merge sort's several passes, an
    odd number of runs), against a base of long rows: the same engine as one ``apply`` per batch
    (in two threads: one row each, about, the third wherever the cut falls)."""
    rng = np.random.default_rng(4)
    rows = [(7, 0), (7, 1), (9, 0)]
    pool = np.arange(300, dtype=np.uint64)
    x, y = RowEngine(), RowEngine()
    seed_batch = random_batch(rng, rows, pool, pool, 3, 2000)
    apply(x, seed_batch)
    apply(y, seed_batch)
    group = [random_batch(rng, rows, pool, pool[:20], 3, int(rng.integers(1, 300))) for _ in range(37)]
    for batch in group:
        apply(x, batch)
    with mock.patch.object(inorder, "PARALLEL_MIN_ENTRIES", 0):
        y.apply_in_order(_as_parts(group), threads)
    assert _engine_state(y) == _engine_state(x)


def test_freeze_copies_strengths_into_the_room_it_is_given_while_it_fits():
    """``freeze(room)``: the runs' strengths are copied into ``room`` one after another (the caller
    touched its pages beforehand); a run that does not fit gets a new array; either way the frozen
    strengths stay what they were while the engine goes on adding."""
    rng = np.random.default_rng(5)
    engine = RowEngine()
    pool = [(c, 7) for c in range(30)]
    for _ in range(6):
        apply(engine, random_batch(rng, pool, POOL64, POOL64, 10, 6))
    runs = [engine._base, *engine._deltas]  # noqa: SLF001
    total = sum(r.num_entries for r in runs)
    assert len(runs) >= 2 and total > 0
    before = [r.st.copy() for r in runs]
    room = np.full(total + 3, -1.0, np.float32)
    frozen = engine.freeze(room)
    got = [frozen.base, *frozen.deltas]
    assert all(np.shares_memory(g.st, room) for g in got)
    assert room[total:].tolist() == [-1.0] * 3
    small = np.zeros(runs[0].num_entries, np.float32)  # the base fits, the deltas do not
    partly = engine.freeze(small)
    assert np.shares_memory(partly.base.st, small) and not any(np.shares_memory(d.st, small) for d in partly.deltas)
    apply(engine, random_batch(rng, pool, POOL64, POOL64, 10, 6))  # adds in place to the live runs
    for view in (got, [partly.base, *partly.deltas]):
        assert all(np.array_equal(g.st, b) for g, b in zip(view, before))


def test_apply_in_order_groups_by_the_windows_rows_not_the_engines():
    """A window's grouping (``by_row``: a count and a cursor per row) is sized by the rows the window
    touches, not by every row the engine holds: a small log replayed over a node of 10^9 rows must
    not make 16 GB of counts and cursors, nor pass over them. The result is the same engine."""
    from giaannd.rowengine import engine as engine_mod

    rng = np.random.default_rng(11)
    many = RowBatch.from_entries(np.arange(50_000, dtype=np.uint64), np.zeros(50_000, np.uint64),
                                 np.zeros(50_000, np.uint8), np.ones(50_000, np.uint64), np.ones(50_000, np.uint64),
                                 np.ones(50_000, np.float32))
    x, y = RowEngine(), RowEngine()
    apply(x, many)
    apply(y, many)
    rows = [(7, 0), (12_345, 0), (60_001, 3)]  # two held rows and a new one
    group = [random_batch(rng, rows, POOL64[:5], POOL64[:4], 3, 6) for _ in range(5)]
    for batch in group:
        apply(x, batch)
    sizes = []
    real = engine_mod.by_row

    def spy(parts, num_rows, threads=1):
        sizes.append(num_rows)
        return real(parts, num_rows, threads)

    with mock.patch.object(engine_mod, "by_row", spy):
        y.apply_in_order(_as_parts(group))
    assert sizes and max(sizes) <= len(rows)
    assert _engine_state(y) == _engine_state(x)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 25), fanout=st.integers(2, 4),
       base_ratio=st.integers(1, 6), per_row=st.sampled_from([1, 8, 60]))
def test_engine_read_part_equals_the_slice_of_the_whole_row(seed, batches, fanout, base_ratio, per_row):
    """``read_part(i, a, z)`` gives the length of ``read(i)`` and the entries of ``read(i)[a:z]`` bit
    for bit (clipped), whatever the row's delta entries and the part's bounds, with one copy of the
    part only (a view of the base when no delta holds part of the row)."""
    rng = np.random.default_rng(seed)
    engine = RowEngine(fanout, base_ratio)
    pool = [(a, b) for a in range(6) for b in (0, 2**64 - 1)]
    for _ in range(batches):
        apply(engine, random_batch(rng, pool, POOL64, np.arange(40, dtype=np.uint64), 8, per_row))
    for key in pool:
        rid = engine.row_id(*key)
        if rid < 0:
            continue
        whole = engine.read(rid)
        n = len(whole)
        cuts = {(0, n), (0, 0), (n, n + 5), (-3, 2), (n // 2, n // 2 + 1)} | {
            tuple(sorted(rng.integers(-2, n + 3, 2).tolist())) for _ in range(6)}
        for a, z in cuts:
            length, part = engine.read_part(rid, a, z)
            lo, hi = min(max(a, 0), n), min(max(z, max(a, 0)), n)
            assert length == n
            for got, want in zip((part.seg, part.tc, part.tf, part.st), (whole.seg, whole.tc, whole.tf, whole.st)):
                assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want[lo:hi].view(np.uint8))


def test_engine_read_part_of_a_long_row_with_a_delta_copies_only_the_part():
    """A part of a 10^6-entry row that one delta entry touches: a copy as long as the part, not a
    view of a merged copy of the whole row (``read(i)[a:z]`` was: 21 MB for a 1,024-entry part)."""
    engine = RowEngine(4, 8)
    n = 1_000_000
    tf = np.arange(0, 2 * n, 2, dtype=np.uint64)
    apply(engine, RowBatch.from_entries(np.full(n, 7), np.zeros(n), np.zeros(n), np.zeros(n), tf,
                                        np.ones(n, np.float32)))
    engine.compact()
    apply(engine, RowBatch.from_entries([7], [0], [0], [0], [2 * 500_000 + 1], np.array([2.0], np.float32)))
    rid = engine.row_id(7, 0)
    length, part = engine.read_part(rid, 499_500, 500_524)
    assert length == n + 1 and len(part) == 1_024
    assert part.tf.base is None or part.tf.base.nbytes <= 1_024 * 8  # its own copy: the part, no more
    assert part.tf[500_001 - 499_500].item() == 2 * 500_000 + 1 and part.st[500_001 - 499_500] == np.float32(2.0)
    assert np.array_equal(part.tf, engine.read(rid).tf[499_500:500_524])
