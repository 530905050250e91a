"""A hint holder that missed the cutover of the operation that removed the hint's target (it was
down, or the drop did not reach it) forgets those hints once its own ring marks the target removed
and the target is not live: before, it kept them for good (hint space, and the writer's floor,
which passes a removed target's hinted seq only once no holder holds it). docs/replication.md,
"A hinted owner that left the placement"."""

import asyncio

import numpy as np
import pytest

from tests.unit.storage_service.test_hint_left_target import COLUMNS, hinted_write
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90)]

async def past_start(svc):
    """Wait out a holder's first hint retry interval after its start: until then it drops nothing
    for a removed target (membership may not have heard of one still running: service.py
    ``removed_for_good``)."""
    await asyncio.sleep(svc.settings.hint_retry_s + 0.05)


async def _hinted_write(cluster, gone):
    """``hinted_write``, with the holder's name."""
    bid, holder = await hinted_write(cluster, gone)
    return bid, holder.node_name


async def _remove_everywhere_but(cluster, name, skip):
    """Commit the ring with ``name`` removed on every running node and the client but ``skip``
    (as the cutover's commit and push do when ``skip`` does not get them)."""
    cluster.ring = cluster.ring.with_removed(name)
    for node_name, node in cluster.nodes.items():
        if node_name != skip:
            await node.runtime.commit_ring(cluster.ring)
    await cluster.client_runtime.commit_ring(cluster.ring)


@pytest.mark.asyncio
async def test_holder_drops_hints_for_a_target_its_ring_marks_removed(tmp_path):
    """The holder learns of the removal after the cutover (a ring pulled later): the ring change
    drops its hints for the removed target, and the writer's floor passes the seq."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        bid, holder = await _hinted_write(cluster, "s2")
        await _remove_everywhere_but(cluster, "s2", skip=holder)
        svc = cluster.services[holder]
        await past_start(svc)
        await svc.deliver_hints()  # its ring still has s2 active: kept
        await client.confirm_hints()
        assert svc.hints.pending("s2") and client.writer_floor < bid.seq
        await cluster.nodes[holder].runtime.commit_ring(cluster.ring)
        assert not svc.hints.pending("s2") and svc.hints.held_bytes == 0
        assert not (svc.hints.directory / ("t-" + b"s2".hex())).exists()
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_holder_down_during_the_removal_drops_its_hints_after_the_restart(tmp_path):
    """The holder was down during the removal: it restarts with its hints for the removed target
    and a ring that already marks it removed; its next delivery round drops them."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        bid, holder = await _hinted_write(cluster, "s2")
        await cluster.kill(holder)
        await _remove_everywhere_but(cluster, "s2", skip=holder)
        assert await cluster.control().drop_hints_for("s2") == 0  # the live members held none
        svc = await cluster.restart_node(holder)
        assert svc.runtime.ring.get("s2").state == "removed"
        await svc.deliver_hints()  # right after the start: kept (s2 might be a standby not heard of yet)
        assert svc.hints.pending("s2")
        await past_start(svc)
        await svc.deliver_hints()  # (the periodic retry's round, started here)
        assert not svc.hints.pending("s2") and svc.hints.held_bytes == 0
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_hints_for_a_removed_target_that_is_live_are_resplit_not_dropped(tmp_path):
    """A removed target that is still live (decommissioned, standby) may have been the source of
    its columns' streams without the hinted write: its hints are not dropped but delivered, and
    re-split to the rows' current owners when it refuses them as not owner."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        bid, holder = await _hinted_write(cluster, "s2")
        await _remove_everywhere_but(cluster, "s2", skip=holder)
        await cluster.restart_node("s2")  # standby now: it owns nothing
        svc = cluster.services[holder]
        assert svc.delivery is not None and svc.delivery.resplit == 0
        await cluster.nodes[holder].runtime.commit_ring(cluster.ring)
        async with asyncio.timeout(20):  # (a round already under way makes ours return at once)
            while svc.hints.pending("s2"):
                await svc.deliver_hints()
                await asyncio.sleep(0.01)
        assert svc.delivery.resplit == 1  # delivered by re-splitting, not dropped
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_stranded_share_of_a_removed_target_settles(tmp_path):
    """A share of a target that no node would hold (stranded) is sent again by the writer after
    the target was removed: as a hint, which no node delivers (the target is gone) and which the
    cutover that removed it could not drop (it came later). Before, the holder kept it for good
    and the writer's floor never passed the seq. Now the holder answers it held without writing a
    hint log (its ring marks the target removed and it is not live: the next round would drop it
    anyway), counts it received, and the seq settles."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        await cluster.kill("s2")
        for svc in cluster.services.values():
            svc.hints.max_bytes = 0  # no node will hold s2's hint: stranded
        res = await client.write(make_batch(np.random.default_rng(7), COLUMNS.size, columns=COLUMNS))
        await client.flush()
        bid = res.batch_id
        assert not any(svc.hints.held for svc in cluster.services.values())
        assert client.writer_floor < bid.seq and client._writes._stranded.get("s2")
        await _remove_everywhere_but(cluster, "s2", skip="")
        for svc in cluster.services.values():
            svc.hints.max_bytes = 1 << 30
        await past_start(next(iter(cluster.services.values())))
        await client.confirm_hints()  # sent again: as a hint for the removed s2
        assert sum(s.counters.hints_received for s in cluster.services.values()) == 1
        for svc in cluster.services.values():
            assert not svc.hints.pending("s2") and svc.hints.held_bytes == 0
            assert not (svc.hints.directory / ("t-" + b"s2".hex())).exists()  # nothing written
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()
