"""Sorted merge-add of a delta row into a stored row, planned before anything is mutated.

Both rows are sorted by the entry key ``(segment, target_column, target_feature)`` (rows.py). The
plain way (``rows.merge_rows``) concatenates and ``lexsort``s: O((n+m) log(n+m)) with three keys.
Here, with n = stored entries and m = delta entries (m << n in steady training):

1. Pack the stored row's keys into 17-byte big-endian strings (one O(n) pass) and ``searchsorted``
   the delta's keys into them: O(m log n) byte-string comparisons, giving each delta entry's
   insertion position ``pos``. Big-endian bytes compare like the numbers, so byte order is exactly
   the lexicographic key order. (A structured array with native fields gives the same order, but
   numpy compares it field by field through a generic path: 3-6x slower, measured.)
2. ``found`` = delta entries whose key is already at ``pos``. If all are found (the common case once
   a column has seen its contexts) the merge is an in-place ``strength[pos] += delta``: no allocation.
3. Otherwise the k new entries are scattered into a fresh region of n + k entries: stored entry i
   goes to ``i + (number of new entries with pos <= i)``, new entry j to ``pos_j + j``; both index
   arrays come from one ``searchsorted`` each, so the whole merge is O(n + m log n) in a few calls.

An *append* (every delta key above the last stored key: the parts of a large row a stream sends
one after another, streaming/stream.py) is recognised from two entries and skips steps 1-3: the
merged row is the stored row followed by the delta, four slice copies at memcpy speed.

Plans are computed for every row of a batch first (that is where the new size, hence the memory
growth, becomes known), so a batch refused for capacity leaves the store untouched.

Whole batches at once (``plan_batch`` / ``merge_batch``)
---------------------------------------------------------
A training delta batch touches thousands of *small* rows (~20 entries, most of them new keys), so a
per-row plan + merge spends its time in ~15 numpy calls of Python overhead per row, not in the
merge itself (profiled: 30 µs per row, 3x the core's in-memory RowStore). The batch path does the
same three steps once over the concatenation of all touched rows, with the row's index in the
batch as the most significant key field (21-byte keys: row u32 | segment | column | feature, all
big-endian). Row boundaries then need no special case: a delta entry of row r can only land
between row r's stored entries, and the scatter formulas of step 3 hold globally. The result is
every merged row, concatenated; the caller cuts it into rows (column_store.py). Per row, only
what cannot be vectorised is left: the dict lookup, and for a growing row its new region. Delta
entries of rows not stored yet skip steps 1-2 (all new, nothing to search), and the stored entries
are placed in step 3 by a masked copy instead of a scatter.

The batch path copies each touched stored row two or three times more than the per-row path (the
concatenation, the merged rows, their regions), so for long stored rows the per-row path is faster;
the column store did so for its long rows before it moved to the row engine (issue 14 phase 2);
this module is kept for tools/bench/storage.py and its tests.

Strengths: a found entry is ``stored + delta`` in float32, exactly as ``add_in_place`` and
``merge_into`` compute it (and bit-equal to ``rows.merge_rows``, which adds two float32 values in
float64 and rounds once: the same correctly rounded sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import Row

__all__ = [
    "KEY_DTYPE",
    "MAX_PLAN_ROWS",
    "BatchPlan",
    "MergePlan",
    "add_in_place",
    "concat_rows",
    "merge_batch",
    "merge_into",
    "packed_keys",
    "plan_batch",
    "plan_merge",
]

#: Packed entry key: big-endian fields, so the 17 bytes of an entry compare (as a fixed-width byte
#: string) exactly like the key (segment, target_column, target_feature) compares numerically.
KEY_DTYPE = np.dtype([("segment", np.uint8), ("target_column", ">u8"), ("target_feature", ">u8")])
_KEY_BYTES = np.dtype("S17")
#: The batch planner's key: the row's index in the batch first, then the entry key (module docstring).
_ROW_KEY_DTYPE = np.dtype(
    [("row", ">u4"), ("segment", np.uint8), ("target_column", ">u8"), ("target_feature", ">u8")]
)
_ROW_KEY_BYTES = np.dtype("S21")
#: Most rows one batch plan may hold: the row index is packed in 4 bytes. Wire batches are far
#: smaller (protocol limits); this only guards the packing against silent wrap-around.
MAX_PLAN_ROWS = 2**32 - 1


def packed_keys(row: Row) -> NDArray[np.bytes_]:
    """The entry keys of ``row`` as 17-byte strings, ordered like the entry key (one O(n) pass)."""
    keys = np.empty(len(row), KEY_DTYPE)
    keys["segment"] = row.segment
    keys["target_column"] = row.target_column
    keys["target_feature"] = row.target_feature
    return keys.view(_KEY_BYTES)


@dataclass(frozen=True, slots=True)
class MergePlan:
    """Where each delta entry lands in the stored row.

    ``pos``: insertion position of each delta entry in the stored row; ``found``: whether that
    position already holds the same key; ``new_count``: delta entries that add a key.
    """

    pos: NDArray[np.intp]
    found: NDArray[np.bool_]
    new_count: int

    @property
    def in_place(self) -> bool:
        return self.new_count == 0


def _entry_key(row: Row, i: int) -> tuple[int, int, int]:
    """Entry ``i``'s key in canonical order: (segment, target_column, target_feature)."""
    return int(row.segment[i]), int(row.target_column[i]), int(row.target_feature[i])


