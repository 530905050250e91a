"""An index from 128-bit row keys (two uint64) to dense row ids, in numpy arrays (no Python dict).

Theory of operation
-------------------
A row key is ``(a, b)`` = (source column id, source feature id), both 64-bit content hashes. Ids
are handed out densely in first-appearance order (0, 1, 2, ...: a call's new keys get the next ids
in the order they first occur in its input) and never change or get reused, so other arrays can be
indexed by id (the row engine's lengths, the runs' row lists). The index is an open-addressing hash
table with linear probing:

- ``_slots``: int64[capacity] (a power of two): 0 for an empty slot (a new table is ``np.zeros``,
  whose pages the OS zeroes as they are first touched, not a fill pass), else the id + 1 in the low
  40 bits and a 23-bit *tag* of the key's hash above them (a walk reads a held slot's key only when
  the tags match: other keys' slots cost no key fetch);
- ``_a``, ``_b``: uint64, the key of each id (grown by doubling).

Every probe loop is a compiled kernel (giaannd/rowengine/jit.py) that walks the keys one at a time,
each from its home slot until it meets its key or an empty slot: lookups (``_lookup``), lookups
that insert what they miss (``_find_or_add``, for ``ids_of`` and ``lookup_or_add``; in a table too
small to prefetch in, ``_find_or_add_near``: the same walk in a loop of its own), placing new ids
(``_place``: ``append`` and the re-insert when the table doubles) and ``append_new``'s checked
placement. One key costs one walk of its probe sequence (~1.2-1.5 slots at load ≤ 1/2), whatever
the batch size. Before them each probe round was a dozen numpy calls over the keys still unresolved
(~40 numpy passes per key, and slot conflicts within a batch settled by claim marks): 2-13x slower
per key (docs/model.md, "The LIF step", has the figures). The table doubles (every id re-placed in
id order) when it would be more than ``max_load`` full; a kernel that inserts stops at the key that
would overfill it, the table grows, and it resumes there, so a batch of keys that are mostly held
already (a LIF row fired again) never makes room for keys it does not add. In a table of at least
``_PREFETCH_BYTES`` the walks prefetch slots and keys a few dozen keys ahead (``prefetch``), so the
cache misses of keys in a row overlap. The kernels take read-only key arrays as they are. A caller
that kept the ids of some keys can check them instead of looking the keys up again (``holds``: the
key stored for each id compared with the given one, no walk; a LIF session's row fired again).

Memory: 8 bytes per slot (2-4 slots per key at the default load 1/2; ``max_load`` lowers it) plus 16
bytes of key per id: 32-48 bytes per row.
The slot hash is multiplicative on a mix of both words (the ids are already uniform hashes; the
mix keeps keys that share a column id apart); :func:`slot_hash` is it in Python ints (the home slot
is its top ``bits`` bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, prefetch

__all__ = ["KeyIndex", "pair_hash", "slot_hash"]

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]

#: Initial number of slots (a power of two).
_INITIAL_SLOTS = 1024
#: The table doubles before more than this fraction of its slots is used.
_MAX_LOAD = 0.5
#: When an inserting kernel stops on a full table with r keys of its input left, the table is sized
#: for all r as new ones if the index holds fewer than r / _FEW_KEYS keys (a session's first long
#: row: one re-insert of few ids instead of a doubling per factor 2); otherwise it doubles.
_FEW_KEYS = 16
_MIX_A_INT = 0x9E3779B97F4A7C15
_MIX_B_INT = 0xC2B2AE3D27D4EB4F
_MASK64 = (1 << 64) - 1
_MIX_A = np.uint64(_MIX_A_INT)
_MIX_B = np.uint64(_MIX_B_INT)
_SHIFT_MIX = np.uint64(29)

_TABLE = "int64[::1], uint64[::1], uint64[::1], int64"  # slots, key a, key b, bits
#: Input keys: C-contiguous, possibly read-only (rows decoded from a log or the wire are).
_IN = 'Array(uint64, 1, "C", readonly=True)'
#: Ids a caller passes back (``holds``): C-contiguous int64, possibly read-only.
_IDS_IN = 'Array(int64, 1, "C", readonly=True)'
#: Kernels prefetch (``prefetch``) only in a table of at least this many bytes: in a smaller one
#: (it fits the cache with the keys) the hints cost more than they save (measured: 10^4-10^5 keys
#: 5-30 % slower with them, 10^6 keys into 2^22 slots 1.6-3x faster).
_PREFETCH_BYTES = 8 << 20
#: How many keys ahead the kernels prefetch: the home slot 2·_AHEAD keys ahead, the key of the id
#: found there _AHEAD keys ahead (measured: 8 → 16 → 32 gave 19.0 / 17.6 / 17.3 ns per new key).
_AHEAD = 16
#: The ring of home slots computed ahead (a power of two > 2·_AHEAD).
_RING = 64
_RING_MASK = _RING - 1
#: ``_find_or_add``'s ``added`` when the caller wants no marks.
_NO_MARKS = np.zeros(0, np.bool_)
#: A slot entry is ``tag << _ID_BITS | (id + 1)``, 0 when empty: ids below 2^40 - 1, and the tag (the
#: hash's low ``_TAG_BITS`` bits, which no table uses for its home slot below 2^41 slots) lets a walk
#: pass the slots of other keys without reading their keys (another cache miss each) but for one
#: in 2^23. The entry stays positive (63 bits), 8 bytes a slot as before.
_ID_BITS = 40
_TAG_BITS = 23
_ID_MASK = np.int64((1 << _ID_BITS) - 1)
_TAG_MASK = np.uint64((1 << _TAG_BITS) - 1)
#: Most ids an index holds.
_MAX_IDS = (1 << _ID_BITS) - 2


def slot_hash(a: int, b: int) -> int:
    """The 64-bit slot hash of key (a, b) in Python ints; the home slot in a table of ``2**bits``
    slots is ``slot_hash(a, b) >> (64 - bits)`` (what the kernels compute in uint64)."""
    h = ((a * _MIX_A_INT) ^ (b * _MIX_B_INT)) & _MASK64
    h ^= h >> 29
    return (h * _MIX_A_INT) & _MASK64


@kernel("uint64(uint64, uint64)")
def _hash(a: np.uint64, b: np.uint64) -> np.uint64:
    """``slot_hash(a, b)`` in uint64: the home slot is its top bits, the tag its low ``_TAG_BITS``."""
    h = (a * _MIX_A) ^ (b * _MIX_B)
    h ^= h >> _SHIFT_MIX
    h *= _MIX_A
    return h


#: The mix of two 64-bit words that places keys, for other kernels that hash keys the same way
#: (deltafilter.py chains it over an entry's fields).
pair_hash = _hash


@kernel("int64(uint64)")
def _tag(h: np.uint64) -> np.int64:
    """The tag bits of a slot entry for hash ``h`` (its low ``_TAG_BITS`` bits, above the id bits)."""
    return np.int64(h & _TAG_MASK) << _ID_BITS


@kernel(f"void({_TABLE}, {_IN}, {_IN}, int64, int64[::1])")
def _lookup(slots: I64, ka: U64, kb: U64, bits: int, a: U64, b: U64, ahead: int, out: I64) -> None:
    """``out[i]``: the id of key (a[i], b[i]) or -1. ``ahead`` > 0 (≤ ``_AHEAD``): prefetch each key's
    home slot 2·ahead keys before its walk, and the key of the id held there ahead keys before."""
    mask = (np.int64(1) << bits) - 1
    shift = np.uint64(64 - bits)
    m = a.shape[0]
    ring = np.empty(_RING, np.uint64)
    for j in range(min(2 * ahead, m)):
        ring[j] = _hash(a[j], b[j])
        prefetch(slots, np.int64(ring[j] >> shift))
    for i in range(m):
        x = a[i]
        y = b[i]
        if ahead:
            h = ring[i & _RING_MASK]
            j = i + 2 * ahead
            if j < m:
                g = _hash(a[j], b[j])
                ring[j & _RING_MASK] = g
                prefetch(slots, np.int64(g >> shift))
            if i + ahead < m:
                # that key's home slot was asked for ``ahead`` keys ago: ask for the key of the id
                # held there if the tags match (only then is it compared). Written out here and in
                # the other walk: as a numba helper (even ``inline="always"``) the walks measured
                # 1.2-2.8x slower at 10^6 keys (reference counting of the arrays passed, per key).
                g = ring[(i + ahead) & _RING_MASK]
                v = slots[np.int64(g >> shift)]
                if v and (v & ~_ID_MASK) == _tag(g):
                    prefetch(ka, (v & _ID_MASK) - 1)
                    prefetch(kb, (v & _ID_MASK) - 1)
        else:
            h = _hash(x, y)
        s = np.int64(h >> shift)
        tag = _tag(h)
        while True:
            v = slots[s]
            if v == 0:
                out[i] = -1
                break
            if (v & ~_ID_MASK) == tag:
                sid = (v & _ID_MASK) - 1
                if ka[sid] == x and kb[sid] == y:
                    out[i] = sid
                    break
            s = (s + 1) & mask


@kernel(f"int64({_TABLE}, uint64, uint64)")
def _lookup_one(slots: I64, ka: U64, kb: U64, bits: int, x: int, y: int) -> int:
    """The id of key (x, y), or -1 (``_lookup`` for one key, no arrays to make)."""
    mask = (np.int64(1) << bits) - 1
    h = _hash(np.uint64(x), np.uint64(y))
    s = np.int64(h >> np.uint64(64 - bits))
    tag = _tag(h)
    while True:
        v = slots[s]
        if v == 0:
            return -1
        if (v & ~_ID_MASK) == tag:
            sid = (v & _ID_MASK) - 1
            if ka[sid] == x and kb[sid] == y:
                return int(sid)
        s = (s + 1) & mask


@kernel(f"UniTuple(int64, 2)({_TABLE}, int64, int64, {_IN}, {_IN}, int64, int64, int64[::1], "
        "bool_[::1])")
def _find_or_add(slots: I64, ka: U64, kb: U64, bits: int, n: int, limit: int, a: U64, b: U64, start: int,
                 ahead: int, out: I64, added: NDArray[np.bool_]) -> tuple[int, int]:
    """Ids of keys ``start..`` into ``out``, a missing key getting id ``n`` (then n + 1, ...) and, if
    ``added`` is not empty, ``added[i] = True``. Stops before adding id ``limit``: returns (the
    position reached, the new n). ``ahead``: prefetching as in ``_lookup`` (the hints read the
    table as it is when they are issued; every walk reads it again)."""
    mask = (np.int64(1) << bits) - 1
    shift = np.uint64(64 - bits)
    mark = added.shape[0] > 0
    m = a.shape[0]
    ring = np.empty(_RING, np.uint64)
    for j in range(start, min(start + 2 * ahead, m)):
        ring[j & _RING_MASK] = _hash(a[j], b[j])
        prefetch(slots, np.int64(ring[j & _RING_MASK] >> shift))
    for i in range(start, m):
        x = a[i]
        y = b[i]
        if ahead:
            h = ring[i & _RING_MASK]
            j = i + 2 * ahead
            if j < m:
                g = _hash(a[j], b[j])
                ring[j & _RING_MASK] = g
                prefetch(slots, np.int64(g >> shift))
            if i + ahead < m:
                # that key's home slot was asked for ``ahead`` keys ago: ask for the key of the id
                # held there if the tags match (only then is it compared). Written out here and in
                # the other walk: as a numba helper (even ``inline="always"``) the walks measured
                # 1.2-2.8x slower at 10^6 keys (reference counting of the arrays passed, per key).
                g = ring[(i + ahead) & _RING_MASK]
                v = slots[np.int64(g >> shift)]
                if v and (v & ~_ID_MASK) == _tag(g):
                    prefetch(ka, (v & _ID_MASK) - 1)
                    prefetch(kb, (v & _ID_MASK) - 1)
        else:
            h = _hash(x, y)
        s = np.int64(h >> shift)
        tag = _tag(h)
        while True:
            v = slots[s]
            if v == 0:
                if n >= limit:
                    return i, n
                slots[s] = tag | (n + 1)
                ka[n] = x
                kb[n] = y
                out[i] = n
                if mark:
                    added[i] = True
                n += 1
                break
            if (v & ~_ID_MASK) == tag:
                sid = (v & _ID_MASK) - 1
                if ka[sid] == x and kb[sid] == y:
                    out[i] = sid
                    break
            s = (s + 1) & mask
    return m, n


@kernel(f"UniTuple(int64, 2)({_TABLE}, int64, int64, {_IN}, {_IN}, int64, int64[::1], bool_[::1])")
def _find_or_add_near(slots: I64, ka: U64, kb: U64, bits: int, n: int, limit: int, a: U64, b: U64, start: int,
                      out: I64, added: NDArray[np.bool_]) -> tuple[int, int]:
    """``_find_or_add`` without prefetching, for a table below ``_PREFETCH_BYTES`` (a LIF session's
    first fires, the row engine's smaller indexes): the same walk, ids, marks and stop, in a loop of
    its own. Every index is unsigned (numba wraps a negative signed index around: a few instructions
    per access) and the prefetching loop's ring and branches are gone, so the walk's values stay in
    registers: a new key ~4.5 -> ~2.9 ns at 10^4 keys, ~10.7 -> ~7.1 at 10^5 (docs/model.md, "The
    LIF step")."""
    mask = np.uint64((1 << bits) - 1)
    shift = np.uint64(64 - bits)
    mark = added.shape[0] > 0
    for i in range(np.uint64(start), np.uint64(a.shape[0])):
        x = a[i]
        y = b[i]
        h = _hash(x, y)
        s = h >> shift
        tag = _tag(h)
        while True:
            v = slots[s]
            if v == 0:
                if n >= limit:
                    return int(i), n
                slots[s] = tag | (n + 1)
                ka[np.uint64(n)] = x
                kb[np.uint64(n)] = y
                out[i] = n
                if mark:
                    added[i] = True
                n += 1
                break
            if (v & ~_ID_MASK) == tag:
                sid = np.uint64((v & _ID_MASK) - 1)
                if ka[sid] == x and kb[sid] == y:
                    out[i] = np.int64(sid)
                    break
            s = (s + np.uint64(1)) & mask
    return a.shape[0], n


@kernel(f"int64({_TABLE}, int64, int64, int64)")
def _place(slots: I64, ka: U64, kb: U64, bits: int, lo: int, hi: int, ahead: int) -> int:
    """Put ids lo..hi-1 (keys meant to be unique and none in the table) into the first free slot of
    their probe (``ahead`` > 0: prefetch the home slot of the id that many ahead). Returns the first
    of them whose key an id met on its probe holds already (-1: none; it is placed all the same):
    the slots it passes whose tags match are compared, so the check costs a key fetch only for
    one slot in 2^23 of other keys."""
    mask = (np.int64(1) << bits) - 1
    shift = np.uint64(64 - bits)
    repeated = -1
    for sid in range(lo, hi):
        if ahead and sid + ahead < hi:
            prefetch(slots, np.int64(_hash(ka[sid + ahead], kb[sid + ahead]) >> shift))
        x = ka[sid]
        y = kb[sid]
        h = _hash(x, y)
        s = np.int64(h >> shift)
        tag = _tag(h)
        while True:
            v = slots[s]
            if v == 0:
                break
            if repeated < 0 and (v & ~_ID_MASK) == tag:
                other = (v & _ID_MASK) - 1
                if ka[other] == x and kb[other] == y:
                    repeated = sid
            s = (s + 1) & mask
        slots[s] = tag | (sid + 1)
    return repeated


@kernel(f"boolean({_TABLE}, int64, {_IN}, {_IN}, int64)")
def _append_new(slots: I64, ka: U64, kb: U64, bits: int, n0: int, a: U64, b: U64, ahead: int) -> bool:
    """Place keys a[i], b[i] as ids n0 + i, comparing each with the held ids < n0 on its probe (those
    whose tag matches); on a match empty every slot this call wrote (they were free before it) and
    return False."""
    mask = (np.int64(1) << bits) - 1
    shift = np.uint64(64 - bits)
    k = a.shape[0]
    at = np.empty(k, np.int64)
    for i in range(k):
        x = a[i]
        y = b[i]
        if ahead and i + ahead < k:
            prefetch(slots, np.int64(_hash(a[i + ahead], b[i + ahead]) >> shift))
        h = _hash(x, y)
        s = np.int64(h >> shift)
        tag = _tag(h)
        while True:
            v = slots[s]
            if v == 0:
                break
            sid = (v & _ID_MASK) - 1
            if (v & ~_ID_MASK) == tag and sid < n0 and ka[sid] == x and kb[sid] == y:
                for j in range(i):
                    slots[at[j]] = 0
                return False
            s = (s + 1) & mask
        slots[s] = tag | (n0 + i + 1)
        at[i] = s
    for i in range(k):
        ka[n0 + i] = a[i]
        kb[n0 + i] = b[i]
    return True


@kernel(f"boolean(uint64[::1], uint64[::1], int64, {_IN}, {_IN}, {_IDS_IN})")
def _holds(ka: U64, kb: U64, n: int, a: U64, b: U64, ids: I64) -> bool:
    """Whether ``ids[i]`` (< n) is the id of key (a[i], b[i]) for every i: one pass comparing each key
    with the key stored for its id, no probe walk (ids handed out in one call are mostly ascending,
    so the reads of the stored keys are close to sequential)."""
    for i in range(a.shape[0]):
        sid = ids[i]
        if sid < 0 or sid >= n or ka[sid] != a[i] or kb[sid] != b[i]:
            return False
    return True


def _keys(a: U64, b: U64) -> tuple[U64, U64]:
    a = np.ascontiguousarray(a, np.uint64)
    b = np.ascontiguousarray(b, np.uint64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError("key arrays must be 1-d and of one length")
    return a, b


class KeyIndex:
    """Dense ids for (a, b) uint64 key pairs (module docstring), at most 2^40 - 2 of them. Not
    thread-safe."""

    def __init__(self, *, max_load: float = _MAX_LOAD) -> None:
        """``max_load``: the table doubles before more than this fraction of its slots is used. Lower
        means shorter probe walks (fewer slots read per key) for more memory (8 bytes per slot)."""
        if not 0.0 < max_load <= _MAX_LOAD:
            raise ValueError(f"max_load must be in (0, {_MAX_LOAD}]")
        self._max_load = max_load
        self._slots: I64 = np.zeros(_INITIAL_SLOTS, np.int64)
        self._bits = int(_INITIAL_SLOTS).bit_length() - 1
        self._a: U64 = np.empty(_INITIAL_SLOTS, np.uint64)
        self._b: U64 = np.empty(_INITIAL_SLOTS, np.uint64)
        self._n = 0
        self._sized()

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return int(self._slots.nbytes + self._a.nbytes + self._b.nbytes)

    def arrays(self) -> list[NDArray[Any]]:
        """The table and the keys' arrays (whole buffers, room included): for page advice."""
        return [self._slots, self._a, self._b]

    def keys(self) -> tuple[U64, U64]:
        """The key of every id, in id order (views; do not mutate)."""
        return self._a[: self._n], self._b[: self._n]

    def lookup(self, a: U64, b: U64) -> I64:
        """The id of every key (a[i], b[i]), or -1 where the key is not indexed."""
        a, b = _keys(a, b)
        out = np.empty(a.shape[0], np.int64)
        _lookup(self._slots, self._a, self._b, self._bits, a, b, self._ahead, out)
        return out

    def lookup_one(self, a: int, b: int) -> int:
        """The id of one key, or -1."""
        return int(_lookup_one(self._slots, self._a, self._b, self._bits, a, b))

    def lookup_or_add(self, a: U64, b: U64) -> tuple[I64, NDArray[np.bool_]]:
        """Ids of the keys, adding those not indexed yet: new keys get the next dense ids in the
        order they first occur in the input. Keys may repeat in the input.

        Returns:
            (ids, added): ``added[i]`` is True for the first occurrence of each key this call added.
        """
        a, b = _keys(a, b)
        added = np.zeros(a.shape[0], np.bool_)
        return self._find_or_add(a, b, added), added

    def ids_of(self, a: U64, b: U64) -> I64:
        """``lookup_or_add`` without the ``added`` mask (the LIF session's state slots): the same ids."""
        a, b = _keys(a, b)
        return self._find_or_add(a, b, _NO_MARKS)

    def holds(self, a: U64, b: U64, ids: I64) -> bool:
        """Whether every ``ids[i]`` is the id of key (a[i], b[i]) here: the ids a caller remembered
        from an earlier ``ids_of`` of the same keys are still right for these keys (ids never change,
        so this is a comparison of keys, not a lookup: ~1-2 ns per key instead of a probe walk).

        Raises:
            ValueError: ``ids`` is not int64 of the keys' length."""
        a, b = _keys(a, b)
        if ids.dtype != np.int64 or ids.shape != a.shape:
            raise ValueError("ids must be int64, one per key")
        return bool(_holds(self._a, self._b, self._n, a, b, np.ascontiguousarray(ids)))

    def _find_or_add(self, a: U64, b: U64, added: NDArray[np.bool_]) -> I64:
        m = int(a.shape[0])
        out = np.empty(m, np.int64)
        i = 0
        while True:
            if self._ahead:
                i, n = _find_or_add(self._slots, self._a, self._b, self._bits, self._n, self._limit, a, b, i,
                                    self._ahead, out, added)
            else:
                i, n = _find_or_add_near(self._slots, self._a, self._b, self._bits, self._n, self._limit, a, b, i,
                                         out, added)
            self._n = int(n)
            if i == m:
                return out
            rest = m - int(i)
            self._reserve(self._n + (rest if self._n * _FEW_KEYS <= rest else 1))

    def append(self, a: U64, b: U64) -> I64:
        """Index keys known to be new and unique (the caller checked): they get the next ids in the
        order given."""
        a, b = _keys(a, b)
        k = int(a.shape[0])
        n0 = self._n
        self._reserve(n0 + k)
        self._a[n0:n0 + k] = a
        self._b[n0:n0 + k] = b
        self._n = n0 + k
        _place(self._slots, self._a, self._b, self._bits, n0, n0 + k, self._ahead)
        return np.arange(n0, n0 + k, dtype=np.int64)

    def append_new(self, a: U64, b: U64) -> I64 | None:
        """``append`` of keys the caller believes new (unique among themselves, as for ``append``),
        checked as they are placed: None, with no key added, when one of them is indexed already
        (the table may have grown: the same index, more room).

        Why no lookup pass is needed: an indexed key sits in the run of held slots that starts at
        its home slot (linear probing, and no slot is ever emptied: a drop rebuilds the index), so
        this key's own probe passes it before it meets a free slot. Only slots held by ids from
        before this call are compared. ``lookup`` + ``append`` cost two walks for the same answer (a
        replay's new rows, RowEngine.append_new_rows)."""
        a, b = _keys(a, b)
        k = int(a.shape[0])
        n0 = self._n
        self._reserve(n0 + k)
        if not _append_new(self._slots, self._a, self._b, self._bits, n0, a, b, self._ahead):
            return None
        self._n = n0 + k
        return np.arange(n0, n0 + k, dtype=np.int64)

    @classmethod
    def from_keys(cls, a: U64, b: U64) -> KeyIndex:
        """An index whose id i is key ``(a[i], b[i])`` (a snapshot's rows, a store after a drop).
        Writable contiguous uint64 arrays become the index's key arrays as they are (no copy into
        fresh memory, whose page faults are most of a load's cost: docs/storage.md "Bulk load"):
        the caller must not change them afterwards. The index never writes into them: they are
        full, so a key added later grows the index into new arrays.

        Raises:
            ValueError: a key repeats (found as the keys are placed: a repeated key's probe passes
                the slot of its first occurrence, linear probing, ``_place``; one walk per key,
                where looking every key up again afterwards cost a second one).
        """
        a, b = _keys(a, b)
        if not (a.flags.writeable and b.flags.writeable):
            a, b = a.copy(), b.copy()
        index = cls()
        index._a, index._b = a, b
        index._sized()
        index._reserve(a.shape[0])  # the table only (no id in it yet): the key arrays are full
        index._n = int(a.shape[0])
        if _place(index._slots, a, b, index._bits, 0, index._n, index._ahead) >= 0:
            raise ValueError("row keys repeat")
        return index

    def _sized(self) -> None:
        """After the table or the key arrays changed: the most ids they hold (``_limit``) and how far
        ahead the kernels prefetch in this table (``_ahead``, 0: not at all)."""
        self._limit = min(int(self._a.shape[0]), int(self._max_load * self._slots.shape[0]))
        self._ahead = _AHEAD if self._slots.nbytes >= _PREFETCH_BYTES else 0

    def _reserve(self, n: int) -> None:
        """Room for ``n`` keys: key arrays, and a table at most ``max_load`` full (re-placing every id).

        Raises:
            OverflowError: more than 2^40 - 2 keys (the ids' bits in a slot entry)."""
        if n > _MAX_IDS:
            raise OverflowError(f"a KeyIndex holds at most {_MAX_IDS} keys")
        if n > self._a.shape[0]:
            cap = max(self._a.shape[0] * 2, n)
            # not np.resize: it fills the new tail by repeating the keys (a pass over it for nothing)
            for name in ("_a", "_b"):
                grown = np.empty(cap, np.uint64)
                grown[: self._n] = getattr(self, name)[: self._n]
                setattr(self, name, grown)
            self._sized()
        if n > self._max_load * self._slots.shape[0]:
            bits = self._bits
            while n > self._max_load * (1 << bits):
                bits += 1
            self._bits = bits
            self._slots = np.zeros(1 << bits, np.int64)  # calloc: no pass over it; pages on first touch
            self._sized()
            _place(self._slots, self._a, self._b, self._bits, 0, self._n, self._ahead)
