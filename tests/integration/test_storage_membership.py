"""Storage services whose topology follows real membership (SWIM over UDP on loopback): the
wiring the daemon will use. A crash is seen as MemberFailed (writes hint), the return as
MemberJoined (hints delivered), a graceful leave changes the placement epoch everywhere."""

import asyncio

import numpy as np
import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView
from giaannd.services.membership import follow_membership
from giaannd.storage.replication.service import StorageService
from peers.keyring import Keyring
from peers.membership.config import MembershipConfig
from peers.membership.meta import NodeMeta
from peers.membership.node import MembershipNode
from peers.transport import Identity, make_transport
from peers.transport.memory import MemoryNetwork
from tests.integration.storage_cluster import CLUSTER, KEY, make_batch

pytestmark = pytest.mark.timeout(60)


async def wait_for(predicate, timeout_s):
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_storage_topology_follows_membership(tmp_path):
    keyring = Keyring.generate()
    network = MemoryNetwork()

    def member(name, roles, address=None):
        meta = NodeMeta(roles=roles, transports={"mem": address} if address else {}).encode()
        return MembershipNode(name=name, bind=("127.0.0.1", 0), cluster="t", keyring=Keyring(list(keyring.keys)),
                              config=MembershipConfig.loopback(), meta=meta)

    def transport(node_id):
        return make_transport("mem", Identity(node_id, CLUSTER, [KEY]), network=network)

    names = ["s0", "s1", "s2"]
    gossip = {n: member(n, ("storage",), f"mem://{n}") for n in names}
    gossip["c"] = member("c", ("compute",))
    services = {}

    async def start_service(n):
        view = ClusterView(local=n, replicas=3)
        svc = StorageService(tmp_path / n, 64 << 20, [f"mem://{n}"], transports={"mem": transport(n)},
                             topology=view, node_name=n, hint_retry_s=0.2)
        await svc.open()
        follow_membership(view, gossip[n])
        services[n] = svc

    for node in gossip.values():
        await node.start()
    for node in list(gossip.values())[1:]:
        await node.join([gossip["s0"].addr])
    await wait_for(lambda: all(len(x.alive_members()) == 4 for x in gossip.values()), 10)
    for n in names:
        await start_service(n)
    topo = ClusterView(replicas=3)
    follow_membership(topo, gossip["c"])
    client = StorageClient(topo, {"mem": transport("c")}, request_timeout_s=2, connect_timeout_s=0.5)
    try:
        assert topo.names == tuple(names) and topo.address("s1") == "mem://s1"
        assert {s.topology.epoch for s in services.values()} == {topo.epoch}

        batch = make_batch(np.random.default_rng(1), 20)
        await client.write(batch)
        await client.flush()  # s1's own ack of the first batch, not a hint

        # crash s1 (gossip and storage): membership declares it failed, the views mark it down
        await gossip["s1"].stop()
        await services.pop("s1").stop(graceful=False)
        await wait_for(lambda: not topo.is_live("s1") and not services["s0"].topology.is_live("s1"), 15)
        epoch = topo.epoch  # a failed member keeps its columns: same placement
        second = make_batch(np.random.default_rng(2), 20)
        result = await client.write(second)
        assert set(result.acked) == {"s0", "s2"}
        await client.flush()
        assert sum(s.hints.held for s in services.values()) == 1

        # s1 comes back: MemberJoined -> came up -> the holder delivers
        gossip["s1"] = member("s1", ("storage",), "mem://s1")
        await gossip["s1"].start()
        await gossip["s1"].join([gossip["s0"].addr])
        await start_service("s1")
        await wait_for(lambda: all(s.hints.held == 0 for s in services.values()), 15)
        assert topo.epoch == epoch
        got = await client.read_from("s1", second.row_column, second.row_feature)
        assert got.num_rows == second.num_rows

        # a graceful leave takes s2 out of the placement on every view
        await gossip["s2"].leave()
        await wait_for(lambda: "s2" not in topo and "s2" not in services["s0"].topology, 10)
        assert topo.epoch != epoch and services["s0"].topology.epoch == topo.epoch
    finally:
        await client.close()
        for svc in services.values():
            await svc.stop(graceful=False)
        for node in gossip.values():
            await node.stop()
