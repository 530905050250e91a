"""The storage ring: the durable, versioned placement set every node agrees on.

Theory of operation
-------------------
Which storage nodes own columns (the *placement set*) must not follow liveness: a node that
restarts, or that just joined and holds nothing yet, must not change who owns what. So the
placement set is a small replicated document, the **ring**, separate from membership (which keeps
only liveness and addresses; giaannd/cluster/view.py combines the two).

The ring maps a storage node's name to a ``RingEntry(stamp, state, weight)``:

- ``state`` is ``"active"`` (in the placement set, with that weight) or ``"removed"`` (a
  tombstone: decommissioned or removed; kept so that an older copy of the ring cannot bring the
  node back);
- ``stamp`` counts the changes made to that name. ``with_active`` / ``with_removed`` write
  ``old stamp + 1`` (1 for a name never seen).

It is a state-based CRDT (a map of last-writer-wins registers ordered by stamp, not by clock):
``merge`` keeps, per name, the entry with the larger ``(stamp, state rank, weight)``, where
removed ranks above active. That order is total, so merge is commutative, associative and
idempotent (tests/unit/ring/test_ring.py checks it with hypothesis), and any two nodes that have
seen the same changes, in any order, hold equal rings with equal ``digest()``. Removed ranking
above active means "remove" wins a tie against a concurrent "add" of the same stamp; the weight
tie-break only decides between two concurrent activations with different weights.

Changes are made by one writer at a time in practice (the node coordinating a topology
operation, or a node bootstrapping itself), so a concurrent conflict is rare, but it can never
make two nodes disagree for good.

``digest()`` is the xxh3-64 of a canonical encoding (entries sorted by name), 0 for the empty
ring; nodes gossip it in ``NodeMeta.ring`` and pull the ring from a peer whose digest differs
(giaannd/services/ring_sync.py).

Files: ``save`` / ``load`` keep a JSON document (``{"version": 1, "entries": {name: {"stamp",
"state", "weight"}}}``) written atomically and fsynced (giaannd/atomic_file.py). A file that does
not parse or validate raises ``CorruptFileError`` naming the path and is never overwritten: the
operator decides (the ring can be pulled again from any peer once the file is moved away).

Pure: no I/O except ``load`` / ``save``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec
import xxhash

from giaannd.atomic_file import atomic_write_bytes
from giaannd.errors import CorruptFileError

__all__ = [
    "EntryState",
    "MAX_RING_ENTRIES",
    "RING_FILE",
    "Ring",
    "RingEntry",
    "WireEntry",
]

#: File name of the ring in a node's data directory.
RING_FILE: Final = "ring.json"
#: Entries a ring may hold (active and removed together). Far above any cluster's storage node
#: count; bounds what a peer's RingState may make us allocate and persist.
MAX_RING_ENTRIES: Final = 4096
#: Bound on a storage node's name (membership's MAX_NAME_BYTES is 128).
MAX_NAME_CHARS: Final = 256
#: The largest stamp: the wire and ``digest()`` encode stamps as msgpack integers (u64 at most).
MAX_STAMP: Final = 2**64 - 1
_FORMAT_VERSION: Final = 1

EntryState = Literal["active", "removed"]
_RANK: Final[dict[str, int]] = {"active": 0, "removed": 1}

#: One entry on the wire (giaannd.protocol's RingState / RingPush): (name, stamp, state, weight).
WireEntry = tuple[
    Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)],
    Annotated[int, msgspec.Meta(ge=0)],
    EntryState,
    Annotated[float, msgspec.Meta(ge=0)],
]


@dataclass(frozen=True, slots=True)
class RingEntry:
    """One storage node's register in the ring (module docstring).

    Attributes:
        stamp: how many changes this name has seen (the larger wins a merge).
        state: ``"active"`` (in the placement set) or ``"removed"`` (tombstone).
        weight: placement weight while active (> 0); kept, unused, on a tombstone.
    """

    stamp: int
    state: EntryState
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.stamp <= MAX_STAMP:
            raise ValueError(f"ring stamp must be in [0, 2**64 - 1], got {self.stamp}")
        if self.state not in _RANK:
            raise ValueError(f"ring state must be active or removed, got {self.state!r}")
        if not math.isfinite(self.weight) or self.weight < 0 or (
                self.state == "active" and self.weight <= 0):
            raise ValueError(f"ring weight must be finite and > 0 when active, got {self.weight}")
        # One encoding per merge-equal weight: -0.0 (or an int) equals 0.0 (a float) in ``order``
        # and ``==`` but encodes differently, so two such rings never merge yet never share a digest.
        object.__setattr__(self, "weight", float(self.weight) + 0.0)

    @property
    def order(self) -> tuple[int, int, float]:
        """The merge order: a total order on entries (stamp, then removed > active, then weight)."""
        return self.stamp, _RANK[self.state], self.weight


class _EntryDoc(msgspec.Struct, forbid_unknown_fields=True):
    stamp: Annotated[int, msgspec.Meta(ge=0)]
    state: EntryState
    weight: Annotated[float, msgspec.Meta(ge=0)]


class _RingDoc(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    entries: Annotated[dict[str, _EntryDoc], msgspec.Meta(max_length=MAX_RING_ENTRIES)]


class Ring:
    """The ring (module docstring): name -> ``RingEntry``.

    ``merge`` changes this object; ``with_active`` / ``with_removed`` return a new one.

    Args:
        entries: the registers (copied).

    Raises:
        ValueError: more than ``MAX_RING_ENTRIES`` entries, or an empty / overlong name.
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: Mapping[str, RingEntry] | None = None) -> None:
        self._entries: dict[str, RingEntry] = dict(entries or {})
        _check_size(len(self._entries))
        for name in self._entries:
            _check_name(name)

    # -- queries ------------------------------------------------------------------------------------
    @property
    def entries(self) -> dict[str, RingEntry]:
        """A copy of the registers."""
        return dict(self._entries)

    def get(self, name: str) -> RingEntry | None:
        return self._entries.get(name)

    def active(self) -> list[tuple[str, float]]:
        """The placement set: ``(name, weight)`` of the active entries, sorted by name."""
        return sorted((n, e.weight) for n, e in self._entries.items() if e.state == "active")

    def is_active(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.state == "active"

    def digest(self) -> int:
        """xxh3-64 of the canonical encoding (entries sorted by name); 0 for the empty ring.
        Equal rings have equal digests on every node."""
        if not self._entries:
            return 0
        return xxhash.xxh3_64_intdigest(msgspec.msgpack.encode(self.to_wire())) or 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ring) and other._entries == self._entries

    __hash__ = None  # type: ignore[assignment]  # mutable (merge)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={e.state}@{e.stamp}/{e.weight:g}" for n, e in sorted(self._entries.items()))
        return f"Ring({inner})"

    # -- changes ------------------------------------------------------------------------------------
    def merge(self, other: Ring) -> bool:
        """Take, per name, the larger entry of ``self`` and ``other`` (module docstring).

        Returns:
            whether this ring changed.

        Raises:
            ValueError: the result would exceed ``MAX_RING_ENTRIES`` (nothing changed).
        """
        wins = {n: e for n, e in other._entries.items()
                if n not in self._entries or e.order > self._entries[n].order}
        if not wins:
            return False
        _check_size(len(self._entries.keys() | wins.keys()))
        self._entries.update(wins)
        return True

    def with_active(self, name: str, weight: float = 1.0) -> Ring:
        """A copy where ``name`` is active with ``weight`` (stamp + 1); ``self`` if it already is."""
        old = self._entries.get(name)
        if old is not None and old.state == "active" and old.weight == weight:
            return self
        return self._with(name, RingEntry((old.stamp if old else 0) + 1, "active", float(weight)))

    def with_removed(self, name: str) -> Ring:
        """A copy where ``name`` is a tombstone (stamp + 1); ``self`` if it already is one."""
        old = self._entries.get(name)
        if old is not None and old.state == "removed":
            return self
        return self._with(name, RingEntry((old.stamp if old else 0) + 1, "removed",
                                          old.weight if old else 1.0))

    def _with(self, name: str, entry: RingEntry) -> Ring:
        _check_name(name)
        out = Ring(self._entries)
        out._entries[name] = entry
        _check_size(len(out._entries))
        return out

    # -- wire ---------------------------------------------------------------------------------------
    def to_wire(self) -> list[WireEntry]:
        """``[(name, stamp, state, weight), ...]`` sorted by name (the canonical encoding)."""
        return [(n, e.stamp, e.state, e.weight) for n, e in sorted(self._entries.items())]

    @classmethod
    def from_wire(cls, entries: Iterable[WireEntry]) -> Ring:
        """The inverse of ``to_wire``.

        Raises:
            ValueError: a bad entry (state, weight, name), a name twice, or too many entries.
        """
        out: dict[str, RingEntry] = {}
        for name, stamp, state, weight in entries:
            if name in out:
                raise ValueError(f"ring entry {name!r} appears twice")
            out[name] = RingEntry(int(stamp), state, float(weight))
            _check_size(len(out))
        return cls(out)

    # -- files --------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Ring:
        """Read a ring file; a missing file is the empty ring.

        Raises:
            CorruptFileError: the file exists but does not parse or validate (left untouched).
        """
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            return cls()
        try:
            doc = msgspec.json.decode(data, type=_RingDoc)
            if doc.version != _FORMAT_VERSION:
                raise ValueError(f"unknown ring file version {doc.version} (this build reads "
                                 f"{_FORMAT_VERSION})")
            return cls({n: RingEntry(e.stamp, e.state, e.weight) for n, e in doc.entries.items()})
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise CorruptFileError(str(path), f"{exc}; move it away to pull the ring from a peer "
                                   "again") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the ring atomically and durably (fsync of the file and its directory)."""
        doc = _RingDoc(_FORMAT_VERSION, {n: _EntryDoc(e.stamp, e.state, e.weight)
                                         for n, e in sorted(self._entries.items())})
        atomic_write_bytes(path, msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")


def _check_size(n: int) -> None:
    if n > MAX_RING_ENTRIES:
        raise ValueError(f"a ring holds at most {MAX_RING_ENTRIES} entries, not {n}")


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"bad ring member name {name!r}")
