"""The node's view of the storage cluster: who owns what, where to reach them, who is up.

Theory of operation
-------------------
Two sets, deliberately different:

- the **placement set**: the storage members that own columns. Placement (``peers.placement``)
  is computed over it, so its epoch changes only when that set (names and weights) changes;
- the **live set**: the members of the placement set we currently believe reachable.

A member that *fails* (membership's ``MemberFailed``, or a test's ``mark_down``) stays in the
placement set and only leaves the live set. Its columns keep their owners; writes to it go to the
other owners plus a *hinted handoff* (hints.py) and reads go to the next live replica. This is
Dynamo's answer to transient failures: moving ownership on every crash-and-restart would stream
whole columns back and forth. ARCHITECTURE §6 says "placement over alive members": this is the
refinement that makes hinted handoff meaningful; docs/replication.md explains it.

Where the placement set comes from, two modes:

- **member mode** (the default; a view fed directly, e.g. a test's own client view):
  storage members that joined and have not left nor been reaped. Inputs ``set_members`` /
  ``add`` / ``remove`` / ``mark_down`` / ``mark_up``, or membership events (``apply_event``):
  ``MemberLeft`` / ``MemberReaped`` remove the member and its columns get new owners.
- **ring mode** (the daemon; entered by ``set_ring``): the placement set is the *ring*'s active
  entries with the ring's weights (giaannd/cluster/ring.py: a durable, gossip-synchronised document), and
  membership only says where members are and whether they are up. A ring member with no live
  membership entry (never seen, failed, left, reaped) is in the placement set but down: reads fail
  over, writes hint; ``MemberLeft`` / ``MemberReaped`` therefore only mark it down. Storage members
  alive in membership but not active in the ring are **standby** (joining, or decommissioned):
  they own nothing, but ``address`` / ``is_live`` answer for them and ``standby()`` lists them.
  During a topology operation's cutover (docs/topology.md) ``set_override(members)`` makes the
  placement set exactly ``members`` whatever the ring says; the override ends by
  ``set_override(None)`` or by itself once the ring's active set (names and weights) equals it,
  i.e. once the operation committed the new ring. ``set_members`` / ``add`` / ``remove`` are
  refused in ring mode (the ring is the only source of the placement set).

Subscribers (``on_change``) hear about every change: members that came up (hint delivery starts
on that), went down, whether the placement moved, and (ring mode) whether the standby set changed.

Pure: no I/O, no clock; the asyncio glue feeds it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from peers.membership.events import (
    MemberFailed,
    MemberJoined,
    MemberLeft,
    MemberReaped,
    MemberSuspected,
    MemberUpdated,
)
from peers.membership.meta import NodeMeta
from peers.placement import DEFAULT_REPLICAS, Member, Placement, Strategy

if TYPE_CHECKING:
    from giaannd.cluster.ring import Ring

__all__ = ["StorageNode", "ClusterView", "ViewChange", "pick_transport_address"]

log = logging.getLogger(__name__)

MemberEvent = MemberJoined | MemberUpdated | MemberSuspected | MemberFailed | MemberLeft | MemberReaped

#: Preferred data-plane scheme order when a member advertises several (ARCHITECTURE §7).
SCHEME_PREFERENCE = ("ucx", "tcp", "mem")


@dataclass(frozen=True, slots=True)
class StorageNode:
    """A storage member as the data plane needs it."""

    name: str
    address: str
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class ViewChange:
    """What changed: members newly live (hint delivery), newly down, whether placement moved, and
    (ring mode) whether the standby set changed."""

    came_up: frozenset[str] = frozenset()
    went_down: frozenset[str] = frozenset()
    placement_changed: bool = False
    standby_changed: bool = False


def pick_transport_address(meta: NodeMeta, schemes: Iterable[str]) -> str | None:
    """The advertised address of the first scheme in ``SCHEME_PREFERENCE`` that we speak."""
    usable = set(schemes)
    for scheme in SCHEME_PREFERENCE:
        if scheme in usable and scheme in meta.transports:
            return meta.transports[scheme]
    return None


@dataclass
class ClusterView:
    """Placement set + live set (module docstring).

    Args:
        local: this node's name if it is a storage member (reads prefer it), else None.
        replicas: R.
        strategy: placement strategy.
        schemes: transport schemes this node can dial (to choose among advertised addresses).
    """

    local: str | None = None
    replicas: int = DEFAULT_REPLICAS
    strategy: Strategy = "hash"
    schemes: tuple[str, ...] = ("tcp", "mem")
    _nodes: dict[str, StorageNode] = field(default_factory=dict)
    _down: set[str] = field(default_factory=set)
    _placement: Placement | None = None
    _order: Placement | None = None
    _subscribers: list[Callable[[ViewChange], None]] = field(default_factory=list)
    #: ``masks``' arrays and what they were made from (the placement, the down set, ``local``)
    _masks: tuple[Placement, frozenset[str], str | None, NDArray[np.bool_], NDArray[np.bool_]] | None = None
    # ring mode (module docstring): the ring's active set, the override, and what membership says
    _ring: tuple[tuple[str, float], ...] | None = None
    _override: tuple[StorageNode, ...] | None = None
    _seen: dict[str, str] = field(default_factory=dict)
    _alive: set[str] = field(default_factory=set)
    _standby: frozenset[str] = frozenset()

    # -- inputs: member mode ------------------------------------------------------------------------
    def set_members(self, nodes: Iterable[StorageNode]) -> None:
        """Replace the placement set (all listed members live). Member mode only.

        Raises:
            ValueError: a weight that is not finite and > 0 (nothing changed).
        """
        self._member_mode("set_members")
        new = {n.name: n for n in nodes}
        for n in new.values():
            Member(n.name, n.weight)  # ValueError: a placement over them could not be built
        came_up = frozenset(n for n in new if n not in self._nodes or n in self._down)
        changed = self._members_differ(new)
        self._nodes, self._down = new, set()
        self._after(ViewChange(came_up, frozenset(), changed), changed)

    def add(self, node: StorageNode) -> None:
        """Add or update one member (live). Member mode only.

        Raises:
            ValueError: a weight that is not finite and > 0 (nothing changed).
        """
        self._member_mode("add")
        Member(node.name, node.weight)  # ValueError: a placement over it could not be built
        old = self._nodes.get(node.name)
        changed = old is None or old.weight != node.weight
        came_up = old is None or node.name in self._down
        self._nodes[node.name] = node
        self._down.discard(node.name)
        self._after(ViewChange(frozenset({node.name}) if came_up else frozenset(), frozenset(), changed),
                    changed)

    def remove(self, name: str) -> None:
        """Drop a member from the placement set (left for good / reaped). Member mode only."""
        self._member_mode("remove")
        if self._nodes.pop(name, None) is not None:
            self._down.discard(name)
            self._after(ViewChange(frozenset(), frozenset({name}), True), True)

    def mark_down(self, name: str) -> None:
        """The member is unreachable; it keeps its columns (hints cover its writes)."""
        if self._ring is not None:
            self._alive.discard(name)
            self._rebuild()
        elif name in self._nodes and name not in self._down:
            self._down.add(name)
            self._after(ViewChange(went_down=frozenset({name})), False)

    def mark_up(self, name: str) -> None:
        """The member is reachable again (ring mode: only if membership gave it an address)."""
        if self._ring is not None:
            if name in self._seen:
                self._alive.add(name)
                self._rebuild()
        elif name in self._down:
            self._down.discard(name)
            self._after(ViewChange(came_up=frozenset({name})), False)

    # -- inputs: ring mode --------------------------------------------------------------------------
    def set_ring(self, ring: Ring) -> None:
        """Enter ring mode (or follow a new ring): the placement set is ``ring.active()`` unless an
        override is in force; an override equal to the ring's active set ends here."""
        self._ring = tuple(ring.active())
        if self._override is not None and _same_set(self._override, self._ring):
            self._override = None
        self._rebuild()

    def set_override(self, members: Sequence[StorageNode] | None) -> None:
        """Cutover (docs/topology.md): the placement set is exactly ``members`` until the ring's
        active set equals it or ``set_override(None)``. Addresses membership knows win over the
        ones given here.

        Raises:
            RuntimeError: not in ring mode.
            ValueError: an empty member list, a name twice, or a weight that is not finite and
                > 0 (nothing changed: its placement could not be built).
        """
        if self._ring is None:
            raise RuntimeError("set_override needs ring mode (set_ring first)")
        if members is not None:
            names = [m.name for m in members]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"an override needs distinct members, got {names}")
            for m in members:
                Member(m.name, m.weight)  # ValueError: a placement over them could not be built
            override: tuple[StorageNode, ...] | None = tuple(sorted(members, key=lambda m: m.name))
            if override is not None and _same_set(override, self._ring):
                override = None
        else:
            override = None
        self._override = override
        self._rebuild()

    @property
    def ring_mode(self) -> bool:
        return self._ring is not None

    @property
    def override(self) -> tuple[StorageNode, ...] | None:
        """The override in force (sorted by name), or None."""
        return self._override

    def apply_event(self, event: MemberEvent) -> None:
        """Feed one membership event (its ``meta`` is a ``NodeMeta``). Non-storage members are ignored."""
        try:
            meta = NodeMeta.decode(event.meta)
        except ValueError:
            log.warning("member metadata undecodable member=%s; ignored", event.name)
            return
        if self._ring is not None:
            self._ring_event(event, meta)
            return
        if "storage" not in meta.roles:
            if event.name in self._nodes:
                self.remove(event.name)
            return
        if isinstance(event, (MemberLeft, MemberReaped)):
            self.remove(event.name)
        elif isinstance(event, MemberFailed):
            self.mark_down(event.name)
        elif isinstance(event, (MemberJoined, MemberUpdated, MemberSuspected)):
            # Suspected stays live: SWIM suspicion is often refuted, and a failed request to it
            # fails over on its own; treating it as down would hint needlessly.
            address = pick_transport_address(meta, self.schemes)
            if address is None:
                log.warning("storage member advertises no usable transport member=%s", event.name)
                return
            weight = meta.weight if math.isfinite(meta.weight) and meta.weight > 0 else 1.0
            self.add(StorageNode(event.name, address, weight))

    def _ring_event(self, event: MemberEvent, meta: NodeMeta) -> None:
        """Ring mode: membership gives addresses and liveness only (module docstring)."""
        name = event.name
        if "storage" not in meta.roles:
            self._seen.pop(name, None)
            self._alive.discard(name)
        elif isinstance(event, (MemberLeft, MemberReaped, MemberFailed)):
            self._alive.discard(name)
        else:  # Joined / Updated / Suspected (suspected stays live, as in member mode)
            address = pick_transport_address(meta, self.schemes)
            if address is None:
                log.warning("storage member advertises no usable transport member=%s", name)
                return
            self._seen[name] = address
            self._alive.add(name)
        self._rebuild()

    def on_change(self, callback: Callable[[ViewChange], None]) -> None:
        self._subscribers.append(callback)

    # -- queries ------------------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """The placement over the placement set.

        Raises:
            LookupError: no storage members known.
        """
        if self._placement is None:
            if not self._nodes:
                raise LookupError("no storage members known")
            members = tuple(Member(n.name, n.weight) for n in self._nodes.values())
            self._placement = Placement(members, self.replicas, self.strategy)
        return self._placement

    @property
    def epoch(self) -> str:
        return self.placement.epoch if self._nodes else ""

    def preference(self, keys: NDArray[np.uint64]) -> NDArray[np.intp]:
        """Every member, per key, in preference order (owners first): shape (K, N), indices into
        ``placement.names``. The members after the R owners are where hints go (Dynamo)."""
        if self._order is None:
            p = self.placement
            self._order = Placement(p.members, len(p.members), p.strategy, p.pins)
        return self._order.owner_indices(keys)

    @property
    def names(self) -> tuple[str, ...]:
        return self.placement.names

    def address(self, name: str) -> str:
        """Data-plane address of a member (ring mode: standby members too).

        Raises:
            KeyError: an unknown member, or (ring mode) one whose address nobody told us yet.
        """
        if self._ring is not None:
            address = self._seen.get(name) or (self._nodes[name].address if name in self._nodes else "")
            if not address:
                raise KeyError(name)
            return address
        return self._nodes[name].address

    def masks(self) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        """(down, local): per member of ``placement.names``, believed down, and is this node: what a
        read orders a row's owners by. Made once per placement, down set and ``local`` and kept
        (read-only arrays): a read made them member by member, O(members) Python per read (~0.1 µs
        a member: 0.1 ms per read at 1,000 members).

        Raises:
            LookupError: no storage members known.
        """
        placement = self.placement
        down = frozenset(self._down)
        cached = self._masks
        if cached is not None and cached[0] is placement and cached[1] == down and cached[2] == self.local:
            return cached[3], cached[4]
        names = placement.names
        down_mask = np.fromiter((n in down for n in names), np.bool_, len(names))
        local_mask = np.fromiter((n == self.local for n in names), np.bool_, len(names))
        down_mask.flags.writeable = local_mask.flags.writeable = False
        self._masks = (placement, down, self.local, down_mask, local_mask)
        return down_mask, local_mask

    def is_live(self, name: str) -> bool:
        """Believed reachable (ring mode: placement and standby members alike)."""
        if self._ring is not None:
            return name in self._alive
        return name in self._nodes and name not in self._down

    def live(self) -> list[str]:
        """The live members of the placement set, sorted."""
        return sorted(n for n in self._nodes if n not in self._down)

    def standby(self) -> list[str]:
        """Ring mode: storage members alive in membership but not in the placement set (joining,
        or decommissioned), sorted. Always empty in member mode."""
        return sorted(self._standby)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    # -- internals ----------------------------------------------------------------------------------
    def _member_mode(self, what: str) -> None:
        if self._ring is not None:
            raise RuntimeError(f"{what}: this topology follows the ring (ring mode); change the ring "
                               "or use set_override")

    def _rebuild(self) -> None:
        """Ring mode: derive the placement set and its down members; tell subscribers what moved."""
        assert self._ring is not None
        source = self._override if self._override is not None else \
            tuple(StorageNode(n, "", w) for n, w in self._ring)
        new = {m.name: StorageNode(m.name, self._seen.get(m.name, m.address), m.weight) for m in source}
        down = {n for n in new if n not in self._alive}
        old_live, new_live = self._nodes.keys() - self._down, new.keys() - down
        standby = frozenset(self._alive - new.keys())
        changed = self._members_differ(new)
        change = ViewChange(frozenset(new_live - old_live), frozenset(old_live - new_live), changed,
                                standby != self._standby)
        self._nodes, self._down, self._standby = new, down, standby
        if change.came_up or change.went_down or changed or change.standby_changed:
            self._after(change, changed)

    def _members_differ(self, new: dict[str, StorageNode]) -> bool:
        return {(n.name, n.weight) for n in new.values()} != {(n.name, n.weight) for n in self._nodes.values()}

    def _after(self, change: ViewChange, placement_changed: bool) -> None:
        if placement_changed:
            self._placement = self._order = None
        for callback in list(self._subscribers):
            callback(change)


def _same_set(members: Sequence[StorageNode], active: Sequence[tuple[str, float]]) -> bool:
    """Whether an override names exactly the ring's active set, with the same weights."""
    return sorted((m.name, float(m.weight)) for m in members) == sorted(active)
