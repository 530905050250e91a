"""The storage role under the real Daemon lifecycle, in-process, built as ``giaannd`` builds it
(the node runtime, membership, then ``build_role_services``; a one-node cluster that bootstraps
its storage ring): startup, metrics, a client writing and reading
through the advertised address, graceful shutdown. (Formerly the standalone storage service's own
daemon entry, ``create_service(config)``; that mode is gone: the runtime's wiring is the only one.)
No key file: the key derived from the cluster name (``derived_cluster_key``) authenticates."""

import asyncio

import numpy as np
import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.config import load_config
from giaannd.daemon import Daemon, build_role_services
from giaannd.runtime.node import NodeRuntime, derived_cluster_key
from giaannd.services.membership import MembershipService
from peers.transport import Identity, make_transport
from tools.cluster_harness import make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.asyncio
async def test_storage_role_runs_under_the_daemon(tmp_path):
    config = load_config(environ={}, overrides=[
        f"node.data-dir={tmp_path / 'data'}", "admin.listen=127.0.0.1:0", "node.name=st",
        'node.roles=["storage"]', 'transport.bind=["tcp://127.0.0.1:0"]',
        "storage.replication-factor=1", "storage.write-quorum=1", "storage.join-mode=bootstrap",
        "membership.bind-port=0", "membership.profile=loopback"])
    runtime = NodeRuntime(config)
    roles, unavailable = build_role_services(config, runtime)
    assert not unavailable
    daemon = Daemon(config, [runtime, MembershipService(runtime), *roles], handle_signals=False,
                    runtime=runtime)
    task = asyncio.create_task(daemon.run())
    try:
        async with asyncio.timeout(10):
            while daemon.state == "starting" and not task.done():
                await asyncio.sleep(0.01)
        status = daemon.status()
        assert status["roles"]["storage"] == "running"
        (address,) = runtime.advertised.values()
        assert status["services"]["storage"]["addresses"] == [address]
        topo = ClusterView(replicas=1)
        topo.set_members([StorageNode("st", address)])
        key = derived_cluster_key(config.cluster.name)
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