def plan_merge(base: Row, delta: Row) -> MergePlan:
    """Plan ``base + delta`` (both canonical). Pure: reads its arguments, mutates nothing."""
    n, m = len(base), len(delta)
    if n == 0 or m == 0:
        return MergePlan(np.zeros(m, np.intp), np.zeros(m, bool), m)
    if _entry_key(delta, 0) > _entry_key(base, n - 1):  # an append (a stream's next part of a row):
        return MergePlan(np.full(m, n, np.intp), np.zeros(m, bool), m)  # no key packing, no search
    base_keys, delta_keys = packed_keys(base), packed_keys(delta)
    pos = np.searchsorted(base_keys, delta_keys, side="left")
    # pos == n means the key is above every stored key, so comparing with the last one is False.
    found = base_keys[np.minimum(pos, n - 1)] == delta_keys
    return MergePlan(pos, found, int(m - np.count_nonzero(found)))


def add_in_place(base: Row, delta: Row, plan: MergePlan) -> None:
    """Apply an ``in_place`` plan: ``base.strength[pos] += delta.strength`` (positions are unique)."""
    base.strength[plan.pos] += delta.strength


def merge_into(base: Row, delta: Row, plan: MergePlan, out: Row) -> None:
    """Write ``base + delta`` into ``out`` (length ``len(base) + plan.new_count``)."""
    n = len(base)
    m = len(delta)
    if m and plan.new_count == m and int(plan.pos[0]) == n:  # an append (pos is non-decreasing)
        for field in ("segment", "target_column", "target_feature", "strength"):
            dst = getattr(out, field)
            dst[:n] = getattr(base, field)
            dst[n:] = getattr(delta, field)
        return
    new_idx = np.flatnonzero(~plan.found)
    new_pos = plan.pos[new_idx]  # non-decreasing, since delta is sorted
    # Stored entry i moves right by the number of new entries inserted at or before it.
    base_dst = np.arange(n) + np.searchsorted(new_pos, np.arange(n), side="right")
    new_dst = new_pos + np.arange(new_idx.shape[0])
    for field in ("segment", "target_column", "target_feature", "strength"):
        dst = getattr(out, field)
        dst[base_dst] = getattr(base, field)
        dst[new_dst] = getattr(delta, field)[new_idx]
    old_idx = np.flatnonzero(plan.found)
    if old_idx.shape[0]:
        # A found entry sits where its stored twin moved to.
        twin_dst = base_dst[plan.pos[old_idx]]
        out.strength[twin_dst] += delta.strength[old_idx]


# -- whole batches ---------------------------------------------------------------------------------

