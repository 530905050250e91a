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

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, prefetch, readonly

__all__ = ["PARALLEL_MIN_ENTRIES", "by_row", "fold_rows", "latest_before"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F32 = NDArray[np.float32]

_KEYS = f"{readonly('uint8')}, {readonly('uint64')}, {readonly('uint64')}"
_FIELDS = "uint8[::1], uint64[::1], uint64[::1], float32[::1]"
#: ``_fold_rows`` asks for (``prefetch``) the first ``_ASK_BASE`` entries of the base slice of the
#: row this many rows ahead: a row's walk starts with a cache miss in each base field (rows of ~44
#: base entries that one batch touches: 56 -> 41 ns per entry; the whole walk of a training log's
#: window 40.5 -> 37.8 ns per entry, docs/storage.md "Replay in threads", Dec 1). Past those
#: entries a slice is read on in order, which the hardware's own prefetcher follows.
_AHEAD = 4
_ASK_BASE = 64


@kernel(f"void({readonly('int64')}, {readonly('int64')}, int64[::1])")
def _count(ids: I64, offsets: I64, counts: I64) -> None:
    """``counts[ids[i] + 1]`` += row occurrence i's entries."""
    for i in range(ids.shape[0]):
        counts[ids[i] + 1] += offsets[i + 1] - offsets[i]


@kernel(f"void({readonly('int64')}, {readonly('int64')}, {_KEYS}, {readonly('float32')}, int64[::1], {_FIELDS},"
        " int64, int64)")
def _scatter(ids: I64, offsets: I64, seg: U8, tc: U64, tf: U64, st: F32, at: I64, gseg: U8, gtc: U64, gtf: U64,
             gst: F32, r0: int, r1: int) -> None:
    """Row occurrence i's entries to ``g*[at[ids[i]]:]``, moving that cursor past them, for the
    occurrences of rows ``r0 <= ids[i] < r1`` (one thread's share)."""
    for i in range(ids.shape[0]):
        r = ids[i]
        if r < r0 or r >= r1:
            continue
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
        f" {readonly('int64')}, {_FIELDS}, int64[::1], int64[::1], int64)")
def _fold_rows(bseg: U8, btc: U64, btf: U64, bst: F32, rows: I64, starts: I64, lo: I64, hi: I64, gseg: U8,
               gtc: U64, gtf: U64, gst: F32, pos: I64, new_count: I64, w: int) -> int:
    """Each row ``rows[t]`` (ascending): its block of the grouped fields (``starts``) sorted, its
    increments added to the keys its base slice ``[lo[t], hi[t])`` holds, its other keys folded
    and written from index ``w`` of the fields on (``pos``: base positions; ``w`` at most the first
    row's block start), ``new_count[t]`` of them. Returns how many new keys were written in all.
    Calls on disjoint ranges of rows touch disjoint memory (``fold_rows``' threads)."""
    longest = 0
    for t in range(rows.shape[0]):
        longest = max(longest, starts[rows[t] + 1] - starts[rows[t]])
    sseg = np.empty(longest, np.uint8)
    stc = np.empty(longest, np.uint64)
    stf = np.empty(longest, np.uint64)
    sst = np.empty(longest, np.float32)
    bounds = np.empty(longest + 1, np.int64)
    w0_all = w  # new keys are written from here on: never past the entry read (w <= a <= k)
    nrows = rows.shape[0]
    for t in range(nrows):
        ta = t + _AHEAD
        if ta < nrows and lo[ta] < hi[ta]:
            # a base slice is read from its start: ask for its first lines now (each field's first
            # read is a cache miss, where the hardware's prefetcher has no stream to follow yet)
            pa = lo[ta]
            prefetch(bseg, pa)
            prefetch(bst, pa)
            for j in range(pa, min(hi[ta], pa + _ASK_BASE), 8):
                prefetch(btc, j)
                prefetch(btf, j)
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
    return w - w0_all


@kernel(f"void({readonly('int64')}, {readonly('int64')}, int64, int64[::1])")
def _latest_before(ids: I64, group: I64, num_ids: int, out: I64) -> None:
    """``out[g]`` = the latest group before ``g`` holding one of ``g``'s ids (left alone where none
    is); ``group`` ascends and a group holds an id at most once."""
    last = np.full(num_ids, -1, np.int64)
    for j in range(ids.shape[0]):
        g = group[j]
        p = last[ids[j]]
        if p > out[g]:
            out[g] = p
        last[ids[j]] = g


def latest_before(ids: I64, group: I64, num_ids: int, groups: int) -> I64:
    """For each of ``groups`` groups (``group``: the group of each entry of ``ids``, ascending;
    dense ids below ``num_ids``, each at most once in a group), the latest earlier group that holds
    one of its ids, -1 where none does: one pass (a replay's records that share a row)."""
    out = np.full(groups, -1, np.int64)
    _latest_before(np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(group, np.int64), num_ids, out)
    return out


#: Windows of fewer entries are grouped and folded by one thread: below this a thread's start and
#: join cost more than its share of the work.
PARALLEL_MIN_ENTRIES = 1 << 18
#: A window's rows are cut into this many shares per thread, taken by the threads as they come
#: free: a row's cost per entry grows with the batches that touch it (its sort's passes), so equal
#: entries are not equal work, and the hot rows of a Zipf log would leave one thread the longest.
SHARES_PER_THREAD = 8


