"""A cluster of StorageServices in one process (mem:// or tcp://) plus a StorageClient: the
``Pair``/``Cluster`` helper of STYLE.md item 27 for the storage tests and the bench."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.storage.replication.service import StorageService
from peers.transport import Identity, make_transport
from peers.transport.memory import MemoryNetwork

KEY = b"storage-tests-key-0123456789abcd"
CLUSTER = "storage-tests"


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Cluster:
    def __init__(self, root: Path, n: int = 3, *, scheme: str = "mem", replicas: int = 3,
                 capacity_bytes: int = 64 << 20, write_quorum: int | None = None,
                 request_timeout_s: float = 2.0) -> None:
        self.root, self.scheme, self.replicas, self.capacity = root, scheme, replicas, capacity_bytes
        self.network = MemoryNetwork()
        self.names = [f"s{i}" for i in range(n)]
        self.addresses = {name: (f"mem://{name}" if scheme == "mem" else free_tcp_address())
                          for name in self.names}
        self.services: dict[str, StorageService] = {}
        self.topologies: dict[str, ClusterView] = {}
        self.client_topology = ClusterView(local=None, replicas=replicas)
        self.client = StorageClient(self.client_topology, {scheme: self._transport("client")},
                                    write_quorum=write_quorum, request_timeout_s=request_timeout_s,
                                    connect_timeout_s=0.5)

    def _transport(self, node_id: str):
        options = {"network": self.network} if self.scheme == "mem" else {}
        return make_transport(self.scheme, Identity(node_id, CLUSTER, [KEY]), **options)

    def _all_topologies(self) -> list[ClusterView]:
        return [*self.topologies.values(), self.client_topology]

    def _members(self) -> list[StorageNode]:
        return [StorageNode(n, self.addresses[n]) for n in self.names]

    def _make_service(self, name: str, **kw) -> StorageService:
        topo = self.topologies.setdefault(name, ClusterView(local=name, replicas=self.replicas))
        return StorageService(self.root / name, self.capacity, [self.addresses[name]],
                              transports={self.scheme: self._transport(name)}, topology=topo,
                              node_name=name, hint_retry_s=0.2, **kw)

    async def start(self, **kw) -> Cluster:
        for name in self.names:
            svc = self._make_service(name, **kw)
            await svc.open()
            self.services[name] = svc
        for topo in self._all_topologies():
            topo.set_members(self._members())
        return self

    async def stop_node(self, name: str, graceful: bool = True) -> None:
        """Stop a node and tell every view it is down (as membership's MemberFailed would)."""
        await self.services.pop(name).stop(graceful)
        for topo in self._all_topologies():
            topo.mark_down(name)

    async def restart_node(self, name: str) -> StorageService:
        svc = self._make_service(name)
        await svc.open()
        self.services[name] = svc
        for topo in self._all_topologies():
            topo.mark_up(name)
        return svc

    async def close(self) -> None:
        await self.client.close()
        for svc in list(self.services.values()):
            await svc.stop(graceful=False)
        self.services.clear()

    def owners(self, column: int) -> tuple[str, ...]:
        return self.client_topology.placement.owners(column)


def make_batch(rng: np.random.Generator, rows: int, entries_per_row: int = 4,
               columns: np.ndarray | None = None) -> RowBatch:
    """A canonical random delta batch (strengths small positive integers: exact float sums)."""
    n = rows * entries_per_row
    src_col = columns if columns is not None else rng.integers(1, 2**63, rows, dtype=np.uint64)
    sc = np.repeat(np.asarray(src_col, np.uint64), entries_per_row)
    sf = np.repeat(rng.integers(0, 50, rows, dtype=np.uint64), entries_per_row)
    return RowBatch.from_entries(sc, sf, rng.integers(0, 9, n).astype(np.uint8),
                                 rng.integers(1, 1000, n, dtype=np.uint64),
                                 rng.integers(0, 1000, n, dtype=np.uint64),
                                 rng.integers(1, 5, n).astype(np.float32))
