"""The storage scan page as it was before issue 14 item 7: the export benchmark's baseline.

A frozen copy of ``giaannd/storage/engine/row_scan.py`` at b704720 (its ``scan_page``), kept so that
tools/bench/export.py measures the vectorised page against the per-row one in the same run, on the
same store. Not used by the daemon. Its original description follows.

Scan: one page of the column store's rows in key order, for the cluster-wide export.

Theory of operation
-------------------
An export (docs/replication.md "Scan") walks every row of the cluster in (column, feature) order,
one bounded page per request, resuming from a cursor: the last key looked at. ``scan_page`` cuts
one page from the store's sorted key index (two arrays, ``ColumnStore._sorted_keys``) and its
slots:

- it starts strictly after the cursor (binary search on the sorted columns, then on that
  column's features) and looks at no more than ``max_examine`` keys, so a filter that rejects
  almost everything still answers in bounded time (``done`` False, the cursor moved on);
- of those, it keeps rows whose column the optional ``keep`` filter accepts (vectorised over the
  window), up to ``limit_rows`` rows and ``limit_entries`` entries, but always at least one row,
  so a huge row cannot stall a scan; stopped by a limit, the cursor is the last row taken;
- the page is a copy (``gather_rows``), safe to send while applies continue.

The index may be older than the slots (a key whose row was dropped is skipped). Rows added behind
the cursor during a scan are not seen by it; rows added ahead of it are (the store rebuilds its
index whenever the row count changed). Pure: no state of its own, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch, RowKey

__all__ = ["RowSlot", "ScanResult", "scan_page"]

ENTRY_BYTES = 21


class RowSlot:
    """A stored row of the dict-of-regions store (before the row engine): its region."""

    __slots__ = ("region", "touches")

    def __init__(self, region: NDArray[np.uint8], touches: int = 1) -> None:
        self.region, self.touches = region, touches


def gather_rows(keys: list[RowKey], regions: list[NDArray[np.uint8]]) -> RowBatch:
    """The rows ``keys`` stored in ``regions`` as one batch (a copy; the old regions.gather_rows)."""
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


@dataclass(frozen=True, slots=True)
class ScanResult:
    """One page of ``ColumnStore.scan``: the rows, the cursor to resume after, whether the end was
    reached, and how many keys were looked at (filtered out or not)."""

    batch: RowBatch
    next_key: RowKey | None
    done: bool
    examined: int


def scan_page(slots: Mapping[RowKey, RowSlot], cols: NDArray[np.uint64], feats: NDArray[np.uint64],
              after: RowKey | None, limit_rows: int, limit_entries: int, max_examine: int,
              keep: Callable[[NDArray[np.uint64]], NDArray[np.bool_]] | None = None) -> ScanResult:
    """One page of the rows in ``slots`` strictly after ``after`` (None: from the first row).

    Args:
        slots: the stored rows by key.
        cols, feats: every key of ``slots`` (possibly more), sorted by (column, feature).
        after: the cursor (``ScanResult.next_key`` of the previous page), or None.
        limit_rows, limit_entries: the page's bounds (at least one row is always returned).
        max_examine: the most keys looked at.
        keep: which columns of a window of keys to return (all when None).

    Raises:
        ValueError: a limit is below 1.
    """
    if limit_rows < 1 or limit_entries < 1 or max_examine < 1:
        raise ValueError("scan limits must be >= 1")
    n = int(cols.shape[0])
    start = 0
    if after is not None:
        ac, af = np.uint64(after[0]), np.uint64(after[1])
        lo, hi = int(np.searchsorted(cols, ac, "left")), int(np.searchsorted(cols, ac, "right"))
        start = lo + int(np.searchsorted(feats[lo:hi], af, "right"))
    end = min(start + max_examine, n)
    if start >= end:
        return ScanResult(RowBatch.empty(), after, True, 0)
    window_c = cols[start:end]
    sel = np.arange(start, end) if keep is None else start + np.flatnonzero(keep(window_c))
    picked: list[RowKey] = []
    regions: list[NDArray[np.uint8]] = []
    entries = 0
    last = end - 1  # the cursor: the last key looked at
    for pos, i in enumerate(sel.tolist()):
        key = (int(cols[i]), int(feats[i]))
        slot = slots.get(key)
        if slot is None:  # (an index entry for a row that no longer exists)
            continue
        size = slot.region.shape[0] // ENTRY_BYTES
        if len(picked) >= limit_rows or (picked and entries + size > limit_entries):
            last = int(sel[pos - 1])  # stopped by a limit: resume after the row before this one
            break
        picked.append(key)
        regions.append(slot.region)
        entries += size
    next_key = (int(cols[last]), int(feats[last]))
    return ScanResult(gather_rows(picked, regions), next_key, last + 1 >= n, last + 1 - start)
