"""Merges in place (run._merged): folds and tier merges write into the run's own buffers only when
nothing else holds them; a frozen engine or a view handed out keeps the entries it saw."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.rowengine import Entries, RowEngine
from giaannd.rowengine import engine as engine_mod
from giaannd.rowengine.run import _merge_back, merge_field
from tests.unit.rowengine.test_engine import (
    POOL64,
    DictReference,
    apply,
    assert_frozen_views_hold,
    random_batch,
    same,
)


def _address(a):
    return a.__array_interface__["data"][0]


def _base_addresses(engine):
    return [_address(getattr(engine._base, f)) for f in ("seg", "tc", "tf", "st")]  # noqa: SLF001


def _grown_engine(rng, pool):
    """An engine whose base was folded once with room to spare (the buffers a later fold goes into)."""
    engine, ref = RowEngine(fanout=2, base_ratio=1), DictReference()  # folds only at deltas >= base
    for _ in range(2):
        batch = random_batch(rng, pool, np.arange(50, dtype=np.uint64), POOL64, len(pool), 30)
        apply(engine, batch)
        ref.apply(batch)
        engine.compact()
    assert engine._base.spare  # noqa: SLF001
    return engine, ref


def _spread_batch(rng, pool):
    """New keys in every row (the first rows too): a fold moves nearly every base entry."""
    return random_batch(rng, pool, np.arange(50, 100, dtype=np.uint64), POOL64, len(pool), 3)


POOL = [(c, 1) for c in range(40)]


def test_fold_goes_in_place_when_nothing_holds_the_base():
    rng = np.random.default_rng(1)
    engine, ref = _grown_engine(rng, POOL)
    before = _base_addresses(engine)
    batch = _spread_batch(rng, POOL)
    apply(engine, batch)
    ref.apply(batch)
    assert engine.num_deltas
    engine.compact()
    assert _base_addresses(engine) == before  # the same buffers: merged in place
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


def test_tier_merge_goes_in_place_when_nothing_holds_the_older_run():
    rng = np.random.default_rng(2)
    engine, ref = _grown_engine(rng, POOL)
    for _ in range(2):  # two delta runs merged (fanout 2): the result has room to spare
        batch = _spread_batch(rng, POOL)
        apply(engine, batch)
        ref.apply(batch)
    (older,) = engine._deltas  # noqa: SLF001
    assert older.spare
    before = [_address(getattr(older, f)) for f in ("seg", "tc", "tf", "st", "pos")]
    batch = random_batch(rng, POOL, np.arange(100, 150, dtype=np.uint64), POOL64, len(POOL), 4)
    apply(engine, batch)
    ref.apply(batch)
    (merged,) = engine._deltas  # noqa: SLF001 - merged (fanout 2), not folded (base_ratio 1)
    assert merged.num_entries > 0 and older.num_entries == 0  # older consumed
    assert [_address(getattr(merged, f)) for f in ("seg", "tc", "tf", "st", "pos")] == before
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


def test_fold_with_a_view_handed_out_copies_and_the_view_keeps_its_entries():
    """A row read before the fold (a storage node's row on its way to a socket): the fold must not
    move entries under it, so it goes into new buffers; without the view the same fold is in place."""
    rng = np.random.default_rng(3)
    engine, ref = _grown_engine(rng, POOL)
    last = POOL[-1]  # the last row: every new key of the rows before it moves its entries
    view = engine.read(engine.row_id(*last))
    assert _address(view.tc) >= _address(engine._base.tc)  # noqa: SLF001 - a view into the base
    want = ref.row(last)
    before = _base_addresses(engine)
    batch = _spread_batch(rng, POOL[:-1])  # nothing added to the viewed row
    apply(engine, batch)
    ref.apply(batch)
    engine.compact()
    assert same(view, want)  # all four fields, strengths too
    assert _base_addresses(engine) != before
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))
    del view  # now nothing holds the (new) base: the next fold goes in place
    before = _base_addresses(engine)
    apply(engine, _spread_batch(rng, POOL))
    engine.compact()
    assert _base_addresses(engine) == before


@pytest.mark.parametrize("hold", ["freeze", "slice_of_view", "memoryview"])
def test_fold_and_tier_merge_with_the_arrays_held_keep_what_the_holder_saw(hold):
    """A frozen engine (a snapshot being written in another thread), a view of a view, a buffer
    export: each holds the base or a delta run's buffers; folds and merges leave them as they were."""
    rng = np.random.default_rng(4)
    engine, ref = _grown_engine(rng, POOL)
    for _ in range(2):  # a delta run with room, to be merged into
        batch = _spread_batch(rng, POOL)
        apply(engine, batch)
        ref.apply(batch)
    rows = {}
    for key in ref.rows:
        rows[key] = engine.read(engine.row_id(*key))
        rows[key] = Entries(*(x.copy() for x in (rows[key].seg, rows[key].tc, rows[key].tf, rows[key].st)))
    frozen = engine.freeze() if hold == "freeze" else None
    runs = [engine._base, *engine._deltas]  # noqa: SLF001
    copies = [[getattr(r, f).copy() for f in ("seg", "tc", "tf")] for r in runs]
    if hold == "slice_of_view":
        held = [[getattr(r, f)[1:][:-1] for f in ("seg", "tc", "tf")] for r in runs]
        copies = [[c[1:-1] for c in cs] for cs in copies]
    elif hold == "memoryview":
        held = [[memoryview(getattr(r, f)) for f in ("seg", "tc", "tf")] for r in runs]
    del runs
    for _ in range(3):
        batch = _spread_batch(rng, POOL)
        apply(engine, batch)
        ref.apply(batch)
    engine.compact()
    if frozen is not None:
        assert_frozen_views_hold([(frozen, {k: _as_ref(v) for k, v in rows.items()})])
    else:
        for hs, cs in zip(held, copies):
            for h, c in zip(hs, cs):
                assert np.array_equal(np.asarray(h), c)
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


def _as_ref(e):
    return (e.seg.tolist(), e.tc.tolist(), e.tf.tolist(), e.st)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 60), m=st.integers(0, 60), room=st.integers(0, 5),
       dtype=st.sampled_from([np.uint8, np.uint64, np.int64, np.float32]))
