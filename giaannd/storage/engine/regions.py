"""The row *region* layout: one row's entries as ``ENTRY_BYTES * n`` bytes, and the vectorised ways
in and out of it.

Theory of operation
-------------------
Rows are stored field-major in the row engine (giaannd/rowengine: four arrays shared by many rows),
not one buffer per row. The region layout survives where bytes of single rows must stay what they
were before the switch (issue 14, phase 2):

- digests: ``row_digest.rows_digest`` hashes rows in this layout, so a stream between nodes of
  different versions still verifies; ``ColumnStore.row_region`` gives one row in it;
- snapshot format 1 (snapshot.py reads it by converting to field-major, ``unpack_regions``).

A region of n entries is laid out ``target_column u64[n] | target_feature u64[n] | strength f32[n]
| segment u8[n]``. Entry e (from 0) of a row whose region starts at byte s therefore has its column
at s + 8e, its feature at s + 8n + 8e, its strength at s + 16n + 4e and its segment at s + 20n + e:
regions back to back (row i at byte ``21 * offsets[i]``) are read and written by four gathers or
scatters over all entries, through views that see a u64 / f32 at *every* byte offset (numpy
handles the unaligned access). Pure; no store state, no I/O.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import Row

__all__ = ["ENTRY_BYTES", "new_region", "pack_regions", "row_from_region", "unpack_regions"]

#: Bytes per entry: u64 + u64 + f32 + u8, no padding.
ENTRY_BYTES = 21


def row_from_region(region: NDArray[np.uint8]) -> Row:
    """The four array views of one region (module docstring)."""
    if region.shape[0] % ENTRY_BYTES:
        raise ValueError(f"region of {region.shape[0]} bytes is not a whole number of entries")
    n = region.shape[0] // ENTRY_BYTES
    return Row(
        segment=region[20 * n : 21 * n],
        target_column=region[0 : 8 * n].view(np.uint64),
        target_feature=region[8 * n : 16 * n].view(np.uint64),
        strength=region[16 * n : 20 * n].view(np.float32),
    )


def new_region(n: int) -> tuple[NDArray[np.uint8], Row]:
    """An uninitialised region of ``n`` entries and its array views."""
    region = np.empty(ENTRY_BYTES * n, np.uint8)
    return region, row_from_region(region)


def _byte_at(offsets: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Per entry: the byte where its row's region starts, its row's length, its index in the row."""
    lengths = np.diff(offsets)
    first = np.repeat(offsets[:-1], lengths)
    return ENTRY_BYTES * first, np.repeat(lengths, lengths), np.arange(int(offsets[-1]), dtype=np.int64) - first


def pack_regions(offsets: NDArray[np.int64], rows: Row) -> NDArray[np.uint8]:
    """The rows (``rows`` concatenated, row i ``[offsets[i], offsets[i+1])``) as regions back to
    back: one buffer of ``ENTRY_BYTES * offsets[-1]`` bytes, four scatters."""
    total = int(offsets[-1])
    out = np.empty(ENTRY_BYTES * total, np.uint8)
    if total == 0:
        return out
    s, n, e = _byte_at(offsets)
    u64 = np.ndarray((out.shape[0] - 7,), np.uint64, out, 0, (1,))
    f32 = np.ndarray((out.shape[0] - 3,), np.float32, out, 0, (1,))
    at = s + 8 * e
    u64[at] = rows.target_column
    at += 8 * n
    u64[at] = rows.target_feature
    at = s + 16 * n + 4 * e
    f32[at] = rows.strength
    out[s + 20 * n + e] = rows.segment
    return out


def unpack_regions(raw: NDArray[np.uint8], offsets: NDArray[np.int64]) -> Row:
    """``pack_regions`` undone: the rows of regions laid back to back in ``raw`` (a copy)."""
    total = int(offsets[-1])
    if total == 0:
        return Row.empty()
    s, n, e = _byte_at(offsets)
    u64 = np.ndarray((raw.shape[0] - 7,), np.uint64, raw, 0, (1,))
    f32 = np.ndarray((raw.shape[0] - 3,), np.float32, raw, 0, (1,))
    at = s + 8 * e
    column = u64[at]
    at += 8 * n
    feature = u64[at]
    return Row(raw[s + 20 * n + e], column, feature, f32[s + 16 * n + 4 * e])
