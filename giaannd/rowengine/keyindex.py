"""An index from 128-bit row keys (two uint64) to dense row ids, in numpy arrays (no Python dict).

Theory of operation
-------------------
A row key is ``(a, b)`` = (source column id, source feature id), both 64-bit content hashes. Ids
are handed out densely in insertion order (0, 1, 2, ...) and never change or get reused, so other
arrays can be indexed by id (the row engine's lengths, the runs' row lists). The index is an
open-addressing hash table with linear probing:

- ``_slots``: int64[capacity] (a power of two), the id stored in each slot or -1 (empty);
- ``_a``, ``_b``: uint64, the key of each id (grown by doubling).

Lookups and inserts are vectorised over many keys at once: each *probe round* is a few numpy
operations over the keys still unresolved, so the Python work is per round (1-3 rounds at load
≤ 1/2, a few more for the rare long cluster), never per key. Inserting many new keys at once
settles slot conflicts between them by letting the first claimant of a free slot win; the others
probe on. The table doubles (a vectorised re-insert of every id) when it is half full.

Memory: 8 bytes per slot (2-4 slots per key) plus 16 bytes of key per id: 32-48 bytes per row.
The slot hash is multiplicative on a mix of both words (the ids are already uniform hashes; the
mix keeps keys that share a column id apart).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["KeyIndex"]

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]

#: Initial number of slots (a power of two).
_INITIAL_SLOTS = 1024
#: The table doubles before more than this fraction of its slots is used.
_MAX_LOAD = 0.5
_MIX_A_INT = 0x9E3779B97F4A7C15
_MIX_B_INT = 0xC2B2AE3D27D4EB4F
_MASK64 = (1 << 64) - 1
_MIX_A = np.uint64(_MIX_A_INT)
_MIX_B = np.uint64(_MIX_B_INT)


class KeyIndex:
    """Dense ids for (a, b) uint64 key pairs (module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self._slots: I64 = np.full(_INITIAL_SLOTS, -1, np.int64)
        self._bits = int(_INITIAL_SLOTS).bit_length() - 1
        self._a: U64 = np.empty(_INITIAL_SLOTS, np.uint64)
        self._b: U64 = np.empty(_INITIAL_SLOTS, np.uint64)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return int(self._slots.nbytes + self._a.nbytes + self._b.nbytes)

    def keys(self) -> tuple[U64, U64]:
        """The key of every id, in id order (views; do not mutate)."""
        return self._a[: self._n], self._b[: self._n]

    def _home(self, a: U64, b: U64) -> I64:
        h = (a * _MIX_A) ^ (b * _MIX_B)
        h ^= h >> np.uint64(29)
        h *= _MIX_A
        return (h >> np.uint64(64 - self._bits)).astype(np.int64)

    def lookup(self, a: U64, b: U64) -> I64:
        """The id of every key (a[i], b[i]), or -1 where the key is not indexed."""
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        out = np.full(a.shape[0], -1, np.int64)
        pending = np.arange(a.shape[0])
        slot = self._home(a, b)
        mask = (1 << self._bits) - 1
        while pending.shape[0]:
            sid = self._slots[slot]
            held = sid >= 0
            safe = np.where(held, sid, 0)
            match = held & (self._a[safe] == a[pending]) & (self._b[safe] == b[pending])
            out[pending[match]] = sid[match]
            go_on = held & ~match
            pending = pending[go_on]
            slot = (slot[go_on] + 1) & mask
        return out

    def lookup_one(self, a: int, b: int) -> int:
        """The id of one key, or -1: ``lookup`` in Python ints (a few µs less than a 1-element call)."""
        h = ((a * _MIX_A_INT) ^ (b * _MIX_B_INT)) & _MASK64
        h ^= h >> 29
        slot = ((h * _MIX_A_INT) & _MASK64) >> (64 - self._bits)
        mask = (1 << self._bits) - 1
        slots, ka, kb = self._slots, self._a, self._b
        while True:
            sid = int(slots[slot])
            if sid < 0:
                return -1
            if int(ka[sid]) == a and int(kb[sid]) == b:
                return sid
            slot = (slot + 1) & mask

    def lookup_or_add(self, a: U64, b: U64) -> tuple[I64, NDArray[np.bool_]]:
        """Ids of the keys, adding those not indexed yet (new ids in the order of first occurrence).

        Returns:
            (ids, added): ``added[i]`` is True where key i got a new id in this call (only its first
            occurrence, if a key repeats).
        """
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        ids = self.lookup(a, b)
        missing = np.flatnonzero(ids < 0)
        added = np.zeros(a.shape[0], bool)
        if missing.shape[0] == 0:
            return ids, added
        # first occurrences of the missing keys, in order (a batch's keys are usually unique already)
        ma, mb = a[missing], b[missing]
        pair = np.empty(missing.shape[0], [("a", np.uint64), ("b", np.uint64)])
        pair["a"], pair["b"] = ma, mb
        _, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        first = first[order]
        new_ids = np.arange(self._n, self._n + first.shape[0], dtype=np.int64)
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0])
        self._append(ma[first], mb[first])
        ids[missing] = new_ids[rank[inverse.reshape(-1)]]
        added[missing[first]] = True
        return ids, added

    def _append(self, a: U64, b: U64) -> None:
        k = int(a.shape[0])
        first = self._n
        if first + k > self._a.shape[0]:
            cap = max(self._a.shape[0] * 2, first + k)
            self._a = np.resize(self._a, cap)
            self._b = np.resize(self._b, cap)
        self._a[first:first + k] = a
        self._b[first:first + k] = b
        self._n = first + k
        if self._n > _MAX_LOAD * self._slots.shape[0]:
            bits = self._bits
            while self._n > _MAX_LOAD * (1 << bits):
                bits += 1
            self._bits = bits
            self._slots = np.full(1 << bits, -1, np.int64)
            self._place(np.arange(self._n, dtype=np.int64))
        else:
            self._place(np.arange(first, self._n, dtype=np.int64))

    def _place(self, ids: I64) -> None:
        """Put ids (whose keys are not in the table) into free slots, all at once."""
        mask = (1 << self._bits) - 1
        slot = self._home(self._a[ids], self._b[ids])
        while ids.shape[0]:
            free = self._slots[slot] < 0
            # among claimants of one free slot, the first wins; everyone else probes on
            cand = np.flatnonzero(free)
            _, win = np.unique(slot[cand], return_index=True)
            won = cand[win]
            self._slots[slot[won]] = ids[won]
            keep = np.ones(ids.shape[0], bool)
            keep[won] = False
            ids = ids[keep]
            slot = (slot[keep] + 1) & mask
