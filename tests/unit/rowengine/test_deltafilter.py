"""The delta runs' key filter (rowengine/deltafilter.py): never rules out a key a delta run holds,
rules out most others, and the engine's plans with it equal plans that search every run."""

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.rowengine import Entries, RowEngine, deltafilter
from giaannd.rowengine.deltafilter import DeltaFilter
from giaannd.rowengine.posindex import BUCKET_ENTRIES, PosIndex
from giaannd.rowengine.run import POS_INDEX_MIN_GAP, Run, find_in_gaps, offsets_of
from giaannd.rowengine.search import lower_bound

from .test_engine import POOL64, _as_parts, _engine_state, _group, apply, random_batch


def _run(rng, rows, per_row):
    """A delta run of random keys: ``rows`` row ids, up to ``per_row`` entries each."""
    counts = rng.integers(1, per_row + 1, rows.shape[0])
    n = int(counts.sum())
    return Run(rows, offsets_of(counts), rng.integers(0, 9, n).astype(np.uint8),
               rng.integers(0, 2**64 - 1, n, dtype=np.uint64), rng.integers(0, 2**64 - 1, n, dtype=np.uint64),
               np.ones(n, np.float32), np.zeros(n, np.int64))


def _ask(f, run):
    row = np.repeat(run.rows, run.counts())
    return f.maybe(row, run.seg, run.tc, run.tf, np.arange(run.num_entries, dtype=np.int64))


@pytest.mark.parametrize("seed", range(5))
def test_filter_never_rules_out_a_key_it_holds_across_rebuilds(seed):
    """Runs added one after another, past the capacity several times (each time rebuilt from the
    runs it is given): every key of every run is "maybe"; keys never added are mostly "no"."""
    rng = np.random.default_rng(seed)
    f = DeltaFilter(0)
    held: list[Run] = []
    for i in range(12):
        run = _run(rng, np.sort(rng.choice(10**6, int(rng.integers(1, 3000)), replace=False)).astype(np.int64),
                   int(rng.integers(1, 20)))
        f.add(run, held)
        held.append(run)
        if i == 5:
            assert f.capacity > deltafilter.MIN_CAPACITY  # it was rebuilt at least once
        for r in held:
            assert _ask(f, r).all()
    others = _run(rng, np.arange(5000, dtype=np.int64), 4)
    assert _ask(f, others).mean() < 0.1
    f.clear()
    assert f.keys == 0 and not _ask(f, held[0]).any()


def test_filter_false_positive_rate_is_near_its_estimate_at_capacity():
    """Filled to its capacity, the share of "maybe" for absent keys is about what
    ``false_positive_rate`` predicts (a hash that put keys in few words would be far above it)."""
    rng = np.random.default_rng(7)
    run = _run(rng, np.arange(20_000, dtype=np.int64), 9)
    f = DeltaFilter(run.num_entries)
    f.add(run)
    absent = _ask(f, _run(rng, np.arange(20_000, 60_000, dtype=np.int64), 5)).mean()
    assert 0.005 < f.false_positive_rate() < 0.05
    assert absent < 2 * f.false_positive_rate()


class _RulesNothingOut(DeltaFilter):
    __slots__ = ()

    def maybe(self, row, seg, tc, tf, at):
        return np.ones(at.shape[0], np.bool_)


def _always_maybe(engine):
    """An engine whose filter rules nothing out: every key the base lacks is searched in every run."""
    engine._delta_keys = _RulesNothingOut()  # noqa: SLF001
    return engine


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.lists(st.sampled_from(["apply", "apply", "apply", "in_order",
       "compact", "drop", "freeze"]), min_size=1, max_size=30), base_ratio=st.integers(1, 6),
       per_row=st.sampled_from([2, 8, 40]), capacity=st.sampled_from([16, 256, deltafilter.MIN_CAPACITY]))
def test_engine_with_the_filter_equals_one_that_searches_every_run(seed, steps, base_ratio, per_row, capacity):
    """Applies, replay windows (``apply_in_order``: its delta run joins the filter too), folds,
    drops of rows and frozen views holding runs (tier merges and folds deferred) in any order, with
    filters made for few keys (rebuilt often) or for more than the test adds (each key missed would
    be ruled out): the engine's state equals an engine's whose filter rules nothing out, after
    every step."""
    rng = np.random.default_rng(seed)
    rows = [(int(c), int(f)) for c in range(8) for f in range(3)]
    with mock.patch.object(deltafilter, "MIN_CAPACITY", capacity):
        x, y = RowEngine(base_ratio=base_ratio), _always_maybe(RowEngine(base_ratio=base_ratio))
        frozen = []
        for step in steps:
            if step == "apply":
                batch = random_batch(rng, rows, POOL64, POOL64[:4], int(rng.integers(1, 8)), per_row)
                apply(x, batch)
                apply(y, batch)
            elif step == "in_order":  # then one of its batches again: keys of the run it may leave
                batches = [_group(rng, rows, POOL64, per_row) for _ in range(int(rng.integers(1, 4)))]
                x.apply_in_order(_as_parts(batches))
                y.apply_in_order(_as_parts(batches))
                assert _engine_state(x) == _engine_state(y)
                apply(x, batches[-1])
                apply(y, batches[-1])
            elif step == "compact":
                x.compact()
                y.compact()
            elif step == "drop" and x.num_rows:
                keep = rng.random(x.num_rows) < 0.7
                x.drop_rows(keep)
                y.drop_rows(keep)
            elif step == "freeze":
                frozen = [x.freeze(), y.freeze()] if not frozen else []
            assert _engine_state(x) == _engine_state(y)
        assert x.stats.delta_merges == y.stats.delta_merges


