"""Which keys no delta run can hold: a filter over every key of a row engine's delta runs.

Why: ``RowEngine.plan`` looks every key the base lacks up in each delta run, largest first
(run.find_in_gaps: the row's slice, the bucket of its base position, a key search). On a training
stream almost every such key is new: measured on the Zipf stream of tools/bench/scale.py at 4.4·10^7
entries, 86 % of a batch's keys were in no run and 0.3 % were in a delta run, and the delta
lookups cost as much CPU as the base search (the plan ~200 ns per entry). With the filter, a new key
costs one read of one 64-bit word; only the keys it cannot rule out (those a delta run holds and
a few percent of the rest) are searched as before.

How: a blocked Bloom filter. A key (row id, segment, target column, target feature) hashes
(``keyindex.pair_hash``, twice) to one 64-bit word and ``PROBES`` bits in it; ``add`` sets them,
``maybe`` reads the word. It is a superset: it may answer "maybe" for a key no run holds (about
``false_positive_rate``), never "no" for a key one holds, which is all ``plan`` relies on (a key
ruled out is new; a false "maybe" costs the search every key paid before).

The engine adds the keys of every delta run it takes on (``RowEngine._hold_delta``: a commit's new
run, a replay window's run); tier merges move keys between runs and change nothing here; a fold of
every run into the base (``compact``, which a drop of rows does first) clears it. The filter is
sized for ``capacity`` keys at ``BITS_PER_KEY``; adding past that rebuilds it from the runs
themselves at twice their entries (exact again, amortised O(1) per key). Row ids are stable while
a key sits in a delta run (only a drop renumbers rows, after a fold).

Memory: ``BITS_PER_KEY`` / 8 bytes per key of capacity, 1-2 bytes per delta entry (a rebuild
sizes it for twice the runs' entries, and a fold's clear keeps the size), and delta runs hold at
most about 1/``base_ratio`` of the store: 0.2-0.5 B per stored entry measured (against 21 B of
payload).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, prefetch, readonly
from giaannd.rowengine.keyindex import pair_hash
from giaannd.rowengine.run import Run

__all__ = ["BITS_PER_KEY", "MIN_CAPACITY", "PROBES", "DeltaFilter"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
Bools = NDArray[np.bool_]

#: Filter bits per key at capacity: with ``PROBES`` bits in one 64-bit word, ~2-4 % false "maybe".
BITS_PER_KEY = 8
#: Bits set per key, all in its word.
PROBES = 4
#: The smallest capacity (keys) a filter is made for.
MIN_CAPACITY = 1 << 12

_SEG_SHIFT = np.uint64(56)
_WORD_SHIFT = np.uint64(32)
_SIX = np.uint64(6)
_LOW6 = np.uint64(63)
_ONE = np.uint64(1)
#: How many queries ahead ``_maybe`` asks for a word, in a ring of ``_RING`` (a power of two).
_AHEAD = 16
_RING = 32
_RING_MASK = _RING - 1
_KEYS = f"{readonly('uint8')}, {readonly('uint64')}, {readonly('uint64')}"


@kernel("UniTuple(uint64, 2)(uint64, int64, uint8, uint64, uint64)")
def _word_and_mask(nwords: np.uint64, row: np.int64, seg: np.uint8, tc: np.uint64,
                   tf: np.uint64) -> tuple[np.uint64, np.uint64]:
    """(the word of key (row, seg, tc, tf) in a filter of ``nwords`` words, its ``PROBES`` bits)."""
    h = pair_hash(pair_hash(np.uint64(row) ^ (np.uint64(seg) << _SEG_SHIFT), tc), tf)
    word = ((h >> _WORD_SHIFT) * nwords) >> _WORD_SHIFT  # the high half, scaled to [0, nwords)
    mask = np.uint64(0)
    for _ in range(PROBES):
        mask |= _ONE << (h & _LOW6)
        h >>= _SIX
    return word, mask


@kernel(f"void(uint64[::1], {readonly('int64')}, {readonly('int64')}, {_KEYS})")
def _add_run(words: U64, rows: I64, offsets: I64, seg: U8, tc: U64, tf: U64) -> None:
    """Set the bits of every entry of a run (``rows``/``offsets``: its row index), each word asked
    for ``_AHEAD`` entries before it is written, as in ``_maybe``."""
    n = np.uint64(words.shape[0])
    m = seg.shape[0]
    where = np.empty(_RING, np.uint64)
    bits = np.empty(_RING, np.uint64)
    r = 0  # the row of entry k, the one looked ahead to
    for k in range(m + _AHEAD):
        if k < m:
            while offsets[r + 1] <= k:
                r += 1
            w, b = _word_and_mask(n, rows[r], seg[k], tc[k], tf[k])
            where[k & _RING_MASK] = w
            bits[k & _RING_MASK] = b
            prefetch(words, np.int64(w))
        i = k - _AHEAD
        if i >= 0:
            words[where[i & _RING_MASK]] |= bits[i & _RING_MASK]


@kernel(f"void({readonly('uint64')}, {readonly('int64')}, {_KEYS}, {readonly('int64')}, boolean[::1])")
def _maybe(words: U64, row: I64, seg: U8, tc: U64, tf: U64, at: I64, out: Bools) -> None:
    """``out[j]``: whether entry ``at[j]`` of the arrays may be held (all its bits are set). Each
    word is asked for (``prefetch``) ``_AHEAD`` queries before it is read: a filter of a few MB is
    past the caches (measured at 10 MB: 35 ns per query without, ~10 with)."""
    n = np.uint64(words.shape[0])
    m = at.shape[0]
    where = np.empty(_RING, np.uint64)
    bits = np.empty(_RING, np.uint64)
    for j in range(min(_AHEAD, m)):
        i = at[j]
        where[j], bits[j] = _word_and_mask(n, row[i], seg[i], tc[i], tf[i])
        prefetch(words, np.int64(where[j]))
    for j in range(m):
        k = j + _AHEAD
        if k < m:
            i = at[k]
            w, b = _word_and_mask(n, row[i], seg[i], tc[i], tf[i])
            where[k & _RING_MASK] = w
            bits[k & _RING_MASK] = b
            prefetch(words, np.int64(w))
        b = bits[j & _RING_MASK]
        out[j] = (words[where[j & _RING_MASK]] & b) == b


class DeltaFilter:
    """The filter over a row engine's delta runs (module docstring). Not thread-safe: the engine
    calls it under its lock."""

    __slots__ = ("_capacity", "_keys", "_words")

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self._capacity = 0
        self._words: U64 = np.zeros(0, np.uint64)
        self._keys = 0
        self._reset(capacity)

    def _reset(self, capacity: int) -> None:
        """Empty, sized for ``capacity`` keys."""
        self._capacity = max(int(capacity), MIN_CAPACITY)
        self._words = np.zeros(-(-self._capacity * BITS_PER_KEY // 64), np.uint64)
        self._keys = 0

    @property
    def keys(self) -> int:
        """Keys added since it was made or cleared (with repeats: an upper bound)."""
        return self._keys

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        return int(self._words.nbytes)

    def arrays(self) -> list[NDArray[np.uint64]]:
        """The filter's words: for page advice."""
        return [self._words]

    def add(self, run: Run, runs: Iterable[Run] = ()) -> None:
        """Add the keys of ``run``, a delta run taken on beside ``runs`` (the ones held already):
        past the capacity, the filter is rebuilt from all of them at twice their entries."""
        if self._keys + run.num_entries > self._capacity:
            held = [*runs, run]
            self._reset(2 * sum(r.num_entries for r in held))
            for r in held:
                self._add(r)
            return
        self._add(run)

    def _add(self, run: Run) -> None:
        _add_run(self._words, np.ascontiguousarray(run.rows, np.int64), np.ascontiguousarray(run.offsets, np.int64),
                 np.ascontiguousarray(run.seg), np.ascontiguousarray(run.tc), np.ascontiguousarray(run.tf))
        self._keys += run.num_entries

    def clear(self) -> None:
        """No delta run holds a key any more (all folded into the base)."""
        if self._keys:
            self._words.fill(0)
            self._keys = 0

    def maybe(self, row: I64, seg: U8, tc: U64, tf: U64, at: I64) -> Bools:
        """For each index in ``at`` (into the four arrays of entries), False where no delta run
        holds that entry's key; True where one may."""
        out = np.empty(at.shape[0], np.bool_)
        c = np.ascontiguousarray
        _maybe(self._words, c(row, np.int64), c(seg, np.uint8), c(tc, np.uint64), c(tf, np.uint64),
               c(at, np.int64), out)
        return out

    def false_positive_rate(self) -> float:
        """The expected share of "maybe" for keys no run holds, at the present fill: a word holds
        ``keys / words`` keys on average, each setting ``PROBES`` of its 64 bits."""
        words = self._words.shape[0]
        set_share = 1.0 - (1.0 - 1.0 / 64) ** (PROBES * self._keys / words)
        return float(set_share ** PROBES)
