"""An in-memory row store: RowKey → Row, merged by add (ARCHITECTURE §8, giaann-algorithm.md §3.3).

The single-process engine's database and the reference for the storage role (which builds the durable,
replicated store on the same :class:`~giaannd.model.rows.Row` format). The rows live in a
:class:`~giaannd.rowengine.RowEngine` (giaannd/rowengine/engine.py): many rows' entries in a few
shared numpy arrays with a numpy key index, so memory stays close to the 21 bytes of an entry and
a batch costs O(its entries · log), whatever the size of the rows it touches (issue 14; the store
before it re-sorted every touched row per batch, tools/bench/baseline_rowstore.py).

Results are the same as before, bit for bit: entries in canonical order, each strength the float32
left fold of its increments in batch order (float64 add, one rounding per batch).

Reads (``get``, ``get_row``) return a canonical :class:`Row`: views into the engine's arrays when
the row has no recent (delta) entries, else a merged copy. A read is valid until the next ``apply``:
an in-place add changes the strengths it views (callers must not hold rows across applies, nor
mutate them). ``compact`` folds everything into one base, after which every read is views.

**A fold thread** (``fold_thread=True``; the single-process ``Engine`` turns it on where the
process may use more than one CPU): the engine's folds of its delta runs into the base and its
largest tier merges (``RowEngine.commit(fold=False)``: the merges of more than
``INLINE_MERGE_ENTRIES``) run in a thread of the store's own while the owner goes on encoding and
training, as a storage node folds off its event loop. Batches applied meanwhile are copied and held
(up to ``max_deferred_bytes``; past them ``apply`` waits for the fold) and applied, in order, when
it ends: by the next ``apply`` after it, and before anything reads the store, so every read sees
every batch applied before it. The result is the same, bit for bit, as without the thread (the
same batches in the same order; folds and merges move entries and never add). Why: at 10^8-10^9
entries a fold rewrites the base (seconds) and the large merges a quarter of it, the part of a
batch's cost that grows with the store; a second core does them while the first trains.

Optional neuron strengths (§3.1 step 5) are kept per (column, feature) as a 9-vector.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Final

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import NUM_SEGMENTS, Row, RowBatch, RowKey
from giaannd.model.train import NeuronBatch
from giaannd.rowengine import Entries, RowEngine
from giaannd.unique import unique

__all__ = ["DEFAULT_DEFERRED_BYTES", "ENTRY_BYTES", "RowStore"]

#: Payload bytes of one entry: segment u8 + target column u64 + target feature u64 + strength f32.
ENTRY_BYTES = 21

_EMPTY = Row.empty()

#: Bytes of batches a store with a fold thread holds while the thread works; past them, ``apply``
#: waits for it (a fold of 10^9 entries takes seconds: a few hundred batches of a training run).
DEFAULT_DEFERRED_BYTES: Final = 256 << 20


def _row(e: Entries) -> Row:
    return Row(e.seg, e.tc, e.tf, e.st)


class _FoldThread:
    """One fold or large tier merge of an engine at a time, in a thread of its own."""

    def __init__(self, engine: RowEngine) -> None:
        self.engine = engine
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: folds and merges this thread did (tests, benchmarks)
        self.runs = 0

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start_if_due(self) -> None:
        """Start a fold if one is due, else the tier merges a commit left, if any (not while one runs)."""
        if self._thread is None and (self.engine.fold_due() or self.engine.merge_due()):
            self._thread = threading.Thread(target=self._run, name="rowstore-fold", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            if self.engine.fold_due():
                self.engine.compact()
            else:
                self.engine.merge_tiers()
            self.runs += 1
        except BaseException as exc:  # handed to the owner by ``wait``
            self._error = exc

    def wait(self) -> None:
        """Until the running fold, if any, has ended; raises what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the row store's fold thread failed") from error


