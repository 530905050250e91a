"""Compiled search of entry keys inside per-query ranges (jit.py's kernels).

An entry key is ``(segment u8, target_column u64, target_feature u64)``, compared lexicographically
(the canonical entry order of giaannd/model/rows.py). The engine keeps each row's entries contiguous
and sorted, so finding where a delta entry of row r belongs is a search inside r's range, not over
all entries: ``lower_bound`` and ``find`` run one such search for every query, in one compiled loop
(``_search``) that reads the entry arrays in place.

How a query is searched: a query whose range differs from the query before it, or whose key is
smaller than that query's, gets a plain binary search of its range (~log2 n comparisons). A query
that shares the range of the query before it and has a key at least as large (a canonical batch's
entries of one row, which arrive ascending) *gallops* from that query's answer when the range's
queries are dense in it (at least one per ``GALLOP_GAP`` entries): it probes 1, 2, 4, ... entries
further until it passes its key, then bisects the last step, ~2·log2(distance) comparisons instead
of log2(row length). A row occurrence that adds to every key of its row (a training-like log) costs
two comparisons per entry after the first; sparse queries into a big row (a Zipf stream's head rows
gain a few hundred of 10^5 keys per batch) bisect the whole row, whose first probes all of them
share (cached). No hint or label is needed: the ranges and keys say when a gallop is valid, and it
gives the answer a binary search gives (the lower bound is unique), so the result never depends on
the order of the queries. ``find_in_gaps`` is the delta runs' search: each query's range narrowed
to the bucket of its base position first (posindex.py), then bisected, in the same pass.

Why compiled: in numpy every binary-search step was a *round* of ~15 whole-array operations over
the queries still searching, and that per-round overhead, not cache misses, was the cost
(docs/model.md, "Rows at scale"). Why not ``np.searchsorted``: it needs one key dtype and one global
order; packing the key into bytes costs 17-21 bytes per stored entry or O(row) work per search.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly

__all__ = ["find", "find_in_gaps", "lower_bound"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
Bools = NDArray[np.bool_]


_KEYS = f"{readonly('uint8')}, {readonly('uint64')}, {readonly('uint64')}"


@kernel(f"boolean({_KEYS}, int64, uint8, uint64, uint64)")
def _less(seg: U8, tc: U64, tf: U64, j: int, s: int, c: int, f: int) -> bool:
    """Whether entry ``j``'s key is smaller than ``(s, c, f)``."""
    ms = seg[j]
    if ms != s:
        return bool(ms < s)
    mc = tc[j]
    if mc != c:
        return bool(mc < c)
    return bool(tf[j] < f)


@kernel(f"int64({_KEYS}, int64, int64, uint8, uint64, uint64)")
def _bisect(seg: U8, tc: U64, tf: U64, a: int, b: int, s: int, c: int, f: int) -> int:
    """The first index in ``[a, b)`` whose key is not smaller than ``(s, c, f)`` (``b`` if none)."""
    m = b - a
    while m > 0:
        half = m >> 1
        j = a + half
        if _less(seg, tc, tf, j, s, c, f):
            a = j + 1
            m -= half + 1
        else:
            m = half
    return a


#: A range's queries gallop when they are at least one per GALLOP_GAP entries of it, else each
#: bisects the whole range: a gallop costs ~2·log2(gap) comparisons, each waiting on the one before
#: (and the next query waits on its answer), where bisections share their first, cached probes. Per
#: query, sorted queries into one range of 2·10^7 keys (same run): 1006 vs 840 ns at a gap of
#: 20,000 entries, 637 vs 558 at 667, 171 vs 392 at 67.
GALLOP_GAP = 256


