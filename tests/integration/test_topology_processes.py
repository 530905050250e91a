"""Topology faults with real processes over tcp://: SIGKILL of the receiving node in the middle of
a join stream (it restarts from its data directory and the stream resumes, re-sending at most one
item), and SIGKILL of a storage node during writes (after hint delivery every owner holds exactly
the reference rows). Storage nodes are ``giaannd`` daemons (tools/cluster_harness: the receiver
next to in-process sources, or a cluster of processes)."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.config import StorageConfig
from giaannd.storage.rebalance.operations import Rebalance, members_after
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio]
#: items a stream keeps on the wire (storage.stream-window): what a receiver restart may re-send
WINDOW = StorageConfig().stream_window

COLUMNS = np.random.default_rng(30).integers(1, 2**63, 100, dtype=np.uint64)


async def assert_owner_rows_equal_reference(client, reference, nodes):
    """Read every reference row from each of its owners among ``nodes``; all must be exact."""
    placement = client.topology.placement
    keys = reference.keys()
    cols = np.array([k[0] for k in keys], np.uint64)
    feats = np.array([k[1] for k in keys], np.uint64)
    owners = placement.owner_indices(cols)
    for node in nodes:
        j = placement.names.index(node)
        mine = (owners == j).any(axis=1)
        got = await client.read_from(node, cols[mine], feats[mine])
        want = reference.read_rows(cols[mine], feats[mine])
        assert got.num_rows == want.num_rows, f"{node}: {got.num_rows} rows, reference {want.num_rows}"
        for a, b in zip(got.buffers(), want.buffers()):
            assert np.array_equal(a, b), f"{node}: rows differ from the reference"


async def test_topology_process_receiver_killed_mid_join_resumes(tmp_path):
    cluster = await Cluster(tmp_path, 3, scheme="tcp", replicas=2).start()
    try:
        rng = np.random.default_rng(31)
        await cluster.write_many(rng, 120, COLUMNS, rows=16)
        await cluster.add_node("s3", process=True)  # fixed ports: restarts keep them
        op = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024,
            rate_bytes_s=60_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(30):
            while sum(r.sender.acked for r in op.runners) < 6:
                await asyncio.sleep(0.01)
        await cluster.kill("s3")
        await asyncio.sleep(0.3)
        await cluster.restart_node("s3")  # same data directory and ports
        op.set_rate(None)
        progress = await asyncio.wait_for(task, 60)
        assert progress["state"] == "done"
        assert sum(s["reconnects"] for s in progress["streams"]) >= 1
        assert all(s["resent_items"] <= WINDOW for s in progress["streams"])
        await cluster.client.flush()
        await assert_owner_rows_equal_reference(cluster.client, cluster.reference, ["s3"])
        assert cluster.mismatches(["s0", "s1", "s2"]) == []
    finally:
        await cluster.close()


class ProcCluster:
    """Three storage processes (R=3), a client and a single-store reference."""

    def __init__(self, tmp_path):
        self.names = ["p0", "p1", "p2"]
        self.cluster = Cluster(tmp_path, processes=True, names=self.names, replicas=3, request_timeout_s=1.0)
        self.rng = np.random.default_rng(32)

    async def start(self):
        await self.cluster.start()
        self.client, self.reference = self.cluster.client, self.cluster.reference
        return self

    async def write(self, n):
        for _ in range(n):
            await self.cluster.write(make_batch(self.rng, 8, 4, self.rng.choice(COLUMNS, 8)), attempts=100)

    async def settle_and_check(self):
        client = self.client
        await client.flush()
        async with asyncio.timeout(30):  # hints reach the node that was away (retry every 0.2 s)
            while client.writer_floor < client._next_seq - 1:
                await client.confirm_hints()
                await asyncio.sleep(0.1)
            while sum([(await client.usage(n)).hints_held for n in self.names]):
                await asyncio.sleep(0.1)
        await assert_owner_rows_equal_reference(client, self.reference, self.names)
        keys = self.reference.keys()
        cols = np.array([k[0] for k in keys], np.uint64)
        feats = np.array([k[1] for k in keys], np.uint64)
        digests = [await client.digests(n, cols, feats) for n in self.names]
        assert [[d[:2] for d in ds] for ds in digests[1:]] == [[d[:2] for d in digests[0]]] * 2

    async def close(self):
        await self.cluster.close()


async def test_topology_process_kill9_during_writes_then_equal_to_reference(tmp_path):
    c = await ProcCluster(tmp_path).start()
    try:
        writer = asyncio.create_task(c.write(150))
        await asyncio.sleep(0.3)
        await c.cluster.kill("p1", noticed=False)  # SIGKILL mid-write
        await asyncio.sleep(0.5)
        await c.cluster.restart_node("p1")
        await asyncio.wait_for(writer, 60)
        await c.settle_and_check()
    finally:
        await c.close()


async def test_topology_process_unreachable_node_gets_hints_after_heal(tmp_path):
    """A node that stops answering (SIGSTOP: its sockets stay open, requests time out, like a
    partition) while writes continue; after the heal (SIGCONT) hinted handoff brings it level."""
    c = await ProcCluster(tmp_path).start()
    try:
        await c.write(20)
        c.cluster.freeze("p2")
        try:
            await asyncio.wait_for(c.write(40), 60)
            await asyncio.wait_for(c.client.flush(), 30)  # p2's shares time out and are hinted
            held = sum([(await c.client.usage(n)).hints_held for n in ("p0", "p1")])
            assert held > 0
        finally:
            c.cluster.freeze("p2", False)
        await c.settle_and_check()
    finally:
        await c.close()