def test_merge_back_equals_merge_field(seed, n, m, room, dtype):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 200, n).astype(dtype)
    new = rng.integers(0, 200, m).astype(dtype)
    pos = np.sort(rng.integers(0, n + 1, m)).astype(np.int64)
    buf = np.full(n + m + room, 7, dtype)
    buf[:n] = old
    _merge_back(((buf, _ro(new)),), n, _ro(pos))
    assert np.array_equal(buf[: n + m], merge_field(old, new, pos))
    assert (buf[n + m:] == 7).all()


def _ro(a):
    out = a.view()
    out.flags.writeable = False
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 60), m=st.integers(0, 60), room=st.integers(0, 5),
       with_pos=st.booleans())
def test_merge_back_of_several_fields_in_one_pass_equals_each_field_merged(seed, n, m, room, with_pos):
    """A run's fields merged in one pass (a fold's four, a delta merge's five): each is what
    ``merge_field`` makes of it, and nothing past the merged entries is written."""
    rng = np.random.default_rng(seed)
    dtypes = (np.uint8, np.uint64, np.uint64, np.float32) + ((np.int64,) if with_pos else ())
    olds = [rng.integers(0, 200, n).astype(t) for t in dtypes]
    news = [rng.integers(0, 200, m).astype(t) for t in dtypes]
    pos = np.sort(rng.integers(0, n + 1, m)).astype(np.int64)
    bufs = []
    for t, old in zip(dtypes, olds):
        buf = np.full(n + m + room, 7, t)
        buf[:n] = old
        bufs.append(buf)
    _merge_back(tuple((b, _ro(x)) for b, x in zip(bufs, news)), n, _ro(pos))
    for buf, old, new in zip(bufs, olds, news):
        assert np.array_equal(buf[: n + m], merge_field(old, new, pos))
        assert (buf[n + m:] == 7).all()


def test_merge_back_refuses_bad_positions_before_writing():
    bufs = (np.arange(8, dtype=np.uint8), np.arange(8, dtype=np.uint64), np.arange(8, dtype=np.uint64),
            np.arange(8, dtype=np.float32))
    for pos in ([3, 2], [0, 7], [-1, 0]):
        with pytest.raises(ValueError):
            _merge_back(((bufs[1], _ro(np.array([9, 9], np.uint64))),), 6, _ro(np.array(pos, np.int64)))
        with pytest.raises(ValueError):
            _merge_back(tuple((b, _ro(np.array([9, 9], b.dtype))) for b in bufs), 6, _ro(np.array(pos, np.int64)))
        for b in bufs:
            assert b.tolist() == list(range(8))


def _folds_due(engine):
    return sum(d.num_entries for d in engine._deltas) * engine.base_ratio >= engine._base.num_entries  # noqa: SLF001


