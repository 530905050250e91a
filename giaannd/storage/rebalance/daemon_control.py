"""``ClusterControl`` for the daemon: a topology operation whose nodes are separate processes.

Theory of operation
-------------------
``Rebalance`` (rebalance/operations.py) is written against a ``ClusterControl``; the in-process one
(local_control.py) flips ``ClusterView`` objects it holds. Here every step is a request to another
``giaannd`` over the data plane, and the durable outcome is a change of the cluster's **ring**
(giaannd/cluster/ring.py: the placement set, a gossiped CRDT every node persists):

- ``view()`` is this node's ``ClusterView``; ``service(name)`` is this node's storage service when
  ``name`` is this node (a local source streams with a local ``StreamRunner``; others are driven
  through their stream endpoints by ``RemoteStreamRunner``, stream_io / source_control);
- ``stream_address(name)`` is the member's ``stream`` address from its gossiped ``NodeMeta``;
- ``switch(names, members)`` sets a *placement override* on those nodes (``SetOverride``): until
  the ring catches up, their placement set is exactly ``members``; ``switch_writers`` does the
  same on every live compute member with ``flush`` (each answers once the writes it computed under
  the old placement have finished). Each override carries a *lease*: this node's name and the
  operation's id (given to ``lock``), so a node drops it if the operation ends without clearing
  it, e.g. this coordinator dies in the cutover (giaannd/services/override_lease.py);
- hint steps ask every live storage member through its stream endpoint (``HintsHeld``,
  ``DeliverHints``, ``DropHints``);
- ``after_cutover(new_members)`` commits the new ring (joiners ``active``, removed members
  ``removed``, each with a higher stamp) locally — persisted before anything else — and pushes it
  to every live member; gossip carries its digest to the rest, and each node drops its override
  as soon as its ring's active set equals it;
- ``abandon()`` (a failed or cancelled operation) clears the overrides it set, so the old ring is
  in force again everywhere;
- ``lock(op, kind)`` / ``unlock(token)``: the cluster's topology-operation lock
  (cluster_lock.py) through this node's register client; a member is live for it while membership
  has it alive or suspect (a suspect coordinator may still be running its operation). A release
  that fails is retried in the background.

Members that are down are skipped by the switches: they learn the ring when they come back
(ring sync pulls it on the first digest mismatch). A node that comes back *during* a cutover
with the old ring may write under the old placement; the sources still forward such writes
until their streams close, and afterwards a node that no longer owns a column refuses the rows
(``NotOwner``), which the writer retries on the placement of the ring it then pulls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from giaannd import protocol as p
from giaannd.client.ring_calls import push_ring, set_override
from giaannd.cluster.view import ClusterView, StorageNode, pick_transport_address
from giaannd.storage.rebalance import source_control as sc
from giaannd.storage.rebalance.cluster_lock import ClusterLock, OperationLockUnavailable, retry_release
from giaannd.storage.rebalance.operations import TopologyOpError
from peers.membership.meta import NodeMeta
from peers.transport import Transport

if TYPE_CHECKING:
    from giaannd.runtime.node import NodeRuntime
    from giaannd.storage.replication.service import StorageService

__all__ = ["STREAM_SCHEME", "DaemonClusterControl"]

log = logging.getLogger(__name__)

#: Key of the stream endpoint's address in ``NodeMeta.transports``.
STREAM_SCHEME: Final = "stream"
#: Bound on one control request (a flush waits for writes in flight: generous).
CONTROL_TIMEOUT_S: Final = 60.0


class DaemonClusterControl:
    """``ClusterControl`` over the daemon's runtime (module docstring).

    Args:
        runtime: this node's runtime (topology, ring, transports, membership).
        storage: this node's storage service, if it has the storage role.
    """

    def __init__(self, runtime: NodeRuntime, storage: StorageService | None) -> None:
        self.runtime = runtime
        self.storage = storage
        # tcp:// (mem:// on a node of an in-process cluster, whose stream endpoint is mem://)
        transport = runtime.transports.get("tcp") or runtime.transports.get("mem")
        if transport is None:
            raise TopologyOpError("topology operations need a tcp:// data-plane listener")
        self.transport: Transport = transport
        self._overridden: set[str] = set()
        #: the lease the overrides are sent with (``lock`` names the operation)
        self._lease: p.OverrideLease | None = None
        self._lock: ClusterLock | None = None
        self._releases: set[asyncio.Task[bool]] = set()  # lock releases retried in the background

    # -- who is where ---------------------------------------------------------------------------
    @property
    def me(self) -> str:
        return self.runtime.node_name

    def view(self) -> ClusterView:
        return self.runtime.topology

    def service(self, name: str) -> StorageService | None:
        return self.storage if name == self.me else None

    def _metas(self) -> dict[str, NodeMeta]:
        """Live members' metadata (this node included)."""
        node = self.runtime.membership
        out: dict[str, NodeMeta] = {}
        if node is None:
            return out
        for info in node.alive_members():
            try:
                out[info.name] = NodeMeta.decode(info.meta)
            except ValueError:
                continue
        out[self.me] = self.runtime.node_meta()
        return out

    def stream_address(self, name: str) -> str:
        meta = self._metas().get(name)
        if meta is None:
            raise TopologyOpError(f"{name} is not a live member")
        address = meta.transports.get(STREAM_SCHEME)
        if not address:
            raise TopologyOpError(f"{name} advertises no stream endpoint (is it a storage node?)")
        return address

    def _data_address(self, name: str) -> str:
        meta = self._metas().get(name)
        address = None if meta is None else pick_transport_address(meta, self.runtime.transports)
        if address is None:
            raise TopologyOpError(f"{name} advertises no data-plane address this node can dial")
        return address

    def _live(self, role: str) -> list[str]:
        return sorted(n for n, m in self._metas().items() if role in m.roles)

    # -- switching ------------------------------------------------------------------------------
    async def _override(self, name: str, members: Sequence[StorageNode] | None, flush: bool) -> None:
        if name == self.me:
            self.runtime.rings.set_override(members, self._lease)
            if flush:
                await asyncio.wait_for(self.runtime.flush_clients(), CONTROL_TIMEOUT_S)
            return
        await set_override(self.runtime.transports, self.runtime.identity, self._data_address(name),
                           members, flush=flush, timeout_s=CONTROL_TIMEOUT_S, lease=self._lease)

    async def _override_all(self, names: Sequence[str], members: Sequence[StorageNode] | None,
                            flush: bool) -> None:
        metas = self._metas()
        targets = [n for n in names if n in metas]  # down members learn the ring later
        results = await asyncio.gather(*(self._override(n, members, flush) for n in targets),
                                       return_exceptions=True)
        if members is not None:
            self._overridden.update(targets)
        failed = [(n, r) for n, r in zip(targets, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            raise TopologyOpError("; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failed))

    async def switch(self, names: Sequence[str], members: Sequence[StorageNode]) -> None:
        await self._override_all(names, members, flush=False)

    async def switch_writers(self, members: Sequence[StorageNode]) -> None:
        await self._override_all(self._live("compute"), members, flush=True)

    async def abandon(self) -> None:
        """Clear every override this control set (the operation failed or was cancelled)."""
        names, self._overridden = sorted(self._overridden), set()
        try:
            await self._override_all(names, None, flush=False)
        except TopologyOpError as exc:
            log.warning("could not clear placement overrides: %s (they clear when the ring next "
                        "changes, or on restart)", exc)

    # -- hints ----------------------------------------------------------------------------------
    def _storage_endpoints(self) -> list[str]:
        """Stream-endpoint addresses of the live storage members (one metadata read)."""
        return [m.transports[STREAM_SCHEME] for _, m in sorted(self._metas().items())
                if "storage" in m.roles and m.transports.get(STREAM_SCHEME)]

    async def hints_held_for(self, names: Sequence[str]) -> int:
        counts = await asyncio.gather(*(sc.hints_held(self.transport, address, list(names))
                                        for address in self._storage_endpoints()))
        return sum(counts)

    async def deliver_hints(self) -> None:
        await asyncio.gather(*(sc.deliver_hints(self.transport, address)
                               for address in self._storage_endpoints()), return_exceptions=True)

    async def drop_hints_for(self, name: str) -> int:
        counts = await asyncio.gather(*(sc.drop_hints(self.transport, address, name)
                                        for address in self._storage_endpoints()),
                                      return_exceptions=True)
        return sum(c for c in counts if isinstance(c, int))

    # -- the cluster's operation lock ------------------------------------------------------------
    def member_live(self, name: str) -> bool:
        """Whether ``name`` is a member membership has alive or suspect (this node is)."""
        node = self.runtime.membership
        if name == self.me:
            return True
        return node is not None and any(m.name == name and m.status in ("alive", "suspect")
                                        for m in node.members())

    def cluster_lock(self) -> ClusterLock:
        """This node's view of the lock (one per control: it remembers the tokens it holds).

        Raises:
            OperationLockUnavailable: no storage service here to propose through.
        """
        if self._lock is None:
            registers = self.storage.register_client if self.storage is not None else None
            if registers is None:
                raise OperationLockUnavailable("this node has no register client (no storage service running)")
            self._lock = ClusterLock(registers, self.me, self.member_live)
        return self._lock

    async def lock(self, op_id: str, kind: str) -> int | None:
        self._lease = p.OverrideLease(self.me, op_id)  # (before the lock: it may be unavailable)
        return await self.cluster_lock().acquire(op_id, kind)

    def _release_done(self, task: asyncio.Task[bool]) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:  # (retry_release raises nothing it expects)
            log.error("topology lock: background release failed: %r", task.exception())

    async def unlock(self, token: int) -> None:
        lock = self.cluster_lock()
        if await lock.release(token):
            return
        task = asyncio.get_running_loop().create_task(retry_release(lock, token, asyncio.sleep))
        self._releases.add(task)
        task.add_done_callback(self._release_done)

    # -- the durable outcome --------------------------------------------------------------------
    async def after_cutover(self, new_members: Sequence[StorageNode]) -> None:
        """Commit the ring the operation moved to and push it to every live member."""
        ring = self.runtime.ring
        old = {name for name, _ in ring.active()}
        new = {m.name: m.weight for m in new_members}
        for name in sorted(old - set(new)):
            ring = ring.with_removed(name)
        for name, weight in sorted(new.items()):
            if name not in old or dict(ring.active()).get(name) != weight:
                ring = ring.with_active(name, weight)
        await self.runtime.commit_ring(ring)
        names = [n for n in self._metas() if n != self.me]
        results = await asyncio.gather(*(
            push_ring(self.runtime.transports, self.runtime.identity, self._data_address(n),
                      self.runtime.ring, timeout_s=CONTROL_TIMEOUT_S) for n in names),
            return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("ring push to %s failed (gossip will carry it): %s", name, result)
        self._overridden.clear()
