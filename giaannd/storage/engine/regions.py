"""Row regions: the byte layout of one stored row, and the vectorised ways in and out of it.

Theory of operation
-------------------
The column store (column_store.py) keeps each (column, feature) row in its own ``uint8`` region of
``ENTRY_BYTES * n`` bytes, laid out ``target_column u64[n] | target_feature u64[n] | strength f32[n]
| segment u8[n]`` (widest first, so every view is naturally aligned). One region = one contiguous
buffer to send for an inference read of that row and one ``readinto`` when a snapshot is loaded
(snapshot.py writes the regions back to back in this layout).

This module owns that layout, and is the only place that computes byte offsets into a region:

- ``row_from_region`` / ``new_region``: the four array views of one region (views, not copies).
- ``RowSlot``: a stored row (its region, the number of applied batches that touched it, its views
  made on first use).
- ``rows_of_regions``: many regions -> one concatenated ``Row`` (a copy) with offsets, the input
  of ``row_merge.plan_batch``; one concatenation and four gathers, no per-row views.
- ``cut_regions``: one concatenated ``Row`` with offsets -> one region per row (the merge path's
  output, and the install path's short rows); four scatters into a staging buffer, then one slice
  copy per row, so no two regions share (and keep alive) a buffer.
- ``install_regions``: the rows of a canonical batch laid out as regions straight from its arrays
  (a row not stored yet merges to its delta): long rows one byte concatenation each, short ones
  through ``cut_regions``. The same bytes either way (tests compare them).
- ``gather_rows``: regions -> one ``RowBatch`` (a copy), one concatenation of byte slices per field.
- ``region_part``: entries ``[offset, offset + limit)`` of one region as views (a part of a large
  row read in chunks, protocol ``ReadRowPart``; why views are safe: its docstring).

Everything here is pure (no store state, no I/O); the functions never keep references to their
inputs' buffers in what they return, except the views ``row_from_region`` and ``region_part`` make.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import Row, RowBatch, RowKey

__all__ = [
    "EMPTY_REGION",
    "ENTRY_BYTES",
    "RowSlot",
    "cut_regions",
    "gather_rows",
    "install_regions",
    "new_region",
    "region_part",
    "row_from_region",
    "rows_of_regions",
]

#: Bytes per entry in a region: u64 + u64 + f32 + u8, no padding.
ENTRY_BYTES = 21
#: The region of a row that is not stored (zero entries); shared, never written.
EMPTY_REGION = np.empty(0, np.uint8)


def row_from_region(region: NDArray[np.uint8]) -> Row:
    """The four array views of a region (see the module docstring for the layout)."""
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


class RowSlot:
    """A stored row: its region, the number of applied batches that touched it, and its array views.

    The views are made on first use of ``row`` (and then kept): a training batch replaces thousands
    of regions of which few are read before the next batch replaces them again, and making the four
    views costs more than copying a small region.
    """

    __slots__ = ("_row", "region", "touches")

    def __init__(self, region: NDArray[np.uint8], row: Row | None, touches: int) -> None:
        self.region = region
        self._row = row
        self.touches = touches

    @property
    def row(self) -> Row:
        if self._row is None:
            self._row = row_from_region(self.region)
        return self._row


def rows_of_regions(regions: list[NDArray[np.uint8]]) -> tuple[NDArray[np.int64], Row]:
    """The rows of ``regions``, concatenated (a copy), with their offsets: ``plan_batch``'s input.

    One concatenation of the raw regions, then four gathers over all entries, through views that
    see a u64 / f32 at *every* byte offset (strides of 1 byte: unaligned reads, which numpy handles)
    — cheaper than making each row's four array views first.
    """
    lengths = np.fromiter((r.shape[0] for r in regions), np.int64, count=len(regions)) // ENTRY_BYTES
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not regions or offsets[-1] == 0:
        return offsets, Row.empty()
    raw = np.concatenate(regions)
    u64 = np.ndarray((raw.shape[0] - 7,), np.uint64, raw, 0, (1,))
    f32 = np.ndarray((raw.shape[0] - 3,), np.float32, raw, 0, (1,))
    e = np.arange(int(offsets[-1]))
    o = np.repeat(offsets[:-1], lengths)  # entry e of a row at offset o, length n, is entry e - o of
    n = np.repeat(lengths, lengths)  # a region starting at byte 21 o (layout: module docstring)
    at_column = 8 * e + 13 * o
    return offsets, Row(
        raw[e + 20 * (o + n)], u64[at_column], u64[at_column + 8 * n], f32[4 * e + 17 * o + 16 * n]
    )


def cut_regions(offsets: NDArray[np.int64], rows: Row, share: bool = False) -> list[NDArray[np.uint8]]:
    """One region per row of the concatenated ``rows`` (layout: module docstring).

    ``share``: the regions are views of the one staging buffer instead of copies (restart's log
    replay, ``storage.snapshot-load-copy-rows`` false): no copy per row, but the buffer lives as
    long as any of them.

    The rows are first laid out as regions in one staging buffer, each starting 8-byte aligned, by
    four scatters over all entries; then each region is one slice copy, so rows never share (and
    keep alive) a buffer, and the per-row Python work is a single call. Entry e of a row starting
    at entry o, n long, whose region starts at byte s, goes to u64 index s/8 + (e - o) (column),
    that + n (feature), f32 index s/4 + 4n + (e - o) (strength) and byte s + 20n + (e - o)
    (segment): one per-row shift repeated over the row's entries, plus e, per field.
    """
    lengths = np.diff(offsets)
    span = (ENTRY_BYTES * lengths + 7) // 8 * 8
    start = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(span, out=start[1:])
    stage = np.empty(int(start[-1]), np.uint8)
    e = np.arange(len(rows))
    s, first = start[:-1], offsets[:-1]
    u64 = stage.view(np.uint64)
    at = np.repeat(s // 8 - first, lengths)
    at += e
    u64[at] = rows.target_column
    at += np.repeat(lengths, lengths)
    u64[at] = rows.target_feature
    at = np.repeat(s // 4 + 4 * lengths - first, lengths)
    at += e
    stage.view(np.float32)[at] = rows.strength
    at = np.repeat(s + 20 * lengths - first, lengths)
    at += e
    stage[at] = rows.segment
    ends = (start[:-1] + ENTRY_BYTES * lengths).tolist()
    views = map(stage.__getitem__, map(slice, start[:-1].tolist(), ends))
    return list(views) if share else list(map(np.ndarray.copy, views))


def install_regions(batch: RowBatch, concat_entries: int, share: bool = False) -> list[NDArray[np.uint8]]:
    """One region per row of ``batch`` (every row non-empty and canonical): the rows as they are,
    since a row not stored yet merges to its delta. Rows of at least ``concat_entries`` entries are
    one byte concatenation each, shorter ones one vectorised scatter (``cut_regions``); the result
    is the same bytes (the threshold only moves the cost: column_store.INSTALL_CONCAT_ENTRIES).
    ``share``: as for ``cut_regions``."""
    offsets = batch.offsets
    lengths = np.diff(offsets)
    long_rows = lengths >= concat_entries
    if not long_rows.any():
        return cut_regions(offsets, Row(batch.segment, batch.target_column, batch.target_feature,
                                        batch.strength), share)
    out: list[NDArray[np.uint8]] = [EMPTY_REGION] * int(lengths.shape[0])
    # byte views of the four fields (native, contiguous: a no-op for arrays off the wire)
    col = np.ascontiguousarray(batch.target_column, np.uint64).view(np.uint8)
    feat = np.ascontiguousarray(batch.target_feature, np.uint64).view(np.uint8)
    strength = np.ascontiguousarray(batch.strength, np.float32).view(np.uint8)
    seg = np.ascontiguousarray(batch.segment, np.uint8)
    cat = np.concatenate
    idx = np.flatnonzero(long_rows)
    for i, a, z in zip(idx.tolist(), offsets[idx].tolist(), offsets[idx + 1].tolist()):
        out[i] = cat((col[8 * a : 8 * z], feat[8 * a : 8 * z], strength[4 * a : 4 * z], seg[a:z]))
    if not long_rows.all():
        short = batch.select_rows(~long_rows)
        regions = cut_regions(short.offsets, Row(short.segment, short.target_column, short.target_feature,
                                                 short.strength), share)
        for i, region in zip(np.flatnonzero(~long_rows).tolist(), regions):
            out[i] = region
    return out


def gather_rows(keys: list[RowKey], regions: list[NDArray[np.uint8]]) -> RowBatch:
    """The rows ``keys`` (canonical order, the caller's) stored in ``regions`` as one batch (a copy):
    per field, one concatenation of the regions' byte slices (no per-row array views are made: most
    rows are never read one at a time)."""
    if not keys:
        return RowBatch.empty()
    ns = [r.shape[0] // ENTRY_BYTES for r in regions]
    offsets = np.zeros(len(regions) + 1, np.int64)
    np.cumsum(ns, out=offsets[1:])
    cat = np.concatenate
    return RowBatch(
        np.fromiter((k[0] for k in keys), np.uint64, len(keys)),
        np.fromiter((k[1] for k in keys), np.uint64, len(keys)),
        offsets,
        cat([r[20 * n :] for r, n in zip(regions, ns)]),
        cat([r[: 8 * n] for r, n in zip(regions, ns)]).view(np.uint64),
        cat([r[8 * n : 16 * n] for r, n in zip(regions, ns)]).view(np.uint64),
        cat([r[16 * n : 20 * n] for r, n in zip(regions, ns)]).view(np.float32),
    )


def region_part(region: NDArray[np.uint8], offset: int, limit: int) -> Row:
    """Entries ``[offset, offset + limit)`` of ``region`` (clipped to the row) as four *views*.

    Views, not copies, so serving a part of a large row costs no memory and no copy on the node:
    the transport sends them after the handler returns (uvloop's writev keeps references), and an
    in-place merge-add may change strengths of a part still waiting in the socket's queue. That is
    safe because every such change bumps the row's ``touches``, and a reader accepts a row only if a
    version check made *after* it received every part still reports the version the parts did
    (giaannd/client/row_parts.py, "No torn rows"): bytes handed to the kernel after a change mean
    the change happened before that check was served. A growing merge replaces the region: the old
    one, unchanged, lives on while its views are queued."""
    n = region.shape[0] // ENTRY_BYTES
    a = min(max(offset, 0), n)
    b = min(a + max(limit, 0), n)
    return Row(
        segment=region[20 * n + a : 20 * n + b],
        target_column=region[8 * a : 8 * b].view(np.uint64),
        target_feature=region[8 * (n + a) : 8 * (n + b)].view(np.uint64),
        strength=region[16 * n + 4 * a : 16 * n + 4 * b].view(np.float32),
    )
