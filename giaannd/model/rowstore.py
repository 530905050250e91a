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

Optional neuron strengths (§3.1 step 5) are kept per (column, feature) as a 9-vector.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import NUM_SEGMENTS, Row, RowBatch, RowKey
from giaannd.model.train import NeuronBatch
from giaannd.rowengine import Entries, RowEngine

__all__ = ["ENTRY_BYTES", "RowStore"]

#: Payload bytes of one entry: segment u8 + target column u64 + target feature u64 + strength f32.
ENTRY_BYTES = 21

_EMPTY = Row.empty()


def _row(e: Entries) -> Row:
    return Row(e.seg, e.tc, e.tf, e.st)


class RowStore:
    """Rows of many (column, feature) neurons, held in RAM. Not thread-safe (one owner).

    Args:
        engine: the row engine to use (a fresh one with the default tiers by default).
    """

    def __init__(self, engine: RowEngine | None = None) -> None:
        self.engine = engine if engine is not None else RowEngine()
        self._neurons: dict[RowKey, NDArray[np.float32]] = {}
        self.batches_applied = 0

    # -- writes ---------------------------------------------------------------------------------
    def apply(self, batch: RowBatch) -> None:
        """Add a (canonical) delta batch: equal entry keys add their strengths, new keys are inserted.

        The store copies what it keeps: later changes to ``batch``'s arrays do not reach it.
        """
        if batch.num_rows == 0:
            return
        self.engine.apply(batch.row_column, batch.row_feature, batch.offsets,
                          Entries(batch.segment, batch.target_column, batch.target_feature, batch.strength))
        self.batches_applied += 1

    def compact(self) -> None:
        """Fold every recent entry into the base: later reads are views, with no merge (e.g. after
        training, before a long inference run)."""
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
        rid = self.engine.row_id(column_id, feature_id)
        return _EMPTY if rid < 0 else _row(self.engine.read(rid))

    def neuron_strength(self, key: RowKey) -> NDArray[np.float32]:
        vec = self._neurons.get(key)
        return vec.copy() if vec is not None else np.zeros(NUM_SEGMENTS, np.float32)

    def __contains__(self, key: object) -> bool:
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) for k in key)):
            return False
        c, f = key
        return 0 <= c < 2**64 and 0 <= f < 2**64 and self.engine.row_id(c, f) >= 0

    def __len__(self) -> int:
        return self.engine.num_rows

    def __iter__(self) -> Iterator[tuple[RowKey, Row]]:
        """Rows in ascending key order (views of one exported copy)."""
        yield from self.export()

    def keys(self) -> list[RowKey]:
        a, b = self.engine.keys()
        order = np.lexsort((b, a))
        return list(zip(a[order].tolist(), b[order].tolist()))

    def largest_rows(self, k: int) -> list[tuple[RowKey, int]]:
        """The ``k`` longest rows and their lengths, longest first."""
        ids = self.engine.largest(k)
        a, b = self.engine.keys()
        lengths = self.engine.lengths()
        return [((int(a[i]), int(b[i])), int(lengths[i])) for i in ids.tolist()]

    @property
    def num_entries(self) -> int:
        return self.engine.num_entries

    @property
    def nbytes(self) -> int:
        """Payload bytes of all rows (``ENTRY_BYTES`` per entry; the engine's own arrays, with their
        indexes, are ``engine.nbytes``)."""
        return ENTRY_BYTES * self.engine.num_entries

    @property
    def num_columns(self) -> int:
        return int(np.unique(self.engine.keys()[0]).shape[0])

    def export(self) -> RowBatch:
        """Every row as one canonical batch (a snapshot's payload, or a transfer): a copy."""
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
