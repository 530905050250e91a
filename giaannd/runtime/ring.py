"""The node's storage ring, as the runtime holds it: load, commit, listeners, runtime requests.

Theory of operation
-------------------
Every node, storage or compute, holds one storage ring (giaannd/cluster/ring.py) and persists it in
``<data dir>/ring.json``; the cluster view (``giaannd.cluster.view``) follows it (ring mode): its
placement set is the ring's active entries. ``NodeRing`` is that state, owned by ``NodeRuntime``
(giaannd/runtime/node.py), which exposes it as ``runtime.ring``, ``runtime.commit_ring`` and
``runtime.ring_listeners``.

- ``load(path)`` (runtime start): reads the file (a missing file is an empty ring; a corrupt one
  raises ``CorruptFileError``: the operator decides) and sets the topology's ring.
- ``commit(ring)`` merges a ring into ours. When that changes anything, the file is replaced
  durably *first* (a crash never leaves a node acting on a ring it has not persisted), then the
  topology follows, then the new digest is gossiped (``NodeMeta.ring``, through the runtime's
  ``refresh_meta``), so peers pull it (giaannd/services/ring_sync.py); last, every listener is
  called with the new ring (release scheduling). Commits run one at a time (a lock), so none is
  lost; a merge that changes nothing does nothing.
- ``serve(msg)`` answers the runtime requests (``giaannd.protocol.RuntimeRequest``), which the
  runtime routes here before any role handler and even on a compute-only node: ``RingGet`` (our
  ring), ``RingPush`` (merge, reply with the merged ring) and ``SetOverride`` (a topology
  operation's cutover: set or clear the topology's override; with ``flush``, the reply waits until
  every ``StorageClient`` the runtime handed out has finished the writes it had in flight, bounded
  by the request's ``flush_timeout_s``). The override is set *before* the flush, so no write
  computed after the reply uses the old placement. The override's ``lease`` (the operation and
  its coordinator) is kept beside it, for giaannd/services/override_lease.py; ``OperationGet``
  is answered by ``operation_state`` (set by a storage node's topology service: the state of the
  operation of that id it coordinates, "" for none).

Invariants: ``ring`` is only replaced under the lock, after the file holds it; the topology's ring
is always the last committed (or loaded) ring.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from giaannd import protocol as p
from giaannd.cluster.ring import Ring
from giaannd.cluster.view import ClusterView, StorageNode

__all__ = ["NodeRing", "no_operation"]

log = logging.getLogger(__name__)


def no_operation(op_id: str) -> str:
    """``OperationGet``'s answer on a node that coordinates no topology operation: ""."""
    return ""


