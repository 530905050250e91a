"""Topology operations over in-process storage services (mem:// and tcp://): join, decommission,
removenode with writes running, receiver crash mid-stream, pause/resume; every owner ends with
exactly the reference rows (0 lost acknowledged updates, nothing counted twice)."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.config import StorageConfig
from giaannd.storage.rebalance.operations import DataLossError, OperationRegistry, Rebalance, members_after
from giaannd.storage.rebalance.plan import TransferRule
from peers.placement import Member, Placement
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]
#: items a stream keeps on the wire (storage.stream-window): what a receiver restart may re-send
WINDOW = StorageConfig().stream_window

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 120, dtype=np.uint64)


async def settle(cluster):
    await cluster.client.flush()
    async with asyncio.timeout(10):
        while await cluster.control().hints_held_for(list(cluster.services)):
            await cluster.control().deliver_hints()
            await asyncio.sleep(0.02)


async def with_writes(cluster, rng, coro, pause_s=0.002):
    """Run ``coro`` while a writer keeps writing; returns (coro's result, batches written during)."""
    stop = asyncio.Event()
    writer = asyncio.create_task(cluster.write_many(rng, 10_000, COLUMNS, stop=stop, pause_s=pause_s))
    try:
        result = await coro
    finally:
        stop.set()
        during = await writer
    return result, during


@pytest.mark.parametrize("scheme", ["mem", "tcp"])
async def test_topology_join_with_concurrent_writes(tmp_path, scheme):
    cluster = await Cluster(tmp_path, 3, scheme=scheme, replicas=2).start()
    try:
        rng = np.random.default_rng(1)
        await cluster.write_many(rng, 60, COLUMNS)
        await cluster.add_node("s3")
        op = Rebalance(cluster.control(), "join",
                       members_after(cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
                       chunk_bytes=2048)
        progress, during = await with_writes(cluster, rng, op.run())
        await settle(cluster)
        assert during > 0 and progress["state"] == "done"
        assert progress["bytes_done"] > 0 and all(s["state"] == "done" for s in progress["streams"])
        assert sum(s["deltas"] for s in progress["streams"]) > 0  # writes landed during the stream
        assert "s3" in cluster.client_topology.names
        assert cluster.mismatches() == []
        assert cluster.services["s3"].store.store.keys()  # the newcomer serves its share
        # with R=2 of 4 nodes a column gains s3 with probability 1/2
        assert 0.3 < progress["columns_moved"] / progress["columns_total"] < 0.7
        # idempotent: the same verb again plans nothing and changes nothing
        again = await Rebalance(cluster.control(), "join", cluster.members()).run()
        assert again["state"] == "done" and again["streams"] == []
        await cluster.write_many(rng, 20, COLUMNS)
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_decommission_with_concurrent_writes(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=2).start()
    try:
        rng = np.random.default_rng(2)
        await cluster.write_many(rng, 60, COLUMNS)
        op = Rebalance(cluster.control(), "decommission", members_after(cluster.client_topology, remove=["s1"]),
                       chunk_bytes=4096)
        progress, during = await with_writes(cluster, rng, op.run())
        assert progress["state"] == "done" and during > 0
        await cluster.retire("s1")
        await settle(cluster)
        assert "s1" not in cluster.client_topology.names
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_column_born_between_the_plan_and_the_streams_is_streamed(tmp_path):
    """A column first written after the plan listed the sources' columns but before the streams
    opened (the plan awaits remote listings and the discard of dead sources' streams) is held by
    its leaving owner when the stream opens. Before, the stream listed the plan's columns only:
    the new column's rows were never read into a chunk, only later writes to it were forwarded
    (``claims``), so its new owner missed them (verify failed "1 of N rows differ", or, with no
    later write, the operation ended done with the rows lost: CI, Dec 1)."""
    cluster = await Cluster(tmp_path, 4, replicas=2).start()
    try:
        rng = np.random.default_rng(7)
        await cluster.write_many(rng, 40, COLUMNS)
        placement = cluster.client_topology.placement
        candidates = rng.integers(1, 2**63, 400, dtype=np.uint64)
        born = candidates[(placement.owner_indices(candidates) == placement.names.index("s1")).any(axis=1)][:3]
        assert born.size == 3 and not np.isin(born, COLUMNS).any()
        op = Rebalance(cluster.control(), "decommission", members_after(cluster.client_topology, remove=["s1"]),
                       chunk_bytes=4096)
        discard = op._discard_dead_sources

        async def write_then_discard():  # awaited after the plan, before the streams start
            assert op.plan is not None and not op.runners
            await cluster.write(make_batch(rng, 3, 4, born))
            await discard()

        op._discard_dead_sources = write_then_discard
        progress = await op.run()
        assert progress["state"] == "done", progress.get("error")
        await cluster.retire("s1")
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


@pytest.mark.parametrize("kind", ["decommission", "replace"])
async def test_topology_column_born_for_a_pair_the_plan_lacks_is_streamed(tmp_path, kind):
    """A column created while an operation runs goes to the (source, target) pair its rule names;
    that pair may have no column to copy in the plan. Before (stress, Dec 2: a replace, 1 run in
    ~180), only pairs to members new to the ring had a stream with nothing to copy, so such a
    column written during a decommission or replace never reached an existing member that gained
    it: the operation ended done and the new owner had none of its rows."""
    cluster = await Cluster(tmp_path, 4, replicas=2 if kind == "decommission" else 3).start()
    try:
        rng = np.random.default_rng(13)
        topology = cluster.client_topology
        if kind == "replace":
            await cluster.kill("s1")
            await cluster.add_node("s4")
            after = members_after(topology, add=[StorageNode("s4", cluster.addresses["s4"])], remove=["s1"])
        else:
            after = members_after(topology, remove=["s1"])
        old = topology.placement
        new = Placement(tuple(Member(m.name, m.weight) for m in after), old.replicas, old.strategy)
        rule = TransferRule(old, new, frozenset(n for n in old.names if topology.is_live(n)))
        candidates = rng.integers(1, 2**63, 20_000, dtype=np.uint64)
        source = "s1" if kind == "decommission" else "s0"
        pair = (source, "s2")  # an existing member gaining columns from that source
        claimed = rule.claims(*pair, candidates)
        existing, born = candidates[~claimed][:60], candidates[claimed][:3]
        assert born.size == 3
        await cluster.write_many(rng, 40, existing)
        op = Rebalance(cluster.control(), kind, after, chunk_bytes=4096)
        assert pair not in {(t.source, t.target) for t in (await op.make_plan()).transfers}
        discard = op._discard_dead_sources

        async def write_then_discard():  # after the plan, before the streams start
            await cluster.write(make_batch(rng, 3, 4, born))
            await discard()

        op._discard_dead_sources = write_then_discard
        progress = await op.run()
        assert progress["state"] == "done", progress.get("error")
        await cluster.write(make_batch(rng, 3, 4, born))  # and one more under the new placement
        if kind == "decommission":
            await cluster.retire("s1")
        await settle_live(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_join_with_a_member_down_then_back_counts_its_hint_once(tmp_path):
    """A member is down while a join streams the columns the newcomer takes from it: each stream
    copies rows from a live old owner, rows that hold the member's hinted batches. When the member
    comes back after the cutover it refuses the hint's rows it no longer owns, and the holder
    re-splits them to their owners now, the newcomer among them, under the batch's id. Before
    (the topology stress, Dec 2: 2 runs in 4), the newcomer applied them again: it had those rows
    from a chunk, which named no batch, and its strengths were twice the reference's. A chunk now
    names the batches in its rows that a share may still come for (F markers), so the newcomer
    drops those rows of the re-split share."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        rng = np.random.default_rng(17)
        topology = cluster.client_topology
        await cluster.add_node("s4")
        after = members_after(topology, add=[StorageNode("s4", cluster.addresses["s4"])])
        old = topology.placement
        new = Placement(tuple(Member(m.name, m.weight) for m in after), old.replicas, old.strategy)
        candidates = rng.integers(1, 2**63, 4000, dtype=np.uint64)
        before, later = old.owner_indices(candidates), new.owner_indices(candidates)
        s1, s4 = old.names.index("s1"), new.names.index("s4")
        taken = candidates[(before == s1).any(axis=1) & (later == s4).any(axis=1)
                           & ~(later == new.names.index("s1")).any(axis=1)][:6]
        assert taken.size == 6  # columns s4 takes from s1
        await cluster.write_many(rng, 10, COLUMNS)
        await cluster.kill("s1")
        hinted = [await cluster.write(make_batch(rng, 6, 4, taken)) for _ in range(3)]  # s1's shares hinted
        assert any(svc.hints.pending("s1") for svc in cluster.services.values())
        progress = await Rebalance(cluster.control(), "join", after).run()
        assert progress["state"] == "done", progress.get("error")
        await cluster.restart_node("s1")
        await settle_live(cluster)  # the hints delivered: s1's part, the rest re-split
        assert not any(svc.hints.pending("s1") for svc in cluster.services.values())
        assert hinted and cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_removenode_rereplicates_from_survivors(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        rng = np.random.default_rng(3)
        await cluster.write_many(rng, 40, COLUMNS)
        await cluster.kill("s2")
        await cluster.write_many(rng, 20, COLUMNS)  # W=2 of 3: acknowledged without s2 (hinted)
        op = Rebalance(cluster.control(), "removenode", members_after(cluster.client_topology, remove=["s2"]))
        progress, _ = await with_writes(cluster, rng, op.run())
        assert progress["state"] == "done" and progress["lost_columns"] == 0
        assert await cluster.control().hints_held_for(["s2"]) == 0  # redundant hints for s2 dropped
        await settle_live(cluster)
        assert cluster.mismatches() == []  # every column has R=3 exact copies on the survivors
    finally:
        await cluster.close()


async def settle_live(cluster):
    await cluster.client.flush()
    live = list(cluster.services)
    async with asyncio.timeout(10):
        while await cluster.control().hints_held_for(live):
            await cluster.control().deliver_hints()
            await asyncio.sleep(0.02)


async def test_topology_removenode_refuses_data_loss(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=1).start()
    try:
        await cluster.write_many(np.random.default_rng(4), 20, COLUMNS)
        await cluster.kill("s1")
        op = Rebalance(cluster.control(), "removenode", members_after(cluster.client_topology, remove=["s1"]))
        with pytest.raises(DataLossError):
            await op.run()
        assert "s1" in cluster.client_topology.names  # nothing switched
    finally:
        await cluster.close()


async def test_topology_join_receiver_killed_mid_stream_resumes(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(5)
        await cluster.write_many(rng, 150, COLUMNS, rows=16)
        await cluster.add_node("s3")
        op = Rebalance(cluster.control(), "join",
                       members_after(cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
                       chunk_bytes=1024, rate_bytes_s=100_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            while sum(r.sender.acked for r in op.runners) < 6:
                await asyncio.sleep(0.01)
        assert all(r.sender.chunks_left for r in op.runners if r.sender.total_bytes_estimate > 20_000)
        before = {r.label: r.sender.acked for r in op.runners}
        await cluster.kill("s3")  # receiver gone mid-stream (all it acknowledged is durable)
        await asyncio.sleep(0.2)
        await cluster.restart_node("s3")
        op.set_rate(None)
        progress = await asyncio.wait_for(task, 30)
        assert progress["state"] == "done"
        assert sum(s["reconnects"] for s in progress["streams"]) >= 1  # the busy streams reconnected
        for s in progress["streams"]:
            assert s["resent_items"] <= WINDOW  # at most the items in flight (the window)
            assert s["items_acked"] >= before[s["stream"]]
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_pause_resume_and_registry(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(6)
        await cluster.write_many(rng, 100, COLUMNS, rows=16)
        await cluster.add_node("s3")
        members = members_after(cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])])
        registry = OperationRegistry()
        op = registry.start(Rebalance(cluster.control(), "join", members, chunk_bytes=1024, rate_bytes_s=200_000))
        async with asyncio.timeout(20):
            while op.progress()["bytes_done"] == 0:
                await asyncio.sleep(0.01)
        op.pause()
        await asyncio.sleep(0.05)
        paused_at = op.progress()["bytes_done"]
        await asyncio.sleep(0.2)
        assert op.progress()["bytes_done"] == paused_at and op.state == "paused"
        assert 0 < paused_at < op.progress()["bytes_total"]
        assert op.progress()["eta_s"] is not None
        same = registry.start(Rebalance(cluster.control(), "join", members))  # re-issued verb: same op, resumed
        assert same is op and op.state == "streaming"
        op.set_rate(None)
        progress = await registry.wait(30)
        assert progress["state"] == "done"
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_cancel_keeps_old_placement_and_the_receiver_can_join_again(tmp_path):
    """A join cancelled mid-stream: the old placement stays, the receiver drops the partial rows
    it got (they used to stay, and every later stream of those columns refused it: "wipe"), and
    the same join run again completes with every row equal."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(7)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        before = cluster.client_topology.epoch
        op = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
            chunk_bytes=1024, rate_bytes_s=50_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            while op.progress()["bytes_done"] == 0:
                await asyncio.sleep(0.01)
        op.cancel()
        with pytest.raises(Exception, match="cancelled"):
            await asyncio.wait_for(task, 10)
        assert op.state == "cancelled" and cluster.client_topology.epoch == before
        assert op.progress()["discarded_rows"] > 0 and op.progress()["discard_errors"] == []
        assert len(cluster.services["s3"].store.store) == 0  # the partial rows are gone
        await cluster.write_many(rng, 10, COLUMNS)
        await settle(cluster)
        assert cluster.mismatches() == []  # the old owners kept everything
        again = Rebalance(cluster.control(), "join", op.new_members)
        progress = await asyncio.wait_for(again.run(), 30)
        assert progress["state"] == "done"
        await settle(cluster)
        assert cluster.mismatches() == []
        # a stream of the cancelled operation can never resume over the dropped rows
        endpoint = cluster.endpoints["s3"]
        assert all(endpoint.scopes.is_discarded(sid) for sid, target in op._streams if target == "s3")
    finally:
        await cluster.close()


async def test_topology_retry_straddling_the_cutover_counts_once(tmp_path):
    """A batch applied by an old owner during the join (and forwarded), then retried by its writer
    with the same id under the new placement: the newcomer must not count it twice."""
    from giaannd.storage.streaming.dedupe import marker_id
    from tools.cluster_harness import make_batch

    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(8)
        await cluster.write_many(rng, 40, COLUMNS, rows=16)
        await cluster.add_node("s3")
        op = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
            chunk_bytes=512, rate_bytes_s=100_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            while not op.runners or sum(r.sender.acked for r in op.runners) < len(op.runners) * 2:
                await asyncio.sleep(0.01)
        moving = np.concatenate([t.columns for t in op.plan.transfers])
        batch = make_batch(rng, 6, 4, rng.choice(moving, 6))
        bid = await cluster.write(batch)  # under the old placement: forwarded to s3
        op.set_rate(None)
        assert (await asyncio.wait_for(task, 30))["state"] == "done"
        applied = cluster.services["s3"].store.store.applied
        assert any(marker_id(bid, r.sender.stream_id) in applied for r in op.runners)
        await cluster.client.write(batch, bid)  # the writer's retry, now to the new owners
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_retry_arriving_before_the_delayed_original_counts_once(tmp_path):
    """The opposite order: the writer's retry reaches the newcomer directly first, then the old
    owner applies the (delayed) original and forwards it: the forwarded copy must be skipped."""
    from giaannd.client.storage_client import StorageClient
    from giaannd.cluster.view import ClusterView
    from tools.cluster_harness import make_batch

    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(9)
        await cluster.write_many(rng, 40, COLUMNS, rows=16)
        await cluster.add_node("s3")
        op = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
            chunk_bytes=512, rate_bytes_s=100_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            while not op.runners or sum(r.sender.acked for r in op.runners) < len(op.runners) * 2:
                await asyncio.sleep(0.01)
        moving = np.concatenate([t.columns for t in op.plan.transfers])
        batch = make_batch(rng, 6, 4, rng.choice(moving, 6))
        bid = cluster.client.next_batch_id()
        retry_view = ClusterView(replicas=2)
        retry_view.set_members(op.new_members)
        retry = StorageClient(retry_view, {"mem": cluster.transport("retry")})
        # as after the targets' switch (the streams still forward until they close): s3 owns its share
        cluster.topologies["s3"].set_override(op.new_members)
        await retry.apply_to("s3", bid, batch)  # the retry, under the new placement, first
        await retry.close()
        await cluster.client.write(batch, bid)  # the original reaches the old owners: forwarded
        cluster.reference.apply(bid, batch)
        op.set_rate(None)
        assert (await asyncio.wait_for(task, 30))["state"] == "done"
        assert cluster.endpoints["s3"].deltas_skipped >= 1
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_join_while_a_source_folds(tmp_path, monkeypatch):
    """A source whose fold holds its rows mid-move (storage/replication/background_fold.py) during a
    join with writes running: its stream waits for the fold without blocking the event loop (the
    fold is let go from the loop: before, a stream's chunk read waited on the engine's lock with
    the loop blocked, so the release never came and the fold timed out), writes during the fold
    are logged and acknowledged at once and forwarded when they reach the rows
    (deferred_applies.py), and every owner ends with the reference rows."""
    from tests.unit.storage_service.test_background_fold import PausedFold

    cluster = await Cluster(tmp_path, 3, replicas=2).start(heap_trim_interval_s=0.0)
    try:
        rng = np.random.default_rng(7)
        await cluster.write_many(rng, 80, COLUMNS)
        await cluster.add_node("s3")
        # throttled while the fold is held: a join that reached its cutover first drained the
        # writers there, so no write met the fold (``deferred`` 0: 1 run in 30 before, more under load)
        op = Rebalance(cluster.control(), "join",
                       members_after(cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
                       chunk_bytes=1024, rate_bytes_s=50_000)
        paused = PausedFold(monkeypatch)
        joined = asyncio.create_task(with_writes(cluster, rng, op.run()))
        await asyncio.sleep(0.05)
        source = cluster.services["s0"]
        assert source.folds is not None and source.store is not None
        paused.armed = True
        fold = asyncio.create_task(source.folds.fold())
        await paused.entered()
        paused.armed = False
        await asyncio.sleep(0.3)
        deferred = source.store.deferred.deferred
        op.set_rate(None)
        paused.release.set()
        await fold
        progress, during = await joined
        await paused.left()
        assert paused.held[0] is True
        assert progress["state"] == "done" and during > 0
        assert deferred > 0  # writes reached the folding source and were held, not refused
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_cancelled_while_its_cutover_waits_switches_nothing_and_discards(tmp_path):
    """A cancel that comes while the cutover waits (for the hints held for the sources, before
    any node switched): the old placement stays and the receiver drops what it got. It used to
    go on to switch the target and the writers, then fail on its aborted streams, too late to
    discard: writers and target on the new placement, the rest on the old, rows left behind."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(11)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        before = cluster.client_topology.epoch
        control = cluster.control()
        op = Rebalance(control, "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024)
        held_for = control.hints_held_for

        async def hints_held_for(names):
            if op.state == "cutover":
                op.cancel()  # the operator's cancel, while the cutover waits for the hints
            return await held_for(names)

        control.hints_held_for = hints_held_for
        with pytest.raises(Exception, match="cancelled"):
            await asyncio.wait_for(op.run(), 30)
        assert op.state == "cancelled"
        assert cluster.client_topology.epoch == before
        assert {name: view.epoch for name, view in cluster.topologies.items()} == \
            dict.fromkeys(cluster.topologies, before)
        assert op.progress()["discarded_rows"] > 0 and op.progress()["discard_errors"] == []
        assert len(cluster.services["s3"].store.store) == 0
        await cluster.write_many(rng, 10, COLUMNS)
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_cancel_while_hints_for_a_dead_source_are_held_ends_at_once(tmp_path):
    """A decommissioning node killed mid-stream leaves hints for it that no one can deliver; the
    cutover waits for the hints held for its sources before any node switches. The operator's
    cancel there ended the operation only once that wait timed out (a minute: the topology
    stress, a decommission whose leaver was killed, ~90 s a run); now at once, switching nothing
    and discarding what the receivers got."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        rng = np.random.default_rng(19)
        await cluster.write_many(rng, 40, COLUMNS)
        before = cluster.client_topology.epoch
        control = cluster.control()
        op = Rebalance(control, "decommission", members_after(cluster.client_topology, remove=["s1"]),
                       chunk_bytes=1024)

        async def hints_held_for(names):  # s1 died with hints for it held elsewhere
            if op.state == "cutover":
                op.cancel()
            return 5 if "s1" in names else 0

        control.hints_held_for = hints_held_for
        with pytest.raises(Exception, match="cancelled"):
            await asyncio.wait_for(op.run(), 10)  # (the hint wait's bound is 60 s)
        assert op.state == "cancelled" and cluster.client_topology.epoch == before
        assert op.progress()["discarded_rows"] > 0 and op.progress()["discard_errors"] == []
    finally:
        await cluster.close()


async def test_topology_pause_during_the_cutover_does_not_stall_it(tmp_path, monkeypatch):
    """A pause that comes once the cutover began: the cutover goes on (it is bounded) and the
    join completes. It used to stop the streams' tasks after they were told to close: the cutover
    waited for their last acknowledgements until it timed out, and the operation was left
    "paused" with the writers on the new placement, not failed, not cleaned up."""
    from giaannd.storage.rebalance import operations

    monkeypatch.setattr(operations, "CUTOVER_TIMEOUT_S", 5.0)
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(12)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        control = cluster.control()
        op = Rebalance(control, "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024)
        switch_writers = control.switch_writers

        async def paused_switch(members):
            op.pause()  # the operator's pause, while the writers switch
            await switch_writers(members)

        control.switch_writers = paused_switch
        progress = await asyncio.wait_for(op.run(), 30)
        assert progress["state"] == "done"
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_pause_or_cancel_of_a_finished_operation_changes_nothing(tmp_path):
    """Pause and cancel act on the registry's last operation even once it ended (the admin routes):
    a finished one stays as it ended. Paused, it used to read "paused" for good and the registry
    refused every later operation ("another topology operation is running")."""
    cluster = await Cluster(tmp_path, 2, replicas=2).start()
    try:
        await cluster.add_node("s2")
        registry = OperationRegistry()
        members = members_after(cluster.client_topology, add=[StorageNode("s2", cluster.addresses["s2"])])
        op = registry.start(Rebalance(cluster.control(), "join", members))
        assert (await registry.wait(30))["state"] == "done"
        op.pause()
        op.cancel()
        assert op.state == "done"
        again = registry.start(Rebalance(cluster.control(), "decommission", members_after(
            cluster.client_topology, remove=["s2"])))
        assert again is not op
        assert (await registry.wait(30))["state"] == "done"
    finally:
        await cluster.close()


async def test_topology_cancelled_while_planning_starts_no_stream(tmp_path, monkeypatch):
    """A cancel that comes while the plan waits for a remote old owner's ``ListColumns``: the
    operation ends cancelled and starts nothing. It used to be overwritten by the streaming state:
    the operation streamed and cut over as if never cancelled."""
    from giaannd.storage.rebalance import operations

    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(13)
        await cluster.write_many(rng, 30, COLUMNS)
        await cluster.add_node("s3")
        before = cluster.client_topology.epoch
        control = cluster.control()
        local = control.service
        control.service = lambda name: None if name == "s1" else local(name)  # s1 is listed remotely
        op = Rebalance(control, "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024)
        listed = operations.list_columns

        async def list_columns(transport, address):
            op.cancel()  # the operator's cancel, while the plan waits for the answer
            return await listed(transport, address)

        monkeypatch.setattr(operations, "list_columns", list_columns)
        with pytest.raises(Exception, match="cancelled"):
            await asyncio.wait_for(op.run(), 30)
        assert op.state == "cancelled" and op.runners == []
        assert cluster.client_topology.epoch == before
        assert len(cluster.services["s3"].store.store) == 0
    finally:
        await cluster.close()


@pytest.mark.parametrize("how", ["local", "remote"])
async def test_repair_ships_every_logged_share_of_a_batch_id(tmp_path, how):
    """A peer that applied two shares of one batch id (a training writer's ids are idempotent per
    column: a hint re-split or a retry under a new placement brings the columns the first share
    lacked) logs two records of that id. Repair read the peer's log into one batch per id, the
    last record winning: the node it repaired got the second share's rows only, recorded the id
    as applied, and the first share's rows were never shipped (rows divergent after the repair)."""
    from giaannd.protocol import BatchId
    from giaannd.storage.repair.local import repair
    from giaannd.storage.repair.remote import repair_self
    from tools.cluster_harness import make_batch

    cluster = await Cluster(tmp_path, 2, replicas=2).start()
    try:
        peer, node = cluster.services["s1"].store, cluster.services["s0"].store
        rng = np.random.default_rng(14)
        bid = BatchId(0x5EED, 1)
        for column in (COLUMNS[:1], COLUMNS[1:2]):  # two shares of one id, other columns each
            assert peer.apply(bid, make_batch(rng, 3, 4, np.repeat(column, 3)), track=True).applied
        await asyncio.to_thread(peer.sync)
        if how == "local":
            report = await repair(cluster.control(), ["s0"])
        else:
            report = await repair_self(cluster.services["s0"], cluster.ops_transport,
                                       {"s1": cluster.stream_addresses["s1"]}, cluster.client_topology.placement)
            assert report["peers_failed"] == {}
        assert report["batches_shipped"] == 1 and report["rows_shipped"] == 6
        assert set(node.store.held_columns().tolist()) == set(COLUMNS[:2].tolist())
        assert report["rows_divergent_count"] == 0
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


def _pause_when_all_caught_up(op, paused):
    """Make the operator's pause land at the instant the last stream catches up: right after that
    ``caught_up.set()``, before the operation's task runs again (in a daemon, the admin request's
    task ahead of it in the same loop turn). Hooks the runners as they are first spawned."""
    spawn = op._spawn_runners

    def hook(event):
        set_event = event.set

        def set_then_pause():
            set_event()
            if not paused.is_set() and all(r.caught_up.is_set() for r in op.runners):
                op.pause()
                paused.set()

        event.set = set_then_pause

    def spawn_hooked():
        if not paused.is_set():
            for r in op.runners:
                if not r.caught_up.is_set():
                    hook(r.caught_up)
        spawn()

    op._spawn_runners = spawn_hooked


async def test_topology_pause_at_the_instant_the_streams_catch_up_holds_the_cutover(tmp_path, monkeypatch):
    """The race between a pause and the cutover: the pause comes after the last stream caught up
    but before the operation's task resumed. The pause wins: the operation stays "paused", no node
    switches, and a resume completes the join with every row equal. The cutover used to begin
    anyway (the state went from "paused" to "cutover", the resume was then ignored) with the
    streams' tasks stopped by the pause: the targets and writers switched, then the streams' last
    acknowledgements never came and the operation failed after ``CUTOVER_TIMEOUT_S``."""
    from giaannd.storage.rebalance import operations

    monkeypatch.setattr(operations, "CUTOVER_TIMEOUT_S", 2.0)  # (only the broken path waits for it)
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    task = None
    try:
        rng = np.random.default_rng(14)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        control = cluster.control()
        switched = []
        switch = control.switch

        async def recording_switch(names, members):
            switched.append(list(names))
            await switch(names, members)

        control.switch = recording_switch
        op = Rebalance(control, "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024)
        paused = asyncio.Event()
        _pause_when_all_caught_up(op, paused)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            await paused.wait()
        for _ in range(50):  # loop turns, not time: the operation's task runs what it would run
            await asyncio.sleep(0)
        assert (op.state, switched) == ("paused", [])
        op.resume()
        progress = await asyncio.wait_for(task, 30)
        assert progress["state"] == "done"
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await cluster.close()


async def test_topology_stream_failing_while_paused_fails_the_operation(tmp_path):
    """A stream that fails while its operation is paused (here: the writes it keeps collecting pass
    its bound, ``max_pending_bytes``, "too slow") fails the operation, which cleans up. It used to
    stay "paused" with its task ended: a resume then streamed with nothing left to cut over, and
    every later operation was refused ("another topology operation is running")."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(15)
        await cluster.write_many(rng, 100, COLUMNS, rows=16)
        await cluster.add_node("s3")
        before = cluster.client_topology.epoch
        registry = OperationRegistry()
        op = registry.start(Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
            chunk_bytes=1024, rate_bytes_s=200_000))
        async with asyncio.timeout(20):
            while op.progress()["bytes_done"] == 0:
                await asyncio.sleep(0.01)
        op.pause()
        for r in op.runners:
            r.sender.max_pending_bytes = 0  # the next write a stream collects is one too many
        await cluster.write_many(rng, 60, COLUMNS)
        assert all(r.state == "failed" for r in op.runners)
        progress = await registry.wait(10)
        assert progress["state"] == "failed" and "unacknowledged" in progress["error"]
        assert cluster.client_topology.epoch == before
        assert progress["discard_errors"] == [] and len(cluster.services["s3"].store.store) == 0
        op.resume()
        assert op.state == "failed"
    finally:
        await cluster.close()
