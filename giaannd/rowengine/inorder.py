"""Batches added in log order, a window at a time: the compiled core of ``RowEngine.apply_in_order``.

Theory of operation
-------------------
A log replay (storage's recovery.py) adds many canonical batches that share rows and keys, and
must leave every key's float32 strength the left fold of its increments in log order: from the
base value for a key the engine holds, from its first increment for a new key. A window of such
batches (row occurrence i = row id ``ids[i]`` with entries ``offsets[i]:offsets[i+1]``, each
occurrence sorted with unique keys) is added in two compiled passes, with no delta run:

1. ``by_row``: a stable counting sort of the window's entries by row id (a count pass, then a
   scatter of the four fields, batch by batch where they lie): each row's entries become one
   block, its occurrences in log order, each still sorted.
2. ``_fold_rows``, row by row in id order: the block is sorted by key in place, stably (a natural
   merge sort: its runs are the occurrences, so a row that k batches touch costs log2(k) merge
   passes of its own entries, nothing for a row one batch touches), so equal keys lie together in
   log order. Then one walk of the block against the row's base slice: each distinct key is
   located by galloping forward from the key before (sorted queries: nearby probes, cached, where
   a search per entry in log order bisected a row of 10^5 keys with a cache miss a probe); a key
   found gets its increments added to its base value one at a time, a key not found is folded
   from its first increment and written, with its base position, over the front of the window's
   arrays (never past the entry being read): the new keys come out in the global order with their
   base positions, a delta run (``RowEngine.apply_in_order`` keeps it, and folds it into the base
   before the next window).

Why not a search per entry in log order and ``np.add.at``: that is what the group replay before
did, and it paid a cache miss per probe into the head rows of a Zipf log, a sort of the new keys
(a lexsort of the rows several batches add to), a delta run per group and the tiers' merges and
folds (fresh memory each: a new process's first touch of a page costs ~20x a reused one). Here a
window costs O(entries · log(occurrences per row)) for the sort plus the gallops, and one merge of
its new keys into the base.

Exactness: the stable sort keeps equal keys in log order and ``v += x`` on float32 scalars rounds
to float32 at every add (no ``fastmath``: jit.py), so every sum is the record-by-record one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly

__all__ = ["by_row", "fold_rows"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F32 = NDArray[np.float32]

_KEYS = f"{readonly('uint8')}, {readonly('uint64')}, {readonly('uint64')}"
_FIELDS = "uint8[::1], uint64[::1], uint64[::1], float32[::1]"


@kernel(f"void({readonly('int64')}, {readonly('int64')}, int64[::1])")
def _count(ids: I64, offsets: I64, counts: I64) -> None:
    """``counts[ids[i] + 1]`` += row occurrence i's entries."""
    for i in range(ids.shape[0]):
        counts[ids[i] + 1] += offsets[i + 1] - offsets[i]


@kernel(f"void({readonly('int64')}, {readonly('int64')}, {_KEYS}, {readonly('float32')}, int64[::1], {_FIELDS})")
def _scatter(ids: I64, offsets: I64, seg: U8, tc: U64, tf: U64, st: F32, at: I64, gseg: U8, gtc: U64, gtf: U64,
             gst: F32) -> None:
    """Row occurrence i's entries to ``g*[at[ids[i]]:]``, moving that cursor past them."""
    for i in range(ids.shape[0]):
        r = ids[i]
        o = at[r]
        for j in range(offsets[i], offsets[i + 1]):
            gseg[o] = seg[j]
            gtc[o] = tc[j]
            gtf[o] = tf[j]
            gst[o] = st[j]
            o += 1
        at[r] = o