def test_fold_due_while_frozen_is_deferred_then_runs_in_place_after_release():
    """A snapshot's frozen view holds the base: a fold due meanwhile would copy the whole base (old
    and new both resident), so it waits; the view keeps what it saw, reads see the merged rows, and
    the first commit after the view is dropped folds, in place (the same buffers)."""
    rng = np.random.default_rng(5)
    engine, ref = _grown_engine(rng, POOL)
    engine.reserve(4 * engine.num_entries)  # room for the fold in place
    before = _base_addresses(engine)
    frozen = engine.freeze()
    seen = {k: ref.row(k) for k in ref.rows}
    folds = engine.stats.folds
    while not _folds_due(engine) and engine.stats.folds == folds:  # (a fold not deferred ends it too)
        batch = _spread_batch(rng, POOL)
        apply(engine, batch)
        ref.apply(batch)
    assert engine.stats.folds == folds and engine.stats.deferred_folds > 0 and engine.num_deltas
    assert _base_addresses(engine) == before  # nothing copied
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))
    assert_frozen_views_hold([(frozen, seen)])
    del frozen
    batch = random_batch(rng, list(ref.rows)[:3], POOL64, POOL64, 3, 2)  # any commit, adds only or not
    apply(engine, batch)
    ref.apply(batch)
    assert engine.stats.folds == folds + 1 and engine.num_deltas == 0
    assert _base_addresses(engine) == before  # the deferred fold went in place
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


def test_fold_deferred_while_frozen_is_bounded():
    """The delta runs never hold HELD_FOLD_LIMIT / base_ratio of the base after a commit: past that
    the fold goes ahead, into new buffers, and the frozen view still reads what it saw."""
    rng = np.random.default_rng(6)
    engine, ref = _grown_engine(rng, POOL)
    frozen = engine.freeze()
    seen = {k: ref.row(k) for k in ref.rows}
    folds = engine.stats.folds
    for i in range(40):  # new rows: the delta runs grow by a batch each time
        pool = [(c, 2) for c in range(40 * i, 40 * i + 40)]
        batch = random_batch(rng, pool, np.arange(50, dtype=np.uint64), POOL64, len(pool), 30)
        apply(engine, batch)
        ref.apply(batch)
        held = sum(d.num_entries for d in engine._deltas)  # noqa: SLF001
        assert held * engine.base_ratio < engine._base.num_entries * engine_mod.HELD_FOLD_LIMIT  # noqa: SLF001
    assert engine.stats.deferred_folds > 0 and engine.stats.folds > folds
    assert_frozen_views_hold([(frozen, seen)])
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 20])
def test_frozen_field_chunks_merge_several_delta_runs_a_chunk_at_a_time(chunk):
    """A frozen view with several delta runs (tier merges into the runs it holds wait): its fields,
    read in chunks of any size (each run's window of base positions merged per chunk), are the rows
    it was taken with; the live engine's tier merges left the held runs alone."""
    rng = np.random.default_rng(7)
    engine, ref = _grown_engine(rng, POOL)
    assert engine.base_ratio == 1  # folds only at deltas >= base: the delta runs stay
    for _ in range(3):
        batch = _spread_batch(rng, POOL)
        apply(engine, batch)
        ref.apply(batch)
    frozen = engine.freeze()
    seen = {k: ref.row(k) for k in ref.rows}
    held = [id(d) for d in engine._deltas]  # noqa: SLF001
    assert held
    folds = engine.stats.folds
    for i in range(4):
        pool = [(c, 3) for c in range(40 * i, 40 * i + 40)]
        batch = random_batch(rng, pool, np.arange(50, dtype=np.uint64), POOL64, len(pool), 3)
        apply(engine, batch)
        ref.apply(batch)
    assert engine.stats.folds == folds
    assert [id(d) for d in engine._deltas[: len(held)]] == held  # noqa: SLF001 - not merged into
    assert len(engine._deltas) > len(held)  # noqa: SLF001
    fields = [np.concatenate([p.copy() for p in frozen.field_chunks(f, chunk)])  # (a piece lives until the next)
              for f in ("seg", "tc", "tf", "st")]
    off = frozen.offsets()
    for i in range(frozen.num_rows):
        assert same(Entries(*(f[off[i]:off[i + 1]] for f in fields)), seen[(int(frozen.a[i]), int(frozen.b[i]))])
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


def _tiers_hold(engine):
    """Each delta run holds more than fanout times the next newer one (engine._add_delta)."""
    sizes = [d.num_entries for d in engine._deltas]  # noqa: SLF001
    return all(newer * engine.fanout < older for older, newer in zip(sizes, sizes[1:]))


