"""StorageService's own daemon entry (``create_service(config)``, standalone mode: its own
listeners) under the real Daemon lifecycle, in-process: startup, metrics, a client writing and
reading through the bound address, graceful shutdown. (The daemon itself hosts the storage role
on its shared node runtime, giaannd/services/roles.py; that wiring is tested with the daemon.)"""

import asyncio
import hashlib

import numpy as np
import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.config import load_config
from giaannd.daemon import Daemon
from giaannd.storage.replication.service import create_service
from peers.transport import Identity, make_transport
from tests.integration.storage_cluster import make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.asyncio
async def test_storage_role_runs_under_the_daemon(tmp_path):
    config = load_config(environ={}, overrides=[
        f"node.data-dir={tmp_path / 'data'}", "admin.listen=127.0.0.1:0", "node.name=st",
        'node.roles=["storage"]', 'transport.bind=["tcp://127.0.0.1:0"]',
        "storage.replication-factor=1", "storage.write-quorum=1"])
    svc = create_service(config)
    daemon = Daemon(config, [svc], handle_signals=False)
    task = asyncio.create_task(daemon.run())
    try:
        async with asyncio.timeout(10):
            while daemon.state == "starting" and not task.done():
                await asyncio.sleep(0.01)
        status = daemon.status()
        assert status["roles"]["storage"] == "running"
        assert status["services"]["storage"]["addresses"] == svc.addresses
        (address,) = svc.addresses
        topo = ClusterView(replicas=1)
        topo.set_members([StorageNode("st", address)])
        key = hashlib.sha256(b"giaannd-unkeyed:" + config.cluster.name.encode()).digest()
        client = StorageClient(topo, {"tcp": make_transport("tcp", Identity("c", config.cluster.name, [key]))})
        batch = make_batch(np.random.default_rng(1), 10)
        await client.write(batch)
        got = await client.read_rows(batch.row_column, batch.row_feature)
        assert got.num_rows == batch.num_rows
        text = daemon.metrics.render().decode()
        assert "giaannd_storage_applies_total 1.0" in text and "giaannd_storage_used_bytes" in text
        await client.close()
    finally:
        daemon.request_stop("test over")
        async with asyncio.timeout(10):
            await asyncio.gather(task, return_exceptions=True)
    snaps = list((tmp_path / "data" / "storage" / "store").glob("*.snap"))
    assert snaps, "graceful stop writes a snapshot"
