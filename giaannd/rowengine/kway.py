"""K-way merges of delta runs: the compiled core of ``run.merge_runs``.

Theory of operation
-------------------
The engine's delta runs merge by size tiers (engine.py, "Tiers"): once ``fanout`` runs sit in one
tier they become one run of the next, in one pass that writes each entry once. A merge of two
runs at a time would write the entries of k runs log2(k) times; the tiers' whole point is that an
entry is written once per tier it climbs.

The runs are key-disjoint and each is in the global order (row id, segment, target column, target
feature). Every delta entry also carries ``pos``, its lower bound in the base, which never
decreases along the global order; so (pos, row id, key) orders the entries of all the runs as the
global order does (two entries with different positions are in position order), and most
comparisons end at the position, one integer already loaded to be moved.

``_merge_back``: the destination is one of the runs (the largest), whose buffers have room for
everything: its entries and the others' are merged **from the back** into those buffers, each
step writing the largest entry left at the last free slot. A write lands at or after the
destination entry that slot held, and that entry was moved already (the slot's index is the
destination entries left plus the sources' left, less one), so nothing unread is overwritten:
no fresh memory, whose first touch costs about as much as the merge (run.py "Merges in place").
Each step picks the largest of up to ``MAX_RUNS`` cursors: a linear scan, since k is small.

``_union_rows``: the merged run's row index, from the runs' sorted row ids and counts: one pass
taking the smallest id of the k cursors, counts of a row held by several runs summed.

The sources come as tuples of ``MAX_RUNS`` arrays (numba's UniTuple, indexed at run time), the
unused places empty; one signature serves every k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly

__all__ = ["MAX_RUNS", "merge_back", "union_rows"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F32 = NDArray[np.float32]

#: The most runs one call merges (the source tuples' length); more are merged in rounds.
MAX_RUNS = 16

_EMPTY = {t: np.empty(0, t) for t in (np.uint8, np.uint64, np.float32, np.int64)}
for _a in _EMPTY.values():
    _a.flags.writeable = False


def _tuple(t: str) -> str:
    return f"UniTuple({readonly(t)}, {MAX_RUNS})"


def _padded(arrays: Sequence[NDArray[Any]], dtype: Any) -> tuple[NDArray[Any], ...]:
    """``arrays`` as read-only contiguous arrays of ``dtype``, padded with empty ones to ``MAX_RUNS``."""
    out = []
    for a in arrays:
        v = np.ascontiguousarray(a, dtype).view()
        v.flags.writeable = False
        out.append(v)
    return tuple(out) + (_EMPTY[np.dtype(dtype).type],) * (MAX_RUNS - len(out))


@kernel(f"int64({_tuple('int64')}, {_tuple('int64')}, int64, int64[::1], int64[::1])")
def _union(rows: Any, offsets: Any, k: int, out_rows: I64, out_counts: I64) -> int:
    """The sorted union of the k runs' row ids into ``out_rows``, each with its entries in all of
    them (``out_counts``); returns how many rows."""
    at = np.zeros(k, np.int64)
    o = 0
    while True:
        best = -1
        low = 0
        for r in range(k):
            i = at[r]
            if i < rows[r].shape[0] and (best < 0 or rows[r][i] < low):
                best = r
                low = rows[r][i]
        if best < 0:
            return o
        count = 0
        for r in range(k):
            i = at[r]
            if i < rows[r].shape[0] and rows[r][i] == low:
                count += offsets[r][i + 1] - offsets[r][i]
                at[r] = i + 1
        out_rows[o] = low
        out_counts[o] = count
        o += 1


def union_rows(rows: Sequence[I64], offsets: Sequence[I64]) -> tuple[I64, I64]:
    """The sorted union of up to ``MAX_RUNS`` runs' row ids (each sorted, unique, with its run's
    ``offsets``) and each row's entries in all of them: one compiled pass."""
    k = len(rows)
    if not 1 <= k <= MAX_RUNS or len(offsets) != k:
        raise ValueError(f"union_rows: 1 to {MAX_RUNS} runs, each with its offsets")
    n = sum(int(r.shape[0]) for r in rows)
    out_rows, out_counts = np.empty(n, np.int64), np.empty(n, np.int64)
    m = _union(_padded(rows, np.int64), _padded(offsets, np.int64), k, out_rows, out_counts)
    return out_rows[:m], out_counts[:m]


