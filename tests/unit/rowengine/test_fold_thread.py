"""Folds in another thread (engine.py "Threads"): ``commit(fold=False)`` leaves a due fold to the
caller, whose ``compact`` may run in a worker thread while the owner reads; every read then waits
for the fold (the engine's lock) and sees what the plain path (folds inside ``commit``) gives, bit
for bit."""

import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import giaannd.rowengine.engine as engine_module
from giaannd.rowengine import Entries, RowEngine
from tests.unit.rowengine.test_engine import random_batch

POOL = np.array([0, 1, 2, 3, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1], np.uint64)


def _entries(batch):
    return Entries(batch.segment, batch.target_column, batch.target_feature, batch.strength)


def _same(x, y):
    return (np.array_equal(x.seg, y.seg) and np.array_equal(x.tc, y.tc) and np.array_equal(x.tf, y.tf)
            and np.array_equal(x.st.view(np.uint32), y.st.view(np.uint32)))


class PausedFold:
    """``run.fold_into_base`` as the engine calls it, held mid-fold (the base is then an empty run:
    a read that did not wait for the fold would miss rows) until ``release``."""

    def __init__(self, monkeypatch):
        self.inside = threading.Event()
        self.release = threading.Event()
        real = engine_module.fold_into_base

        def fold(base, delta, grow=False):
            self.inside.set()
            assert self.release.wait(10)
            return real(base, delta, grow)

        monkeypatch.setattr(engine_module, "fold_into_base", fold)


def _fed(rng, rows, plain, deferred, batches, n_rows, per_row):
    """``batches`` random batches, each applied to ``plain`` and committed to ``deferred`` without
    its fold; yields after each."""
    for _ in range(batches):
        b = random_batch(rng, rows, POOL, POOL, n_rows, per_row)
        plain.apply(b.row_column, b.row_feature, b.offsets, _entries(b))
        deferred.commit(deferred.plan(b.row_column, b.row_feature, b.offsets, _entries(b)), fold=False)
        yield


def test_commit_without_fold_leaves_it_to_the_caller():
    rng = np.random.default_rng(0)
    rows = [(c, f) for c in range(1, 30) for f in range(3)]
    plain, deferred = RowEngine(), RowEngine()
    due = 0
    for _ in _fed(rng, rows, plain, deferred, 60, 12, 6):
        if deferred.fold_due():
            due += 1
            assert deferred.num_deltas  # not folded by the commit
            deferred.compact()
    assert due and deferred.stats.folds == plain.stats.folds
    for i in range(plain.num_rows):
        assert _same(plain.read(i), deferred.read(i))


def test_commit_without_fold_leaves_large_tier_merges_to_the_caller(monkeypatch):
    """``commit(fold=False)`` merges delta runs of at most ``INLINE_MERGE_ENTRIES`` together, and
    leaves larger merges to ``merge_tiers`` (a storage node runs it in a worker thread: before, the
    largest, up to 1/base_ratio of the store, ran inside the commit, on the event loop); the rows
    are the plain engine's."""
    monkeypatch.setattr(engine_module, "INLINE_MERGE_ENTRIES", 60)
    rng = np.random.default_rng(1)
    rows = [(c, f) for c in range(1, 40) for f in range(3)]
    plain, deferred = RowEngine(), RowEngine()
    left = 0
    for _ in _fed(rng, rows, plain, deferred, 80, 12, 6):
        sizes = [d.num_entries for d in deferred._deltas]
        # no pair the commit left out of tier is one it should have merged
        assert all(sizes[i + 1] * deferred.fanout < sizes[i] or sizes[i] + sizes[i + 1] > 60
                   for i in range(len(sizes) - 1))
        if deferred.merge_due():
            left += 1
            merges = deferred.stats.delta_merges
            deferred.merge_tiers()
            assert deferred.stats.delta_merges > merges and not deferred.merge_due()
        if deferred.fold_due():
            deferred.compact()
        for i in range(plain.num_rows):
            assert _same(plain.read(i), deferred.read(i))
    assert left


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), reads=st.integers(1, 6))
def test_reads_during_a_fold_in_a_thread_wait_and_see_the_plain_rows(seed, reads):
    rng = np.random.default_rng(seed)
    rows = [(c, f) for c in range(1, 40) for f in range(2)]
    plain, threaded = RowEngine(), RowEngine()
    folds = 0
    for _ in _fed(rng, rows, plain, threaded, 40, 15, 5):
        if not threaded.fold_due():
            continue
        folds += 1
        ids = rng.integers(0, threaded.num_rows, reads)
        worker = threading.Thread(target=threaded.compact)
        worker.start()
        got = [(threaded.read(int(i)), threaded.gather(ids[:1])[1]) for i in ids]  # the owner reads meanwhile
        worker.join()
        for i, (one, many) in zip(ids, got):
            assert _same(one, plain.read(int(i))) and _same(many, plain.read(int(ids[0])))
    assert folds
    for i in range(plain.num_rows):
        assert _same(plain.read(i), threaded.read(i))


def test_a_read_waits_for_a_fold_under_way(monkeypatch):
    rng = np.random.default_rng(1)
    rows = [(c, 0) for c in range(1, 50)]
    engine, plain = RowEngine(), RowEngine()
    for _ in _fed(rng, rows, plain, engine, 6, 20, 4):
        pass
    assert engine.num_deltas
    paused = PausedFold(monkeypatch)
    worker = threading.Thread(target=engine.compact)
    worker.start()
    assert paused.inside.wait(10)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(engine.gather(np.arange(engine.num_rows))[1]))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got  # waiting for the fold, not reading its half-moved runs
    paused.release.set()
    worker.join()
    reader.join()
    assert _same(got[0], plain.gather(np.arange(plain.num_rows))[1])


def test_repeated_is_numpys_repeat():
    from giaannd.rowengine.run import repeated

    rng = np.random.default_rng(5)
    values = rng.integers(-2**62, 2**62, 1000)
    counts = rng.integers(0, 5, 1000)
    assert np.array_equal(repeated(values, counts), np.repeat(values, counts))
    assert repeated(values[:0], counts[:0]).shape == (0,)
    for bad in (counts[:-1], np.where(counts == 0, -1, counts)):
        try:
            repeated(values, bad)
        except ValueError:
            continue
        raise AssertionError("accepted a bad count")
