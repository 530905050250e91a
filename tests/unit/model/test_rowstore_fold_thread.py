"""RowStore(fold_thread=True): folds beside the owner, the same rows bit for bit, reads see every write."""

import itertools
import threading

import numpy as np
import pytest

from giaannd.cpus import usable_cpus
from giaannd.model.columns import ColumnAssigner
from giaannd.model.engine import Engine
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.train import train_batch
from giaannd.rowengine import RowEngine
from tools.bench.zipf_stream import ZipfStream


def _same_batch(x: RowBatch, y: RowBatch) -> bool:
    return all(np.array_equal(u.view(np.uint8), v.view(np.uint8)) and u.dtype == v.dtype
               for u, v in zip(x.buffers(), y.buffers()))


def _batches(n_sentences: int, per_batch: int, seed: int = 5) -> list[RowBatch]:
    assigner = ColumnAssigner()
    sentences = list(assigner.encode_many(itertools.islice(ZipfStream(seed), n_sentences)))
    return [train_batch(sentences[i:i + per_batch]).rows for i in range(0, len(sentences), per_batch)]


class _GatedEngine(RowEngine):
    """A row engine whose folds and thread merges wait for ``gate`` (set by the test), so the test,
    not the scheduler, decides how long the fold thread works."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail: BaseException | None = None

    def compact(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail is not None:
                raise self.fail
        super().compact()

    def merge_tiers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"
        super().merge_tiers()


def test_fold_thread_gives_the_same_rows_bit_for_bit_with_reads_between():
    batches = _batches(2500, 50)
    serial = RowStore(RowEngine(fanout=2, base_ratio=1))
    threaded = RowStore(RowEngine(fanout=2, base_ratio=1), fold_thread=True)
    for i, batch in enumerate(batches):
        serial.apply(batch)
        threaded.apply(batch)
        if i % 9 == 4:  # a read in the middle: it must see every batch applied so far
            for key, _ in serial.largest_rows(3) + [(k, 0) for k in serial.keys()[::501]]:
                a, b = serial.get(key), threaded.get(key)
                assert np.array_equal(a.strength.view(np.uint32), b.strength.view(np.uint32)) and a.equals(b)
    assert threaded.thread_folds > 0, "no fold ran in the thread: the test would prove nothing"
    assert _same_batch(threaded.export(), serial.export())
    assert threaded.keys() == serial.keys() and len(threaded) == len(serial)
    assert threaded.num_entries == serial.num_entries and threaded.batches_applied == serial.batches_applied


def test_batches_applied_during_a_fold_are_held_copied_and_seen_by_the_next_read():
    batches = _batches(1200, 40, seed=7)
    engine = _GatedEngine(fanout=2, base_ratio=1)
    store, reference = RowStore(engine, fold_thread=True), RowStore()
    held_from = None
    for i, batch in enumerate(batches):
        store.apply(batch)
        reference.apply(batch)
        if store.folding:
            assert engine.started.wait(10)
            held_from = i + 1
            break
    assert held_from is not None, "no fold began: the test would prove nothing"
    rest = batches[held_from:held_from + 6]
    assert store.batches_deferred == 0
    for batch in rest:
        mine = batch.copy()
        store.apply(mine)
        reference.apply(batch)
        mine.strength[:] = 1e9  # the store copied what it holds
    assert store.batches_deferred == len(rest)
    engine.gate.set()
    assert _same_batch(store.export(), reference.export())  # the read waited and applied them in order


def test_past_max_deferred_bytes_apply_waits_for_the_fold():
    batches = _batches(1200, 40, seed=7)
    engine = _GatedEngine(fanout=2, base_ratio=1)
    store, reference = RowStore(engine, fold_thread=True, max_deferred_bytes=0), RowStore()
    it = iter(batches)
    for batch in it:
        store.apply(batch)
        reference.apply(batch)
        if store.folding:
            break
    assert engine.started.wait(10)
    opener = threading.Timer(0.2, engine.gate.set)
    opener.start()
    try:
        nxt = next(it)
        store.apply(nxt)  # no room to hold it: waits for the fold (the timer opens the gate)
        reference.apply(nxt)
    finally:
        opener.join()
    assert store.batches_deferred == 0 and engine.gate.is_set()
    for batch in it:
        store.apply(batch)
        reference.apply(batch)
    assert _same_batch(store.export(), reference.export())


def test_a_failed_fold_is_raised_to_the_owner():
    engine = _GatedEngine(fanout=2, base_ratio=1)
    engine.fail = MemoryError("no room for the new base")
    store = RowStore(engine, fold_thread=True)
    for batch in _batches(1200, 40, seed=7):
        store.apply(batch)
        if store.folding:
            break
    assert engine.started.wait(10)
    engine.gate.set()
    with pytest.raises(RuntimeError, match="fold thread failed") as info:
        store.settle()
    assert isinstance(info.value.__cause__, MemoryError)


class _RefusingEngine(_GatedEngine):
    """Refuses a batch whose first row's column is 999 (as the engine refuses a malformed one)."""

    def plan(self, a, b, offsets, entries):  # type: ignore[no-untyped-def]
        if len(a) and int(a[0]) == 999:
            raise ValueError("refused")
        return super().plan(a, b, offsets, entries)


