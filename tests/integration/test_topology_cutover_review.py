"""Topology operations at their cutover (in-process nodes): a cancel once nodes switched, and a
placement that changed under an operation (a second coordinator's operation committed first)."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.storage.rebalance.operations import Rebalance, TopologyOpError, members_after
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 120, dtype=np.uint64)


async def settle(cluster):
    await cluster.client.flush()
    async with asyncio.timeout(10):
        while await cluster.control().hints_held_for(list(cluster.services)):
            await cluster.control().deliver_hints()
            await asyncio.sleep(0.02)


async def test_topology_cancel_after_the_targets_switched_lets_the_cutover_finish(tmp_path, monkeypatch):
    """A cancel that comes once the cutover switched the targets (here: while the writers
    switch). The cutover goes on and the join completes, every node on the new placement and
    every row equal. It used to abort the streams there: the cutover then failed on them with the
    target and the writers on the new placement and every other node on the old one, the ring
    not committed and the writes forwarded by nobody (a half-switched cluster)."""
    from giaannd.storage.rebalance import operations

    monkeypatch.setattr(operations, "CUTOVER_TIMEOUT_S", 5.0)
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(21)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        control = cluster.control()
        op = Rebalance(control, "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024)
        switch_writers = control.switch_writers

        async def cancelled_switch(members):
            op.cancel()  # the operator's cancel, while the writers switch
            await switch_writers(members)
            await cluster.write_many(rng, 10, COLUMNS)  # writes under the new placement

        control.switch_writers = cancelled_switch
        progress = await asyncio.wait_for(op.run(), 30)
        assert progress["state"] == "done"
        epochs = {name: view.epoch for name, view in cluster.topologies.items()}
        assert set(epochs.values()) == {cluster.client_topology.epoch}
        assert cluster.ring.is_active("s3")
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_placement_changed_under_an_operation_refuses_its_cutover(tmp_path):
    """Two coordinators: a join of s3 streams while a join of s4 (planned from the same placement)
    completes and commits its ring. The first must not cut over from a placement no longer in
    force: it fails before any node switches, its receiver drops what it got, and s4 stays in the
    ring. It used to switch every node to {s0, s1, s2, s3} and commit that ring: s4 got a
    tombstone (a removed node never re-adds itself) and the writes acknowledged by s4 alone since
    its join were no longer served."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(22)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        await cluster.add_node("s4")
        control = cluster.control()
        first = Rebalance(control, "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024)
        second = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s4", cluster.addresses["s4"])]), chunk_bytes=1024)
        held_for = control.hints_held_for

        async def hints_held_for(names):
            if first.state == "cutover" and second.state == "new":
                assert (await asyncio.wait_for(second.run(), 30))["state"] == "done"
                await cluster.write_many(rng, 10, COLUMNS)  # under {s0, s1, s2, s4}
            return await held_for(names)

        control.hints_held_for = hints_held_for
        with pytest.raises(TopologyOpError, match="placement"):
            await asyncio.wait_for(first.run(), 60)
        assert first.state == "failed" and first.progress()["discard_errors"] == []
        assert cluster.ring.is_active("s4") and not cluster.ring.is_active("s3")
        assert "s4" in cluster.client_topology.names and "s3" not in cluster.client_topology.names
        assert len(cluster.services["s3"].store.store) == 0
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_decommission_of_the_last_live_replica_holder_refuses(tmp_path):
    """R = 2 on two nodes, s1 down, writes acknowledged by s0 alone (W = 1, hinted for s1):
    decommissioning s0 would leave every column with no live owner, s0 (then standby, to be
    stopped) holding the only copy of those writes. It must refuse, as a removenode that would
    lose data does. It used to plan nothing (s1 already owns everything), switch every node to
    {s1}, which is down, and report "done"."""
    from giaannd.storage.rebalance.operations import DataLossError

    cluster = await Cluster(tmp_path, 2, replicas=2, write_quorum=1).start()
    try:
        rng = np.random.default_rng(23)
        await cluster.write_many(rng, 20, COLUMNS)
        await cluster.kill("s1")
        await cluster.write_many(rng, 20, COLUMNS)  # acknowledged by s0 alone
        before = cluster.client_topology.epoch
        op = Rebalance(cluster.control(), "decommission", members_after(cluster.client_topology, remove=["s0"]))
        with pytest.raises(DataLossError, match="no live owner"):
            await asyncio.wait_for(op.run(), 30)
        assert cluster.client_topology.epoch == before and cluster.ring.is_active("s0")
    finally:
        await cluster.close()