@kernel(f"void({_FIELDS}, int64, int64, {_FIELDS}, int64, int64[::1])")
def _sort_block(gseg: U8, gtc: U64, gtf: U64, gst: F32, a: int, z: int, sseg: U8, stc: U64, stf: U64, sst: F32,
                runs: int, bounds: I64) -> None:
    """Sort ``[a, z)`` of the fields by key in place, stably: a bottom-up merge of its ascending
    runs, whose ``runs`` starts are ``bounds[:runs]`` (``bounds[runs] == z``); ``s*`` are scratch
    fields of at least ``z - a`` entries."""
    src_g = True  # where the entries are now: the g fields (index i) or the scratch (i - a)
    while runs > 1:
        if src_g:
            xs, xc, xf, xt, xo = gseg, gtc, gtf, gst, a
            ys, yc, yf, yt, yo = sseg, stc, stf, sst, 0
        else:
            xs, xc, xf, xt, xo = sseg, stc, stf, sst, 0
            ys, yc, yf, yt, yo = gseg, gtc, gtf, gst, a
        w = 0
        for p in range(0, runs, 2):
            i = bounds[p]
            m = bounds[p + 1]
            e = bounds[p + 2] if p + 2 <= runs else m
            j = m
            o = i
            while i < m and j < e:
                ii = i - a + xo
                jj = j - a + xo
                take_right = xs[jj] < xs[ii] or (xs[jj] == xs[ii] and (
                    xc[jj] < xc[ii] or (xc[jj] == xc[ii] and xf[jj] < xf[ii])))
                k = jj if take_right else ii
                oo = o - a + yo
                ys[oo] = xs[k]
                yc[oo] = xc[k]
                yf[oo] = xf[k]
                yt[oo] = xt[k]
                o += 1
                if take_right:
                    j += 1
                else:
                    i += 1
            for rest_lo, rest_hi in ((i, m), (j, e)):
                for k in range(rest_lo - a + xo, rest_hi - a + xo):
                    oo = o - a + yo
                    ys[oo] = xs[k]
                    yc[oo] = xc[k]
                    yf[oo] = xf[k]
                    yt[oo] = xt[k]
                    o += 1
            bounds[w] = bounds[p]
            w += 1
        bounds[w] = z
        runs = w
        src_g = not src_g
    if not src_g:
        n = z - a
        gseg[a:z] = sseg[:n]
        gtc[a:z] = stc[:n]
        gtf[a:z] = stf[:n]
        gst[a:z] = sst[:n]


@kernel(f"int64({_KEYS}, float32[::1], {readonly('int64')}, {readonly('int64')}, {readonly('int64')},"
        f" {readonly('int64')}, {_FIELDS}, int64[::1], int64[::1])")