def test_delta_runs_stacked_behind_a_frozen_view_merge_once_it_is_released():
    """While a view holds a delta run, newer runs pile up behind it (none merges into the held
    one); once it is released, the next commit merges the stack back into size tiers, so the runs
    a lookup or a snapshot walks stay O(log) in number. Contents unchanged throughout."""
    rng = np.random.default_rng(8)
    engine, ref = RowEngine(fanout=2, base_ratio=1), DictReference()  # folds only at deltas >= base
    big = [(c, 1) for c in range(3000)]
    batch = random_batch(rng, big, np.arange(50, dtype=np.uint64), POOL64, len(big), 10)
    apply(engine, batch)
    ref.apply(batch)
    engine.compact()
    batch = random_batch(rng, [(c, 5) for c in range(40)], np.arange(50, dtype=np.uint64), POOL64, 40, 5)
    apply(engine, batch)
    ref.apply(batch)
    frozen = engine.freeze()
    for i in range(5):  # growing batches of new rows: each newer run larger than the held one
        rows = [(c, 6 + i) for c in range(20 * 2 ** i)]
        batch = random_batch(rng, rows, np.arange(50, dtype=np.uint64), POOL64, len(rows), 3)
        apply(engine, batch)
        ref.apply(batch)
    assert not _tiers_hold(engine)  # stacked behind the held run
    del frozen
    new_keys = np.arange(50, 100, dtype=np.uint64)  # in old rows: a delta run
    batch = random_batch(rng, [(c, 1) for c in range(5)], new_keys, POOL64, 5, 10)
    apply(engine, batch)
    ref.apply(batch)
    assert _tiers_hold(engine)
    for key in ref.rows:
        assert same(engine.read(engine.row_id(*key)), ref.row(key))


def _pairwise_chunks(frozen, names, chunk):
    """``FrozenEngine.entry_chunks`` as it was before its merge kernel: each piece's delta windows
    merged pair by pair (run.merge_deltas), then each field merged with the base slice: the
    reference of the kernel's pieces."""
    from giaannd.rowengine.run import merge_deltas, window

    bases = [getattr(frozen.base, name) for name in names]
    n = frozen.base.num_entries
    step = max(1, chunk)
    if not frozen.deltas:
        for lo in range(0, n, step):
            yield tuple(f[lo : lo + step].copy() for f in bases)
        return
    bounds = [*range(0, n, step), n]
    starts = [0] * len(frozen.deltas)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:] or [n])):
        last = i == len(bounds) - 2 or not bounds[1:]
        merged = None
        for k, delta in enumerate(frozen.deltas):
            j = starts[k]
            starts[k] = delta.pos.shape[0] if last else int(np.searchsorted(delta.pos, hi, "left"))
            if starts[k] > j:
                piece = window(delta, j, starts[k])
                merged = piece if merged is None else merge_deltas(merged, piece)
        if merged is None:
            yield tuple(f[lo:hi].copy() for f in bases)
        else:
            yield tuple(merge_field(f[lo:hi], getattr(merged, name), merged.pos - lo) for f, name in zip(bases, names))


@pytest.mark.parametrize("seed", range(6))
def test_frozen_entry_chunks_kernel_equals_pairwise_merges(seed):
    """The one-pass k-way merge of a piece's delta windows (frozen._merge_windows) gives the pieces
    the pairwise merges gave, bit for bit and piece for piece, whatever the number of delta runs
    (tiers held by views, new rows among old ones), the chunk size and the fields asked for."""
    rng = np.random.default_rng(100 + seed)
    engine, ref = RowEngine(fanout=int(rng.integers(1, 4)), base_ratio=1), DictReference()
    pool = [(c, 1) for c in range(30 + 10 * seed)]
    base = random_batch(rng, pool, np.arange(0, 40, dtype=np.uint64), POOL64, len(pool), 20)
    apply(engine, base)
    ref.apply(base)
    engine.compact()
    views = []
    for step in range(3 + seed):
        grow_pool = pool + [(c, 1) for c in range(1000 + 7 * step, 1000 + 7 * step + int(rng.integers(0, 5)))]
        batch = random_batch(rng, grow_pool, np.arange(20 * step, 20 * step + 60, dtype=np.uint64), POOL64,
                             int(rng.integers(1, len(grow_pool))), int(rng.integers(1, 6)))
        apply(engine, batch)
        ref.apply(batch)
        if rng.random() < 0.7:
            views.append(engine.freeze())  # held runs: later batches become runs of their own
    frozen = engine.freeze()
    assert len(frozen.deltas) >= 2
    names = [["seg", "tc", "tf", "st"], ["st"], ["tf", "seg"]][seed % 3]
    for chunk in (1, 2, 7, 64, 1000, 1 << 30):
        got = [tuple(p.copy() for p in piece) for piece in frozen.entry_chunks(names, chunk)]
        want = list(_pairwise_chunks(frozen, names, chunk))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(g, w))
    everything = dict(zip(("seg", "tc", "tf", "st"), next(frozen.entry_chunks(["seg", "tc", "tf", "st"], 1 << 30))))
    off = frozen.offsets()
    for i in range(frozen.num_rows):  # and the rows are the ones the view was taken with
        entries = Entries(*(everything[f][off[i] : off[i + 1]] for f in ("seg", "tc", "tf", "st")))
        assert same(entries, ref.row((int(frozen.a[i]), int(frozen.b[i]))))
    for view in (*views, frozen):
        view.release() if hasattr(view, "release") else None
