"""Scan: one page of the column store's rows in key order, for the cluster-wide export.

Theory of operation
-------------------
An export (docs/replication.md "Scan") walks every row of the cluster in (column, feature) order,
one bounded page per request, resuming from a cursor. ``scan_page`` cuts one page from the store's
sorted key index (``ColumnStore._sorted_keys``: columns, features and row ids in key order), the
rows' lengths and a gather of rows by id (``RowEngine.gather``):

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
- the page is a copy (one ``gather`` of the rows taken), safe to send while applies continue.

Cost: no Python per row or entry: the limits are cumulative sums over blocks of the window's
lengths, the page one gather (before the row engine: a dict lookup and a region per row).

The index is rebuilt whenever the rows changed (count or drop). Rows added behind
the cursor during a scan are not seen by it; rows added ahead of it are (the store rebuilds its
index whenever the row count changed). A row that grows between the pieces of a cut is resumed at
the same entry offset, so its pieces may then repeat or miss entries of that growth: a scan is not
a snapshot (docs/replication.md "Scan"). Pure: no state of its own, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.protocol import SCAN_ROW_BYTES, scan_page_bytes
from giaannd.storage.engine.regions import ENTRY_BYTES

__all__ = ["ScanResult", "page_bytes", "scan_page"]

#: Keys filtered and measured at a time: the work stops soon after a limit is reached (a 4 MiB page
#: of 17-entry rows is ~11,000 rows).
_LOOKUP_BLOCK = 1024
#: Reads rows by id, in the order given: (offsets, the rows concatenated) (``RowEngine.gather``).
Gather = Callable[[NDArray[np.int64]], tuple[NDArray[np.int64], Row]]
#: Reads one row by id (views where the engine has them: ``RowEngine.read``).
#: entries ``[first, stop)`` of one row by id (a copy or views: ``_piece`` copies)
ReadOne = Callable[[int, int, int], Row]


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


def _entry_budget(limit_entries: int, limit_bytes: int | None) -> int:
    """The most entries one row may bring to an empty page."""
    if limit_bytes is None:
        return limit_entries
    return max(1, min(limit_entries, (limit_bytes - page_bytes(1, 0)) // ENTRY_BYTES))


def scan_page(cols: NDArray[np.uint64], feats: NDArray[np.uint64], ids: NDArray[np.int64],
              lengths: NDArray[np.int64], gather: Gather, read: ReadOne, after: RowKey | None, limit_rows: int,
              limit_entries: int, max_examine: int,
              keep: Callable[[NDArray[np.uint64]], NDArray[np.bool_]] | None = None,
              limit_bytes: int | None = None, after_entry: int = 0, more: bool = False) -> ScanResult:
    """One page of the rows after the cursor (None: from the first row).

    Args:
        cols, feats, ids: every stored row's key, sorted by (column, feature), and its row id;
            or a window of them that starts at the cursor's key or before it and holds at least
            ``max_examine`` keys after it unless it reaches the last key (``more`` False).
        lengths: entries per row, by row id.
        gather: reads rows by id (``Gather``); read: one row by id (``ReadOne``), for a row cut.
        after: the cursor (``ScanResult.next_key`` of the previous page), or None.
        limit_rows, limit_entries: the page's bounds (at least one row, or piece of one, is
            always returned).
        max_examine: the most keys looked at.
        keep: which columns of a window of keys to return (all when None).
        limit_bytes: the page's bound in bytes (``page_bytes``); a row over it is cut. None:
            no byte bound, and a row over ``limit_entries`` goes whole, alone (not cut).
        after_entry: with ``after``, resume inside that row at this entry (``next_entry``).
        more: keys follow the last of ``cols`` (a window: the page is never the last).

    Raises:
        ValueError: a limit is below 1, or ``after_entry`` is negative or given without ``after``.
    """
    if limit_rows < 1 or limit_entries < 1 or max_examine < 1 or (limit_bytes is not None and limit_bytes < 1):
        raise ValueError("scan limits must be >= 1")
    if after_entry < 0 or (after_entry and after is None):
        raise ValueError("after_entry must be >= 0, and given with a cursor row")
    n = int(cols.shape[0])
    last_index = n + 1 if more else n  # (an index >= it: the scan is done)
    start = 0
    if after is not None:
        ac, af = np.uint64(after[0]), np.uint64(after[1])
        lo, hi = int(np.searchsorted(cols, ac, "left")), int(np.searchsorted(cols, ac, "right"))
        start = lo + int(np.searchsorted(feats[lo:hi], af, "right"))
        held = start > lo and int(feats[start - 1]) == after[1]
        if after_entry and held and (keep is None or bool(keep(np.array([after[0]], np.uint64))[0])):
            return _rest_of_row(after, int(ids[start - 1]), lengths, read, after_entry, start, last_index,
                                limit_entries, limit_bytes)
    end = min(start + max_examine, n)
    if start >= end:
        return ScanResult(RowBatch.empty(), after, not more, 0)
    taken: list[NDArray[np.int64]] = []
    rows = entries = 0
    last = end - 1  # the cursor: the last key looked at
    for b in range(start, end, _LOOKUP_BLOCK):  # the filter, too, only over what a page takes
        idx = np.arange(b, min(b + _LOOKUP_BLOCK, end))
        if keep is not None:
            idx = idx[keep(cols[idx])]
        sizes = lengths[ids[idx]]
        cum_entries = entries + np.cumsum(sizes)
        cum_rows = rows + np.arange(1, sizes.shape[0] + 1)
        fits = (cum_rows <= limit_rows) & (cum_entries <= limit_entries)
        if limit_bytes is not None:
            fits &= page_bytes(0, 0) + SCAN_ROW_BYTES * cum_rows + ENTRY_BYTES * cum_entries <= limit_bytes
        k = int(np.argmin(fits)) if not bool(fits.all()) else int(fits.shape[0])
        if k == 0 and rows == 0 and sizes.shape[0]:  # the first row alone is over a limit
            key = (int(cols[idx[0]]), int(feats[idx[0]]))
            row_id = int(ids[idx[0]])
            if limit_bytes is None:  # a client that cannot resume inside a row: whole, alone
                batch = _piece(key, read(row_id, 0, int(lengths[row_id])))
                return ScanResult(batch, key, int(idx[0]) + 1 >= last_index, int(idx[0]) + 1 - start)
            return _rest_of_row(key, row_id, lengths, read, 0, int(idx[0]) + 1, last_index, limit_entries,
                                limit_bytes, examined=int(idx[0]) + 1 - start)
        taken.append(idx[:k])
        rows, entries = int(cum_rows[k - 1]) if k else rows, int(cum_entries[k - 1]) if k else entries
        if k < sizes.shape[0]:
            last = int(idx[k]) - 1  # stopped by a limit: resume after the row before this one
            break
    picked = np.concatenate(taken) if taken else np.empty(0, np.int64)
    next_key = (int(cols[last]), int(feats[last]))
    if picked.shape[0] == 0:
        return ScanResult(RowBatch.empty(), next_key, last + 1 >= last_index, last + 1 - start)
    offsets, got = gather(ids[picked])
    batch = RowBatch(cols[picked], feats[picked], offsets, got.segment, got.target_column, got.target_feature,
                     got.strength)
    return ScanResult(batch, next_key, last + 1 >= last_index, last + 1 - start)


def _piece(key: RowKey, part: Row) -> RowBatch:
    """Entries of one row (a piece ``read`` gave) as a one-row batch (a copy)."""
    return RowBatch(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64),
                    np.array([0, len(part)], np.int64), part.segment.copy(), part.target_column.copy(),
                    part.target_feature.copy(), part.strength.copy())


def _rest_of_row(key: RowKey, row_id: int, lengths: NDArray[np.int64], read: ReadOne, first: int,
                 next_index: int, n: int, limit_entries: int, limit_bytes: int | None,
                 examined: int = 0) -> ScanResult:
    """The page of one piece of the row ``key`` from entry ``first``: as much as the limits let
    through; the cursor stays inside the row until its last piece. ``next_index`` is the index
    position just after the row (to tell whether the scan is done)."""
    total = int(lengths[row_id])
    count = min(total - first, _entry_budget(limit_entries, limit_bytes))
    if count <= 0:  # (a cursor past the row's end: nothing left of it)
        return ScanResult(RowBatch.empty(), key, next_index >= n, examined)
    batch = _piece(key, read(row_id, first, first + count))  # (that piece only, not the row)
    if first + count < total:
        return ScanResult(batch, key, False, examined, first + count)
    return ScanResult(batch, key, next_index >= n, examined)
