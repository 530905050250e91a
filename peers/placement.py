"""Placement: which storage members own a 64-bit key (ARCHITECTURE §6). Pure functions, no I/O.

Theory of operation
-------------------
Weighted rendezvous hashing (HRW, Thaler & Ravishankar 1998). Every (key, member) pair gets a
pseudo-random 64-bit hash ``h``; mapped to ``u`` uniform in (0, 1), the member's score is the
"logarithmic method" of Schindelhauer & Schomaker (2005), ``score = -w / ln(u)``. The R members with
the highest scores, in descending order, are the key's owners (the first is the *primary*).

Why this shape:

- ``-w/ln(u)`` is an exponential race: ``-ln(u)/w`` is Exp(w) distributed, the smallest of several
  independent exponentials is member *i*'s with probability ``w_i / sum(w)``. Weighted shares are
  therefore exact in expectation (not approximately, as with ``w * u``), for any weights.
- Each member's score for a key depends only on (key, member name, weight), so every node computes
  the same owners from the same member set in any order, and adding a member changes a key's owner
  list only by inserting the newcomer: no key moves between two old members (minimal disruption).
- With equal weights the score order is the order of ``h`` itself, so the ``hash`` strategy compares
  integers and skips the logarithm.

The hash is splitmix64's finaliser (Steele et al. 2014) of ``mix(key) ^ seed(member)``, written with
wrapping uint64 numpy operations so thousands of keys are placed in a few vector passes; ``seed`` is
xxh3_64 of the member name. Exact ties (probability ~2**-64) go to the member whose name sorts first,
so the result never depends on input order.

Strategies (after the seed paper's "Neuron Distributor": by count, percentage, identifier):

- ``hash``: equal weights, whatever the members advertise.
- ``weighted``: each member's ``weight`` (its capacity, or an operator percentage: only ratios count).
- ``pinned``: ``hash`` for every key, except keys listed in ``pins`` (key -> member names). Pins are
  honoured by every strategy: a pinned key's owners are its pinned members that are alive, in the
  listed order, then (if fewer than R) the best-scoring other members. A pin naming only dead members
  therefore degrades to ordinary placement instead of making the key unavailable.

The *placement epoch* is a digest of everything that decides ownership (names, weights as used,
strategy, replicas, pins), so two nodes compare 16 bytes to know whether they agree.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import xxhash
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "DEFAULT_REPLICAS",
    "Member",
    "Move",
    "Placement",
    "Strategy",
    "moved",
    "owners",
]

Strategy = Literal["hash", "weighted", "pinned"]
_STRATEGIES: tuple[str, ...] = ("hash", "weighted", "pinned")

#: Replication factor by default (ARCHITECTURE §6): survives one failure with a majority of 2 left.
DEFAULT_REPLICAS = 3

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_INV_2_53 = 1.0 / float(1 << 53)


def _mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic; numpy arrays never warn on it)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


#: Keys whose owner rows one Placement remembers. A compute node's per-token reads and a storage
#: node's ownership check of each request ask about the same hot columns again and again, and the
#: vector path costs a fixed ~15 us of numpy calls however few the keys (tools/bench/readpath.py).
#: 16,384 keys cost about 2 MiB (measured, R = 3: ~136 bytes a key); a full cache is emptied and
#: refilled (a placement lives for one epoch, so nothing in it ever goes stale).
OWNER_CACHE_KEYS = 16_384
#: Calls with at most this many keys go through the cache (one dict lookup per key); larger ones
#: take the vector path alone, whose fixed cost they spread while per-key lookups would grow.
CACHED_CALL_KEYS = 64

#: Above this many members per owner slot, select the top R with argpartition before sorting them.
_PARTITION_FACTOR = 4


def _top(rank: NDArray[np.generic], r: int) -> NDArray[np.intp]:
    """Column indices of the r smallest ranks of each row, ascending; ties to the lower index.

    A full stable argsort of every row costs O(N log N) per key; with many members only the top R
    matter, so argpartition picks them in O(N) and a lexsort on (rank, index) orders those R.
    """
    n = rank.shape[1]
    if n <= _PARTITION_FACTOR * r:
        return np.argsort(rank, axis=1, kind="stable")
    # Ties at the partition boundary need equal 64-bit hashes (p ~ 2**-64): not worth a slow path.
    part = np.argpartition(rank, r - 1, axis=1)[:, :r]
    vals = np.take_along_axis(rank, part, axis=1)
    inner = np.lexsort((part, vals), axis=1)
    return np.take_along_axis(part, inner, axis=1)


@dataclass(frozen=True, slots=True)
class Member:
    """A storage member as placement sees it: a unique name and a positive weight."""

    name: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("member name must be non-empty")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"member {self.name!r}: weight must be finite and > 0, got {self.weight}")


@dataclass(frozen=True, slots=True)
class Move:
    """A key whose owner list differs between two placements."""

    key: int
    old: tuple[str, ...]
    new: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Placement:
    """Owners of keys over one member set. Immutable; build a new one when membership changes.

    Args:
        members: the alive storage members (any order; names must be unique).
        replicas: R, the number of owners per key (capped by the member count).
        strategy: ``hash``, ``weighted`` or ``pinned`` (module docstring).
        pins: key -> member names, honoured by every strategy.

    Raises:
        ValueError: duplicate names, no members, replicas < 1, unknown strategy.
    """

    members: tuple[Member, ...]
    replicas: int = DEFAULT_REPLICAS
    strategy: Strategy = "hash"
    pins: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    _names: tuple[str, ...] = field(init=False, repr=False)
    _seeds: NDArray[np.uint64] = field(init=False, repr=False)
    _log_w: NDArray[np.float64] = field(init=False, repr=False)
    _epoch: str = field(init=False, repr=False)
    _owner_cache: dict[int, tuple[int, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"unknown placement strategy {self.strategy!r}; expected one of {_STRATEGIES}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        ordered = tuple(sorted(self.members, key=lambda m: m.name))
        if not ordered:
            raise ValueError("placement needs at least one member")
        names = tuple(m.name for m in ordered)
        if len(set(names)) != len(names):
            raise ValueError("member names must be unique")
        pins = {int(k) & 0xFFFFFFFFFFFFFFFF: tuple(v) for k, v in self.pins.items()}
        set_ = object.__setattr__
        set_(self, "members", ordered)
        set_(self, "pins", pins)
        set_(self, "_names", names)
        set_(self, "_seeds", np.array([xxhash.xxh3_64_intdigest(n.encode()) for n in names], np.uint64))
        weights = [m.weight if self.strategy == "weighted" else 1.0 for m in ordered]
        set_(self, "_log_w", np.log(np.array(weights, np.float64)))
        set_(self, "_epoch", self._digest(weights))
        set_(self, "_owner_cache", {})

    # -- identity -------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """Member names in the canonical (sorted) order that owner indices refer to."""
        return self._names

    @property
    def epoch(self) -> str:
        """Hex digest of everything that decides ownership; equal epochs mean equal placements."""
        return self._epoch

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self._epoch == other._epoch

    def __hash__(self) -> int:
        return hash(self._epoch)

    @property
    def effective_replicas(self) -> int:
        return min(self.replicas, len(self._names))

    def _digest(self, weights: Sequence[float]) -> str:
        h = xxhash.xxh3_128()
        h.update(struct.pack("<4sII", b"PLC1", self.replicas, _STRATEGIES.index(self.strategy)))
        for name, w in zip(self._names, weights):
            raw = name.encode()
            h.update(struct.pack("<I", len(raw)) + raw + struct.pack("<d", w))
        for key in sorted(self.pins):
            h.update(struct.pack("<QI", key, len(self.pins[key])))
            for name in self.pins[key]:
                raw = name.encode()
                h.update(struct.pack("<I", len(raw)) + raw)
        return h.hexdigest()

    # -- owners ---------------------------------------------------------------------------------
    def owner_indices(self, keys: ArrayLike) -> NDArray[np.intp]:
        """Owner indices (into ``names``) of many keys: shape (len(keys), R), best first.

        This is the hot path of a compute node grouping a batch's rows by owner: a few vector passes
        over a (keys x members) matrix, then a per-key loop only for pinned keys. A call with few
        keys (``CACHED_CALL_KEYS``) is answered from the placement's cache of owner rows when it
        holds every key (``OWNER_CACHE_KEYS``): small reads pay a dict lookup per key instead.
        """
        k = np.asarray(keys).astype(np.uint64, copy=False).reshape(-1)
        if k.shape[0] > CACHED_CALL_KEYS:
            return self._compute_owner_indices(k)
        cache = self._owner_cache
        wanted = k.tolist()
        rows = [cache.get(key) for key in wanted]
        if None not in rows:
            return np.array(rows, np.intp).reshape(len(wanted), self.effective_replicas)
        out = self._compute_owner_indices(k)
        if len(cache) + len(wanted) > OWNER_CACHE_KEYS:
            cache.clear()
        cache.update(zip(wanted, map(tuple, out.tolist())))
        return out

    def _compute_owner_indices(self, k: NDArray[np.uint64]) -> NDArray[np.intp]:
        """``owner_indices`` by the vector passes (no cache)."""
        r = self.effective_replicas
        mixed = _mix64(k)[:, None]
        h = _mix64(mixed ^ self._seeds[None, :])
        if self.strategy == "weighted":
            # score = -w/ln(u) is ordered like log(w) - log(-ln(u)); the log form never overflows.
            u = ((h >> _S11).astype(np.float64) + 0.5) * _INV_2_53
            rank: NDArray[np.generic] = np.log(np.log(u) * -1.0) - self._log_w[None, :]  # ascending = best
        else:
            rank = ~h  # ascending = highest hash first
        order = _top(rank, r if not self.pins else rank.shape[1])
        out = np.ascontiguousarray(order[:, :r])
        if self.pins:
            self._apply_pins(k, order, out)
        return out

    def _apply_pins(self, keys: NDArray[np.uint64], order: NDArray[np.intp], out: NDArray[np.intp]) -> None:
        index = {n: i for i, n in enumerate(self._names)}
        pinned = np.flatnonzero(np.isin(keys, np.fromiter(self.pins, np.uint64, len(self.pins))))
        r = out.shape[1]
        for row in pinned:
            chosen = [index[n] for n in dict.fromkeys(self.pins[int(keys[row])]) if n in index][:r]
            rest = [int(i) for i in order[row] if int(i) not in chosen]
            out[row] = (chosen + rest)[:r]

    def owners(self, key: int) -> tuple[str, ...]:
        """The ordered owners of one key (primary first)."""
        idx = self.owner_indices(np.array([key & 0xFFFFFFFFFFFFFFFF], np.uint64))[0]
        return tuple(self._names[int(i)] for i in idx)

    def primary_indices(self, keys: ArrayLike) -> NDArray[np.intp]:
        """Index of the primary owner of each key."""
        return self.owner_indices(keys)[:, 0]

    def group_by_owner(self, keys: ArrayLike) -> dict[str, NDArray[np.intp]]:
        """For each member, the positions in ``keys`` of the keys it owns (as any of the R owners)."""
        idx = self.owner_indices(keys)
        out: dict[str, NDArray[np.intp]] = {}
        for m, name in enumerate(self._names):
            hit = np.flatnonzero((idx == m).any(axis=1))
            if hit.size:
                out[name] = hit
        return out


def owners(
    key: int, members: Iterable[Member], replicas: int = DEFAULT_REPLICAS, strategy: Strategy = "hash"
) -> tuple[str, ...]:
    """The ordered owners of ``key`` (convenience wrapper over :class:`Placement`)."""
    return Placement(tuple(members), replicas, strategy).owners(key)


def moved(old: Placement, new: Placement, keys: ArrayLike) -> list[Move]:
    """The keys whose owner lists differ between ``old`` and ``new`` (join / decommission streaming).

    Args:
        old, new: the placements before and after a membership change.
        keys: the keys to check (e.g. every column a node holds).

    Returns:
        One :class:`Move` per changed key, in the order of ``keys``.
    """
    k = np.asarray(keys).astype(np.uint64, copy=False).reshape(-1)
    # Compare owner lists by name: map both index matrices onto the union of the names.
    union = sorted(set(old.names) | set(new.names))
    pos = {n: i for i, n in enumerate(union)}
    old_map = np.array([pos[n] for n in old.names], np.intp)
    new_map = np.array([pos[n] for n in new.names], np.intp)
    a = old_map[old.owner_indices(k)]
    b = new_map[new.owner_indices(k)]
    if a.shape[1] == b.shape[1]:
        changed = np.flatnonzero((a != b).any(axis=1))
    else:
        changed = np.arange(k.shape[0])
    return [
        Move(int(k[i]), tuple(union[j] for j in a[i]), tuple(union[j] for j in b[i])) for i in changed
    ]