class NodeRing:
    """The ring one node holds, its file, its listeners and the runtime requests about it.

    Args:
        topology: the node's cluster view; follows every loaded or committed ring.
        refresh_meta: gossips the node's metadata (called after a commit changed the ring).
        flush_clients: waits until the node's storage clients finished their in-flight writes
            (``SetOverride`` with ``flush``).
    """

    def __init__(self, topology: ClusterView, refresh_meta: Callable[[], None],
                 flush_clients: Callable[[], Awaitable[None]]) -> None:
        self.topology = topology
        #: The ring this node holds (loaded by ``load``; change it with ``commit``).
        self.ring = Ring()
        #: called with the new ring after every change ``commit`` made (release scheduling)
        self.listeners: list[Callable[[Ring], None]] = []
        self._refresh_meta = refresh_meta
        self._flush_clients = flush_clients
        self._lease: p.OverrideLease | None = None
        #: the state of the topology operation of an id this node coordinates ("": none); set by
        #: a storage node's topology service (``OperationGet``)
        self.operation_state: Callable[[str], str] = no_operation
        self._path: Path | None = None
        self._lock = asyncio.Lock()

    def load(self, path: Path) -> None:
        """Load the ring persisted at ``path`` (none: empty) and let the topology follow it.

        Raises:
            CorruptFileError: the file exists but is not a valid ring.
        """
        self._path = path
        self.ring = Ring.load(path)  # CorruptFileError: the operator decides
        self.topology.set_ring(self.ring)
        if len(self.ring):
            log.info("ring loaded digest=%016x active=%s", self.ring.digest(),
                     ",".join(n for n, _ in self.ring.active()) or "-")

    async def commit(self, ring: Ring) -> bool:
        """Merge ``ring`` into this node's ring. If that changed anything: persist it (atomic
        replace + fsync, in a worker thread), then let the topology follow, then gossip the new
        digest, then call the listeners. Commits run one at a time (a lock), so none is lost.

        Returns:
            whether our ring changed.

        Raises:
            RuntimeError: before ``load`` (no data directory known).
            OSError: the ring file could not be written (our ring is unchanged).
            ValueError: the merge would exceed the ring's entry limit (unchanged).
        """
        path = self._path
        if path is None:
            raise RuntimeError("commit_ring before the runtime started")
        async with self._lock:
            merged = Ring(self.ring.entries)
            if not merged.merge(ring):
                return False
            await asyncio.to_thread(merged.save, path)
            self.ring = merged
            self.topology.set_ring(merged)
        log.info("ring changed digest=%016x active=%s removed=%s", merged.digest(),
                 ",".join(n for n, _ in merged.active()) or "-",
                 ",".join(sorted(n for n, e in merged.entries.items() if e.state == "removed")) or "-")
        self._refresh_meta()
        for callback in list(self.listeners):
            callback(merged)
        return True

    async def serve(self, msg: p.RuntimeRequest) -> p.Reply:
        """Answer a ring or override request (module docstring)."""
        if isinstance(msg, p.RingGet):
            return p.RingState(self.ring.to_wire())
        if isinstance(msg, p.RingPush):
            try:
                await self.commit(Ring.from_wire(msg.entries))
            except ValueError as exc:
                return p.BadRequest(str(exc)[:p.MAX_TEXT_CHARS])
            except (OSError, RuntimeError) as exc:
                return p.Unavailable(f"cannot persist the ring: {exc}"[:p.MAX_TEXT_CHARS])
            return p.RingState(self.ring.to_wire())
        if isinstance(msg, p.OperationGet):
            return p.OperationState(self.operation_state(msg.op_id)[:p.MAX_TEXT_CHARS])
        return await self._set_override(msg)

    @property
    def lease(self) -> p.OverrideLease | None:
        """The lease of the override in force (None: no override, or one without a lease)."""
        if self.topology.override is None:
            return None
        return self._lease

    def set_override(self, members: Sequence[StorageNode] | None, lease: p.OverrideLease | None = None) -> None:
        """Set (or clear: None) the topology's override, and the lease it is held under.

        Raises:
            RuntimeError / ValueError: as ``ClusterView.set_override`` (nothing changed).
        """
        self.topology.set_override(members)
        self._lease = lease if members is not None else None

    async def _set_override(self, msg: p.SetOverride) -> p.Reply:
        members = None if msg.members is None else [StorageNode(n, a, w) for n, a, w in msg.members]
        try:
            self.set_override(members, msg.lease)
        except (RuntimeError, ValueError) as exc:
            return p.BadRequest(str(exc)[:p.MAX_TEXT_CHARS])
        epoch = self.topology.epoch
        lease = msg.lease
        log.info("placement override %s epoch=%s flush=%s%s",
                 "cleared" if members is None else "set members=" + ",".join(m.name for m in members),
                 epoch[:12], msg.flush,
                 "" if lease is None or members is None else f" op={lease.op_id} coordinator={lease.coordinator}")
        if msg.flush:
            try:
                async with asyncio.timeout(msg.flush_timeout_s):
                    await self._flush_clients()
            except TimeoutError:
                return p.Unavailable(f"override set (epoch {epoch[:12]}) but writes in flight did "
                                     f"not finish within {msg.flush_timeout_s}s")
        return p.OverrideSet(epoch, self.topology.override is not None)
