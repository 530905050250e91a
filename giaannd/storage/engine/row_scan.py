"""Scan: one page of the column store's rows in key order, for the cluster-wide export.

Theory of operation
-------------------
An export (docs/replication.md "Scan") walks every row of the cluster in (column, feature) order,
one bounded page per request, resuming from a cursor. ``scan_page`` cuts one page from the store's
sorted key index (two arrays, ``ColumnStore._sorted_keys``) and its slots:

- the cursor is ``(after, after_entry)``: with ``after_entry == 0`` the page starts strictly after
  the row ``after`` (binary search on the sorted columns, then on that column's features); with
  ``after_entry > 0`` it starts *inside* the row ``after``, at that entry: the rest of a row that
  an earlier page cut (below);
- it looks at no more than ``max_examine`` keys, so a filter that rejects almost everything still
  answers in bounded time (``done`` False, the cursor moved on);
- of those, it keeps whole rows whose column the optional ``keep`` filter accepts (vectorised over
  the window), up to ``limit_rows`` rows, ``limit_entries`` entries and ``limit_bytes`` bytes of
  the page's arrays (``page_bytes``); stopped by a limit, the cursor is the last row taken;
- **a row bigger than a page is cut** (issue 14 item 5: no limit makes a row that exists
  unreadable): when the first row of a page does not fit it alone, the page is its first entries
  up to the limits and the cursor is ``(that row, entries sent)``; the next pages carry the rest,
  one piece each. Entries of a row are sorted, so every piece is a canonical one-row batch, and
  the pieces concatenated in cursor order are the row. Without ``limit_bytes`` (a client that
  predates cutting: it could not resume inside a row) the first row goes whole, alone, as before;
- the page is a copy (``regions.rows_of_regions``), safe to send while applies continue.

Cost: per row one dict lookup and one list slot (the regions live in a dict keyed by row key, so
some per-row work is unavoidable); everything per entry is vectorised: one concatenation of the
rows' regions and four gathers. The previous version made each row's four array views to learn its
length and sliced every region four times (2.5 µs a row; profile in tools/bench/export.py).

The index may be older than the slots (a key whose row was dropped is skipped). Rows added behind
the cursor during a scan are not seen by it; rows added ahead of it are (the store rebuilds its
index whenever the row count changed). A row that grows between the pieces of a cut is resumed at
the same entry offset, so its pieces may then repeat or miss entries of that growth: a scan is not
a snapshot (docs/replication.md "Scan"). Pure: no state of its own, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch, RowKey
from giaannd.protocol import SCAN_ROW_BYTES, scan_page_bytes
from giaannd.storage.engine.regions import ENTRY_BYTES, RowSlot, row_from_region

__all__ = ["ScanResult", "page_bytes", "scan_page"]

#: Keys filtered and looked up at a time: the per-row work stops soon after a limit is reached,
#: without a Python step per row to check it (a 4 MiB page of 17-entry rows is ~11,000 rows).
_LOOKUP_BLOCK = 1024


#: The bytes of a page's seven arrays (``RowBatch.nbytes``) of ``rows`` rows and ``entries``
#: (the protocol's count for ``ScanRows.max_bytes``).
page_bytes = scan_page_bytes


@dataclass(frozen=True, slots=True)
class ScanResult:
    """One page of ``ColumnStore.scan``: the rows, the cursor to resume after (``next_key``, and
    ``next_entry`` > 0 when the page ends inside that row), whether the end was reached, and how
    many keys were looked at (filtered out or not)."""

    batch: RowBatch
    next_key: RowKey | None
    done: bool
    examined: int
    next_entry: int = 0


def _piece(key: RowKey, region: NDArray[np.uint8], first: int, count: int) -> RowBatch:
    """Entries ``first .. first + count`` of one row as a one-row batch (a copy)."""
    row = row_from_region(region)
    sl = slice(first, first + count)
    return RowBatch(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64),
                    np.array([0, count], np.int64), row.segment[sl].copy(), row.target_column[sl].copy(),
                    row.target_feature[sl].copy(), row.strength[sl].copy())


def _entry_budget(limit_entries: int, limit_bytes: int | None) -> int:
    """The most entries one row may bring to an empty page."""
    if limit_bytes is None:
        return limit_entries
    return max(1, min(limit_entries, (limit_bytes - page_bytes(1, 0)) // ENTRY_BYTES))


def scan_page(slots: Mapping[RowKey, RowSlot], cols: NDArray[np.uint64], feats: NDArray[np.uint64],
              after: RowKey | None, limit_rows: int, limit_entries: int, max_examine: int,
              keep: Callable[[NDArray[np.uint64]], NDArray[np.bool_]] | None = None,
              limit_bytes: int | None = None, after_entry: int = 0) -> ScanResult:
    """One page of the rows in ``slots`` after the cursor (None: from the first row).

    Args:
        slots: the stored rows by key.
        cols, feats: every key of ``slots`` (possibly more), sorted by (column, feature).
        after: the cursor (``ScanResult.next_key`` of the previous page), or None.
        limit_rows, limit_entries: the page's bounds (at least one row, or piece of one, is
            always returned).
        max_examine: the most keys looked at.
        keep: which columns of a window of keys to return (all when None).
        limit_bytes: the page's bound in bytes (``page_bytes``); a row over it is cut. None:
            no byte bound, and a row over ``limit_entries`` goes whole, alone (not cut).
        after_entry: with ``after``, resume inside that row at this entry (``next_entry``).

    Raises:
        ValueError: a limit is below 1, or ``after_entry`` is negative or given without ``after``.
    """
    if limit_rows < 1 or limit_entries < 1 or max_examine < 1 or (limit_bytes is not None and limit_bytes < 1):
        raise ValueError("scan limits must be >= 1")
    if after_entry < 0 or (after_entry and after is None):
        raise ValueError("after_entry must be >= 0, and given with a cursor row")
    n = int(cols.shape[0])
    start = 0
    if after is not None:
        ac, af = np.uint64(after[0]), np.uint64(after[1])
        lo, hi = int(np.searchsorted(cols, ac, "left")), int(np.searchsorted(cols, ac, "right"))
        start = lo + int(np.searchsorted(feats[lo:hi], af, "right"))
        slot = slots.get(after) if after_entry else None
        if slot is not None and (keep is None or bool(keep(np.array([after[0]], np.uint64))[0])):
            return _rest_of_row(after, slot, after_entry, start, n, limit_entries, limit_bytes)
    end = min(start + max_examine, n)
    if start >= end:
        return ScanResult(RowBatch.empty(), after, True, 0)
    taken: list[NDArray[np.intp]] = []
    taken_sizes: list[NDArray[np.int64]] = []
    regions: list[NDArray[np.uint8]] = []
    rows = entries = 0
    last = end - 1  # the cursor: the last key looked at
    for b in range(start, end, _LOOKUP_BLOCK):  # the filter, too, only over what a page takes
        idx = np.arange(b, min(b + _LOOKUP_BLOCK, end))
        if keep is not None:
            idx = idx[keep(cols[idx])]
        # C loops (map), no bytecode per row: the per-row cost left is the memory each row touches
        found = list(map(slots.get, zip(cols[idx].tolist(), feats[idx].tolist())))
        if None in found:  # (an index entry of a dropped row: skipped)
            idx = idx[np.fromiter(map(_present, found), bool, len(found))]
            found = [slot for slot in found if slot is not None]
        block = list(map(_REGION, found))
        sizes = np.fromiter(map(len, block), np.int64, len(block)) // ENTRY_BYTES
        cum_entries = entries + np.cumsum(sizes)
        cum_rows = rows + np.arange(1, sizes.shape[0] + 1)
        fits = (cum_rows <= limit_rows) & (cum_entries <= limit_entries)
        if limit_bytes is not None:
            fits &= page_bytes(0, 0) + SCAN_ROW_BYTES * cum_rows + ENTRY_BYTES * cum_entries <= limit_bytes
        k = int(np.argmin(fits)) if not bool(fits.all()) else int(fits.shape[0])
        if k == 0 and rows == 0 and sizes.shape[0]:  # the first row alone is over a limit
            key = (int(cols[idx[0]]), int(feats[idx[0]]))
            if limit_bytes is None:  # a client that cannot resume inside a row: whole, alone
                return ScanResult(_whole(key, block[0]), key, int(idx[0]) + 1 >= n, int(idx[0]) + 1 - start)
            return _rest_of_row(key, RowSlot(block[0], None, 0), 0, int(idx[0]) + 1, n, limit_entries,
                                limit_bytes, examined=int(idx[0]) + 1 - start)
        taken.append(idx[:k])
        taken_sizes.append(sizes[:k])
        regions += block[:k]
        rows, entries = int(cum_rows[k - 1]) if k else rows, int(cum_entries[k - 1]) if k else entries
        if k < sizes.shape[0]:
            last = int(idx[k]) - 1  # stopped by a limit: resume after the row before this one
            break
    picked = np.concatenate(taken) if taken else np.empty(0, np.intp)
    next_key = (int(cols[last]), int(feats[last]))
    if not regions:
        return ScanResult(RowBatch.empty(), next_key, last + 1 >= n, last + 1 - start)
    sizes_taken = np.concatenate(taken_sizes)
    offsets = np.zeros(sizes_taken.shape[0] + 1, np.int64)
    np.cumsum(sizes_taken, out=offsets[1:])
    batch = RowBatch(cols[picked], feats[picked], offsets, *_fields(np.concatenate(regions), offsets, sizes_taken))
    return ScanResult(batch, next_key, last + 1 >= n, last + 1 - start)


_REGION = attrgetter("region")


def _present(slot: RowSlot | None) -> bool:
    return slot is not None


def _fields(raw: NDArray[np.uint8], offsets: NDArray[np.int64],
            lengths: NDArray[np.int64]) -> tuple[NDArray[np.uint8], NDArray[np.uint64], NDArray[np.uint64],
                                                 NDArray[np.float32]]:
    """The four entry arrays (segment, target_column, target_feature, strength) of regions laid end
    to end in ``raw`` (``regions.rows_of_regions``' gathers, with the lengths already known):
    entry e of a row of n entries starting at entry o is at byte 21 o + 8 (e - o) (its column),
    that + 8 n (feature), 21 o + 16 n + 4 (e - o) (strength), 21 o + 20 n + (e - o) (segment)."""
    total = int(offsets[-1])
    if total == 0:  # (rows without entries: the views below need 8 bytes)
        return np.empty(0, np.uint8), np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.float32)
    u64 = np.ndarray((raw.shape[0] - 7,), np.uint64, raw, 0, (1,))  # unaligned views: every byte offset
    f32 = np.ndarray((raw.shape[0] - 3,), np.float32, raw, 0, (1,))
    e = np.arange(total)
    o = np.repeat(offsets[:-1], lengths)
    n = np.repeat(lengths, lengths)
    at = 13 * o
    at += 8 * e
    column = u64[at]
    at += 8 * n
    feature = u64[at]
    at = 17 * o
    at += 16 * n
    at += 4 * e
    strength = f32[at]
    at = 20 * (o + n)
    at += e
    return raw[at], column, feature, strength


def _whole(key: RowKey, region: NDArray[np.uint8]) -> RowBatch:
    return _piece(key, region, 0, region.shape[0] // ENTRY_BYTES)


def _rest_of_row(key: RowKey, slot: RowSlot, first: int, next_index: int, n: int, limit_entries: int,
                 limit_bytes: int | None, examined: int = 0) -> ScanResult:
    """The page of one piece of the row ``key`` from entry ``first``: as much as the limits let
    through; the cursor stays inside the row until its last piece. ``next_index`` is the index
    position just after the row (to tell whether the scan is done)."""
    total = slot.region.shape[0] // ENTRY_BYTES
    count = min(total - first, _entry_budget(limit_entries, limit_bytes))
    if count <= 0:  # (the row shrank: only a drop does that, and then the slot is gone)
        return ScanResult(RowBatch.empty(), key, next_index >= n, examined)
    batch = _piece(key, slot.region, first, count)
    if first + count < total:
        return ScanResult(batch, key, False, examined, first + count)
    return ScanResult(batch, key, next_index >= n, examined)
