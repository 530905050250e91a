"""Topology faults with real processes over tcp://: SIGKILL of the receiving node in the middle of
a join stream (it restarts from its data directory and the stream resumes, re-sending at most one
item), and SIGKILL of a storage node during writes (after hint delivery every owner holds exactly
the reference rows). Storage nodes run ``python -m giaannd.storage.rebalance.endpoint``."""

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.storage.rebalance.operations import Rebalance, members_after
from peers.transport import Identity, make_transport
from tests.integration.storage_cluster import CLUSTER, KEY, free_tcp_address
from tests.integration.topology_harness import TopoCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio]

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = np.random.default_rng(30).integers(1, 2**63, 100, dtype=np.uint64)


class NodeProc:
    """One storage node + stream endpoint in its own process (fixed ports: restarts keep them)."""

    def __init__(self, name, data_dir, members, cluster, replicas, key=b""):
        self.name, self.data_dir, self.members, self.key = name, data_dir, members, key
        self.cluster, self.replicas = cluster, replicas
        self.address, self.stream_address = members[name], free_tcp_address()
        self.popen = None

    def start(self):
        args = [sys.executable, "-m", "giaannd.storage.rebalance.endpoint", "--listen", self.address,
                "--stream-listen", self.stream_address, "--data-dir", str(self.data_dir),
                "--cluster", self.cluster, "--key-hex", self.key.hex(), "--name", self.name,
                "--replicas", str(self.replicas),
                "--hint-retry-s", "0.2", "--capacity-bytes", str(256 << 20)]
        for n, a in self.members.items():
            args += ["--member", f"{n}={a}"]
        self.popen = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.popen.stdout.readline()  # bounded by the test timeout; printed at start
        assert line.startswith("LISTENING"), line

    def kill(self):
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=20)
        self.popen.stdout.close()

    def stop(self):
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
            self.popen.stdout.close()


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
    cluster = await TopoCluster(tmp_path, 3, scheme="tcp", replicas=2).start()
    members = {**{n: cluster.addresses[n] for n in cluster.names}, "s3": free_tcp_address()}
    newcomer = NodeProc("s3", tmp_path / "s3", members, CLUSTER, 2, KEY)
    try:
        rng = np.random.default_rng(31)
        await cluster.write_many(rng, 120, COLUMNS, rows=16)
        newcomer.start()
        cluster.stream_addresses["s3"] = newcomer.stream_address
        op = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", newcomer.address)]), chunk_bytes=1024,
            rate_bytes_s=60_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(30):
            while sum(r.sender.acked for r in op.runners) < 6:
                await asyncio.sleep(0.01)
        newcomer.kill()
        await asyncio.sleep(0.3)
        newcomer.start()  # same data directory and ports
        op.set_rate(None)
        progress = await asyncio.wait_for(task, 60)
        assert progress["state"] == "done"
        assert sum(s["reconnects"] for s in progress["streams"]) >= 1
        assert all(s["resent_items"] <= 1 for s in progress["streams"])
        await cluster.client.flush()
        await assert_owner_rows_equal_reference(cluster.client, cluster.reference, ["s3"])
        assert cluster.mismatches(["s0", "s1", "s2"]) == []
    finally:
        newcomer.stop()
        await cluster.close()


class ProcCluster:
    """Three storage processes (R=3), a client and a single-store reference."""

    def __init__(self, tmp_path, name):
        from giaannd.storage.engine.column_store import ColumnStore

        self.key = hashlib.sha256(f"giaannd-unkeyed:{name}".encode()).digest()
        self.names = ["p0", "p1", "p2"]
        members = {n: free_tcp_address() for n in self.names}
        self.procs = {n: NodeProc(n, tmp_path / n, members, name, 3, self.key) for n in self.names}
        for p in self.procs.values():
            p.start()
        topo = ClusterView(replicas=3)
        topo.set_members([StorageNode(n, a) for n, a in members.items()])
        self.client = StorageClient(topo, {"tcp": make_transport("tcp", Identity("client", name, [self.key]))},
                                    request_timeout_s=1.0, connect_timeout_s=0.5)
        self.reference = ColumnStore(1 << 32)
        self.rng = np.random.default_rng(32)

    async def write(self, n):
        from giaannd.client.storage_client import QuorumNotReached
        from tests.integration.storage_cluster import make_batch

        for _ in range(n):
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
        await self.client.close()
        for p in self.procs.values():
            p.stop()


async def test_topology_process_kill9_during_writes_then_equal_to_reference(tmp_path):
    c = ProcCluster(tmp_path, "topo-proc")
    try:
        writer = asyncio.create_task(c.write(150))
        await asyncio.sleep(0.3)
        c.procs["p1"].kill()  # SIGKILL mid-write
        await asyncio.sleep(0.5)
        c.procs["p1"].start()
        await asyncio.wait_for(writer, 60)
        await c.settle_and_check()
    finally:
        await c.close()


async def test_topology_process_unreachable_node_gets_hints_after_heal(tmp_path):
    """A node that stops answering (SIGSTOP: its sockets stay open, requests time out, like a
    partition) while writes continue; after the heal (SIGCONT) hinted handoff brings it level."""
    c = ProcCluster(tmp_path, "topo-part")
    try:
        await c.write(20)
        c.procs["p2"].popen.send_signal(signal.SIGSTOP)
        try:
            await asyncio.wait_for(c.write(40), 60)
            await asyncio.wait_for(c.client.flush(), 30)  # p2's shares time out and are hinted
            held = sum([(await c.client.usage(n)).hints_held for n in ("p0", "p1")])
            assert held > 0
        finally:
            c.procs["p2"].popen.send_signal(signal.SIGCONT)
        await c.settle_and_check()
    finally:
        await c.close()
