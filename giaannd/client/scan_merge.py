"""The k-way merge of a cluster scan: several page streams, each in key order, into one.

Theory of operation
-------------------
A cluster scan (scan.py) reads every node's share of the rows as a stream of pages, each stream
in (column, feature) order; an export must write the rows in global key order without holding
the model. ``PageMerge`` is the sans-IO core (STYLE.md item 1) that merges the streams one *page*
at a time, never one row at a time:

- it holds at most one page per stream (what is left of the last page fed);
- ``wanted()`` names the streams whose page is used up and that are not finished: each must be
  fed (``feed``) before anything more can come out, because its next row could be smaller than
  any row held;
- ``pop()`` returns every held row with a key <= the *frontier*, the smallest last key of the
  unfinished streams' pages (rows above it could still be preceded by rows of the stream that
  set it), as one canonical batch: one binary search per stream, one ``lexsort`` over the rows
  taken, four gathers over their entries. The stream that set the frontier is then used up.

Each call takes O(held rows) vectorised work, and the rows out are those held: so an export of
any size holds at most (streams x page) bytes plus one output batch.

**Duplicates** — the scan's ownership filter (``scan_chain_mask``) gives every row to exactly one
stream, and the client drops rows outside a stream's share before they get here, so the streams
are disjoint by construction. A key held by two streams at once is merged anyway by today's rule
(the row of the stream that comes first in ``PageMerge``'s order: the scan passes the node that is
the first live owner before failover streams), and counted in ``duplicates``; it is never summed.

**Pieces** — a stream's page may end inside a row (a row bigger than a page is cut by storage,
row_scan.py); the next page of that stream starts with the rest of the row under the same key. The
frontier rule outputs the first piece, and the rest comes out with a later ``pop``: consecutive
batches may therefore share their first and last key, whose entries, concatenated, are the row.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch

__all__ = ["PageMerge", "rows_upto", "take_rows"]


def rows_upto(batch: RowBatch, column: int, feature: int) -> int:
    """How many of ``batch``'s rows (sorted) have a key <= (column, feature)."""
    cols = batch.row_column
    c = np.uint64(column)
    lo, hi = int(np.searchsorted(cols, c, "left")), int(np.searchsorted(cols, c, "right"))
    return lo + int(np.searchsorted(batch.row_feature[lo:hi], np.uint64(feature), "right"))


def take_rows(batch: RowBatch, idx: NDArray[np.intp]) -> RowBatch:
    """The rows ``idx`` of ``batch`` in that order (a copy): one gather per array."""
    starts = batch.offsets[idx]
    lengths = batch.offsets[idx + 1] - starts
    offsets = np.zeros(idx.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    entry = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
    return RowBatch(batch.row_column[idx], batch.row_feature[idx], offsets, batch.segment[entry],
                    batch.target_column[entry], batch.target_feature[entry], batch.strength[entry])


def _head(batch: RowBatch, rows: int) -> tuple[RowBatch, RowBatch]:
    """``batch`` split after its first ``rows`` rows (views, no copy)."""
    o = batch.offsets
    e = int(o[rows])
    head = RowBatch(batch.row_column[:rows], batch.row_feature[:rows], o[: rows + 1], batch.segment[:e],
                    batch.target_column[:e], batch.target_feature[:e], batch.strength[:e])
    tail = RowBatch(batch.row_column[rows:], batch.row_feature[rows:], o[rows:] - e, batch.segment[e:],
                    batch.target_column[e:], batch.target_feature[e:], batch.strength[e:])
    return head, tail


class PageMerge:
    """Merges ``streams`` page streams, each in key order (module docstring).

    Args:
        streams: how many; stream i wins a duplicate key over stream j > i.
    """

    def __init__(self, streams: int) -> None:
        self._held: list[RowBatch | None] = [None] * streams
        self._finished = [False] * streams
        #: rows dropped because an earlier stream held the same key (should stay 0)
        self.duplicates = 0

    def wanted(self) -> list[int]:
        """The streams that must be fed before ``pop`` can return more rows."""
        return [i for i, (h, f) in enumerate(zip(self._held, self._finished)) if h is None and not f]

    @property
    def done(self) -> bool:
        """Every stream finished and every row returned."""
        return all(self._finished) and all(h is None for h in self._held)

    def feed(self, stream: int, page: RowBatch | None) -> None:
        """The next page of ``stream`` (sorted, canonical), or None: the stream has finished.

        Raises:
            ValueError: the stream still holds rows, or has finished.
        """
        if self._held[stream] is not None or self._finished[stream]:
            raise ValueError(f"scan merge: stream {stream} fed while it holds rows or has finished")
        if page is None:
            self._finished[stream] = True
        elif page.num_rows:
            self._held[stream] = page

    def pop(self) -> RowBatch | None:
        """Every held row every stream is past, merged (module docstring); None when a stream
        must be fed first (``wanted``) or nothing is held."""
        if self.wanted():
            return None
        held = [(i, h) for i, h in enumerate(self._held) if h is not None]
        if not held:
            return None
        lasts = [(int(h.row_column[-1]), int(h.row_feature[-1])) for i, h in held if not self._finished[i]]
        frontier = min(lasts) if lasts else None
        parts: list[tuple[int, RowBatch]] = []
        for i, h in held:
            n = h.num_rows if frontier is None else rows_upto(h, *frontier)
            if n == 0:
                continue
            head, tail = _head(h, n)
            self._held[i] = tail if tail.num_rows else None
            parts.append((i, head))
        if len(parts) == 1:
            return parts[0][1]
        return self._combine(parts)

    def _combine(self, parts: list[tuple[int, RowBatch]]) -> RowBatch:
        """The rows of several sorted batches in key order, the first stream's row kept where two
        hold one key."""
        rc = np.concatenate([b.row_column for _, b in parts])
        rf = np.concatenate([b.row_feature for _, b in parts])
        rank = np.concatenate([np.full(b.num_rows, i, np.int64) for i, b in parts])
        order = np.lexsort((rank, rf, rc))
        src, sfe = rc[order], rf[order]
        keep = np.ones(order.shape[0], bool)
        keep[1:] = (src[1:] != src[:-1]) | (sfe[1:] != sfe[:-1])
        dropped = int(order.shape[0] - int(keep.sum()))
        if dropped:
            self.duplicates += dropped
            order = order[keep]
        lengths = np.concatenate([np.diff(b.offsets) for _, b in parts])
        starts = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        whole = RowBatch(rc, rf, starts, np.concatenate([b.segment for _, b in parts]),
                         np.concatenate([b.target_column for _, b in parts]),
                         np.concatenate([b.target_feature for _, b in parts]),
                         np.concatenate([b.strength for _, b in parts]))
        return take_rows(whole, order)