@pytest.mark.parametrize("seed", range(6))
def test_a_replay_windows_delta_run_is_in_the_filter(seed):
    """A replay window's new keys left as a delta run over a larger base, then added to again by a
    plain apply: found in that run (the filter holds them), as an engine that searches every run
    finds them."""
    rng = np.random.default_rng(seed)
    rows = [(int(c), int(f)) for c in range(8) for f in range(3)]
    x, y = RowEngine(base_ratio=1), _always_maybe(RowEngine(base_ratio=1))
    for _ in range(20):
        batch = random_batch(rng, rows, POOL64, POOL64[:4], 8, 40)
        apply(x, batch)
        apply(y, batch)
    batches = [_group(rng, rows, POOL64, 8) for _ in range(2)]
    x.apply_in_order(_as_parts(batches))
    y.apply_in_order(_as_parts(batches))
    assert x.num_deltas == 1
    apply(x, batches[-1])
    apply(y, batches[-1])
    assert _engine_state(x) == _engine_state(y)


@pytest.mark.parametrize("seed", range(4))
def test_find_in_gaps_without_the_position_index_gives_its_answers(seed):
    """Few keys into a run with no position index yet bisect their row slices; the answers (lower
    bounds in the row slice, found or not) are those of the index's gap search."""
    rng = np.random.default_rng(seed)
    e = RowEngine()
    for _ in range(30):
        apply(e, random_batch(rng, [(c, f) for c in range(40) for f in range(2)], POOL64, POOL64[:4], 20, 40))
    for _ in range(3):
        e.apply(np.array([2**63], np.uint64), np.array([1], np.uint64), np.array([0, 1], np.int64),
                Entries(np.zeros(1, np.uint8), np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.ones(1, np.float32)))
    delta = max(e._deltas, key=lambda d: d.num_entries)  # noqa: SLF001
    base = e._base  # noqa: SLF001
    # queries: every key of the run, and keys next to them (absent), with their base positions
    row = np.repeat(delta.rows, delta.counts())
    qs, qc, qf = delta.seg, delta.tc, delta.tf
    qf2 = qf + np.uint64(1)
    delta._pos_index = None  # noqa: SLF001 - as a run no plan searched yet
    for tf in (qf, qf2):
        lo, hi = delta.ranges(row)
        blo, bhi = base.ranges(row)
        pos = lower_bound(base.seg, base.tc, base.tf, blo, bhi, qs, qc, tf)
        assert not delta.pos_indexed
        with mock.patch("giaannd.rowengine.run.POS_INDEX_MIN_GAP", 0):
            few = find_in_gaps(delta, lo, hi, pos, qs, qc, tf)
        assert not delta.pos_indexed
        with mock.patch("giaannd.rowengine.run.POS_INDEX_MIN_GAP", 10**9):
            indexed = find_in_gaps(delta, lo, hi, pos, qs, qc, tf)
        assert delta.pos_indexed
        delta._pos_index = None  # noqa: SLF001
        assert few[1].tolist() == indexed[1].tolist()
        assert few[0][few[1]].tolist() == indexed[0][indexed[1]].tolist()
    assert few[1].sum() < few[1].shape[0]  # some of the last queries were absent


def test_a_run_searched_batch_after_batch_gets_its_position_index():
    """Few keys per call bisect their row slices; once the keys searched in the run reach one per
    ``POS_INDEX_MIN_GAP`` of its entries, the index is made (and kept), with the same answers."""
    rng = np.random.default_rng(3)
    raw = _run(rng, np.arange(0, 2_000, 2, dtype=np.int64), 40)
    rows = np.repeat(raw.rows, raw.counts())
    order = np.lexsort((raw.tf, raw.tc, raw.seg, rows))  # each row's entries in key order
    run = Run(raw.rows, raw.offsets, raw.seg[order], raw.tc[order], raw.tf[order], raw.st,
              np.sort(rng.integers(0, 10**6, raw.num_entries)).astype(np.int64))  # any sorted positions
    calls = 0
    while not run.pos_indexed and calls < run.num_entries:
        i = rng.integers(0, run.num_entries, 3)
        row = np.repeat(run.rows, run.counts())[i]
        lo, hi = run.ranges(row)
        at, hit = find_in_gaps(run, lo, hi, run.pos[i], run.seg[i], run.tc[i], run.tf[i])
        assert hit.all() and at.tolist() == i.tolist()
        calls += 1
    assert run.pos_indexed
    assert 3 * calls * POS_INDEX_MIN_GAP >= run.num_entries
    assert 3 * (calls - 1) * POS_INDEX_MIN_GAP < run.num_entries


@pytest.mark.parametrize("seed", range(6))
def test_position_index_bucket_bounds_equal_searchsorted(seed):
    """``first[b]`` is the number of positions below ``b << shift`` for every bucket, and a few
    entries fall in a bucket: positions spread, skewed onto one value (new rows at the end of the
    base), repeated, one, none."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 50_000))
    top = int(rng.integers(1, 10**7))
    pos = np.sort(rng.integers(0, top, n)).astype(np.int64)
    if seed % 3 == 1 and n:
        pos[n // 2:] = top  # half of them at one position
    index = PosIndex(pos)
    bounds = np.arange(index.first.shape[0], dtype=np.int64) << index.shift
    assert index.first.tolist() == np.searchsorted(pos, bounds, side="left").tolist()
    assert index.first[-1] == n
    if n > 1000 and seed % 3 != 1:
        assert n / index.first.shape[0] >= BUCKET_ENTRIES / 4  # not one bucket per entry
