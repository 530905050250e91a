"""``ClusterControl`` for services and views that live in one process (tests, benchmarks, a
single-process deployment): switching a node's view is setting its placement set directly
(rebalance/operations.py). A view that follows the ring (a node runtime's, ring mode) gets a placement
override, as the daemon's control sets by request; it ends once the ring is committed
(``after_cutover``, which an owner of the runtimes overrides to commit it)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.storage.replication.service import StorageService
from peers.transport import Transport

__all__ = ["LocalClusterControl"]


class LocalClusterControl:
    """``ClusterControl`` over services and views living in this process (tests, bench, and a
    single-process deployment): switching a view is setting its members.

    Args:
        transport: dials the stream endpoints.
        services: member name -> its running service.
        node_views: member name -> that node's ClusterView.
        writer_views: ClusterView objects of writers (their clients); the first is "the" cluster view.
        writers: the clients behind ``writer_views`` (``flush`` drains their writes).
        stream_addresses: member name -> StreamEndpoint address.
        drain_grace_s: after switching writers, how long writes computed under the old placement
            may still be on their way before ``flush`` (requests in flight are not tracked here).
    """

    def __init__(self, transport: Transport, services: Mapping[str, StorageService],
                 node_views: Mapping[str, ClusterView], writer_views: Sequence[ClusterView],
                 writers: Sequence[Any], stream_addresses: Mapping[str, str], drain_grace_s: float = 0.1) -> None:
        self.transport = transport
        self.services, self.node_views = services, node_views
        self.writer_views, self.writers = writer_views, writers
        self.stream_addresses, self.drain_grace_s = stream_addresses, drain_grace_s

    def view(self) -> ClusterView:
        return self.writer_views[0]

    def service(self, name: str) -> StorageService | None:
        return self.services.get(name)

    def stream_address(self, name: str) -> str:
        return self.stream_addresses[name]

    async def switch(self, names: Sequence[str], members: Sequence[StorageNode]) -> None:
        for name in names:
            view = self.node_views.get(name)
            if view is not None:
                _switch_view(view, members)

    async def switch_writers(self, members: Sequence[StorageNode]) -> None:
        for view in self.writer_views:
            _switch_view(view, members)
        await asyncio.sleep(self.drain_grace_s)
        for writer in self.writers:
            await writer.flush()

    async def hints_held_for(self, names: Sequence[str]) -> int:
        return sum(len(svc.hints.pending(n)) for svc in self.services.values() if svc.hints is not None
                   for n in names)

    async def deliver_hints(self) -> None:
        for svc in list(self.services.values()):
            await svc.deliver_hints()

    async def drop_hints_for(self, name: str) -> int:
        return sum(svc.hints.drop(name) for svc in self.services.values() if svc.hints is not None)

    async def after_cutover(self, new_members: Sequence[StorageNode]) -> None:
        """Nothing to persist: the views switched are the whole state here."""

    async def lock(self, op_id: str, kind: str) -> int | None:
        """No cluster lock: one process, and its callers hold one ``OperationRegistry``."""
        return None

    async def unlock(self, token: int) -> None:
        """Nothing was locked (``lock``)."""

    async def abandon(self) -> None:
        """Nothing to undo: the targets' views switch only after every stream caught up, and a
        failure after that is not rolled back here (the daemon's control clears its overrides)."""


def _switch_view(view: ClusterView, members: Sequence[StorageNode]) -> None:
    """Set a view's placement set, keeping members it believes down marked down (ring mode: an
    override, which leaves liveness to membership)."""
    if view.ring_mode:
        view.set_override(members)
        return
    down = [m.name for m in members if m.name in view and not view.is_live(m.name)]
    view.set_members(members)
    for name in down:
        view.mark_down(name)