class RowStore:
    """Rows of many (column, feature) neurons, held in RAM. Not thread-safe (one owner).

    Args:
        engine: the row engine to use (a fresh one with the default tiers by default).
        fold_thread: fold in a thread of the store's own (module docstring).
        max_deferred_bytes: with ``fold_thread``, the most bytes of batches held while it folds.
    """

    def __init__(self, engine: RowEngine | None = None, *, fold_thread: bool = False,
                 max_deferred_bytes: int = DEFAULT_DEFERRED_BYTES) -> None:
        if max_deferred_bytes < 0:
            raise ValueError(f"max_deferred_bytes must be >= 0, got {max_deferred_bytes}")
        self.engine = engine if engine is not None else RowEngine()
        self._neurons: dict[RowKey, NDArray[np.float32]] = {}
        self.batches_applied = 0
        self._folds = _FoldThread(self.engine) if fold_thread else None
        self.max_deferred_bytes = max_deferred_bytes
        self._deferred: list[RowBatch] = []
        self._deferred_bytes = 0
        #: batches held while the fold thread worked (tests, benchmarks)
        self.batches_deferred = 0

    @property
    def fold_thread(self) -> bool:
        return self._folds is not None

    @property
    def folding(self) -> bool:
        """Whether the fold thread is working now."""
        return self._folds is not None and self._folds.busy()

    @property
    def thread_folds(self) -> int:
        """Folds and large tier merges done in the fold thread so far."""
        return 0 if self._folds is None else self._folds.runs

    # -- writes ---------------------------------------------------------------------------------
    def apply(self, batch: RowBatch, *, validate: bool = True) -> None:
        """Add a (canonical) delta batch: equal entry keys add their strengths, new keys are inserted.

        The store copies what it keeps: later changes to ``batch``'s arrays do not reach it.
        ``validate=False`` skips the check below for batches canonical by construction (the
        ``Engine``'s ``train_batch`` output, ~1.5 % of a small store's apply), as
        ``ColumnStore.prepare``'s ``validate`` does.

        Raises:
            ValueError: the batch is not canonical (``RowBatch.validate``: one compiled pass over
                its entries, as the storage role's ``ColumnStore.prepare`` checks); nothing is
                applied or held. The engine does not check: it gave a repeated row two ids, lost
                an increment of a repeated key and kept non-finite strengths or unsorted keys, so
                the store's own export, and its snapshot, were no longer canonical.
            ValueError, RuntimeError: with a fold thread, what applying the batches held before
                this one raised (a batch the engine refuses, a failed fold: ``settle``); this batch
                is then held after those still held, and applied by the next call that settles.
        """
        if validate:
            batch.validate()
        if batch.num_rows == 0:
            return
        folds = self._folds
        if folds is None:
            self._add(batch, fold=True)
        elif folds.busy() and self._deferred_bytes + batch.nbytes <= self.max_deferred_bytes:
            self._deferred.append(batch.copy())
            self._deferred_bytes += batch.nbytes
            self.batches_deferred += 1
        else:
            try:
                self.settle()
            except BaseException:  # a held batch's failure: this one is held after those still held
                self._deferred.append(batch.copy())
                self._deferred_bytes += batch.nbytes
                self.batches_deferred += 1
                self.batches_applied += 1
                raise
            self._add(batch, fold=False)
            folds.start_if_due()
        self.batches_applied += 1

    def _add(self, batch: RowBatch, fold: bool) -> None:
        entries = Entries(batch.segment, batch.target_column, batch.target_feature, batch.strength)
        engine = self.engine
        engine.commit(engine.plan(batch.row_column, batch.row_feature, batch.offsets, entries), fold=fold)

    def settle(self) -> None:
        """Wait for the fold thread's work, if any, and apply the batches held meanwhile, in order
        (every read does this first; a no-op without a fold thread). A held batch the engine refuses
        is raised here, by the call that applies it; the batches held after it stay held."""
        if self._folds is None:
            return
        self._folds.wait()
        deferred, self._deferred, self._deferred_bytes = self._deferred, [], 0
        for i, batch in enumerate(deferred):
            try:
                self._add(batch, fold=False)
            except BaseException:  # that batch is refused; those after it stay held, in order
                self._deferred = deferred[i + 1:]
                self._deferred_bytes = sum(b.nbytes for b in self._deferred)
                raise

    def compact(self) -> None:
        """Fold every recent entry into the base: later reads are views, with no merge (e.g. after
        training, before a long inference run)."""
        self.settle()
        self.engine.compact()

    def apply_neurons(self, neurons: NeuronBatch) -> None:
        """Add optional neuron-strength increments."""
        for c, f, s, v in zip(neurons.column.tolist(), neurons.feature.tolist(),
                              neurons.segment.tolist(), neurons.strength.tolist()):
            vec = self._neurons.get((c, f))
            if vec is None:
                vec = self._neurons[(c, f)] = np.zeros(NUM_SEGMENTS, np.float32)
            vec[s] += v

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: RowKey) -> Row:
        """The row of ``key`` (an empty row if the neuron has no outgoing synapses). Do not mutate it;
        it is valid until the next ``apply``."""
        return self.get_row(key[0], key[1])

    def get_row(self, column_id: int, feature_id: int) -> Row:
        """Row source protocol used by inference (see :class:`giaannd.model.infer.RowSource`)."""
        self.settle()
        rid = self.engine.row_id(column_id, feature_id)
        return _EMPTY if rid < 0 else _row(self.engine.read(rid))

    def neuron_strength(self, key: RowKey) -> NDArray[np.float32]:
        vec = self._neurons.get(key)
        return vec.copy() if vec is not None else np.zeros(NUM_SEGMENTS, np.float32)

    def __contains__(self, key: object) -> bool:
        # numpy integers too (ids read from arrays): ``get`` finds their rows, as the dict before did
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, (int, np.integer)) for k in key)):
            return False
        c, f = int(key[0]), int(key[1])
        self.settle()
        return 0 <= c < 2**64 and 0 <= f < 2**64 and self.engine.row_id(c, f) >= 0

    def __len__(self) -> int:
        self.settle()
        return self.engine.num_rows

    def __iter__(self) -> Iterator[tuple[RowKey, Row]]:
        """Rows in ascending key order (views of one exported copy)."""
        yield from self.export()

    def keys(self) -> list[RowKey]:
        self.settle()
        a, b = self.engine.keys()
        order = np.lexsort((b, a))
        return list(zip(a[order].tolist(), b[order].tolist()))

    def largest_rows(self, k: int) -> list[tuple[RowKey, int]]:
        """The ``k`` longest rows and their lengths, longest first."""
        self.settle()
        ids = self.engine.largest(k)
        a, b = self.engine.keys()
        lengths = self.engine.lengths()
        return [((int(a[i]), int(b[i])), int(lengths[i])) for i in ids.tolist()]

    @property
    def num_entries(self) -> int:
        self.settle()
        return self.engine.num_entries

    @property
    def nbytes(self) -> int:
        """Payload bytes of all rows (``ENTRY_BYTES`` per entry; the engine's own arrays, with their
        indexes, are ``engine.nbytes``)."""
        return ENTRY_BYTES * self.num_entries  # (settles: the batches held during a fold count)

    @property
    def num_columns(self) -> int:
        self.settle()
        return int(unique(self.engine.keys()[0]).shape[0])

    def export(self) -> RowBatch:
        """Every row as one canonical batch (a snapshot's payload, or a transfer): a copy."""
        self.settle()
        a, b, offsets, e = self.engine.export()
        return RowBatch(a, b, offsets, e.seg, e.tc, e.tf, e.st)

    def neuron_items(self) -> Iterator[tuple[RowKey, NDArray[np.float32]]]:
        for key in sorted(self._neurons):
            yield key, self._neurons[key]

    @classmethod
    def from_batch(cls, batch: RowBatch) -> RowStore:
        store = cls()
        store.apply(batch)
        return store
