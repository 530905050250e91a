"""The core's row store as it was before issue 14 ("Rows at scale"): the benchmark's baseline.

A frozen copy of ``giaannd/model/rowstore.py`` at e5ceb33 (plus ``largest_rows`` for the
benchmark), kept so that tools/bench/scale.py measures the new store against the old one in the
same run, on the same machine. Not used by the daemon. Its original description follows.

An in-memory row store: RowKey → Row, merged by add (ARCHITECTURE §8, giaann-algorithm.md §3.3).
The single-process engine's database and the reference for the storage role (which builds the durable,
replicated store on the same :class:`~giaannd.model.rows.Row` format). Each row is its own set of
small arrays, so a read is one contiguous lookup, and ``apply`` is vectorised per batch: rows new to
the store are copied in directly; rows already present are merged with one sort over just the touched
entries (``RowBatch.concat``), never a per-entry Python loop.

Optional neuron strengths (§3.1 step 5) are kept per (column, feature) as a 9-vector.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import NUM_SEGMENTS, Row, RowBatch, RowKey
from giaannd.model.train import NeuronBatch

__all__ = ["RowStore"]

_EMPTY = Row.empty()


def _merge_add(base: list[Row], delta: RowBatch) -> list[Row]:
    """``base[i] + delta.row(i)`` for every i, in one sort over all their entries.

    Targets are ranked by (column id, feature id) over the entries involved, so the packed int64 key
    ``(row, segment, target rank)`` sorts in the canonical entry order (one ``np.unique`` instead of a
    five-key lexsort). Strengths of equal keys are summed in float64 (base first), then stored as
    float32 — the same arithmetic as ``merge_rows``.
    """
    r = len(base)
    base_len = np.fromiter((len(x) for x in base), dtype=np.int64, count=r)
    delta_len = np.diff(delta.offsets)
    row_idx = np.concatenate([np.repeat(np.arange(r, dtype=np.int64), base_len),
                              np.repeat(np.arange(r, dtype=np.int64), delta_len)])
    seg = np.concatenate([x.segment for x in base] + [delta.segment])
    tc = np.concatenate([x.target_column for x in base] + [delta.target_column])
    tf = np.concatenate([x.target_feature for x in base] + [delta.target_feature])
    st = np.concatenate([x.strength for x in base] + [delta.strength]).astype(np.float64)
    order = np.lexsort((tf, tc))
    tco, tfo = tc[order], tf[order]
    new = np.ones(order.shape[0], dtype=bool)
    new[1:] = (tco[1:] != tco[:-1]) | (tfo[1:] != tfo[:-1])
    rank = np.empty(order.shape[0], dtype=np.int64)
    rank[order] = np.cumsum(new) - 1
    utc, utf = tco[new], tfo[new]
    m = int(utc.shape[0])
    key = (row_idx * NUM_SEGMENTS + seg.astype(np.int64)) * m + rank
    uniq, inverse = np.unique(key, return_inverse=True)
    summed = np.bincount(inverse.reshape(-1), weights=st, minlength=uniq.shape[0]).astype(np.float32)
    out_row = uniq // (NUM_SEGMENTS * m)
    out_seg = ((uniq // m) % NUM_SEGMENTS).astype(np.uint8)
    out_t = uniq % m
    out_tc, out_tf = utc[out_t], utf[out_t]
    bounds = np.searchsorted(out_row, np.arange(r + 1, dtype=np.int64)).tolist()
    return [Row(out_seg[a:b], out_tc[a:b], out_tf[a:b], summed[a:b]) for a, b in zip(bounds, bounds[1:])]


class RowStore:
    """Rows of many (column, feature) neurons, held in RAM. Not thread-safe (one owner)."""

    def __init__(self) -> None:
        self._rows: dict[RowKey, Row] = {}
        self._neurons: dict[RowKey, NDArray[np.float32]] = {}
        self._entries = 0
        self._bytes = 0
        self.batches_applied = 0

    # -- writes ---------------------------------------------------------------------------------
    def apply(self, batch: RowBatch) -> None:
        """Add a (canonical) delta batch: equal entry keys add their strengths, new keys are inserted.

        Rows new to the store become views into one copy of their sub-batch (no per-row copy);
        rows already present are merged together in one vectorised pass (:func:`_merge_add`).
        """
        if batch.num_rows == 0:
            return
        rows = self._rows
        keys = list(zip(batch.row_column.tolist(), batch.row_feature.tolist()))
        present = np.fromiter((k in rows for k in keys), dtype=bool, count=len(keys))
        if not present.all():
            fresh = batch.select_rows(~present)  # fancy indexing: a private copy
            offsets = fresh.offsets.tolist()
            for i, key in enumerate(k for k, p in zip(keys, present.tolist()) if not p):
                a, b = offsets[i], offsets[i + 1]
                self._put(key, Row(fresh.segment[a:b], fresh.target_column[a:b],
                                   fresh.target_feature[a:b], fresh.strength[a:b]))
        if present.any():
            touched_keys = [k for k, p in zip(keys, present.tolist()) if p]
            merged = _merge_add([rows[k] for k in touched_keys], batch.select_rows(present))
            for key, row in zip(touched_keys, merged):
                self._put(key, row)
        self.batches_applied += 1

    def compact(self) -> None:
        """Copy every row into its own arrays, releasing batch buffers that rows still view.

        ``apply`` stores rows as views into the (private) arrays of the batch that created them; a
        batch's buffer is freed once all its rows were replaced by merges. Call this after training
        to drop buffers kept alive by a few unmerged rows (e.g. before a long inference run).
        """
        for key, row in list(self._rows.items()):
            self._rows[key] = Row(row.segment.copy(), row.target_column.copy(), row.target_feature.copy(),
                                  row.strength.copy())

    def apply_neurons(self, neurons: NeuronBatch) -> None:
        """Add optional neuron-strength increments."""
        for c, f, s, v in zip(neurons.column.tolist(), neurons.feature.tolist(),
                              neurons.segment.tolist(), neurons.strength.tolist()):
            vec = self._neurons.get((c, f))
            if vec is None:
                vec = self._neurons[(c, f)] = np.zeros(NUM_SEGMENTS, np.float32)
            vec[s] += v

    def _put(self, key: RowKey, row: Row) -> None:
        old = self._rows.get(key)
        if old is not None:
            self._entries -= len(old)
            self._bytes -= old.nbytes
        self._rows[key] = row
        self._entries += len(row)
        self._bytes += row.nbytes

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: RowKey) -> Row:
        """The row of ``key`` (an empty row if the neuron has no outgoing synapses). Do not mutate it."""
        return self._rows.get(key, _EMPTY)

    def get_row(self, column_id: int, feature_id: int) -> Row:
        """Row source protocol used by inference (see :class:`giaannd.model.infer.RowSource`)."""
        return self._rows.get((column_id, feature_id), _EMPTY)

    def neuron_strength(self, key: RowKey) -> NDArray[np.float32]:
        vec = self._neurons.get(key)
        return vec.copy() if vec is not None else np.zeros(NUM_SEGMENTS, np.float32)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[tuple[RowKey, Row]]:
        """Rows in ascending key order."""
        for key in sorted(self._rows):
            yield key, self._rows[key]

    def keys(self) -> list[RowKey]:
        return sorted(self._rows)

    @property
    def num_entries(self) -> int:
        return self._entries

    @property
    def nbytes(self) -> int:
        """Payload bytes of all rows (arrays only, not dict overhead)."""
        return self._bytes

    @property
    def num_columns(self) -> int:
        return len({c for c, _ in self._rows})

    def export(self) -> RowBatch:
        """Every row as one canonical batch (a snapshot's payload, or a transfer)."""
        return RowBatch.from_rows(self._rows)

    def neuron_items(self) -> Iterator[tuple[RowKey, NDArray[np.float32]]]:
        for key in sorted(self._neurons):
            yield key, self._neurons[key]

    def largest_rows(self, k: int) -> list[tuple[RowKey, int]]:
        """The ``k`` longest rows and their lengths, longest first (a Python scan: baseline only)."""
        return heapq.nlargest(k, ((key, len(row)) for key, row in self._rows.items()), key=lambda kv: kv[1])

    @classmethod
    def from_batch(cls, batch: RowBatch) -> RowStore:
        store = cls()
        store.apply(batch)
        return store