_SOURCES = ", ".join(_tuple(t) for t in ("uint8", "uint64", "uint64", "float32", "int64", "int64", "int64"))


@kernel(f"void(uint8[::1], uint64[::1], uint64[::1], float32[::1], int64[::1], int64, {readonly('int64')}, "
        f"{readonly('int64')}, {_SOURCES}, int64, boolean)")
def _merge_back(oseg: U8, otc: U64, otf: U64, ost: F32, opos: I64, n: int, orows: I64, ooff: I64, sseg: Any,
                stc: Any, stf: Any, sst: Any, spos: Any, srows: Any, soff: Any, k: int, base: bool) -> None:
    """The destination run's ``n`` entries (the prefix of the ``o*`` buffers; its row index
    ``orows``/``ooff``) and the k source runs' merged into ``o*[:n + sum]`` in the global order,
    from the back (module docstring). ``base``: the destination is the base (no ``pos``: ``opos``
    is not used; its entry i comes after a source entry whose position is at most i, fold_into_base's
    rule), else a delta run, ordered with the sources by (pos, row id, key).

    Each source's last unmoved entry's (position, row id) is kept in ``cp``/``cr``; a step finds
    the largest source entry and the runner-up, moves the destination's entries larger than it,
    then the largest source's entries while they stay larger than both (stretches of one run,
    found without scanning the others again)."""
    x = np.empty(k, np.int64)  # each source's last entry not yet moved
    xr = np.empty(k, np.int64)  # the index of the row holding it in that source's row index
    cp = np.empty(k, np.int64)  # its position
    cr = np.empty(k, np.int64)  # its row id
    total = n
    for r in range(k):
        e = sst[r].shape[0] - 1
        x[r] = e
        total += e + 1
        if e >= 0:
            j = srows[r].shape[0] - 1
            while soff[r][j] > e:
                j -= 1
            xr[r] = j
            cp[r] = spos[r][e]
            cr[r] = srows[r][j]
    i = n - 1
    ir = orows.shape[0] - 1
    o = total - 1
    while o > i:  # when o == i every source entry is placed and the destination's rest is in place
        best = -1
        second = -1
        for r in range(k):
            if x[r] < 0:
                continue
            if best < 0:
                best = r
                continue
            b = best
            if cp[r] != cp[b]:
                bigger = cp[r] > cp[b]
            elif cr[r] != cr[b]:
                bigger = cr[r] > cr[b]
            else:
                e, f = x[r], x[b]
                bigger = sseg[r][e] > sseg[b][f] or (sseg[r][e] == sseg[b][f] and (
                    stc[r][e] > stc[b][f] or (stc[r][e] == stc[b][f] and stf[r][e] > stf[b][f])))
            if bigger:
                second = best
                best = r
            elif second < 0:
                second = r
            else:
                s2 = second
                if cp[r] != cp[s2]:
                    bigger2 = cp[r] > cp[s2]
                elif cr[r] != cr[s2]:
                    bigger2 = cr[r] > cr[s2]
                else:
                    e, f = x[r], x[s2]
                    bigger2 = sseg[r][e] > sseg[s2][f] or (sseg[r][e] == sseg[s2][f] and (
                        stc[r][e] > stc[s2][f] or (stc[r][e] == stc[s2][f] and stf[r][e] > stf[s2][f])))
                if bigger2:
                    second = r
        # the destination's entries larger than the largest source entry
        bp = cp[best]
        brow = cr[best]
        bx = x[best]
        while i >= 0:
            if base:
                if i < bp:
                    break
            else:
                while ooff[ir] > i:
                    ir -= 1
                p = opos[i]
                if p != bp:
                    if p < bp:
                        break
                else:
                    row = orows[ir]
                    if row != brow:
                        if row < brow:
                            break
                    else:
                        s0, c0, f0 = oseg[i], otc[i], otf[i]
                        s1, c1, f1 = sseg[best][bx], stc[best][bx], stf[best][bx]
                        if not (s0 > s1 or (s0 == s1 and (c0 > c1 or (c0 == c1 and f0 > f1)))):
                            break
            oseg[o] = oseg[i]
            otc[o] = otc[i]
            otf[o] = otf[i]
            ost[o] = ost[i]
            if not base:
                opos[o] = opos[i]
            i -= 1
            o -= 1
        # then the largest source's entries while larger than the runner-up and the destination's
        ss = sseg[best]
        sc = stc[best]
        sf = stf[best]
        sv = sst[best]
        sp = spos[best]
        sr = srows[best]
        so = soff[best]
        j = xr[best]
        e = x[best]
        while True:
            oseg[o] = ss[e]
            otc[o] = sc[e]
            otf[o] = sf[e]
            ost[o] = sv[e]
            if not base:
                opos[o] = sp[e]
            o -= 1
            e -= 1
            if e < 0:
                break
            while so[j] > e:
                j -= 1
            p = sp[e]
            row = sr[j]
            if second >= 0:  # still larger than the runner-up?
                if p != cp[second]:
                    if p < cp[second]:
                        break
                elif row != cr[second]:
                    if row < cr[second]:
                        break
                else:
                    f = x[second]
                    s2, c2, f2 = sseg[second][f], stc[second][f], stf[second][f]
                    if not (ss[e] > s2 or (ss[e] == s2 and (sc[e] > c2 or (sc[e] == c2 and sf[e] > f2)))):
                        break
            if i >= 0:  # and than the destination's last unmoved entry?
                if base:
                    if i >= p:
                        break
                else:
                    while ooff[ir] > i:
                        ir -= 1
                    q = opos[i]
                    if q != p:
                        if q > p:
                            break
                    else:
                        row0 = orows[ir]
                        if row0 != row:
                            if row0 > row:
                                break
                        elif oseg[i] > ss[e] or (oseg[i] == ss[e] and (
                                otc[i] > sc[e] or (otc[i] == sc[e] and otf[i] > sf[e]))):
                            break
        x[best] = e
        if e >= 0:
            xr[best] = j
            cp[best] = sp[e]
            cr[best] = sr[j]


