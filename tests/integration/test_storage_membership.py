"""Storage nodes whose views follow real membership (SWIM over UDP on loopback), each built as the
daemon builds it (runtime, membership service, storage role: tools/cluster_harness, gossip mode).
A crash is seen as MemberFailed (writes hint), the return as MemberJoined (hints delivered); a
graceful leave marks the member down everywhere. The daemon's views follow the storage ring, so
the leave keeps the placement (a ring change moves columns); a view in member mode (placement
over the live storage members) drops the member and changes epoch."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import ClusterView
from giaannd.services.membership import follow_membership
from tools.cluster_harness import Cluster, make_batch

pytestmark = pytest.mark.timeout(60)


async def wait_for(predicate, timeout_s):
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_storage_topology_follows_membership(tmp_path):
    names = ["s0", "s1", "s2"]
    cluster = await Cluster(tmp_path, 3, gossip=True).start()
    services = cluster.services
    topo = cluster.client_topology
    client_gossip = cluster.client_runtime.membership
    assert client_gossip is not None
    member_view = ClusterView(replicas=3)  # member mode, fed by the client's gossip
    follow_membership(member_view, client_gossip)
    client = cluster.client
    try:
        assert topo.names == tuple(names) and topo.address("s1") == "mem://s1"
        assert {s.topology.epoch for s in services.values()} == {topo.epoch} == {member_view.epoch}

        batch = make_batch(np.random.default_rng(1), 20)
        await client.write(batch)
        await client.flush()  # s1's own ack of the first batch, not a hint

        # crash s1 (gossip and storage): membership declares it failed, the views mark it down
        await cluster.kill("s1")
        await wait_for(lambda: not topo.is_live("s1") and not services["s0"].topology.is_live("s1"), 15)
        epoch = topo.epoch  # a failed member keeps its columns: same placement
        second = make_batch(np.random.default_rng(2), 20)
        result = await client.write(second)
        assert set(result.acked) == {"s0", "s2"}
        await client.flush()
        assert sum(s.hints.held for s in services.values()) == 1

        # s1 comes back: MemberJoined -> came up -> the holder delivers
        await cluster.restart_node("s1")
        await wait_for(lambda: all(s.hints.held == 0 for s in services.values()), 15)
        assert topo.epoch == epoch
        got = await client.read_from("s1", second.row_column, second.row_feature)
        assert got.num_rows == second.num_rows

        # a graceful leave: down on every view; out of the placement of a member-mode view only
        await wait_for(lambda: "s1" in member_view and member_view.is_live("s1"), 10)
        before = member_view.epoch
        await cluster.stop_node("s2")
        await wait_for(lambda: not topo.is_live("s2") and not services["s0"].topology.is_live("s2"), 10)
        assert topo.epoch == epoch and services["s0"].topology.epoch == epoch
        await wait_for(lambda: "s2" not in member_view, 10)
        assert member_view.epoch != before
    finally:
        await cluster.close()