I64 = NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Where every delta entry of a batch lands among the concatenated stored rows (module docstring).

    Row i of the plan is stored entries ``base[base_offsets[i]:base_offsets[i+1]]`` (a private copy)
    plus delta entries ``delta[delta_offsets[i]:delta_offsets[i+1]]`` (views of the caller's arrays).
    ``pos``: each delta entry's insertion position in ``base`` (global, not per row); ``found``:
    whether ``base`` holds the same key there; ``new_count``: per row, delta entries adding a key.
    """

    base_offsets: I64
    base: Row
    delta_offsets: I64
    delta: Row
    pos: NDArray[np.intp]
    found: NDArray[np.bool_]
    new_count: I64

    @property
    def num_rows(self) -> int:
        return int(self.new_count.shape[0])

    def local_pos(self) -> NDArray[np.intp]:
        """Each delta entry's position inside its own stored row (for an in-place add)."""
        return self.pos - np.repeat(self.base_offsets[:-1], np.diff(self.delta_offsets))


def _offsets(lengths: I64) -> I64:
    out = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def concat_rows(rows: Sequence[Row]) -> tuple[I64, Row]:
    """Rows as (offsets, their entries concatenated): the form ``plan_batch`` takes (a copy)."""
    offsets = _offsets(np.fromiter((len(r) for r in rows), np.int64, count=len(rows)))
    if not rows:
        return offsets, Row.empty()
    return offsets, Row(
        np.concatenate([r.segment for r in rows]),
        np.concatenate([r.target_column for r in rows]),
        np.concatenate([r.target_feature for r in rows]),
        np.concatenate([r.strength for r in rows]),
    )


def _packed_row_keys(row_ids: NDArray[np.uint32], row: Row) -> NDArray[np.bytes_]:
    keys = np.empty(len(row), _ROW_KEY_DTYPE)
    keys["row"] = row_ids
    keys["segment"] = row.segment
    keys["target_column"] = row.target_column
    keys["target_feature"] = row.target_feature
    return keys.view(_ROW_KEY_BYTES)


def plan_batch(base_offsets: I64, base: Row, delta_offsets: I64, delta: Row) -> BatchPlan:
    """Plan ``stored row i + delta row i`` for every i at once. Pure: mutates nothing.

    Args:
        base_offsets, base: the stored rows, concatenated (``concat_rows``; each row canonical, an
            empty one for a row not stored yet). The plan keeps ``base``: pass a private copy.
        delta_offsets, delta: the delta rows, concatenated the same way (each row canonical).
    """
    r = int(base_offsets.shape[0]) - 1
    if r > MAX_PLAN_ROWS:
        raise ValueError(f"{r} rows in one merge plan; at most {MAX_PLAN_ROWS}")
    for offsets, rows in ((base_offsets, base), (delta_offsets, delta)):
        if offsets.shape[0] != r + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != len(rows):
            raise ValueError("offsets do not partition the entries over the rows")
    base_len = np.diff(base_offsets)
    delta_len = np.diff(delta_offsets)
    n = int(base_offsets[-1])
    # A row not stored yet needs no search: each of its delta entries is new, inserted at the
    # row's (empty) range in ``base``. Only the delta entries of stored rows are packed and searched
    # (early in training that is a minority).
    pos = np.repeat(base_offsets[:-1], delta_len).astype(np.intp)
    found = np.zeros(len(delta), np.bool_)
    if n:
        row_ids = np.arange(r, dtype=np.uint32)
        stored = np.repeat(base_len > 0, delta_len)
        searched = np.flatnonzero(stored)
        base_keys = _packed_row_keys(np.repeat(row_ids, base_len), base)
        delta_keys = _packed_row_keys(
            np.repeat(row_ids, delta_len)[searched], _take(delta, searched) if searched.shape[0] < len(delta) else delta
        )
        at = np.searchsorted(base_keys, delta_keys, side="left")
        # at == n: the key is above every stored key, so comparing with the last one is False
        found[searched] = base_keys[np.minimum(at, n - 1)] == delta_keys
        pos[searched] = at
    new_before = _offsets((~found).astype(np.int64))
    new_count = new_before[delta_offsets[1:]] - new_before[delta_offsets[:-1]]
    return BatchPlan(base_offsets, base, delta_offsets, delta, pos, found, new_count)


def _take(row: Row, mask: NDArray[np.bool_] | NDArray[np.intp]) -> Row:
    return Row(row.segment[mask], row.target_column[mask], row.target_feature[mask], row.strength[mask])


def merge_batch(plan: BatchPlan, rows: NDArray[np.bool_] | None = None) -> tuple[I64, Row]:
    """The merged rows (all, or those where ``rows`` is True), concatenated, with their offsets.

    ``merge_into``'s formulas, applied globally: new entry j goes to ``pos_j + j``; the stored
    entries fill the remaining slots in order (stored entry i moves right by the number of new
    entries inserted at or before it); a found entry adds its strength to where its twin went.
    """
    base, delta, pos, found = plan.base, plan.delta, plan.pos, plan.found
    base_offsets, new_count = plan.base_offsets, plan.new_count
    if rows is not None:
        base_len = np.diff(base_offsets)
        base_mask = np.repeat(rows, base_len)
        delta_mask = np.repeat(rows, np.diff(plan.delta_offsets))
        # a kept row's delta positions shift left by the stored entries of dropped rows before it
        dropped_before = _offsets((~base_mask).astype(np.int64))
        pos = pos[delta_mask]
        pos = pos - dropped_before[pos]
        found = found[delta_mask]
        base, delta = _take(base, base_mask), _take(delta, delta_mask)
        base_offsets, new_count = _offsets(base_len[rows]), new_count[rows]
    n = len(base)
    new_idx = np.flatnonzero(~found)
    new_pos = pos[new_idx]  # non-decreasing: delta is sorted by (row, entry key)
    k = int(new_idx.shape[0])
    new_dst = new_pos + np.arange(k)
    # stored entries fill the other slots in order: a masked copy, cheaper than a scatter
    stored_slot = np.ones(n + k, np.bool_)
    stored_slot[new_dst] = False
    out = Row(np.empty(n + k, np.uint8), np.empty(n + k, np.uint64), np.empty(n + k, np.uint64),
              np.empty(n + k, np.float32))
    for field in ("segment", "target_column", "target_feature", "strength"):
        dst = getattr(out, field)
        dst[stored_slot] = getattr(base, field)
        dst[new_dst] = getattr(delta, field)[new_idx]
    old_idx = np.flatnonzero(found)
    if old_idx.shape[0]:
        twin = pos[old_idx]
        # stored entry i moved right by the number of new entries inserted at or before it
        out.strength[twin + np.searchsorted(new_pos, twin, side="right")] += delta.strength[old_idx]
    return base_offsets + _offsets(new_count), out
