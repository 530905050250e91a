"""Vectorised binary search of entry keys inside per-query ranges.

An entry key is ``(segment u8, target_column u64, target_feature u64)``, compared lexicographically
(the canonical entry order of giaannd/model/rows.py). The engine keeps each row's entries contiguous
and sorted, so finding where a delta entry of row r belongs is a binary search inside r's range,
not over all entries: ``lower_bound`` runs one such search for every query at once.

How it stays cheap in numpy: the search is the branch-free form (``n`` halves each round, the base
moves by ``half`` when the probed key is smaller), so a query over a range of n entries takes
exactly ceil(log2 n) rounds. Queries are ordered by that round count, longest first (a radix sort
of one byte), so the queries still searching at round j are always a *prefix* of the arrays: each
round is ~15 numpy operations on views, with no compaction, and queries into short ranges (most
rows are short) drop out after a few rounds whatever the longest row is.

Why not ``np.searchsorted``: it needs one key dtype and one global order. Packing the key into
bytes (``S17``, or ``S21`` with a row prefix) costs 17-21 bytes per stored entry, or O(row) work per
search to pack, and measured 2.7x slower than a uint64 search (memcmp per comparison); here the
entry arrays are read in place.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["RUN_STRIDE", "SEARCH_CHUNK", "find_runs", "keys_less", "lower_bound", "lower_bound_chunked",
           "merge_positions"]

#: Queries per ``lower_bound`` call in ``lower_bound_chunked``: each round makes ~15 passes over
#: the queries still searching (keys, bases, widths, probes), which stay in the CPU's cache up to
#: a few tens of thousands of queries; at millions every pass streams from memory, and a search
#: measured ~2x slower per query (a group replay's 3.6 M queries: 1.8 s in one call; 64 Ki-query
#: calls cost ~25 numpy calls each, nothing at that size).
SEARCH_CHUNK = 1 << 16

#: ``find_runs``: every RUN_STRIDE-th query of a run is searched in its whole range, the
#: ones between in the window their bounds leave (<= RUN_STRIDE entries where queries are dense:
#: log2 = 4 rounds). Larger: fewer full searches, wider windows; 16 measured best of 4-32
#: (training-like log replay, tools.bench.snapshot: 6.45, 6.26, 5.93, 6.24 s/GB at 4, 8, 16, 32).
RUN_STRIDE = 16

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
Bools = NDArray[np.bool_]


def keys_less(seg: U8, tc: U64, tf: U64, at: I64, qs: U8, qc: U64, qf: U64) -> Bools:
    """Whether the entry at ``at[i]`` has a smaller key than query i (lexicographic, 3 fields)."""
    ms = seg[at]
    mc = tc[at]
    less: Bools = (ms < qs) | ((ms == qs) & (mc < qc))
    tie = np.flatnonzero((ms == qs) & (mc == qc))
    if tie.shape[0]:
        less[tie] = tf[at[tie]] < qf[tie]
    return less


def lower_bound(seg: U8, tc: U64, tf: U64, lo: I64, hi: I64, qs: U8, qc: U64, qf: U64) -> I64:
    """For every query i, the first index in ``[lo[i], hi[i])`` whose key is ≥ query i's key.

    ``seg``, ``tc``, ``tf``: the entry arrays, sorted by key inside every queried range.
    Returns ``hi[i]`` where every key of the range is smaller, ``lo[i]`` for an empty range.
    """
    out = np.array(lo, np.int64, copy=True)
    n = np.asarray(hi, np.int64) - out
    live = np.flatnonzero(n > 0)
    if live.shape[0] == 0:
        return out
    n = n[live]
    # rounds = ceil(log2(n)): bit length of n - 1 (exact for any int64, unlike a float log)
    rounds = np.zeros(n.shape[0], np.uint8)
    rest = n - 1
    while True:
        more = rest > 0
        if not more.any():
            break
        rounds += more
        rest >>= 1
    order = np.argsort(np.uint8(255) - rounds, kind="stable")  # longest first; a one-byte radix sort
    q = live[order]
    base, width = out[q], n[order]
    s, c, f = qs[q], qc[q], qf[q]
    # searching[j]: how many queries take more than j rounds (a prefix, by the order above)
    searching = np.cumsum(np.bincount(rounds, minlength=1)[::-1])[::-1][1:]
    for k in searching.tolist():
        half = width[:k] >> 1
        probe = base[:k] + half
        base[:k] += half * keys_less(seg, tc, tf, probe, s[:k], c[:k], f[:k])
        width[:k] -= half
    out[q] = base + keys_less(seg, tc, tf, base, s, c, f)
    return out


def lower_bound_chunked(seg: U8, tc: U64, tf: U64, lo: I64, hi: I64, qs: U8, qc: U64, qf: U64) -> I64:
    """``lower_bound`` in calls of at most ``SEARCH_CHUNK`` queries (the same result)."""
    n = int(lo.shape[0])
    if n <= SEARCH_CHUNK:
        return lower_bound(seg, tc, tf, lo, hi, qs, qc, qf)
    out = np.empty(n, np.int64)
    for a in range(0, n, SEARCH_CHUNK):
        z = min(n, a + SEARCH_CHUNK)
        out[a:z] = lower_bound(seg, tc, tf, lo[a:z], hi[a:z], qs[a:z], qc[a:z], qf[a:z])
    return out


def _at_guess(seg: U8, tc: U64, tf: U64, guess: I64, lo: I64, hi: I64, qs: U8, qc: U64, qf: U64) -> Bools:
    """Whether the entry at ``guess[i]``, inside query i's range ``[lo[i], hi[i])``, holds its key:
    then ``guess[i]`` is its lower bound (a range's keys are sorted and unique; another range may
    hold the same key, hence the range check)."""
    if seg.shape[0] == 0:
        return np.zeros(guess.shape[0], bool)
    inside = (guess < hi) & (guess >= lo)
    at = np.where(inside, guess, 0)
    eq: Bools = inside & (seg[at] == qs) & (tc[at] == qc) & (tf[at] == qf)
    return eq


def find_runs(seg: U8, tc: U64, tf: U64, lo: I64, hi: I64, qs: U8, qc: U64, qf: U64, run: I64,
              guess: I64 | None = None, run_length: I64 | None = None) -> tuple[I64, Bools]:
    """``lower_bound``, and whether the key is there (``found``), for queries in sorted runs:
    ``run`` (non-decreasing) labels each query's run; a run's queries are consecutive, in
    ascending key order, and share one range (a row occurrence of a canonical batch). The bounds
    are ``lower_bound``'s; the work is less where runs are long and dense in their range.

    1. Guess: the k-th query of a run is the k-th key of its range (a batch adding to every key of
       a row, as tools.bench.snapshot's training-like log does; a batch adding to a sparse subset
       of a big row's keys, as a Zipf stream's head rows get, misses and pays this check on top of
       step 2). A guess is checked by one
       comparison of the key there (``_at_guess``), and a right one is the answer, whatever
       made it: ~10 passes over the queries instead of log2(row length) search rounds of ~15
       (12-17 rounds for the long rows that hold most entries).
    2. Every ``RUN_STRIDE``-th query of a run and its last, unless guessed, are searched in the
       whole range; then each query between two of them is guessed again right after the one
       before it (a dense stretch that does not start the row), else searched only between their
       bounds (a run's bounds are non-decreasing): <= ``RUN_STRIDE`` entries where dense.

    A run holding under half its range's keys is searched plainly (``lower_bound``): its guesses
    would miss. ``run_length``: each query's run's whole length, when the caller passes a slice of
    longer runs (else counted here).

    ``guess``: step 1's guesses when the caller has them (a run cut by a slice boundary: its
    place in the run counts from the run's true start); any positions will do, each is checked.
    A run of one query that is not its row's first key costs one check plus one full search, as
    in ``lower_bound``. Two levels, not log2(n): each level costs ~25 passes over its queries,
    which at tens of thousands of queries is what a search round costs (a log2(n)-level version
    measured 1.8x slower than ``lower_bound`` on one 45k-entry batch)."""
    n = int(run.shape[0])
    if n == 0:
        return np.empty(0, np.int64), np.zeros(0, bool)
    # A run holding under half its range's keys (sparse adds to a big row, the usual case of a
    # Zipf stream's head rows) would miss its guesses and pay the check and the two levels on top
    # of a search: such runs get the plain search (tools.bench.snapshot's Zipf training log: group
    # replay went from 0.62-0.95x the replay before it to ~1x with this).
    if run_length is None:
        begin = np.concatenate([[0], np.flatnonzero(run[1:] != run[:-1]) + 1])
        length = np.diff(np.append(begin, n))
        run_length = np.repeat(length, length)
    sparse = run_length * 2 < (hi - lo)
    if sparse.any():
        out = np.empty(n, np.int64)
        found = np.zeros(n, bool)
        sp = np.flatnonzero(sparse)
        out[sp] = lower_bound(seg, tc, tf, lo[sp], hi[sp], qs[sp], qc[sp], qf[sp])
        found[sp] = _at_guess(seg, tc, tf, out[sp], lo[sp], hi[sp], qs[sp], qc[sp], qf[sp])
        de = np.flatnonzero(~sparse)
        if de.shape[0]:
            out[de], found[de] = find_runs(seg, tc, tf, lo[de], hi[de], qs[de], qc[de], qf[de], run[de],
                                           None if guess is None else guess[de], run_length[de])
        return out, found
    if guess is not None:
        out = np.array(guess, np.int64, copy=True)
        done = _at_guess(seg, tc, tf, out, lo, hi, qs, qc, qf)
        if done.all():
            return out, done
    idx = np.arange(n, dtype=np.int64)
    starts = np.ones(n, bool)
    starts[1:] = run[1:] != run[:-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0))
    if guess is None:
        out = lo + (idx - first)
        done = _at_guess(seg, tc, tf, out, lo, hi, qs, qc, qf)
        if done.all():
            return out, done
    found = done.copy()
    ends = np.ones(n, bool)
    ends[:-1] = starts[1:]
    last = np.minimum.accumulate(np.where(ends, idx, n)[::-1])[::-1]
    step = (idx - first) % RUN_STRIDE
    top = ((step == 0) | ends) & ~done
    t = np.flatnonzero(top)
    out[t] = lower_bound(seg, tc, tf, lo[t], hi[t], qs[t], qc[t], qf[t])
    m = np.flatnonzero(~top & ~done)
    if m.shape[0]:
        left = m - step[m]
        right = np.minimum(left + RUN_STRIDE, last[m])
        again = out[left] + step[m]
        hit = _at_guess(seg, tc, tf, again, lo[m], hi[m], qs[m], qc[m], qf[m])
        out[m[hit]] = again[hit]
        found[m[hit]] = True
        m, left, right = m[~hit], left[~hit], right[~hit]
        out[m] = lower_bound(seg, tc, tf, out[left], out[right], qs[m], qc[m], qf[m])
        t = np.concatenate([t, m])
    found[t] = _at_guess(seg, tc, tf, out[t], lo[t], hi[t], qs[t], qc[t], qf[t])
    return out, found


def merge_positions(base_len: int, pos: I64) -> tuple[I64, I64]:
    """Where things go when sorted entries are inserted at positions ``pos`` of a base sequence.

    ``pos`` (non-decreasing) is each inserted entry's lower bound in the base. Inserted entry j
    goes to ``pos[j] + j``; the base entries fill the other slots in order.

    Returns:
        (dst, keep): the destination of every inserted entry, and of every base entry (both int64
        index arrays into the merged sequence of ``base_len + len(pos)``). Computed once, they
        serve every field (an index scatter measured 25-45 % faster per field than a mask).
    """
    k = int(pos.shape[0])
    dst = pos + np.arange(k, dtype=np.int64)
    base_slot = np.ones(base_len + k, bool)
    base_slot[dst] = False
    return dst, np.flatnonzero(base_slot)
