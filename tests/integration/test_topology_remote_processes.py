"""A join whose sources are other processes: three storage nodes are ``giaannd`` daemons; the
newcomer runs in this process (tools/cluster_harness) and coordinates, so every stream is started,
polled and closed through the sources' stream endpoints over tcp://. Writes run during the join;
afterwards every owner holds exactly the reference rows. A source killed with SIGKILL and
restarted mid-join is refused clearly (its forwarded-write queue died with it)."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.storage.rebalance import source_control as sc
from giaannd.storage.rebalance.local_control import LocalClusterControl
from giaannd.storage.rebalance.operations import Rebalance, TopologyOpError, members_after
from giaannd.storage.rebalance.remote_source import RemoteStreamRunner
from tests.integration.test_topology_processes import assert_owner_rows_equal_reference
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(60).integers(1, 2**63, 100, dtype=np.uint64)


class ProcJoin:
    """p0..p2 as processes (R=2), the newcomer s3 in this process, a client and a reference."""

    def __init__(self, tmp_path):
        self.cluster = Cluster(tmp_path, processes=True, names=["p0", "p1", "p2"], replicas=2)
        self.rng = np.random.default_rng(61)
        self.procs = self.cluster.procs

    async def start(self):
        await self.cluster.start()
        self.svc = await self.cluster.add_node("s3")  # standby: not in the ring
        self.client, self.client_topology = self.cluster.client, self.cluster.client_topology
        self.reference = self.cluster.reference
        self.address3 = self.cluster.addresses["s3"]
        return self

    def control(self):
        return ProcControl(self)

    async def write(self, n, stop=None, pause_s=0.0):
        done = 0
        for _ in range(n):
            if stop is not None and stop.is_set():
                break
            await self.cluster.write(make_batch(self.rng, 8, 4, self.rng.choice(COLUMNS, 8)), attempts=100)
            done += 1
            if pause_s:
                await asyncio.sleep(pause_s)
        return done

    async def close(self):
        await self.cluster.close()


class ProcControl(LocalClusterControl):
    """The newcomer's control: only s3 is local. The source processes keep the ring they started
    with (this control sends no request that switches their views: the daemon's control does
    that); the writers' and the newcomer's views switch here. Hints go through every node's
    stream endpoint."""

    def __init__(self, c):
        super().__init__(c.cluster.transport("coordinator"), {"s3": c.svc}, {"s3": c.cluster.topologies["s3"]},
                         [c.client_topology], [c.client], c.cluster.stream_addresses, drain_grace_s=0.05)

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
        await c.cluster.kill("p1", noticed=False)
        await c.cluster.restart_node("p1")  # same data directory and ports: a fresh registry
        with pytest.raises(TopologyOpError, match="restarted"):
            await asyncio.wait_for(task, 60)
        assert "p1->s3" in op.error
        assert list(c.client_topology.names) == ["p0", "p1", "p2"]  # the old placement stays
    finally:
        await c.close()