def merge_back(dest: tuple[U8, U64, U64, F32, I64], n: int, dest_rows: I64, dest_offsets: I64,
               sources: Sequence[tuple[I64, I64, U8, U64, U64, F32, I64]], base: bool = False) -> None:
    """Merge up to ``MAX_RUNS`` key-disjoint delta runs (``sources``: each its rows, offsets, seg,
    tc, tf, st, pos) into a destination run whose ``n`` entries are the prefix of the five buffers
    ``dest`` (seg, tc, tf, st, pos), which must have room for all of them: on return ``dest[f][:n +
    sum]`` is the union in the global order (module docstring). The sources are not changed.
    ``base``: the destination is the base run (``dest[4]`` is then not written: pass any int64
    array), the sources' entries inserted at their positions (run.fold_into_base's rule)."""
    k = len(sources)
    if not 1 <= k <= MAX_RUNS:
        raise ValueError(f"merge_back: 1 to {MAX_RUNS} source runs")
    m = sum(int(s[5].shape[0]) for s in sources)
    if any(d.shape[0] < n + m or not d.flags.c_contiguous or not d.flags.writeable for d in dest[:4 if base else 5]):
        # checked here: the kernel writes without bounds checks
        raise ValueError("merge_back: the destination buffers need room for every entry")
    if int(dest_offsets[-1]) != n or any(int(s[1][-1]) != s[5].shape[0] for s in sources):
        raise ValueError("merge_back: each run's offsets must end at its entry count")
    types = (np.int64, np.int64, np.uint8, np.uint64, np.uint64, np.float32, np.int64)
    cols = [_padded([s[j] for s in sources], types[j]) for j in range(7)]
    rows, offsets, seg, tc, tf, st, pos = cols
    c = np.ascontiguousarray
    _merge_back(*dest, n, c(dest_rows, np.int64), c(dest_offsets, np.int64), seg, tc, tf, st, pos, rows, offsets, k,
                base)
