"""Storage services as real processes over tcp://: quorum writes, SIGKILL of an owner, hinted
handoff across processes, restart from the data directory (``python -m giaannd.storage.replication.service``;
the daemon wiring is tested by the daemon's own tests once the role is wired)."""

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
from peers.transport import Identity, make_transport
from tests.integration.storage_cluster import free_tcp_address, make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "proc-storage"
KEY = hashlib.sha256(f"giaannd-unkeyed:{CLUSTER}".encode()).digest()


class Proc:
    def __init__(self, name, address, data_dir, members):
        self.name, self.address, self.data_dir, self.members = name, address, data_dir, members
        self.popen = None

    def start(self):
        args = [sys.executable, "-m", "giaannd.storage.replication.service", "--listen", self.address,
                "--data-dir", str(self.data_dir), "--cluster", CLUSTER, "--name", self.name,
                "--hint-retry-s", "0.2", "--capacity-bytes", str(64 << 20)]
        for n, a in self.members.items():
            args += ["--member", f"{n}={a}"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        line = self.popen.stdout.readline()  # bounded by the test timeout; the child prints at once
        assert line.startswith("LISTENING"), line

    def kill(self, sig=signal.SIGKILL):
        self.popen.send_signal(sig)
        self.popen.wait(timeout=20)
        self.popen.stdout.close()


@pytest.mark.asyncio
async def test_storage_processes_kill_owner_hint_delivered_restart(tmp_path):
    names = ["p0", "p1", "p2"]
    members = {n: free_tcp_address() for n in names}
    procs = {n: Proc(n, members[n], tmp_path / n, members) for n in names}
    for proc in procs.values():
        proc.start()
    topo = ClusterView(replicas=3)
    topo.set_members([StorageNode(n, a) for n, a in members.items()])
    client = StorageClient(topo, {"tcp": make_transport("tcp", Identity("client", CLUSTER, [KEY]))},
                           request_timeout_s=5, connect_timeout_s=0.5)
    try:
        rng = np.random.default_rng(21)
        first = make_batch(rng, 30)
        await client.write(first)
        procs["p1"].kill()  # no membership here: the client learns it from failed requests
        second = make_batch(rng, 30)
        result = await client.write(second)
        assert set(result.acked) == {"p0", "p2"}
        await client.flush()
        assert result.batch_id.seq == 2
        read = await client.read_rows(second.row_column, second.row_feature)
        assert read.num_rows == second.num_rows

        procs["p1"].start()  # same data dir and port: recovers the first batch from its log
        # (the first batch's ack from p1 may also have been lost to the kill: then it is hinted too)
        async with asyncio.timeout(15):
            while client.writer_floor < 2:
                await client.confirm_hints()
                await asyncio.sleep(0.1)
        for batch in (first, second):
            digests = [await client.digests(n, batch.row_column, batch.row_feature) for n in names]
            assert all(d is not None for d in digests[1])
            assert digests[0] == digests[1] == digests[2]
        for n in names:
            usage = await client.usage(n)
            assert usage.hints_held == 0 and usage.num_rows == 60
        procs["p0"].kill(signal.SIGTERM)  # graceful: snapshot on the way out
        assert any(p.suffix == ".snap" for p in (tmp_path / "p0" / "store").iterdir())
    finally:
        await client.close()
        for proc in procs.values():
            if proc.popen is not None and proc.popen.poll() is None:
                proc.kill()
