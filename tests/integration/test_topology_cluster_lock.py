"""One topology operation at a time in the whole cluster (rebalance/cluster_lock.py), with the
lock in the replicated registers of an in-process cluster: a second operation coordinated by
another node is refused while the first runs (OperationRegistry.begin, the admin verbs' path),
and starts once the first ended; a failed operation releases the lock too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from giaannd.client.registers import register_owners
from giaannd.cluster.view import StorageNode
from giaannd.storage.rebalance.cluster_lock import LOCK_KEY, ClusterLock, OperationLockBusy
from giaannd.storage.rebalance.operations import OperationRegistry, Rebalance, members_after
from tests.integration.test_topology_remote import COLUMNS, RemoteControl, settle
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]


class LockingControl(RemoteControl):
    """``RemoteControl`` with the daemon's lock: a ``ClusterLock`` over the coordinator's own
    storage service's register client (daemon_control.py does the same)."""

    def __init__(self, cluster: Cluster, me: str) -> None:
        super().__init__(cluster, me)
        client = cluster.services[me].register_client
        assert client is not None
        self.cluster_lock = ClusterLock(client, me, lambda name: name in cluster.services)

    async def lock(self, op_id: str, kind: str) -> int | None:
        return await self.cluster_lock.acquire(op_id, kind)

    async def unlock(self, token: int) -> None:
        assert await self.cluster_lock.release(token)


async def test_cluster_lock_refuses_a_second_operation_coordinated_elsewhere_until_the_first_ended(tmp_path):
    cluster = await Cluster(tmp_path, 5, replicas=3).start()
    try:
        await cluster.write_many(np.random.default_rng(3), 60, COLUMNS)
        a, b = LockingControl(cluster, "s0"), LockingControl(cluster, "s1")
        reg_a, reg_b = OperationRegistry(), OperationRegistry()
        first = await reg_a.begin(Rebalance(a, "decommission", members_after(cluster.client_topology, remove=["s3"]),
                                            avoid_sources=("s0", "s1", "s2", "s4"), chunk_bytes=2048,
                                            rate_bytes_s=200_000))
        assert first.lock_state == "held"
        second = Rebalance(b, "decommission", members_after(cluster.client_topology, remove=["s4"]),
                           avoid_sources=("s0", "s1", "s2", "s3"))
        with pytest.raises(OperationLockBusy) as info:
            await reg_b.begin(second)
        assert info.value.holder.coordinator == "s0" and info.value.holder.kind == "decommission"
        assert reg_b.current is None and second.state == "new"  # refused before anything ran
        done = await reg_a.wait(60)
        assert done["state"] == "done", done
        assert done["cluster_lock"] == "released"
        await cluster.retire("s3")
        await settle(cluster)
        # the lock is free again: the second one (re-planned on the new placement) runs
        again = await reg_b.begin(Rebalance(b, "decommission",
                                            members_after(cluster.client_topology, remove=["s4"]),
                                            avoid_sources=("s0", "s1", "s2")))
        assert (await reg_b.wait(60))["state"] == "done"
        assert again.lock_state == "released"
        await cluster.retire("s4")
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_cluster_lock_a_failed_operation_releases_it(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=2).start()
    try:
        await cluster.write_many(np.random.default_rng(4), 30, COLUMNS)
        a, b = LockingControl(cluster, "s0"), LockingControl(cluster, "s1")
        reg = OperationRegistry()
        op = await reg.begin(Rebalance(a, "decommission", members_after(cluster.client_topology, remove=["s2"]),
                                       avoid_sources=("s0", "s1", "s3"), chunk_bytes=1024, rate_bytes_s=20_000))
        async with asyncio.timeout(30):
            while op.state in ("new", "planning"):
                await asyncio.sleep(0.01)
        op.cancel()
        ended = await reg.wait(30)
        assert ended["state"] == "cancelled" and ended["cluster_lock"] == "released"
        token = await b.lock("join:x", "join")  # free: another coordinator takes it
        assert token is not None
        await b.unlock(token)
    finally:
        await cluster.close()


async def test_cluster_lock_register_lost_in_a_handoff_does_not_fail_a_replace_of_a_dead_member(tmp_path):
    """R = 2: once the lock was ever taken, its register exists on two owners; with one of them
    dead, neither can the lock be taken (a majority of two is two: the replace runs without it,
    and says so) nor its register be moved by the handoff. The lock carries no data, so the
    replace goes on (it failed as for a job's register before the lock was let go there)."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        await cluster.write_many(np.random.default_rng(5), 30, COLUMNS)
        first = LockingControl(cluster, "s0")
        await first.unlock(await first.lock("earlier", "join"))  # the register now exists
        owners = register_owners(cluster.client_topology, LOCK_KEY)
        dead = next(n for n in owners if n != "s0")
        await cluster.kill(dead)
        await cluster.add_node("s3")
        control = LockingControl(cluster, "s3")
        op = Rebalance(control, "replace", members_after(cluster.client_topology, add=[
            StorageNode("s3", cluster.addresses["s3"])], remove=[dead]))
        progress = await op.run()
        assert progress["state"] == "done", progress
        assert progress["registers_lost"] == 1 and progress["cluster_lock"].startswith("unavailable")
        token = await LockingControl(cluster, "s0").lock("next", "join")  # free on its new owners
        assert token is not None
    finally:
        await cluster.close()
