"""A join whose sources are other processes: three storage nodes run ``python -m
giaannd.storage.rebalance.endpoint``; the newcomer runs in this process and coordinates, so every
stream is started, polled and closed through the sources' stream endpoints over tcp://. Writes
run during the join; afterwards every owner holds exactly the reference rows. A source killed
with SIGKILL and restarted mid-join is refused clearly (its forwarded-write queue died with it)."""

import asyncio

import numpy as np
import pytest

from giaannd.client.storage_client import QuorumNotReached, StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.rebalance import source_control as sc
from giaannd.storage.rebalance.endpoint import StreamEndpoint
from giaannd.storage.rebalance.local_control import LocalClusterControl
from giaannd.storage.rebalance.operations import Rebalance, TopologyOpError, members_after
from giaannd.storage.rebalance.remote_source import RemoteStreamRunner
from giaannd.storage.replication.service import StorageService
from peers.transport import Identity, make_transport
from tests.integration.storage_cluster import CLUSTER, KEY, free_tcp_address, make_batch
from tests.integration.test_topology_processes import NodeProc, assert_owner_rows_equal_reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(60).integers(1, 2**63, 100, dtype=np.uint64)


def tcp(node_id):
    return make_transport("tcp", Identity(node_id, CLUSTER, [KEY]))


class ProcJoin:
    """p0..p2 as processes (R=2), the newcomer s3 in this process, a client and a reference."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.members = {n: free_tcp_address() for n in ("p0", "p1", "p2")}
        self.procs = {n: NodeProc(n, tmp_path / n, self.members, CLUSTER, 2, KEY) for n in self.members}
        self.client_topology = ClusterView(replicas=2)
        self.client = StorageClient(self.client_topology, {"tcp": tcp("client")}, request_timeout_s=2.0,
                                    connect_timeout_s=0.5)
        self.reference = ColumnStore(1 << 32)
        self.rng = np.random.default_rng(61)
        self.svc = self.endpoint = None

    async def start(self):
        for p in self.procs.values():
            p.start()
        nodes = [StorageNode(n, a) for n, a in self.members.items()]
        self.client_topology.set_members(nodes)
        self.address3 = free_tcp_address()
        self.topology3 = ClusterView(local="s3", replicas=2)
        self.topology3.set_members(nodes)
        self.svc = StorageService(self.tmp_path / "s3", 256 << 20, [self.address3], transports={"tcp": tcp("s3")},
                                  topology=self.topology3, node_name="s3", hint_retry_s=0.2)
        await self.svc.open()
        self.endpoint = await StreamEndpoint(self.svc, tcp("s3-stream"), free_tcp_address()).open()
        return self

    def stream_addresses(self):
        out = {n: p.stream_address for n, p in self.procs.items()}
        out["s3"] = self.endpoint.address
        return out

    def control(self):
        return ProcControl(self)

    async def write(self, n, stop=None, pause_s=0.0):
        done = 0
        for _ in range(n):
            if stop is not None and stop.is_set():
                break
            batch = make_batch(self.rng, 8, 4, self.rng.choice(COLUMNS, 8))
            bid = self.client.next_batch_id()
            for _attempt in range(100):
                try:
                    await self.client.write(batch, bid)
                    break
                except QuorumNotReached:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("write never acknowledged")
            self.reference.apply(bid, batch)
            done += 1
            if pause_s:
                await asyncio.sleep(pause_s)
        return done

    async def close(self):
        await self.client.close()
        if self.endpoint is not None:
            await self.endpoint.close()
        if self.svc is not None:
            await self.svc.stop(graceful=True)
        for p in self.procs.values():
            p.stop()


class ProcControl(LocalClusterControl):
    """The newcomer's control: only s3 is local. The source processes keep the member list they
    were started with (this harness has no request that switches their views: the daemon's
    control does that); the writers' and the newcomer's views switch here. Hints go through
    every node's stream endpoint."""

    def __init__(self, c):
        super().__init__(tcp("coordinator"), {"s3": c.svc}, {"s3": c.topology3}, [c.client_topology],
                         [c.client], c.stream_addresses(), drain_grace_s=0.05)

    async def hints_held_for(self, names):
        return sum([await sc.hints_held(self.transport, a, names) for a in self.stream_addresses.values()])

    async def deliver_hints(self):
        for a in self.stream_addresses.values():
            await sc.deliver_hints(self.transport, a)

    async def drop_hints_for(self, name):
        return sum([await sc.drop_hints(self.transport, a, name) for a in self.stream_addresses.values()])


async def test_topology_process_join_with_remote_sources_equals_reference(tmp_path):
    c = await ProcJoin(tmp_path).start()
    try:
        await c.write(80)
        control = c.control()
        op = Rebalance(control, "join", members_after(c.client_topology, add=[StorageNode("s3", c.address3)]),
                       chunk_bytes=2048)
        stop = asyncio.Event()
        writer = asyncio.create_task(c.write(10_000, stop=stop, pause_s=0.002))
        try:
            progress = await asyncio.wait_for(op.run(), 60)
        finally:
            stop.set()
            during = await writer
        assert progress["state"] == "done" and during > 0
        assert {r.label.split("->")[0] for r in op.runners} == {"p0", "p1", "p2"}
        assert all(isinstance(r, RemoteStreamRunner) for r in op.runners)
        assert progress["bytes_done"] > 0
        assert sum(s["deltas"] for s in progress["streams"]) > 0  # the source processes forwarded writes
        await c.write(20)  # under the new placement
        await c.client.flush()
        assert await control.hints_held_for(["p0", "p1", "p2", "s3"]) == 0
        assert c.svc.store.store.keys()
        await assert_owner_rows_equal_reference(c.client, c.reference, ["p0", "p1", "p2", "s3"])
    finally:
        await c.close()


async def test_topology_process_source_killed_mid_join_is_refused(tmp_path):
    c = await ProcJoin(tmp_path).start()
    try:
        await c.write(120)
        op = Rebalance(c.control(), "join", members_after(c.client_topology, add=[StorageNode("s3", c.address3)]),
                       chunk_bytes=1024, rate_bytes_s=30_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(30):
            while not op.runners or not all(r.progress()["items_acked"] for r in op.runners):
                await asyncio.sleep(0.02)
        c.procs["p1"].kill()
        c.procs["p1"].start()  # same data directory and ports: a fresh registry
        with pytest.raises(TopologyOpError, match="restarted"):
            await asyncio.wait_for(task, 60)
        assert "p1->s3" in op.error
        assert list(c.client_topology.names) == ["p0", "p1", "p2"]  # the old placement stays
    finally:
        await c.close()
