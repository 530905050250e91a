"""Registers across placement changes (rebalance/register_handoff.py): keys written while one owner
was down (so only a bare majority holds them), then a join / decommission / removenode; afterwards
a majority of every key's *new* owners holds its value, and a read and a CAS through the client
see it even with one holder stopped. Every wait is bounded."""

from __future__ import annotations

import pytest

from giaannd.client.registers import ABSENT, register_owners
from giaannd.cluster.view import StorageNode
from giaannd.storage.rebalance.operations import Rebalance, TopologyOpError, members_after
from tests.integration.test_topology_remote import RemoteControl
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90), pytest.mark.asyncio]

KEYS = [f"job/{i}" for i in range(40)]


async def write_with_one_down(cluster: Cluster, down: str) -> dict[str, tuple[int, int, int]]:
    """Every key CASed while ``down`` is stopped: only the other owners accepted it."""
    await cluster.stop_node(down)
    versions = {}
    for key in KEYS:
        out = await cluster.client.cas_register(key, ABSENT, f"v-{key}".encode())
        assert out.ok
        versions[key] = out.version
    await cluster.restart_node(down)
    return versions


def holders(cluster: Cluster, key: str) -> list[str]:
    """The key's owners (client placement) whose acceptor holds the value written."""
    return [o for o in register_owners(cluster.client_topology, key)
            if o in cluster.services and cluster.services[o].registers.get(key).value == f"v-{key}".encode()]


async def check_after(cluster: Cluster, versions: dict[str, tuple[int, int, int]], moved_to: str) -> None:
    quorum = cluster.client_topology.placement.effective_replicas // 2 + 1
    short = {k: holders(cluster, k) for k in KEYS if len(holders(cluster, k)) < quorum}
    assert short == {}, f"keys held by less than a majority of their new owners: {short}"
    # the strongest check: stop a holder that is not the new owner, so the quorum must use it
    victims = [k for k in KEYS if moved_to in register_owners(cluster.client_topology, k)]
    assert victims
    key = victims[0]
    other = next(o for o in holders(cluster, key) if o != moved_to)
    await cluster.stop_node(other)
    read = await cluster.client.read_register(key)
    assert (read.version, read.value) == (versions[key], f"v-{key}".encode())
    out = await cluster.client.cas_register(key, versions[key], b"next")
    assert out.ok and out.version[0] == versions[key][0] + 1


@pytest.mark.parametrize("remote", [False, True])
async def test_registers_survive_a_join(tmp_path, remote):
    cluster = await Cluster(tmp_path, 3, replicas=3).start()
    try:
        versions = await write_with_one_down(cluster, "s1")
        await cluster.add_node("s3")
        control = RemoteControl(cluster, "s3") if remote else cluster.control()
        op = Rebalance(control, "join", members_after(cluster.client_topology,
                                                      add=[StorageNode("s3", cluster.addresses["s3"])]))
        progress = await op.run()
        assert progress["state"] == "done" and progress["registers_moved"] > 0
        assert progress["registers_lost"] == 0
        # the displaced owners dropped their seals: nothing refuses a key any more
        assert all(not svc.registers._sealed for svc in cluster.services.values())
        await check_after(cluster, versions, "s3")
    finally:
        await cluster.close()


async def test_registers_survive_a_decommission(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        versions = await write_with_one_down(cluster, "s1")
        op = Rebalance(cluster.control(), "decommission", members_after(cluster.client_topology, remove=["s0"]))
        progress = await op.run()
        assert progress["state"] == "done" and progress["registers_moved"] > 0
        await cluster.retire("s0")
        quorum = 2
        assert all(len(holders(cluster, k)) >= quorum for k in KEYS)
        for key in KEYS[:5]:
            read = await cluster.client.read_register(key)
            assert (read.version, read.value) == (versions[key], f"v-{key}".encode())
    finally:
        await cluster.close()


async def test_registers_survive_removenode(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        versions = await write_with_one_down(cluster, "s1")
        await cluster.kill("s2")
        op = Rebalance(cluster.control(), "removenode", members_after(cluster.client_topology, remove=["s2"]))
        progress = await op.run()
        assert progress["state"] == "done" and progress["registers_lost"] == 0
        # back to R copies: s2's keys gained a new owner holding the value, so a majority holds each
        assert all(len(holders(cluster, k)) >= 2 for k in KEYS)
        for key in KEYS[:5]:
            read = await cluster.client.read_register(key)
            assert (read.version, read.value) == (versions[key], f"v-{key}".encode())
    finally:
        await cluster.close()


async def test_register_handoff_refuses_when_a_majority_is_gone(tmp_path):
    # R = 3 on 4 nodes; s1 missed every write, s2 and s3 are dead: a key owned by s1, s2, s3 has
    # one old owner answering (s1, empty), which cannot show what a majority decided: refused
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        await write_with_one_down(cluster, "s1")
        await cluster.kill("s2")
        await cluster.kill("s3")
        remove = members_after(cluster.client_topology, remove=["s2"])
        op = Rebalance(cluster.control(), "removenode", remove)
        with pytest.raises(TopologyOpError, match="register handoff"):
            await op.run()
        assert op.registers_lost > 0
        assert all(not svc.registers._sealed for svc in cluster.services.values())  # abandoned: unsealed
        forced = await Rebalance(cluster.control(), "removenode", remove, allow_loss=True).run()
        assert forced["state"] == "done" and forced["registers_lost"] == op.registers_lost
    finally:
        await cluster.close()
