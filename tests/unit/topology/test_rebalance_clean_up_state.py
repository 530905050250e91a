"""An operation abandoned before its cutover publishes its terminal state ("failed", "cancelled")
only once its clean-up ended (rebalance/operations.py ``run``: the receivers discard its streams'
rows). It used to publish it first: a client polling for a terminal state (giaannctl's ``--wait``,
the SDK's follow) saw the operation ended while its rows were still on the receivers, and the next
operation it started then was refused there ("already holds ... rows")."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.sdk.follow import Follower
from giaannd.storage.rebalance import operations
from giaannd.storage.rebalance.operations import OperationRegistry, Rebalance, TopologyOpError, members_after
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 60, dtype=np.uint64)
TERMINAL = ("done", "failed", "cancelled")


def _ended(state):
    """What the SDK's follow (and giaannctl ``--wait``) makes of a polled state: True once ended."""
    try:
        return Follower("topology", {}, progress=False).see({"state": state, "op": "join"})
    except Exception:  # noqa: BLE001 - JobFailedError: ended, not in success
        return True


@pytest.mark.parametrize("how", ["fail", "cancel"])
async def test_an_abandoned_operation_is_not_ended_until_its_receivers_discarded(tmp_path, monkeypatch, how):
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(9)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        discarding, release = asyncio.Event(), asyncio.Event()
        discard = operations.discard_stream

        async def held_discard(transport, address, stream_id):
            discarding.set()
            await release.wait()  # the receiver is slow to drop the rows
            return await discard(transport, address, stream_id)

        monkeypatch.setattr(operations, "discard_stream", held_discard)
        registry = OperationRegistry()
        members = members_after(cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])])
        op = registry.start(Rebalance(cluster.control(), "join", members, chunk_bytes=1024, rate_bytes_s=50_000))
        async with asyncio.timeout(20):
            while op.progress()["bytes_done"] == 0:
                await asyncio.sleep(0.01)
        if how == "fail":
            op.runners[0].abort("injected stream failure")
        else:
            op.cancel()
        async with asyncio.timeout(20):
            while not discarding.is_set():
                assert op.state not in TERMINAL, op.state
                await asyncio.sleep(0.01)
        # the clean-up runs: the rows are still on the receiver, and nobody may take it as ended
        assert len(cluster.services["s3"].store.store) > 0
        assert op.state not in TERMINAL and not _ended(op.progress()["state"]), op.state
        with pytest.raises(TopologyOpError, match="cleaning up"):  # the next operation waits for it
            registry.start(Rebalance(cluster.control(), "join", members))
        release.set()
        progress = await registry.wait(20)
        assert progress["state"] == ("failed" if how == "fail" else "cancelled"), progress
        assert _ended(progress["state"]) and progress["discard_errors"] == [] and progress["discarded_rows"] > 0
        assert len(cluster.services["s3"].store.store) == 0
        if how == "fail":
            assert "injected stream failure" in progress["error"]
        again = registry.start(Rebalance(cluster.control(), "join", members))
        assert (await registry.wait(30))["state"] == "done" and again.state == "done"
    finally:
        release.set()
        await cluster.close()