def test_a_held_batch_that_is_refused_is_raised_and_those_after_it_stay_held():
    engine = _RefusingEngine(fanout=2, base_ratio=1)
    store, reference = RowStore(engine, fold_thread=True), RowStore()
    for batch in _batches(1200, 40, seed=7):
        store.apply(batch)
        reference.apply(batch)
        if store.folding:
            break
    assert engine.started.wait(10)
    one = np.array([1.0], np.float32)
    bad = RowBatch.from_entries([999], [1], [0], [5], [6], one)
    after = RowBatch.from_entries([1000], [1], [0], [5], [6], one)
    store.apply(bad)
    store.apply(after)
    reference.apply(after)
    assert store.batches_deferred == 2
    engine.gate.set()
    with pytest.raises(ValueError, match="refused"):
        store.settle()
    assert _same_batch(store.export(), reference.export())  # the batch after it was applied next


def test_settle_and_reads_without_a_fold_thread_are_as_before():
    store = RowStore()
    assert not store.fold_thread and store.thread_folds == 0
    store.settle()  # a no-op
    b = RowBatch.from_entries([1], [2], [4], [0], [0], np.array([1.0], np.float32))
    store.apply(b)
    assert store.batches_deferred == 0 and len(store) == 1
    with pytest.raises(ValueError, match="max_deferred_bytes"):
        RowStore(fold_thread=True, max_deferred_bytes=-1)


def test_the_engine_folds_in_a_thread_where_several_cpus_are_usable():
    assert Engine().store.fold_thread == (usable_cpus() > 1)
    assert not Engine(store=RowStore()).store.fold_thread


#: Every public name of RowStore that reads its rows, and how to read with it: each must settle
#: first (see every batch applied before it). A new public name must be added here or to
#: ``_NOT_ROW_READS`` (``test_every_public_name_is_classified``).
_ROW_READS = {
    "get": lambda s, key: _row_bits(s.get(key)),
    "get_row": lambda s, key: _row_bits(s.get_row(*key)),
    "__contains__": lambda s, key: key in s,
    "__len__": lambda s, key: len(s),
    "__iter__": lambda s, key: [(k, _row_bits(r)) for k, r in s],
    "keys": lambda s, key: s.keys(),
    "largest_rows": lambda s, key: s.largest_rows(3),
    "num_entries": lambda s, key: s.num_entries,
    "nbytes": lambda s, key: s.nbytes,
    "num_columns": lambda s, key: s.num_columns,
    "export": lambda s, key: [u.tobytes() for u in s.export().buffers()],
}
_NOT_ROW_READS = {"apply", "settle", "compact", "apply_neurons", "neuron_strength", "neuron_items", "from_batch",
                  "fold_thread", "folding", "thread_folds", "engine", "batches_applied", "batches_deferred",
                  "max_deferred_bytes"}


def _row_bits(row):  # type: ignore[no-untyped-def]
    return [np.asarray(a).tobytes() for a in (row.segment, row.target_column, row.target_feature, row.strength)]


def test_every_public_name_is_classified():
    store = RowStore(fold_thread=True)
    public = {n for n in set(dir(RowStore)) | set(vars(store)) if not n.startswith("_")}
    public |= {n for n in ("__contains__", "__len__", "__iter__") if hasattr(RowStore, n)}
    assert public == set(_ROW_READS) | _NOT_ROW_READS, "classify the new name: a row read must settle() first"


@pytest.fixture(scope="module")
def _fold_batches() -> list[RowBatch]:
    return _batches(1200, 40, seed=7)


@pytest.mark.parametrize("name", sorted(_ROW_READS))
def test_every_row_read_sees_the_batches_held_during_a_fold(name, _fold_batches):
    """A batch held while the fold thread works (a new, longest row in a new column) is in what
    every row read returns, as in a store without the thread. (Before: ``nbytes`` read the engine
    directly, without the held batches.)"""
    engine = _GatedEngine(fanout=2, base_ratio=1)
    store, reference = RowStore(engine, fold_thread=True), RowStore()
    for batch in _fold_batches:
        store.apply(batch)
        reference.apply(batch)
        if store.folding:
            break
    assert engine.started.wait(10), "no fold began: the test would prove nothing"
    n = 50_000
    key = (1 << 40, 7)
    held = RowBatch.from_entries(np.full(n, key[0]), np.full(n, key[1]), np.arange(n) % 9, np.arange(n) + 3,
                                 np.zeros(n), np.ones(n, np.float32))
    store.apply(held)
    reference.apply(held)
    assert store.batches_deferred == 1
    engine.gate.set()
    assert _ROW_READS[name](store, key) == _ROW_READS[name](reference, key)