def _fold_rows(bseg: U8, btc: U64, btf: U64, bst: F32, rows: I64, starts: I64, lo: I64, hi: I64, gseg: U8,
               gtc: U64, gtf: U64, gst: F32, pos: I64, new_count: I64) -> int:
    """Each row ``rows[t]`` (ascending): its block of the grouped fields (``starts``) sorted, its
    increments added to the keys its base slice ``[lo[t], hi[t])`` holds, its other keys folded
    and written from the front of the fields on (``pos``: base positions), ``new_count[t]`` of
    them. Returns how many new keys were written in all."""
    longest = 0
    for t in range(rows.shape[0]):
        longest = max(longest, starts[rows[t] + 1] - starts[rows[t]])
    sseg = np.empty(longest, np.uint8)
    stc = np.empty(longest, np.uint64)
    stf = np.empty(longest, np.uint64)
    sst = np.empty(longest, np.float32)
    bounds = np.empty(longest + 1, np.int64)
    w = 0  # new keys written so far: never past the entry read (w <= a <= k)
    for t in range(rows.shape[0]):
        a = starts[rows[t]]
        z = starts[rows[t] + 1]
        runs = 1
        bounds[0] = a
        for k in range(a + 1, z):
            if gseg[k] < gseg[k - 1] or (gseg[k] == gseg[k - 1] and (
                    gtc[k] < gtc[k - 1] or (gtc[k] == gtc[k - 1] and gtf[k] < gtf[k - 1]))):
                bounds[runs] = k
                runs += 1
        bounds[runs] = z
        if runs > 1:
            _sort_block(gseg, gtc, gtf, gst, a, z, sseg, stc, stf, sst, runs, bounds)
        p = lo[t]
        h = hi[t]
        w0 = w
        k = a
        while k < z:
            s = gseg[k]
            c = gtc[k]
            f = gtf[k]
            e = k + 1
            while e < z and gseg[e] == s and gtc[e] == c and gtf[e] == f:
                e += 1
            # the lower bound in [p, h): gallop from the key before's (every entry before p is
            # smaller), probing p, p+1, p+3, p+7, ... until an entry is not smaller, then bisect
            b = h
            step = 1
            while True:
                j = p + step - 1
                if j >= h:
                    break
                if bseg[j] < s or (bseg[j] == s and (btc[j] < c or (btc[j] == c and btf[j] < f))):
                    p = j + 1
                    step <<= 1
                else:
                    b = j
                    break
            m = b - p
            while m > 0:
                half = m >> 1
                j = p + half
                if bseg[j] < s or (bseg[j] == s and (btc[j] < c or (btc[j] == c and btf[j] < f))):
                    p = j + 1
                    m -= half + 1
                else:
                    m = half
            if p < h and bseg[p] == s and btc[p] == c and btf[p] == f:
                v = bst[p]
                for q in range(k, e):
                    v += gst[q]
                bst[p] = v
            else:
                v = gst[k]
                for q in range(k + 1, e):
                    v += gst[q]
                gseg[w] = s
                gtc[w] = c
                gtf[w] = f
                gst[w] = v
                pos[w] = p
                w += 1
            k = e
        new_count[t] = w - w0
    return w


def by_row(parts: Sequence[tuple[I64, I64, U8, U64, U64, F32]], num_rows: int) -> tuple[I64, U8, U64, U64, F32]:
    """The entries of ``parts`` (row occurrences' ids, offsets, then the four entry fields),
    grouped by row id in one counting sort (stable: ``_count`` of every part, then ``_scatter``):
    (starts, seg, tc, tf, st), row r's block being ``[starts[r], starts[r+1])`` for every row id
    below ``num_rows``. The parts are read where they lie (a replay's batches are views of its
    segment buffer): no concatenation."""
    c = np.ascontiguousarray
    parts = [(c(i, np.int64), c(o, np.int64), c(s, np.uint8), c(x, np.uint64), c(y, np.uint64), c(t, np.float32))
             for i, o, s, x, y, t in parts]
    starts = np.zeros(num_rows + 1, np.int64)
    for ids, offsets, *_ in parts:
        _count(ids, offsets, starts)
    np.cumsum(starts, out=starts)
    n = int(starts[-1])
    g = (np.empty(n, np.uint8), np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n, np.float32))
    at = starts[:-1].copy()
    for part in parts:
        _scatter(*part, at, *g)
    return (starts, *g)


def fold_rows(bseg: U8, btc: U64, btf: U64, bst: F32, rows: I64, starts: I64, lo: I64, hi: I64, gseg: U8,
              gtc: U64, gtf: U64, gst: F32) -> tuple[int, I64, I64]:
    """``_fold_rows`` (``bst`` and the ``g*`` fields are written in place): returns (new keys
    written at the front of the ``g*`` fields, their base positions, new keys per row of ``rows``)."""
    if not (bst.flags.c_contiguous and bst.flags.writeable):
        raise ValueError("fold_rows: the base strengths must be a writable contiguous array")
    pos = np.empty(gst.shape[0], np.int64)
    new_count = np.empty(rows.shape[0], np.int64)
    c = np.ascontiguousarray
    m = _fold_rows(c(bseg, np.uint8), c(btc, np.uint64), c(btf, np.uint64), bst, c(rows, np.int64),
                   c(starts, np.int64), c(lo, np.int64), c(hi, np.int64), gseg, gtc, gtf, gst, pos, new_count)
    return int(m), pos[:m], new_count
