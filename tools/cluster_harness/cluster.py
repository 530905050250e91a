"""``Cluster``: storage nodes in this process or as ``giaannd`` processes, behind one API.

See the package docstring for the modes. Theory of operation:

- **Nodes.** An in-process node is an ``InProcessNode`` (node.py: the daemon's own factories); a
  process node is a ``tools.local_cluster`` ``Node`` (``python -m giaannd``) with pinned ports, so
  a restart keeps its addresses. Both keep their data directory (``root/NAME``) across restarts.
- **Membership.** With ``gossip`` the in-process nodes run the membership service and learn
  everything by SWIM. Otherwise the harness *is* membership for the views it holds (in-process
  nodes' and the client's): it feeds them the ``MemberJoined`` / ``MemberFailed`` events SWIM
  would, at once (``noticed=False`` leaves a stop unnoticed: a crash nobody saw yet). Process
  nodes gossip among themselves; they learn in-process nodes only from the ring.
- **The ring.** ``ring`` is the cluster's storage ring; the initial nodes start active in it
  (``bootstrap``), nodes added later standby. A node gets it before its roles start, as ring sync
  would give it; ``commit_ring`` / ``commit_members`` merge a change into every node (pushed to
  process nodes over the data plane, ``RingPush``). ``control()`` is a ``LocalClusterControl``
  whose cutover commits the ring, as the daemon's control does.
- **Client and reference.** ``client`` is a ``StorageClient`` of a compute node's runtime in this
  process (its view fed like the others'); ``write`` / ``write_many`` record every acknowledged
  batch in ``reference`` (one plain ``ColumnStore``) and ``mismatches`` compares each in-process
  owner's rows with it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from giaannd.client.ring_calls import push_ring
from giaannd.client.storage_client import StorageClient
from giaannd.cluster.ring import Ring
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.config import StorageConfig
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.runtime.node import NodeRuntime
from giaannd.sdk.local_cluster import LocalCluster, Node
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.rebalance.endpoint import StreamEndpoint
from giaannd.storage.rebalance.local_control import LocalClusterControl
from giaannd.storage.replication.service import StorageService
from peers.keyring import Keyring
from peers.membership.events import MemberFailed, MemberJoined
from peers.membership.messages import MemberStatus
from peers.membership.meta import NodeMeta
from peers.transport import Identity, Transport, make_transport
from peers.transport.memory import MemoryNetwork
from tools.cluster_harness.data import free_tcp_address
from tools.cluster_harness.node import InProcessNode, node_config
from tools.cluster_harness.reference import ReferenceWrites

__all__ = ["CLUSTER_NAME", "CONVERGE_TIMEOUT_S", "Cluster"]

CLUSTER_NAME: Final = "harness"
CLIENT: Final = "client"
#: Bound on a gossiping cluster agreeing on members and ring.
CONVERGE_TIMEOUT_S: Final = 30.0


class Cluster(ReferenceWrites):
    """Storage nodes plus a client and a reference (module docstring).

    Args:
        root: holds every node's data directory, the key file and the process nodes' logs.
        n: initial storage nodes, named ``names`` or ``s0``..``s{n-1}``, active in the ring.
        processes: initial nodes are ``giaannd`` processes (tcp); else nodes in this process.
        scheme: ``mem`` or ``tcp`` for in-process nodes (process nodes are tcp).
        replicas / write_quorum: R and the client's W (None: a majority of the effective R).
        capacity_bytes: each node's ``storage.capacity-bytes``.
        request_timeout_s: the client's request deadline.
        gossip: in-process nodes run membership (SWIM on loopback) instead of being fed.
        membership: ``membership`` config keys of process nodes (Python names).
    """

    def __init__(self, root: Path, n: int = 3, *, processes: bool = False, scheme: str = "mem",
                 replicas: int = 3, write_quorum: int | None = None, capacity_bytes: int = 64 << 20,
                 request_timeout_s: float = 2.0, gossip: bool = False, names: Sequence[str] | None = None,
                 membership: dict[str, Any] | None = None, log_level: str = "info") -> None:
        self.root, self.processes, self.gossip = root, processes, gossip
        self.scheme = "tcp" if processes else scheme
        self.replicas, self.write_quorum, self.capacity = replicas, write_quorum, capacity_bytes
        self.request_timeout_s, self.log_level = request_timeout_s, log_level
        self.membership_options = dict(membership or {})
        self.names = list(names) if names is not None else [f"s{i}" for i in range(n)]
        self.network = MemoryNetwork()
        root.mkdir(parents=True, exist_ok=True)
        self.key_file = root / "cluster.key"
        Keyring.generate().save(self.key_file)
        self.keys = list(Keyring.load(self.key_file).keys)
        self.storage = self._storage_config()
        self.ring = Ring()
        #: what tests reach into: data-plane and stream addresses (fixed for a node's life), and
        #: the running in-process nodes with their storage services, views and stream endpoints
        self.addresses: dict[str, str] = {}
        self.stream_addresses: dict[str, str] = {}
        self.nodes: dict[str, InProcessNode] = {}
        self.services: dict[str, StorageService] = {}
        self.topologies: dict[str, ClusterView] = {}
        self.endpoints: dict[str, StreamEndpoint] = {}
        #: process nodes (running or not) and their launcher
        self.procs: dict[str, Node] = {}
        self.local: LocalCluster | None = None
        self.reference = ColumnStore(1 << 34)
        self.written: list[tuple[BatchId, RowBatch]] = []
        self.failures: list[BaseException] = []
        self._binds: dict[str, tuple[str, str]] = {}
        self._metas: dict[str, tuple[str, NodeMeta]] = {}
        self._down: set[str] = set()
        self._client_node: InProcessNode | None = None
        self._client: StorageClient | None = None
        self._ops_transport: Transport | None = None

    def _storage_config(self, **overrides: Any) -> StorageConfig:
        """The nodes' ``storage`` section: the old in-process defaults of the storage tests (no
        group-commit window, unpaced hints retried every 0.2 s, releases held back)."""
        settings: dict[str, Any] = {
            "capacity_bytes": self.capacity, "replication_factor": self.replicas,
            "write_quorum": min(self.write_quorum or self.replicas // 2 + 1, self.replicas),
            "fsync_group_commit_ms": 0.0, "ramp_up_s": 0.0, "hint_retry_s": 0.2,
            "release_delay_s": 86400.0, "join_mode": "manual", **overrides}
        return StorageConfig(**settings)

    # -- what tests use -----------------------------------------------------------------------------
    @property
    def client(self) -> StorageClient:
        assert self._client is not None, "start the cluster first"
        return self._client

    @property
    def client_runtime(self) -> NodeRuntime:
        assert self._client_node is not None, "start the cluster first"
        return self._client_node.runtime

    @property
    def client_topology(self) -> ClusterView:
        return self.client_runtime.topology

    @property
    def ops_transport(self) -> Transport:
        """A transport of the cluster (dials stream endpoints: topology operations, repair)."""
        if self._ops_transport is None:
            self._ops_transport = self.transport("topology-ops")
        return self._ops_transport

    def transport(self, node_id: str) -> Transport:
        """A new transport with the cluster's identity (a test's own client or listener)."""
        options = {"network": self.network} if self.scheme == "mem" else {}
        return make_transport(self.scheme, Identity(node_id, CLUSTER_NAME, self.keys), **options)

    def owners(self, column: int) -> tuple[str, ...]:
        return self.client_topology.placement.owners(column)

    def members(self) -> list[StorageNode]:
        """The client's placement set as ``StorageNode`` objects."""
        return [StorageNode(n, self.addresses[n]) for n in self.client_topology.names]

    def storage_dir(self, name: str) -> Path:
        """Where node ``name`` keeps its store, hints and vocabulary."""
        return self.root / name / "storage"

    def column_store(self, name: str) -> ColumnStore:
        """In-process node ``name``'s rows: its storage service's ``DurableStore``'s ``ColumnStore``."""
        durable = self.services[name].store
        assert durable is not None, f"{name}'s storage service is not started"
        return durable.store

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self, **storage: Any) -> Cluster:
        """Start the initial nodes (``storage``: further ``storage`` config keys) and the client;
        on failure, stop what started."""
        self.storage = self._storage_config(**storage)
        for name in self.names:
            self.ring = self.ring.with_active(name, self.storage.placement_weight)
        try:
            await self._start_all()
        except BaseException:
            await self.close()
            raise
        return self

    async def _start_all(self) -> None:
        if self.processes:
            self.local = self._launcher(self.names)
            await asyncio.to_thread(self.local.start)
            for name, node in zip(self.names, self.local.nodes):
                self.procs[name] = node
                await self._process_up(name, notice=True)
        else:
            for name in self.names:
                await self._start_node(name, notice=True, join_mode="bootstrap")
        await self._start_client()
        if self.gossip:
            await self.converge()

    async def add_node(self, name: str, *, process: bool = False) -> StorageService | None:
        """A new, empty storage node that knows the cluster but owns nothing: standby, outside
        the ring (a join adds it). Returns its service (None for a process node)."""
        self.names.append(name)
        if not process:
            await self._start_node(name, notice=True, join_mode="manual")
            return self.services[name]
        if self.local is None:
            self.local = self._launcher([])
        node = await asyncio.to_thread(self.local.add_node, name, ["storage"], join_mode="manual")
        self.procs[name] = node
        await self._process_up(name, notice=True)
        await self._push_ring(name)
        return None

    async def stop_node(self, name: str, graceful: bool = True, *, noticed: bool = True) -> None:
        """Stop a node (``graceful``: drain and snapshot; else a crash: SIGKILL for a process) and,
        if ``noticed``, tell every view it is down (as membership's MemberFailed would)."""
        if name in self.procs:
            assert self.local is not None
            stop = self.local.stop_node if graceful else self.local.kill
            await asyncio.to_thread(stop, self.procs[name])
        else:
            node = self.nodes.pop(name)
            for table in (self.services, self.topologies, self.endpoints):
                table.pop(name, None)
            await node.stop(graceful)
            self.failures += node.failures
        if noticed:
            self.notice_down(name)

    async def kill(self, name: str, *, noticed: bool = True) -> None:
        """A crash: nothing drains, nothing is snapshotted (everything acknowledged is in the log)."""
        await self.stop_node(name, graceful=False, noticed=noticed)

    async def retire(self, name: str) -> None:
        """After a decommission: the node stops gracefully (its views keep it as they are)."""
        await self.stop_node(name, graceful=True, noticed=False)

    async def restart_node(self, name: str, *, noticed: bool = True) -> StorageService | None:
        """Start a stopped node again from its data directory (same addresses); with ``noticed``
        every view hears it is up. Returns its service (None for a process node)."""
        if name in self.procs:
            assert self.local is not None
            await asyncio.to_thread(self.local.restart, self.procs[name])
            await self._process_up(name, notice=noticed)
            return None
        await self._start_node(name, notice=noticed, join_mode="manual")
        return self.services[name]

    def freeze(self, name: str, frozen: bool = True) -> None:
        """SIGSTOP (``frozen``) or SIGCONT a process node: its sockets stay open, nothing answers."""
        proc = self.procs[name].proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    async def close(self) -> None:
        """Stop everything (in-process nodes at once, process nodes gracefully, then SIGKILL).

        Raises:
            RuntimeError: a background task of an in-process node failed meanwhile (``failures``).
        """
        if self._client is not None:
            await self._client.close()
        for name in list(self.nodes):
            node = self.nodes.pop(name)
            await node.stop(graceful=False)
            self.failures += node.failures
        self.services.clear()
        if self._client_node is not None:
            await self._client_node.stop(graceful=False)
            self.failures += self._client_node.failures
        if self.local is not None:
            local = self.local
            try:
                await asyncio.to_thread(local.stop)
            finally:
                await asyncio.to_thread(local.kill_all)
        if self.failures:  # (the daemon would have stopped with status 1)
            raise RuntimeError(f"background tasks of the cluster's nodes failed: {self.failures!r}")

    # -- membership, as the harness plays it ----------------------------------------------------------
    def notice_down(self, name: str) -> None:
        """Tell every view the harness feeds that ``name`` failed."""
        self._down.add(name)
        self._tell(name, up=False, views=self._views())

    def notice_up(self, name: str) -> None:
        """Tell every view the harness feeds that ``name`` is alive (with its current metadata)."""
        self._down.discard(name)
        self._tell(name, up=True, views=self._views())

    def _views(self) -> list[ClusterView]:
        if self.gossip:
            return []  # membership feeds them
        out = list(self.topologies.values())
        if self._client_node is not None:
            out.append(self._client_node.runtime.topology)
        return out

    def _tell(self, name: str, up: bool, views: Iterable[ClusterView]) -> None:
        node_id, meta = self._metas[name]
        kind = MemberJoined if up else MemberFailed
        event = kind(name, node_id, ("127.0.0.1", 0), 0, MemberStatus.ALIVE if up else MemberStatus.DEAD,
                     meta.encode(), "cluster harness")
        for view in views:
            view.apply_event(event)

    async def converge(self, timeout_s: float = CONVERGE_TIMEOUT_S) -> None:
        """Gossip mode: wait until every view sees every running node alive and the same ring."""
        running = set(self.nodes) | {n for n, p in self.procs.items() if p.exit_code is None}
        views = [*self.topologies.values(), self.client_topology]
        rings = [n.runtime for n in self.nodes.values()] + [self.client_runtime]
        async with asyncio.timeout(timeout_s):
            while not (all(all(v.is_live(n) for n in running) for v in views)
                       and len({rt.ring.digest() for rt in rings}) == 1):
                await asyncio.sleep(0.05)

    # -- the ring -----------------------------------------------------------------------------------
    async def commit_ring(self, ring: Ring) -> None:
        """Merge ``ring`` into the cluster's ring and every node's (process nodes by RingPush)."""
        merged = Ring(self.ring.entries)
        merged.merge(ring)
        self.ring = merged
        for runtime in [n.runtime for n in self.nodes.values()] + [self.client_runtime]:
            await runtime.commit_ring(merged)
        for name, proc in self.procs.items():
            if proc.exit_code is None:
                await self._push_ring(name)

    async def commit_members(self, members: Sequence[StorageNode]) -> None:
        """Commit the ring whose active set is ``members`` (removed: the active ones left out)."""
        ring, new = self.ring, {m.name: m.weight for m in members}
        active = dict(ring.active())
        for name in sorted(set(active) - set(new)):
            ring = ring.with_removed(name)
        for name, weight in sorted(new.items()):
            if active.get(name) != weight:
                ring = ring.with_active(name, weight)
        await self.commit_ring(ring)

    async def _push_ring(self, name: str) -> None:
        rt = self.client_runtime
        await push_ring(rt.transports, rt.identity, self.addresses[name], self.ring)

    def control(self) -> _Control:
        """A ``ClusterControl`` over the in-process nodes (topology operations, repair)."""
        return _Control(self)

    # -- nodes --------------------------------------------------------------------------------------
    def _bind(self, name: str) -> tuple[str, str]:
        """(data-plane bind, stream bind) of a node, fixed for its life."""
        if name not in self._binds:
            self._binds[name] = (f"mem://{name}", f"mem://{name}-stream") if self.scheme == "mem" \
                else (free_tcp_address(), free_tcp_address())
        return self._binds[name]

    def _seeds(self) -> list[str]:
        return [n.gossip_address for n in self.nodes.values()][:1] if self.gossip else []

    async def _start_node(self, name: str, *, notice: bool, join_mode: str) -> None:
        bind, stream = self._bind(name)
        storage = msgspec.structs.replace(self.storage, stream_bind=stream, join_mode=join_mode)
        config = node_config(self.root, name, roles=["storage"], bind=bind, cluster=CLUSTER_NAME,
                             key_file=self.key_file, storage=storage, seeds=self._seeds())
        node = InProcessNode(config, network=self.network, gossip=self.gossip)
        await node.start(self._settle)
        endpoint, service = node.endpoint, node.storage
        assert endpoint is not None and service is not None
        self.nodes[name], self.services[name] = node, service
        self.topologies[name], self.endpoints[name] = node.runtime.topology, endpoint
        self.addresses[name], self.stream_addresses[name] = node.address, endpoint.address
        self._metas[name] = (node.runtime.node_id, node.runtime.node_meta())
        self._tell(name, up=True, views=[] if self.gossip else [node.runtime.topology])
        if notice:
            self.notice_up(name)

    async def _settle(self, runtime: NodeRuntime) -> None:
        """Before a node's roles start: the ring, and (static membership) every member it would
        know, itself included, as ring sync and membership give them to a daemon."""
        if self.gossip:
            return
        await runtime.commit_ring(self.ring)
        if "storage" in runtime.config.node.roles:
            self._metas[runtime.node_name] = (runtime.node_id, runtime.node_meta())
            self._down.discard(runtime.node_name)  # (it knows it is up)
        for name in self._metas:
            if name not in self._down:
                self._tell(name, up=True, views=[runtime.topology])

    async def _start_client(self) -> None:
        bind = f"mem://{CLIENT}" if self.scheme == "mem" else "tcp://127.0.0.1:0"
        seeds = self._seeds()
        config = node_config(self.root, CLIENT, roles=["compute"], bind=bind, cluster=CLUSTER_NAME,
                             key_file=self.key_file, storage=self.storage, seeds=seeds)
        self._client_node = InProcessNode(config, network=self.network, gossip=self.gossip, roles=False)
        await self._client_node.start(self._settle)
        self._client = self.client_runtime.storage_client(
            write_quorum=self.write_quorum, request_timeout_s=self.request_timeout_s, connect_timeout_s=0.5)

    def _launcher(self, names: Sequence[str]) -> LocalCluster:
        settings = msgspec.structs.asdict(self.storage)
        for key in ("replication_factor", "write_quorum", "join_mode", "stream_bind"):
            settings.pop(key)
        return LocalCluster(self.root, nodes=[(n, ["storage"]) for n in names], transport="tcp",
                            replication_factor=self.replicas, write_quorum=self.storage.write_quorum,
                            storage_options=settings, cluster_name=CLUSTER_NAME, key_file=self.key_file,
                            pin_ports=True, membership_options=self.membership_options,
                            log_level=self.log_level)

    async def _process_up(self, name: str, *, notice: bool) -> None:
        """A process node is ready: learn its addresses and metadata from its status."""
        proc = self.procs[name]
        status = await asyncio.to_thread(proc.status)
        services = status["services"]
        transports = dict(services["runtime"]["advertised"])
        transports["stream"] = services["storage"]["stream_address"]
        meta = NodeMeta(roles=tuple(proc.roles), transports=transports,
                        capacity_bytes=self.storage.capacity_bytes, weight=self.storage.placement_weight)
        self._metas[name] = (str(status["node_id"]), meta)
        self.addresses[name], self.stream_addresses[name] = transports["tcp"], transports["stream"]
        if notice:
            self.notice_up(name)


class _Control(LocalClusterControl):
    """``LocalClusterControl`` over the cluster's in-process nodes and client; its cutover commits
    the new ring everywhere, as the daemon's control does (``after_cutover``)."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster.ops_transport, cluster.services, cluster.topologies,
                         [cluster.client_topology], [cluster.client], cluster.stream_addresses,
                         drain_grace_s=0.05)
        self.cluster = cluster

    async def after_cutover(self, new_members: Sequence[StorageNode]) -> None:
        await self.cluster.commit_members(new_members)

