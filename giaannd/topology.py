"""The node's view of the storage cluster: who owns what, where to reach them, who is up.

Theory of operation
-------------------
Two sets, deliberately different:

- the **placement set**: storage members that joined and have not left (nor been reaped). Placement
  (``peers.placement``) is computed over it, so its epoch changes only when a member joins, leaves
  for good, or changes weight;
- the **live set**: the members of the placement set we currently believe reachable.

A member that *fails* (membership's ``MemberFailed``, or a test's ``mark_down``) stays in the
placement set and only leaves the live set. Its columns keep their owners; writes to it go to the
other owners plus a *hinted handoff* (hints.py) and reads go to the next live replica. This is
Dynamo's answer to transient failures: moving ownership on every crash-and-restart would stream
whole columns back and forth (issue 8's job, triggered by a permanent leave or ``removenode``).
When membership reaps the member (``reap_after_s``) or it leaves gracefully, it leaves the placement
set and its columns get new owners. ARCHITECTURE §6 says "placement over alive members": this is the
refinement that makes hinted handoff meaningful; docs/replication.md explains it.

Inputs: ``set_members`` / ``mark_down`` / ``mark_up`` (tests and the daemon), or ``apply_event``
with membership's member events carrying ``NodeMeta``. Subscribers (``on_change``) hear about every
change, with the members that came up (hint delivery starts on that).

Pure: no I/O, no clock; the asyncio glue feeds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from peers.membership.events import (
    MemberFailed,
    MemberJoined,
    MemberLeft,
    MemberReaped,
    MemberSuspected,
    MemberUpdated,
    NameConflict,
)
from peers.membership.meta import NodeMeta
from peers.membership.node import MembershipNode, member_status
from peers.placement import DEFAULT_REPLICAS, Member, Placement, Strategy

__all__ = ["StorageNode", "Topology", "TopologyChange", "follow_membership", "pick_transport_address"]

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
class TopologyChange:
    """What changed: members newly live (hint delivery), newly down, and whether placement moved."""

    came_up: frozenset[str] = frozenset()
    went_down: frozenset[str] = frozenset()
    placement_changed: bool = False


def pick_transport_address(meta: NodeMeta, schemes: Iterable[str]) -> str | None:
    """The advertised address of the first scheme in ``SCHEME_PREFERENCE`` that we speak."""
    usable = set(schemes)
    for scheme in SCHEME_PREFERENCE:
        if scheme in usable and scheme in meta.transports:
            return meta.transports[scheme]
    return None


@dataclass
class Topology:
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
    _subscribers: list[Callable[[TopologyChange], None]] = field(default_factory=list)

    # -- inputs -------------------------------------------------------------------------------------
    def set_members(self, nodes: Iterable[StorageNode]) -> None:
        """Replace the placement set (all listed members live)."""
        new = {n.name: n for n in nodes}
        came_up = frozenset(n for n in new if n not in self._nodes or n in self._down)
        changed = self._members_differ(new)
        self._nodes, self._down = new, set()
        self._after(TopologyChange(came_up, frozenset(), changed), changed)

    def add(self, node: StorageNode) -> None:
        """Add or update one member (live)."""
        old = self._nodes.get(node.name)
        changed = old is None or old.weight != node.weight
        came_up = old is None or node.name in self._down
        self._nodes[node.name] = node
        self._down.discard(node.name)
        self._after(TopologyChange(frozenset({node.name}) if came_up else frozenset(), frozenset(), changed),
                    changed)

    def remove(self, name: str) -> None:
        """Drop a member from the placement set (left for good / reaped)."""
        if self._nodes.pop(name, None) is not None:
            self._down.discard(name)
            self._after(TopologyChange(frozenset(), frozenset({name}), True), True)

    def mark_down(self, name: str) -> None:
        """The member is unreachable; it keeps its columns (hints cover its writes)."""
        if name in self._nodes and name not in self._down:
            self._down.add(name)
            self._after(TopologyChange(went_down=frozenset({name})), False)

    def mark_up(self, name: str) -> None:
        if name in self._down:
            self._down.discard(name)
            self._after(TopologyChange(came_up=frozenset({name})), False)

    def apply_event(self, event: MemberEvent) -> None:
        """Feed one membership event (its ``meta`` is a ``NodeMeta``). Non-storage members are ignored."""
        try:
            meta = NodeMeta.decode(event.meta)
        except ValueError:
            log.warning("member metadata undecodable member=%s; ignored", event.name)
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
            self.add(StorageNode(event.name, address, meta.weight if meta.weight > 0 else 1.0))

    def on_change(self, callback: Callable[[TopologyChange], None]) -> None:
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
        """Data-plane address of a member. Raises KeyError for an unknown one."""
        return self._nodes[name].address

    def is_live(self, name: str) -> bool:
        return name in self._nodes and name not in self._down

    def live(self) -> list[str]:
        return sorted(n for n in self._nodes if n not in self._down)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    # -- internals ----------------------------------------------------------------------------------
    def _members_differ(self, new: dict[str, StorageNode]) -> bool:
        return {(n.name, n.weight) for n in new.values()} != {(n.name, n.weight) for n in self._nodes.values()}

    def _after(self, change: TopologyChange, placement_changed: bool) -> None:
        if placement_changed:
            self._placement = self._order = None
        for callback in list(self._subscribers):
            callback(change)


def follow_membership(topology: Topology, node: MembershipNode) -> None:
    """Feed ``topology`` from a running membership node: the members alive now, then every event.
    (The subscription lasts as long as the node; events arrive on the loop, in order.)"""
    for info in node.alive_members():
        topology.apply_event(MemberJoined(info.name, info.node_id, info.addr, info.incarnation,
                                          member_status(info), info.meta, "initial"))

    def on_event(event: object) -> None:
        if not isinstance(event, NameConflict):
            topology.apply_event(event)  # type: ignore[arg-type]

    node.on_event(on_event)
