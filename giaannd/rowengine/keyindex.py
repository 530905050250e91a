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
operations over the keys still unresolved (``x.nonzero()[0]``, not ``np.flatnonzero``, in the probe
loops of ``lookup`` and ``ids_of``: the same indices without ~2 µs of Python wrapping per call,
which adds up over the rounds of a short row), so the Python work is per round (1-3 rounds at load
≤ 1/2, a few more for the rare long cluster), never per key. Inserting many new keys at once
settles slot conflicts between them by letting the first claimant of a free slot win; the others
probe on. The table doubles (a vectorised re-insert of every id) when it is more than ``max_load`` full.

Memory: 8 bytes per slot (2-4 slots per key at the default load 1/2; ``max_load`` lowers it) plus 16
bytes of key per id: 32-48 bytes per row.
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
#: ``ids_of`` makes room for every input key up front while the index holds fewer than 1/_FEW_KEYS
#: as many keys (re-placing them is then cheap next to the input); otherwise it looks up first.
_FEW_KEYS = 16
_MIX_A_INT = 0x9E3779B97F4A7C15
_MIX_B_INT = 0xC2B2AE3D27D4EB4F
_MASK64 = (1 << 64) - 1
_MIX_A = np.uint64(_MIX_A_INT)
_MIX_B = np.uint64(_MIX_B_INT)