def _cuts(cumulative: I64, total: int, threads: int) -> list[int]:
    """Indices into ``cumulative`` (non-decreasing counts of entries before each item) that cut
    the items into ``threads`` consecutive shares of about ``total / threads`` entries each,
    first and last included."""
    targets = np.arange(1, threads, dtype=np.int64) * total // threads
    inner = np.searchsorted(cumulative, targets, side="left").tolist()
    return [0, *inner, len(cumulative) - 1]


def _in_threads(work: Callable[[int], int], shares: int, threads: int) -> list[int]:
    """``work(k)`` for every share k, in order of k, by ``threads`` threads taking shares as they
    come free (the kernels release the GIL)."""
    if shares == 1 or threads <= 1:
        return [work(k) for k in range(shares)]
    with ThreadPoolExecutor(max_workers=min(threads, shares), thread_name_prefix="giaannd-replay") as pool:
        return list(pool.map(work, range(shares)))


def by_row(parts: Sequence[tuple[I64, I64, U8, U64, U64, F32]], num_rows: int,
           threads: int = 1) -> tuple[I64, U8, U64, U64, F32]:
    """The entries of ``parts`` (row occurrences' ids, offsets, then the four entry fields),
    grouped by row id in one counting sort (stable: ``_count`` of every part, then ``_scatter``):
    (starts, seg, tc, tf, st), row r's block being ``[starts[r], starts[r+1])`` for every row id
    below ``num_rows`` (dense ids: ``RowEngine.apply_in_order`` numbers the window's own rows, so
    these arrays are sized by the window, not the store). The parts are read where they lie (a
    replay's batches are views of its segment buffer): no concatenation. With ``threads`` > 1 (and a window of at least
    ``PARALLEL_MIN_ENTRIES``), each thread scatters the rows of one range of ids, about an equal
    share of the entries: every thread reads every occurrence's id, and copies only its own."""
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
    cuts = _cuts(starts, n, threads) if threads > 1 and n >= PARALLEL_MIN_ENTRIES else [0, num_rows]

    def scatter(k: int) -> int:
        for part in parts:
            _scatter(*part, at, *g, cuts[k], cuts[k + 1])
        return 0

    _in_threads(scatter, len(cuts) - 1, threads)
    return (starts, *g)


def fold_rows(bseg: U8, btc: U64, btf: U64, bst: F32, rows: I64, starts: I64, lo: I64, hi: I64, gseg: U8,
              gtc: U64, gtf: U64, gst: F32, threads: int = 1) -> tuple[int, I64, I64]:
    """``_fold_rows`` (``bst`` and the ``g*`` fields are written in place): returns (new keys
    written at the front of the ``g*`` fields, their base positions, new keys per row of ``rows``).

    With ``threads`` > 1 (and at least ``PARALLEL_MIN_ENTRIES`` entries), the rows are cut into
    ``SHARES_PER_THREAD`` consecutive shares per thread, of about equal entries, that the threads
    fold as they come free: each share writes its new keys from its first block's start (rows own
    disjoint blocks and base slices), then the shares' new keys are moved to the front in order
    (the new keys only: a few percent of a training log's entries). The result is the one
    thread's, bit for bit."""
    if not (bst.flags.c_contiguous and bst.flags.writeable):
        raise ValueError("fold_rows: the base strengths must be a writable contiguous array")
    pos = np.empty(gst.shape[0], np.int64)
    new_count = np.empty(rows.shape[0], np.int64)
    c = np.ascontiguousarray
    bseg, btc, btf = c(bseg, np.uint8), c(btc, np.uint64), c(btf, np.uint64)
    rows, starts, lo, hi = c(rows, np.int64), c(starts, np.int64), c(lo, np.int64), c(hi, np.int64)
    total = int(gst.shape[0])
    if threads > 1 and total >= PARALLEL_MIN_ENTRIES and rows.shape[0] >= threads:
        before = starts[rows]  # entries of the window before each row's block
        cuts = _cuts(np.append(before, total), total, min(threads * SHARES_PER_THREAD, rows.shape[0]))
    else:
        cuts = [0, rows.shape[0]]
    firsts = [int(starts[rows[cuts[k]]]) if cuts[k] < rows.shape[0] else 0 for k in range(len(cuts) - 1)]

    def fold(k: int) -> int:
        t0, t1 = cuts[k], cuts[k + 1]
        if t0 == t1:
            return 0
        return int(_fold_rows(bseg, btc, btf, bst, rows[t0:t1], starts, lo[t0:t1], hi[t0:t1], gseg, gtc, gtf, gst,
                              pos, new_count[t0:t1], firsts[k]))

    written = _in_threads(fold, len(cuts) - 1, threads)
    m = 0
    for first, count in zip(firsts, written):
        if count and first != m:  # to the front, in order (numpy copies overlapping slices safely)
            for f in (gseg, gtc, gtf, gst, pos):
                f[m:m + count] = f[first:first + count]
        m += count
    return m, pos[:m], new_count
