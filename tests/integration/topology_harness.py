"""An in-process storage cluster with stream endpoints and a single-store reference: the helper of
the topology tests (join, decommission, removenode, repair) and tools/bench/topology.py."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from giaannd.client.storage_client import QuorumNotReached
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.rebalance.endpoint import StreamEndpoint
from giaannd.storage.rebalance.local_control import LocalClusterControl
from giaannd.storage.replication.service import StorageService
from tests.integration.storage_cluster import Cluster, free_tcp_address, make_batch


class TopoCluster(Cluster):
    """``Cluster`` plus a StreamEndpoint per node, nodes added/removed at run time, and the
    reference: every acknowledged batch applied once to one plain ColumnStore."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.endpoints: dict[str, StreamEndpoint] = {}
        self.stream_addresses: dict[str, str] = {}
        self.reference = ColumnStore(1 << 34)
        self.written: list[tuple[BatchId, RowBatch]] = []
        self.ops_transport = self._transport("topology-ops")

    def _stream_address(self, name: str) -> str:
        return f"mem://{name}-stream" if self.scheme == "mem" else free_tcp_address()

    async def _open_endpoint(self, name: str) -> None:
        ep = StreamEndpoint(self.services[name], self._transport(f"{name}-stream"),
                            self.stream_addresses.setdefault(name, self._stream_address(name)))
        self.endpoints[name] = await ep.open()

    async def start(self, **kw) -> TopoCluster:
        await super().start(**kw)
        for name in self.names:
            await self._open_endpoint(name)
        return self

    def members(self) -> list[StorageNode]:
        return [StorageNode(n, self.addresses[n]) for n in self.client_topology.names]

    async def add_node(self, name: str) -> StorageService:
        """A new, empty node that knows the cluster but is not in anyone's placement yet."""
        self.names.append(name)
        self.addresses[name] = f"mem://{name}" if self.scheme == "mem" else free_tcp_address()
        view = self.topologies[name] = ClusterView(local=name, replicas=self.replicas)
        view.set_members(self.members())
        svc = self._make_service(name)
        await svc.open()
        self.services[name] = svc
        await self._open_endpoint(name)
        return svc

    async def kill(self, name: str) -> None:
        """Stop a node at once (every acknowledged batch is in its synced log) and mark it down."""
        ep = self.endpoints.pop(name, None)
        if ep is not None:
            await ep.close()
        await self.stop_node(name, graceful=False)

    async def restart(self, name: str) -> StorageService:
        svc = await self.restart_node(name)
        await self._open_endpoint(name)
        return svc

    async def retire(self, name: str) -> None:
        """After a decommission: the node stops."""
        ep = self.endpoints.pop(name, None)
        if ep is not None:
            await ep.close()
        svc = self.services.pop(name, None)
        if svc is not None:
            await svc.stop(graceful=True)

    def control(self) -> LocalClusterControl:
        return LocalClusterControl(self.ops_transport, self.services, self.topologies, [self.client_topology],
                                   [self.client], self.stream_addresses, drain_grace_s=0.05)

    async def close(self) -> None:
        for ep in self.endpoints.values():
            with contextlib.suppress(Exception):
                await ep.close()
        await super().close()

    # -- writes with a reference ------------------------------------------------------------------
    async def write(self, batch: RowBatch, attempts: int = 20) -> BatchId:
        """Write until acknowledged (retrying the same id: the client's contract); then, and only
        then, the batch counts in the reference."""
        bid = self.client.next_batch_id()
        for attempt in range(attempts):
            try:
                await self.client.write(batch, bid)
                break
            except QuorumNotReached:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.05)
        self.reference.apply(bid, batch)
        self.written.append((bid, batch))
        return bid

    async def write_many(self, rng: np.random.Generator, n: int, columns: np.ndarray, rows: int = 8,
                         stop: asyncio.Event | None = None, pause_s: float = 0.0) -> int:
        done = 0
        for _ in range(n):
            if stop is not None and stop.is_set():
                break
            await self.write(make_batch(rng, rows, 4, rng.choice(columns, rows)))
            done += 1
            if pause_s:
                await asyncio.sleep(pause_s)
        return done

    def mismatches(self, names: list[str] | None = None) -> list[str]:
        """Every (row, owner) where the owner's copy differs from the reference, under the writers'
        placement; an owner must hold exactly the reference rows of its columns (no loss, no double)."""
        placement = self.client_topology.placement
        ref_keys = self.reference.keys()
        cols = np.unique(np.array([k[0] for k in ref_keys], np.uint64))
        owners = placement.owner_indices(cols)
        problems: list[str] = []
        by_col: dict[int, list[tuple[int, int]]] = {}
        for k in ref_keys:
            by_col.setdefault(k[0], []).append(k)
        for i, c in enumerate(cols.tolist()):
            for j in owners[i]:
                name = placement.names[int(j)]
                if names is not None and name not in names:
                    continue
                store = self.services[name].store.store
                have = [k for k in store.keys() if k[0] == c]
                if have != by_col[c]:
                    problems.append(f"{name} column {c:#x}: {len(have)} rows, reference {len(by_col[c])}")
                    continue
                for k in have:
                    if not self.reference.row(k).equals(store.row(k)):
                        problems.append(f"{name} row {k}: strengths differ from the reference")
        return problems
