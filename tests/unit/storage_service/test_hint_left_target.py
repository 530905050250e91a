"""A hinted target that leaves the cluster for good (removenode while it is down): the writer's
floor passes the seqs hinted for it once no holder holds those hints any more (docs/replication.md,
"Writer floors"), and not before."""

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.errors import RemoteBadRequest
from giaannd.storage.rebalance.operations import Rebalance, members_after
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90)]

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 40, dtype=np.uint64)


async def hinted_write(cluster, gone):
    """Stop ``gone``, write a batch with rows it owns (W = 2 of 3: acknowledged, its share hinted).
    Returns (the batch id, the service holding the hint). (test_hint_removed_target.py and
    test_hint_rejoined_target.py use it too.)"""
    client = cluster.client
    await cluster.kill(gone)
    batch = make_batch(np.random.default_rng(7), COLUMNS.size, columns=COLUMNS)
    res = await client.write(batch)
    await client.flush()
    # (not ``res.hinted``: a share that fails after W was reached is hinted in the background,
    # after the write returned; a CI run saw it empty)
    assert client.writer_floor < res.batch_id.seq  # gone's share is a hint: unsettled
    (holder,) = [s for s in cluster.services.values() if s.hints.pending(gone)]
    return res.batch_id, holder


@pytest.mark.asyncio
async def test_hinted_seq_of_a_removed_target_settles_once_its_hint_is_dropped(tmp_path):
    """removenode of a down member: the cutover copies its rows to their new owners from the
    survivors and drops the hints held for it. The writer used to ask only live hinted owners
    (``BatchesApplied``), so the removed member's seqs never settled: the floor stuck, and every
    node kept every later batch id of that writer. Now it asks the holders of those hints."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        bid, holder = await hinted_write(cluster, "s2")
        await client.confirm_hints()
        assert client.writer_floor < bid.seq  # s2 is only down: its hint is still to deliver
        op = Rebalance(cluster.control(), "removenode", members_after(cluster.client_topology, remove=["s2"]))
        progress = await op.run()
        assert progress["state"] == "done"
        assert not holder.hints.pending("s2")  # dropped by the cutover
        assert "s2" not in cluster.client_topology.names
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_hinted_seq_of_a_target_out_of_the_placement_waits_while_its_hint_is_held(tmp_path):
    """The target is out of the placement but the holder still holds its hint (a topology
    operation whose cutover has not dropped or delivered it yet): the seq stays unsettled, since a
    floor past it would make the node the hint still reaches ignore it. It settles once the hint
    is gone from its holder."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        bid, holder = await hinted_write(cluster, "s2")
        # the writers' switch of a cutover (an override), before its streams end: nothing dropped
        # (a ring that marks s2 removed would make the holder drop it: test_hint_removed_target.py)
        cluster.client_topology.set_override([m for m in cluster.members() if m.name != "s2"])
        assert "s2" not in cluster.client_topology.names
        await client.confirm_hints()
        assert holder.hints.pending("s2")
        assert client.writer_floor < bid.seq
        assert await cluster.control().drop_hints_for("s2") == 1
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_hinted_seq_of_a_removed_target_waits_for_an_answer_from_every_holder(tmp_path):
    """A holder that gives no answer (a node that predates ``HeldHints`` answers BadRequest; a
    down one none) may still hold the hint: the seq stays unsettled until it answers."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        bid, holder = await hinted_write(cluster, "s2")
        op = Rebalance(cluster.control(), "removenode", members_after(cluster.client_topology, remove=["s2"]))
        assert (await op.run())["state"] == "done"
        writes = client._writes
        call = writes._call
        asked = []

        async def old_node(node, msg, *args, **kwargs):
            if isinstance(msg, p.HeldHints):
                asked.append(node)
                raise RemoteBadRequest("undecodable request", node)
            return await call(node, msg, *args, **kwargs)

        writes._call = old_node
        await client.confirm_hints()
        assert asked == [holder.node_name]
        assert client.writer_floor < bid.seq
        writes._call = call
        too_many = holder.core.serve(p.HeldHints("s2", bid.writer, [1] * (p.MAX_QUERY_SEQS + 1)), [])
        assert isinstance(too_many.reply, p.BadRequest)
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()


def test_held_hints_round_trips():
    msg = p.HeldHints("s2", 2**64 - 1, [1, 2])
    assert p.decode_request(p.encode(msg)) == msg
    assert p.decode_reply(p.encode(p.HeldMask([True, False]))) == p.HeldMask([True, False])
    assert (p.HeldHints.__struct_config__.tag, p.HeldMask.__struct_config__.tag) == (18, 79)
