"""RowStore(fold_thread=True) when its fold thread fails: the owner is told, and never reads rows a
half-done fold left (a review's tests: each failed before its fix)."""

import itertools
import threading

import numpy as np
import pytest

from giaannd.model.columns import ColumnAssigner
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from giaannd.rowengine import RowEngine
from giaannd.rowengine import run as run_module
from tools.bench.zipf_stream import ZipfStream


def _batches(n_sentences: int, per_batch: int, seed: int = 7) -> list[RowBatch]:
    assigner = ColumnAssigner()
    sentences = list(assigner.encode_many(itertools.islice(ZipfStream(seed), n_sentences)))
    return [train_batch(sentences[i:i + per_batch]).rows for i in range(0, len(sentences), per_batch)]


def _row_bits(row):  # type: ignore[no-untyped-def]
    return [np.asarray(a).tobytes() for a in (row.segment, row.target_column, row.target_feature, row.strength)]


class _GatedEngine(RowEngine):
    """Its folds and merges in the fold thread wait for ``gate``: the test decides when they run."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.armed = False  # (the gate is used once armed)
        self.gate = threading.Event()
        self.started = threading.Event()

    def _wait(self) -> None:
        if self.armed and threading.current_thread() is not threading.main_thread():
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"

    def compact(self) -> None:
        self._wait()
        super().compact()

    def merge_tiers(self) -> None:
        self._wait()
        super().merge_tiers()


#: The allocations a fold or a tier merge makes before it has written anything (run.py): the row
#: index (``_union_rows``), the insertion points of a delta merge, a field's new buffer or append.
_FIRST_ALLOCATIONS = ("_union_rows", "insertion_points", "_merged", "_appended")


def test_a_fold_that_fails_midway_never_leaves_rows_that_lost_entries(monkeypatch):
    """The fold thread's fold (or tier merge) runs out of memory at its first allocation, before it
    has written anything. The owner is told (``settle`` raises); after that every read of a row
    gives the row as a store without the thread has it, or raises: never a row missing entries.
    (Before: ``compact`` had already swapped the base for an empty run and taken the delta runs out,
    ``_merge_tiers`` the newer run, so later reads returned empty or partial rows, silently.)"""
    fail = threading.Event()
    for name in _FIRST_ALLOCATIONS:
        real = getattr(run_module, name)

        def failing(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            if fail.is_set() and threading.current_thread() is not threading.main_thread():
                raise MemoryError("no room")
            return _real(*args, **kwargs)

        monkeypatch.setattr(run_module, name, failing)
    engine = _GatedEngine(fanout=2, base_ratio=1)
    store, reference = RowStore(engine, fold_thread=True), RowStore()
    batches = iter(_batches(1200, 40))
    for batch in batches:  # the thread's first fold: the first base (no allocation to fail)
        store.apply(batch)
        reference.apply(batch)
        store.settle()
        if store.thread_folds:
            break
    assert store.thread_folds == 1 and engine.num_entries > 0
    engine.armed = True
    for batch in batches:
        store.apply(batch)
        reference.apply(batch)
        if store.folding:
            break
    assert engine.started.wait(10), "no second fold began: the test would prove nothing"
    fail.set()
    engine.gate.set()
    with pytest.raises(RuntimeError, match="fold thread failed") as info:
        store.settle()
    assert isinstance(info.value.__cause__, MemoryError)
    fail.clear()
    keys = [k for k, _ in reference.largest_rows(20)] + reference.keys()[::97]
    for key in keys:
        try:
            got = store.get(key)
        except RuntimeError:
            continue  # refused: fine, it is not a wrong row
        assert _row_bits(got) == _row_bits(reference.get(key)), f"row {key} silently lost entries"


class _RefusingEngine(_GatedEngine):
    """Refuses a batch whose first row's column is 999 (as the engine refuses a malformed one)."""

    def plan(self, a, b, offsets, entries):  # type: ignore[no-untyped-def]
        if len(a) and int(a[0]) == 999:
            raise ValueError("refused")
        return super().plan(a, b, offsets, entries)


def test_a_held_batch_refused_by_the_next_apply_does_not_lose_that_apply_s_batch():
    """A batch held during a fold is refused when the next ``apply`` applies it (the fold has ended
    meanwhile): that ``apply`` raises the refusal, and its own batch, which is fine, is kept and
    applied after the batches held, as the store without the thread applies it (where the refused
    batch raised by its own ``apply`` and this one went in). Before: it was neither applied nor held."""
    engine = _RefusingEngine(fanout=2, base_ratio=1)
    engine.armed = True
    store, reference = RowStore(engine, fold_thread=True), RowStore()
    for batch in _batches(1200, 40):
        store.apply(batch)
        reference.apply(batch)
        if store.folding:
            break
    assert engine.started.wait(10), "no fold began: the test would prove nothing"
    one = np.array([1.0], np.float32)
    bad = RowBatch.from_entries([999], [1], [0], [5], [6], one)
    held_after = RowBatch.from_entries([1000], [1], [0], [5], [6], one)
    mine = RowBatch.from_entries([1001], [2], [3], [5], [7], one)
    store.apply(bad)
    store.apply(held_after)
    reference.apply(held_after)
    assert store.batches_deferred == 2
    engine.gate.set()
    folds = store._folds
    assert folds is not None and folds._thread is not None
    folds._thread.join(30)  # the fold has ended: the next apply applies the held batches first
    assert not store.folding
    with pytest.raises(ValueError, match="refused"):
        store.apply(mine)
    reference.apply(mine)
    assert (1001, 2) in store, "the apply's own batch was lost"
    exported, want = store.export(), reference.export()
    assert all(np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))
               for u, v in zip(exported.buffers(), want.buffers()))