@kernel(f"void({_KEYS}, {readonly('int64')}, {readonly('int64')}, {_KEYS}, int64[::1], boolean[::1])")
def _search(seg: U8, tc: U64, tf: U64, lo: I64, hi: I64, qs: U8, qc: U64, qf: U64, out: I64, found: Bools) -> None:
    """``out[i]``: query i's lower bound in ``[lo[i], hi[i])``; ``found[i]``: its key is there."""
    n = lo.shape[0]
    dense = False
    for i in range(n):
        h = hi[i]
        s, c, f = qs[i], qc[i], qf[i]
        a = lo[i]
        b = h
        shared = i > 0 and a == lo[i - 1] and h == hi[i - 1]
        if not shared:  # the first query of a range: are the queries of this range dense in it?
            k = i + 1
            while k < n and lo[k] == a and hi[k] == h:
                k += 1
            dense = h - a <= GALLOP_GAP * (k - i)
        if shared and dense and not (
                s < qs[i - 1] or (s == qs[i - 1] and (c < qc[i - 1] or (c == qc[i - 1] and f < qf[i - 1])))):
            # gallop from the answer before (every key before it is smaller than that query's key,
            # so than this one's): probe a, a+1, a+3, a+7, ... until a key is not smaller
            a = out[i - 1]
            step = 1
            while True:
                j = a + step - 1
                if j >= h:
                    break
                if _less(seg, tc, tf, j, s, c, f):
                    a = j + 1
                    step <<= 1
                else:
                    b = j
                    break
        # the lower bound in [a, b): every key before a is smaller, b is h or a key not smaller
        a = _bisect(seg, tc, tf, a, b, s, c, f)
        out[i] = a
        found[i] = a < h and seg[a] == s and tc[a] == c and tf[a] == f


def find(seg: U8, tc: U64, tf: U64, lo: I64, hi: I64, qs: U8, qc: U64, qf: U64) -> tuple[I64, Bools]:
    """For every query i, the first index in ``[lo[i], hi[i])`` whose key is ≥ query i's key
    (``hi[i]`` where every key of the range is smaller, ``lo[i]`` for an empty range), and whether
    that entry holds query i's key.

    ``seg``, ``tc``, ``tf``: the entry arrays, sorted by key inside every queried range (0 <= lo <=
    hi <= their length: not checked). Queries in any order; consecutive ones over one range in
    ascending key order are the cheap case (module docstring)."""
    n = int(np.shape(lo)[0])
    out = np.empty(n, np.int64)
    found = np.empty(n, np.bool_)
    c = np.ascontiguousarray
    _search(c(seg, np.uint8), c(tc, np.uint64), c(tf, np.uint64), c(lo, np.int64), c(hi, np.int64),
            c(qs, np.uint8), c(qc, np.uint64), c(qf, np.uint64), out, found)
    return out, found


def lower_bound(seg: U8, tc: U64, tf: U64, lo: I64, hi: I64, qs: U8, qc: U64, qf: U64) -> I64:
    """``find``'s lower bounds only."""
    return find(seg, tc, tf, lo, hi, qs, qc, qf)[0]


@kernel(f"void({_KEYS}, {readonly('int64')}, int64, {readonly('int64')}, {readonly('int64')}, {readonly('int64')},"
        f" {_KEYS}, int64[::1], boolean[::1])")
def _search_gaps(seg: U8, tc: U64, tf: U64, first: I64, shift: int, lo: I64, hi: I64, pos: I64, qs: U8, qc: U64,
                 qf: U64, out: I64, found: Bools) -> None:
    """``_search`` in each query's range ``[lo[i], hi[i])`` narrowed to the bucket of ``pos[i]``."""
    nb = first.shape[0] - 1
    for i in range(lo.shape[0]):
        b = min(pos[i] >> shift, nb)
        h = hi[i]
        a = min(max(first[b], lo[i]), h)
        z = max(min(first[min(b + 1, nb)], h), a)
        s, c, f = qs[i], qc[i], qf[i]
        a = _bisect(seg, tc, tf, a, z, s, c, f)
        out[i] = a
        found[i] = a < z and seg[a] == s and tc[a] == c and tf[a] == f


def find_in_gaps(seg: U8, tc: U64, tf: U64, first: I64, shift: int, lo: I64, hi: I64, pos: I64, qs: U8, qc: U64,
                 qf: U64) -> tuple[I64, Bools]:
    """``find`` in a delta run (run.find_in_gaps), each query's range first narrowed to the bucket
    of its base position ``pos[i]`` (posindex.py: entries ``[first[b], first[b + 1])`` with
    ``pos >> shift == b``; ``first`` has one more slot than there are buckets): the search then
    bisects a gap of a few entries. One pass per query, where numpy took ~10 whole-array passes for
    the bucket bounds and clamps, then log2(gap) search rounds."""
    n = int(np.shape(lo)[0])
    out = np.empty(n, np.int64)
    found = np.empty(n, np.bool_)
    c = np.ascontiguousarray
    _search_gaps(c(seg, np.uint8), c(tc, np.uint64), c(tf, np.uint64), c(first, np.int64), shift, c(lo, np.int64),
                 c(hi, np.int64), c(pos, np.int64), c(qs, np.uint8), c(qc, np.uint64), c(qf, np.uint64), out, found)
    return out, found
