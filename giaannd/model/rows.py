"""The row format: the unit of GIAANN storage, update and transfer (ARCHITECTURE §8).

A *row* is the list of outgoing synapses of one neuron (source column id, source feature id): entries
``(segment, target_column, target_feature, strength)`` kept as a struct of arrays, sorted by the
entry key ``(segment, target_column, target_feature)`` with no duplicate keys. Because GIAANN training
is a pure sum of non-negative increments (giaann-algorithm.md §3.3), rows merge by adding strengths
of equal keys, in any order.

A *row batch* packs many rows into seven flat arrays (so a batch travels as a few contiguous buffers,
never as per-entry messages):

====================  ==========  =====================================================
array                 dtype       meaning
====================  ==========  =====================================================
``row_column``        uint64[R]   source column id of each row
``row_feature``       uint64[R]   source feature id of each row (0 = prime concept)
``offsets``           int64[R+1]  entries of row i are ``[offsets[i], offsets[i+1])``
``segment``           uint8[N]    dendritic segment of the target neuron (0..8)
``target_column``     uint64[N]   target column id
``target_feature``    uint64[N]   target feature id
``strength``          float32[N]  synapse strength (or a strength increment, in a delta)
====================  ==========  =====================================================

Invariants of a *canonical* batch (what every constructor here returns): rows sorted by
``(row_column, row_feature)`` and unique; entries of each row sorted by the entry key and unique;
``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``. ``validate()`` checks them for data that
came from outside (wire, disk) before anything trusts it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.canon import BATCH_FAULTS, batch_fault

__all__ = ["NUM_SEGMENTS", "Row", "RowBatch", "RowKey", "merge_rows"]

#: Segments per neuron in the default LIF layout: 4 column + 4 feature segments + soma (§1.2).
NUM_SEGMENTS = 9

RowKey = tuple[int, int]
"""(source column id, source feature id)."""

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F32 = NDArray[np.float32]

#: The dtypes of a batch's seven arrays, in wire order (``RowBatch.buffers``).
_DTYPES = (np.uint64, np.uint64, np.int64, np.uint8, np.uint64, np.uint64, np.float32)


@dataclass(frozen=True, slots=True, eq=False)
class Row:
    """The outgoing synapses of one neuron, sorted by (segment, target_column, target_feature)."""

    segment: U8
    target_column: U64
    target_feature: U64
    strength: F32

    def __len__(self) -> int:
        return int(self.strength.shape[0])

    @property
    def nbytes(self) -> int:
        return int(
            self.segment.nbytes + self.target_column.nbytes + self.target_feature.nbytes + self.strength.nbytes
        )

    @classmethod
    def empty(cls) -> Row:
        return cls(
            np.empty(0, np.uint8), np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.float32)
        )

    def equals(self, other: Row, rtol: float = 0.0) -> bool:
        """Same keys, and strengths equal (exactly, or within ``rtol`` relative)."""
        if len(self) != len(other):
            return False
        same_keys = (
            np.array_equal(self.segment, other.segment)
            and np.array_equal(self.target_column, other.target_column)
            and np.array_equal(self.target_feature, other.target_feature)
        )
        if not same_keys:
            return False
        if rtol == 0.0:
            return bool(np.array_equal(self.strength, other.strength))
        return bool(np.allclose(self.strength, other.strength, rtol=rtol, atol=0.0))


def _sorted_unique_sum(
    keys: Sequence[NDArray[np.generic]], strength: F32
) -> tuple[list[NDArray[np.generic]], F32]:
    """Sort entries by ``keys`` (most significant first), sum the strengths of equal keys."""
    n = int(strength.shape[0])
    if n == 0:
        return [k[:0] for k in keys], strength[:0]
    order = np.lexsort(tuple(reversed(keys)))
    sorted_keys = [k[order] for k in keys]
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for k in sorted_keys:
        change[1:] |= k[1:] != k[:-1]
    starts = np.flatnonzero(change)
    summed = np.add.reduceat(strength[order].astype(np.float64), starts).astype(np.float32)
    return [k[starts] for k in sorted_keys], summed


@dataclass(frozen=True, slots=True, eq=False)
class RowBatch:
    """Many rows packed into seven flat arrays (see the module docstring for the layout)."""

    row_column: U64
    row_feature: U64
    offsets: I64
    segment: U8
    target_column: U64
    target_feature: U64
    strength: F32

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> RowBatch:
        e = Row.empty()
        return cls(
            np.empty(0, np.uint64), np.empty(0, np.uint64), np.zeros(1, np.int64),
            e.segment, e.target_column, e.target_feature, e.strength,
        )

    @classmethod
    def from_entries(
        cls,
        source_column: NDArray[np.generic],
        source_feature: NDArray[np.generic],
        segment: NDArray[np.generic],
        target_column: NDArray[np.generic],
        target_feature: NDArray[np.generic],
        strength: NDArray[np.generic],
    ) -> RowBatch:
        """A canonical batch from unsorted entries; entries with equal full keys are summed."""
        keys: list[NDArray[np.generic]] = [
            np.asarray(source_column, np.uint64),
            np.asarray(source_feature, np.uint64),
            np.asarray(segment, np.uint8),
            np.asarray(target_column, np.uint64),
            np.asarray(target_feature, np.uint64),
        ]
        (sc, sf, seg, tc, tf), st = _sorted_unique_sum(keys, np.asarray(strength, np.float32))
        n = int(st.shape[0])
        if n == 0:
            return cls.empty()
        row_start = np.ones(n, dtype=bool)
        row_start[1:] = (sc[1:] != sc[:-1]) | (sf[1:] != sf[:-1])
        starts = np.flatnonzero(row_start)
        offsets = np.append(starts, n).astype(np.int64)
        return cls(
            sc[starts].astype(np.uint64), sf[starts].astype(np.uint64), offsets,
            seg.astype(np.uint8), tc.astype(np.uint64), tf.astype(np.uint64), st,
        )

    @classmethod
    def from_rows(cls, rows: Mapping[RowKey, Row]) -> RowBatch:
        """Pack a mapping of rows (each already canonical) into a batch."""
        if not rows:
            return cls.empty()
        keys = sorted(rows)
        lengths = np.array([len(rows[k]) for k in keys], dtype=np.int64)
        offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])

        def cat(field: str, dtype: type[np.generic]) -> NDArray[np.generic]:
            parts = [getattr(rows[k], field) for k in keys]
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)

        return cls(
            np.array([k[0] for k in keys], dtype=np.uint64),
            np.array([k[1] for k in keys], dtype=np.uint64),
            offsets,
            cat("segment", np.uint8), cat("target_column", np.uint64),  # type: ignore[arg-type]
            cat("target_feature", np.uint64), cat("strength", np.float32),  # type: ignore[arg-type]
        )

    @classmethod
    def concat(cls, batches: Sequence[RowBatch]) -> RowBatch:
        """The sum of several batches, as one canonical batch (coalescing: equal keys add up)."""
        batches = [b for b in batches if b.num_entries]
        if not batches:
            return cls.empty()
        if len(batches) == 1:
            return batches[0]
        return cls.from_entries(
            np.concatenate([b.entry_source_column() for b in batches]),
            np.concatenate([b.entry_source_feature() for b in batches]),
            np.concatenate([b.segment for b in batches]),
            np.concatenate([b.target_column for b in batches]),
            np.concatenate([b.target_feature for b in batches]),
            np.concatenate([b.strength for b in batches]),
        )

    # -- access ---------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self.row_column.shape[0])

    @property
    def num_entries(self) -> int:
        return int(self.strength.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers())

    def row(self, i: int) -> Row:
        """Row i as zero-copy views into the batch's arrays."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Row(self.segment[a:b], self.target_column[a:b], self.target_feature[a:b], self.strength[a:b])

    def key(self, i: int) -> RowKey:
        return int(self.row_column[i]), int(self.row_feature[i])

    def __iter__(self) -> Iterator[tuple[RowKey, Row]]:
        for i in range(self.num_rows):
            yield self.key(i), self.row(i)

    def entry_source_column(self) -> U64:
        """Source column id of every entry (row_column repeated by row length)."""
        return np.repeat(self.row_column, np.diff(self.offsets))

    def entry_source_feature(self) -> U64:
        return np.repeat(self.row_feature, np.diff(self.offsets))

    def select_rows(self, mask: NDArray[np.bool_]) -> RowBatch:
        """The sub-batch of the rows where ``mask`` is true (e.g. the rows one owner holds)."""
        idx = np.flatnonzero(mask)
        lengths = (self.offsets[idx + 1] - self.offsets[idx]).astype(np.int64)
        offsets = np.zeros(idx.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if idx.shape[0] == 0:
            return RowBatch.empty()
        entry_idx = np.repeat(self.offsets[idx] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return RowBatch(
            self.row_column[idx], self.row_feature[idx], offsets,
            self.segment[entry_idx], self.target_column[entry_idx],
            self.target_feature[entry_idx], self.strength[entry_idx],
        )

    # -- bulk transfer --------------------------------------------------------------------------
    def copy(self) -> RowBatch:
        """A copy whose arrays are its own (e.g. no longer the transport's pooled receive buffers,
        for a batch kept after the request that carried it)."""
        return RowBatch(self.row_column.copy(), self.row_feature.copy(), self.offsets.copy(), self.segment.copy(),
                        self.target_column.copy(), self.target_feature.copy(), self.strength.copy())

    def buffers(self) -> list[NDArray[np.generic]]:
        """The seven arrays in wire order: send these as raw bulk buffers."""
        return [
            self.row_column, self.row_feature, self.offsets,
            self.segment, self.target_column, self.target_feature, self.strength,
        ]

    @classmethod
    def from_buffers(cls, buffers: Sequence[NDArray[np.generic]], validate: bool = True) -> RowBatch:
        """Rebuild a batch from the seven arrays of ``buffers()`` (checked unless told otherwise)."""
        if len(buffers) != 7:
            raise ValueError(f"a row batch has 7 buffers, got {len(buffers)}")
        _check_dtypes(buffers)
        batch = cls(*buffers)  # type: ignore[arg-type]
        if validate:
            batch.validate()
        return batch

    def validate(self) -> None:
        """Raise ValueError unless the batch is canonical (see the module docstring).

        The shapes here, the rest in one compiled pass over the entries (rowengine/canon.py
        ``batch_fault``: the numpy checks before it were ~15 whole-array passes with temporaries,
        3.7 ns per entry of a log replay's records and most of a small read's check)."""
        r, n = self.num_rows, self.num_entries
        _check_dtypes(self.buffers())
        if self.row_feature.shape[0] != r or self.offsets.shape[0] != r + 1:
            raise ValueError("row batch: row arrays disagree in length")
        if not (self.segment.shape[0] == self.target_column.shape[0] == self.target_feature.shape[0] == n):
            raise ValueError("row batch: entry arrays disagree in length")
        fault = batch_fault(self.row_column, self.row_feature, self.offsets, self.segment, self.target_column,
                            self.target_feature, self.strength, NUM_SEGMENTS)
        if fault == 2:
            raise ValueError(f"row batch: segment out of range (max {int(self.segment.max())})")
        if fault:
            raise ValueError(f"row batch: {BATCH_FAULTS[fault]}")


def _check_dtypes(buffers: Sequence[NDArray[np.generic]]) -> None:
    """Raise ValueError unless the seven arrays are 1-d of their dtypes (``_DTYPES``)."""
    for i, (buf, dt) in enumerate(zip(buffers, _DTYPES)):
        if buf.dtype != dt or buf.ndim != 1:
            raise ValueError(f"row batch buffer {i}: expected 1-d {np.dtype(dt)}, got {buf.ndim}-d {buf.dtype}")


def merge_rows(base: Row, delta: Row) -> Row:
    """``base + delta``: the sorted union of keys, strengths of equal keys added (the plain way)."""
    if len(delta) == 0:
        return base
    if len(base) == 0:
        return delta
    (seg, tc, tf), st = _sorted_unique_sum(
        [
            np.concatenate([base.segment, delta.segment]),
            np.concatenate([base.target_column, delta.target_column]),
            np.concatenate([base.target_feature, delta.target_feature]),
        ],
        np.concatenate([base.strength, delta.strength]),
    )
    return Row(seg.astype(np.uint8), tc.astype(np.uint64), tf.astype(np.uint64), st)