class KeyIndex:
    """Dense ids for (a, b) uint64 key pairs (module docstring). Not thread-safe."""

    def __init__(self, *, max_load: float = _MAX_LOAD) -> None:
        """``max_load``: the table doubles before more than this fraction of its slots is used. Lower
        means fewer probe rounds per vectorised call (each round is a few numpy calls over the keys
        left) for more memory (8 bytes per slot): the LIF session's short-lived index uses 1/4."""
        if not 0.0 < max_load <= _MAX_LOAD:
            raise ValueError(f"max_load must be in (0, {_MAX_LOAD}]")
        self._max_load = max_load
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
        # in place where numpy allows: two temporaries instead of five (the same values)
        h = a * _MIX_A
        h ^= b * _MIX_B
        h ^= h >> np.uint64(29)
        h *= _MIX_A
        h >>= np.uint64(64 - self._bits)
        return h.view(np.int64)  # < 2**bits: the same numbers as int64, without a copy

    def lookup(self, a: U64, b: U64) -> I64:
        """The id of every key (a[i], b[i]), or -1 where the key is not indexed."""
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        slot = self._home(a, b)
        out = self._slots[slot]  # round 0 over every key, without gathering the keys again
        held = out >= 0
        safe = np.where(held, out, 0)
        match = held & (self._a[safe] == a) & (self._b[safe] == b)
        out[~match] = -1
        pending = (held & ~match).nonzero()[0]
        slot = (slot[pending] + 1) & ((1 << self._bits) - 1)
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

    def _home_one(self, a: int, b: int) -> int:
        """``_home`` of one key, in Python ints (the same slot)."""
        h = ((a * _MIX_A_INT) ^ (b * _MIX_B_INT)) & _MASK64
        h ^= h >> 29
        return ((h * _MIX_A_INT) & _MASK64) >> (64 - self._bits)

    def lookup_one(self, a: int, b: int) -> int:
        """The id of one key, or -1: ``lookup`` in Python ints (a few µs less than a 1-element call)."""
        slot = self._home_one(a, b)
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
        """Ids of the keys, adding those not indexed yet (new keys get the next dense ids).

        One probe loop for lookups and inserts, no sort: a key meeting an empty slot claims it (of
        several claimants of one slot, one wins; the rest look again at the same slot, which now
        holds a key that may be theirs). Keys may repeat in the input.

        Returns:
            (ids, added): ``added[i]`` is True for exactly one occurrence of each key this call added.
        """
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        ids = self.lookup(a, b)
        added = np.zeros(a.shape[0], bool)
        missing = np.flatnonzero(ids < 0)
        if missing.shape[0]:
            self._reserve(self._n + int(missing.shape[0]))
            self._probe(a, b, missing, ids, added)
        return ids, added

    def ids_of(self, a: U64, b: U64) -> I64:
        """Ids of the keys, adding those not indexed yet: ``lookup_or_add`` in one probe loop.

        For callers that need the ids only (the LIF session's state slots): no ``added`` mask, and
        the order in which new keys get the next dense ids is unspecified (it is the claim order,
        not the input order). When the index is small next to the input (a session's first long
        row), room is made for every key up front and lookups and inserts share every probe round,
        the first on the inputs as given: a key costs one pass of the loop, not a lookup pass and
        then an insert pass as in ``lookup_or_add``. Otherwise (most keys may be there already) it
        looks all up first and makes room for the missing ones only. Keys may repeat in the input.
        """
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        m = int(a.shape[0])
        if m == 0:
            return np.empty(0, np.int64)
        out: I64 | None = None
        pending = np.empty(0, np.int64)
        pa, pb = a, b
        if self._n + m > self._max_load * self._slots.shape[0] and self._n * _FEW_KEYS > m:
            # Room for every key as a new one would mean re-placing many ids for nothing if most are
            # there already (a row fired again): look them all up first, make room for the rest only.
            out = self.lookup(a, b)
            pending = (out < 0).nonzero()[0]
            if pending.shape[0] == 0:
                return out
            self._reserve(self._n + int(pending.shape[0]))
            pa, pb = a[pending], b[pending]
        else:
            self._reserve(self._n + m)  # few ids to re-place: room for every key, no lookup pass
        mask = (1 << self._bits) - 1
        slots, ka, kb = self._slots, self._a, self._b
        slot = self._home(pa, pb)
        while True:
            sid = slots[slot]
            held = sid >= 0
            if out is None and self._n * _FEW_KEYS <= m:
                # round 0 over a (nearly) fresh index: most slots are empty, compare the held ones only
                on = held.nonzero()[0]
                match = np.zeros(held.shape[0], np.bool_)
                match[on] = (ka[sid[on]] == pa[on]) & (kb[sid[on]] == pb[on])
            else:
                # an empty slot's -1 reads the last key array entry (any value): ``held`` masks it out
                match = ka[sid] == pa
                match &= kb[sid] == pb
                match &= held
            free = (~held).nonzero()[0]
            if free.shape[0]:
                # claim marks as in _probe: of several claimants of one slot the last write wins
                at = slot[free]
                tag = -2 - free
                slots[at] = tag
                won = free[slots[at] == tag]
                new = np.arange(self._n, self._n + won.shape[0], dtype=np.int64)
                ka[new] = pa[won]
                kb[new] = pb[won]
                self._n += int(won.shape[0])
                slots[slot[won]] = new
                sid[won] = new
                match[won] = True
            go_on = (~match).nonzero()[0]
            if out is None:
                out = sid  # round 0: every key; the unresolved ones are overwritten below
                pending = go_on
            else:
                out[pending[match]] = sid[match]
                pending = pending[go_on]
            if pending.shape[0] == 0:
                return out
            # a slot held by another key: probe the next one; a lost claim: look at the same slot again
            slot = (slot[go_on] + held[go_on]) & mask
            pa, pb = a[pending], b[pending]

    def append(self, a: U64, b: U64) -> I64:
        """Index keys known to be new and unique (the caller checked): they get the next ids in the
        order given (``lookup_or_add`` gives them in claim order). One vectorised placement."""
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        k = int(a.shape[0])
        self._reserve(self._n + k)
        new = np.arange(self._n, self._n + k, dtype=np.int64)
        self._a[new] = a
        self._b[new] = b
        self._n += k
        self._place(new)
        return new

    def append_new(self, a: U64, b: U64) -> I64 | None:
        """``append`` of keys the caller believes new (unique among themselves, as for ``append``),
        checked as they are placed: None, with no key added, when one of them is indexed already
        (the table may have grown: the same index, more room).

        Why no lookup pass is needed: an indexed key sits in the run of held slots that starts at
        its home slot (linear probing, and no slot is ever emptied: a drop rebuilds the index), so
        this key's own probe passes it before it meets a free slot. Only slots held by ids from
        before this call are compared. ``lookup`` + ``append`` cost two passes over the table for
        the same answer (a replay's new rows, RowEngine.append_new_rows)."""
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        k = int(a.shape[0])
        n0 = self._n
        self._reserve(n0 + k)
        mask = (1 << self._bits) - 1
        slots, ka, kb = self._slots, self._a, self._b
        pending = np.arange(k, dtype=np.int64)  # input positions still to place
        slot = self._home(a, b)
        written: list[I64] = []
        while pending.shape[0]:
            sid = slots[slot]
            older = ((sid >= 0) & (sid < n0)).nonzero()[0]
            if older.shape[0]:
                at_old, key = sid[older], pending[older]
                if bool(((ka[at_old] == a[key]) & (kb[at_old] == b[key])).any()):
                    for w in written:  # undo: these slots were free before this call
                        slots[w] = -1
                    return None
            free = (sid < 0).nonzero()[0]
            at = slot[free]
            slots[at] = -2 - free  # claim marks as in _place: one claimant per slot wins
            won = free[slots[at] == -2 - free]
            slots[slot[won]] = n0 + pending[won]
            written.append(slot[won])
            keep = np.ones(pending.shape[0], bool)
            keep[won] = False
            pending = pending[keep]
            slot = (slot[keep] + 1) & mask
        new = np.arange(n0, n0 + k, dtype=np.int64)
        ka[new] = a
        kb[new] = b
        self._n = n0 + k
        return new

    @classmethod
    def from_keys(cls, a: U64, b: U64) -> KeyIndex:
        """An index whose id i is key ``(a[i], b[i])`` (a snapshot's rows, a store after a drop).

        Raises:
            ValueError: a key repeats (found by looking every key up again: a repeated key's
                later ids are not what the lookup returns).
        """
        index = cls()
        ids = index.append(a, b)
        if ids.shape[0] and not np.array_equal(index.lookup(a, b), ids):
            raise ValueError("row keys repeat")
        return index

    def _probe(self, a: U64, b: U64, pending: I64, ids: I64, added: NDArray[np.bool_]) -> None:
        """Resolve keys ``(a[i], b[i])`` for i in ``pending``: find, or claim a slot for, each."""
        mask = (1 << self._bits) - 1
        slot = self._home(a[pending], b[pending])
        slots = self._slots
        while pending.shape[0]:
            sid = slots[slot]
            held = sid >= 0
            safe = np.where(held, sid, 0)
            match = held & (self._a[safe] == a[pending]) & (self._b[safe] == b[pending])
            ids[pending[match]] = sid[match]
            settled = match
            free = np.flatnonzero(~held)
            if free.shape[0]:
                at, who = slot[free], pending[free]
                slots[at] = -2 - who  # claim marks; one per slot survives
                won = free[slots[at] == -2 - who]
                new = np.arange(self._n, self._n + won.shape[0], dtype=np.int64)
                self._a[new] = a[pending[won]]
                self._b[new] = b[pending[won]]
                self._n += int(won.shape[0])
                slots[slot[won]] = new
                ids[pending[won]] = new
                added[pending[won]] = True
                settled = settled.copy()
                settled[won] = True
            go_on = ~settled
            # a slot held by another key: probe the next one; a lost claim: look at the same slot again
            slot = np.where(held[go_on], slot[go_on] + 1, slot[go_on]) & mask
            pending = pending[go_on]

    def _reserve(self, n: int) -> None:
        """Room for ``n`` keys: key arrays, and a table at most ``max_load`` full (re-placing every id)."""
        if n > self._a.shape[0]:
            cap = max(self._a.shape[0] * 2, n)
            # not np.resize: it fills the new tail by repeating the keys (a pass over it for nothing)
            for name in ("_a", "_b"):
                grown = np.empty(cap, np.uint64)
                grown[: self._n] = getattr(self, name)[: self._n]
                setattr(self, name, grown)
        if n > self._max_load * self._slots.shape[0]:
            bits = self._bits
            while n > self._max_load * (1 << bits):
                bits += 1
            self._bits = bits
            self._slots = np.full(1 << bits, -1, np.int64)
            self._place(np.arange(self._n, dtype=np.int64))

    def _place(self, ids: I64) -> None:
        """Put ids (unique keys, none in the table) into free slots, all at once (claims as in
        ``_probe``; a claimant that loses probes on)."""
        mask = (1 << self._bits) - 1
        slot = self._home(self._a[ids], self._b[ids])
        slots = self._slots
        while ids.shape[0]:
            free = np.flatnonzero(slots[slot] < 0)
            at = slot[free]
            slots[at] = -2 - free
            won = free[slots[at] == -2 - free]
            slots[slot[won]] = ids[won]
            keep = np.ones(ids.shape[0], bool)
            keep[won] = False
            ids = ids[keep]
            slot = (slot[keep] + 1) & mask
