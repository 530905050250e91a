"""Topology operations whose sources are *remote*: the coordinator's control serves only its own
node (``service(name)`` is None for every other), so every other source is driven through its
stream endpoint (source_control.py / rebalance/remote_source.py) and every hint step is a request. join /
decommission / removenode under concurrent writes end exactly equal to the single-store
reference; a dropped control connection is survived; pause / resume / cancel reach the sources;
a source that restarted is refused clearly; the admin join / replace verbs."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.errors import AdminHTTPError
from giaannd.storage.rebalance import source_control as sc
from giaannd.storage.rebalance.local_control import LocalClusterControl
from giaannd.storage.rebalance.operations import OperationRegistry, Rebalance, TopologyOpError, members_after
from giaannd.storage.rebalance.remote_source import RemoteStreamRunner
from giaannd.storage.rebalance.routes import register_admin_routes
from giaannd.storage.streaming.sender import StreamRunner
from tests.integration.test_topology_admin import FakeAdmin
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(50).integers(1, 2**63, 120, dtype=np.uint64)


class RemoteControl(LocalClusterControl):
    """The coordinator ``me`` serves only itself; views still switch in-process (as the daemon's
    control would by request), hints go through every live node's stream endpoint."""

    def __init__(self, cluster: Cluster, me: str) -> None:
        super().__init__(cluster.ops_transport, cluster.services, cluster.topologies, [cluster.client_topology],
                         [cluster.client], cluster.stream_addresses, drain_grace_s=0.05)
        self.me, self.cluster = me, cluster
        self.after = []

    def service(self, name):
        return self.services.get(name) if name == self.me else None

    def _live(self):
        return [n for n in self.cluster.endpoints if n in self.services]

    async def hints_held_for(self, names):
        counts = [await sc.hints_held(self.transport, self.stream_addresses[n], names) for n in self._live()]
        return sum(counts)

    async def deliver_hints(self):
        for n in self._live():
            await sc.deliver_hints(self.transport, self.stream_addresses[n])

    async def drop_hints_for(self, name):
        return sum([await sc.drop_hints(self.transport, self.stream_addresses[n], name) for n in self._live()])

    async def after_cutover(self, new_members):
        self.after.append([m.name for m in new_members])


async def settle(cluster):
    await cluster.client.flush()
    control = cluster.control()
    async with asyncio.timeout(10):
        while await control.hints_held_for(list(cluster.services)):
            await control.deliver_hints()
            await asyncio.sleep(0.02)


async def with_writes(cluster, rng, coro, pause_s=0.002):
    stop = asyncio.Event()
    writer = asyncio.create_task(cluster.write_many(rng, 10_000, COLUMNS, stop=stop, pause_s=pause_s))
    try:
        result = await coro
    finally:
        stop.set()
        during = await writer
    return result, during


def join_members(cluster, name="s3"):
    return members_after(cluster.client_topology, add=[StorageNode(name, cluster.addresses[name])])


@pytest.mark.parametrize("scheme", ["mem", "tcp"])
async def test_topology_remote_join_with_concurrent_writes(tmp_path, scheme):
    cluster = await Cluster(tmp_path, 3, scheme=scheme, replicas=2).start()
    try:
        rng = np.random.default_rng(1)
        await cluster.write_many(rng, 60, COLUMNS)
        await cluster.add_node("s3")
        control = RemoteControl(cluster, "s3")  # the joining node coordinates; every source is remote
        op = Rebalance(control, "join", join_members(cluster), chunk_bytes=2048)
        progress, during = await with_writes(cluster, rng, op.run())
        assert during > 0 and progress["state"] == "done"
        assert op.runners and all(isinstance(r, RemoteStreamRunner) for r in op.runners)
        assert {r.label.split("->")[0] for r in op.runners} == {"s0", "s1", "s2"}
        assert progress["bytes_done"] > 0 and all(s["state"] == "done" for s in progress["streams"])
        assert sum(s["deltas"] for s in progress["streams"]) > 0  # writes forwarded by remote sources
        assert control.after == [[m.name for m in op.new_members]]
        await settle(cluster)
        assert "s3" in cluster.client_topology.names
        assert cluster.mismatches() == []
        assert cluster.services["s3"].store.store.keys()
        for name in ("s0", "s1", "s2"):  # the sources' registries saw their streams finish
            ep = cluster.endpoints[name]
            assert all(e.runner.state == "done" for e in ep.sources._sources.values())
            assert not ep.sources.service.core.store.observers  # tee detached
        again = await Rebalance(control, "join", cluster.members()).run()
        assert again["state"] == "done" and again["streams"] == []
    finally:
        await cluster.close()


async def test_topology_remote_decommission_coordinated_elsewhere(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=2).start()
    try:
        rng = np.random.default_rng(2)
        await cluster.write_many(rng, 60, COLUMNS)
        control = RemoteControl(cluster, "s0")  # s1 leaves, s0 coordinates: s1 streams remotely
        op = Rebalance(control, "decommission", members_after(cluster.client_topology, remove=["s1"]),
                       avoid_sources=("s0", "s2", "s3"), chunk_bytes=4096)
        progress, during = await with_writes(cluster, rng, op.run())
        assert progress["state"] == "done" and during > 0
        assert {r.label.split("->")[0] for r in op.runners} == {"s1"}
        assert all(isinstance(r, RemoteStreamRunner) for r in op.runners)
        await cluster.retire("s1")
        await settle(cluster)
        assert "s1" not in cluster.client_topology.names
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_remote_removenode_mixed_sources(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        rng = np.random.default_rng(3)
        await cluster.write_many(rng, 40, COLUMNS)
        await cluster.kill("s2")
        await cluster.write_many(rng, 20, COLUMNS)  # hinted for s2
        control = RemoteControl(cluster, "s0")
        assert await control.hints_held_for(["s2"]) > 0
        op = Rebalance(control, "removenode", members_after(cluster.client_topology, remove=["s2"]))
        progress, _ = await with_writes(cluster, rng, op.run())
        assert progress["state"] == "done" and progress["lost_columns"] == 0
        kinds = {type(r) for r in op.runners}
        assert kinds == {StreamRunner, RemoteStreamRunner}  # s0 local, s1 / s3 remote
        assert await control.hints_held_for(["s2"]) == 0  # dropped through the endpoints
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_remote_survives_dropped_control_connection(tmp_path):
    cluster = await Cluster(tmp_path, 3, scheme="tcp", replicas=2).start()
    try:
        rng = np.random.default_rng(4)
        await cluster.write_many(rng, 100, COLUMNS, rows=16)
        await cluster.add_node("s3")
        op = Rebalance(RemoteControl(cluster, "s3"), "join", join_members(cluster), chunk_bytes=1024,
                       rate_bytes_s=150_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            while not op.runners or sum(r.progress()["items_acked"] for r in op.runners) < 4:
                await asyncio.sleep(0.01)
        for r in op.runners:  # every control connection drops (the sources keep streaming)
            conn = r._client._conn
            if conn is not None:
                await conn.close()
        op.set_rate(None)
        progress = await asyncio.wait_for(task, 30)
        assert progress["state"] == "done"
        assert sum(r.reconnects for r in op.runners) >= 1
        assert all(s["resent_items"] == 0 for s in progress["streams"])  # the streams never broke
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_remote_pause_resume_via_registry(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(6)
        await cluster.write_many(rng, 100, COLUMNS, rows=16)
        await cluster.add_node("s3")
        control = RemoteControl(cluster, "s3")
        registry = OperationRegistry()
        op = registry.start(Rebalance(control, "join", join_members(cluster), chunk_bytes=1024,
                                      rate_bytes_s=150_000))
        async with asyncio.timeout(20):
            while op.progress()["bytes_done"] == 0:
                await asyncio.sleep(0.01)
        op.pause()
        await asyncio.sleep(0.3)  # the SourcePause requests land
        sources = [e for n in ("s0", "s1", "s2") for e in cluster.endpoints[n].sources._sources.values()]
        assert sources and all(e.task is None for e in sources)  # the remote senders stopped
        acked = [e.runner.sender.acked for e in sources]
        await asyncio.sleep(0.2)
        assert [e.runner.sender.acked for e in sources] == acked and op.state == "paused"
        same = registry.start(Rebalance(control, "join", join_members(cluster)))
        assert same is op and op.state == "streaming"
        op.set_rate(None)
        progress = await registry.wait(30)
        assert progress["state"] == "done"
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_remote_cancel_aborts_sources(tmp_path):
    """A join coordinated by the joining node (as the daemon runs it: fixed stream ids from its join
    generation), cancelled mid-stream: the sources stop, the old placement stays, the joining node
    drops what it received and its generation goes up; the join run again (new stream ids)
    completes, and one with the old ids is refused as discarded."""
    from giaannd.storage.rebalance.join_generation import JoinGeneration

    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(7)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        before = cluster.client_topology.epoch
        generation = JoinGeneration(cluster.services["s3"].data_dir)
        op = Rebalance(RemoteControl(cluster, "s3"), "join", join_members(cluster), chunk_bytes=1024,
                       rate_bytes_s=50_000, stream_nonce=generation.current(), after_discard=generation.advance)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            while op.progress()["bytes_done"] == 0:
                await asyncio.sleep(0.01)
        op.cancel()
        with pytest.raises(Exception, match="cancelled"):
            await asyncio.wait_for(task, 10)
        async with asyncio.timeout(5):  # the SourceAbort requests land: nothing forwards any more
            while any(e.runner.state != "failed" for n in ("s0", "s1", "s2")
                      for e in cluster.endpoints[n].sources._sources.values()):
                await asyncio.sleep(0.02)
        assert cluster.client_topology.epoch == before
        assert op.progress()["discard_errors"] == [] and len(cluster.services["s3"].store.store) == 0
        await cluster.write_many(rng, 10, COLUMNS)
        await settle(cluster)
        assert cluster.mismatches() == []
        assert generation.current() == 1
        stale = Rebalance(RemoteControl(cluster, "s3"), "join", join_members(cluster), chunk_bytes=1024,
                          stream_nonce=0)
        with pytest.raises(Exception, match="cancelled|discarded"):  # the old ids are done for, at both ends
            await asyncio.wait_for(stale.run(), 30)
        assert len(cluster.services["s3"].store.store) == 0
        # the receiver dropped what the cancelled streams brought: the join runs again, to the end
        again = Rebalance(RemoteControl(cluster, "s3"), "join", join_members(cluster), chunk_bytes=1024,
                          stream_nonce=generation.current(), after_discard=generation.advance)
        assert (await asyncio.wait_for(again.run(), 30))["state"] == "done"
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_remote_source_restart_is_refused_clearly(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(8)
        await cluster.write_many(rng, 100, COLUMNS, rows=16)
        await cluster.add_node("s3")
        op = Rebalance(RemoteControl(cluster, "s3"), "join", join_members(cluster), chunk_bytes=1024,
                       rate_bytes_s=30_000)
        task = asyncio.create_task(op.run())
        async with asyncio.timeout(20):
            while not op.runners or not all(r.progress()["items_acked"] for r in op.runners):
                await asyncio.sleep(0.01)
        await cluster.kill("s1")  # a source restarts: its queue of forwarded writes is gone
        await cluster.restart_node("s1")
        with pytest.raises(TopologyOpError, match="restarted"):
            await asyncio.wait_for(task, 30)
        assert op.state == "failed" and "s1->s3" in op.error
    finally:
        await cluster.close()


async def test_source_control_refusals_and_hint_calls(tmp_path):
    cluster = await Cluster(tmp_path, 2, replicas=2).start()
    try:
        t, addr = cluster.ops_transport, cluster.stream_addresses["s0"]
        await cluster.write_many(np.random.default_rng(9), 10, COLUMNS)
        cols = await sc.list_columns(t, addr)
        held = {k[0] for k in cluster.services["s0"].store.store.keys()}
        assert cols.dtype == np.uint64 and set(cols.tolist()) == held
        client = sc.SourceClient(t, addr)
        with pytest.raises(sc.SourceControlError, match="restarted"):
            await client.request(sc.SourceStatus(123))
        start = sc.SourceStart(124, cluster.stream_addresses["s1"], "s0", "s1", [("s0", 1.0)],
                               [("s0", 1.0), ("s1", 1.0)], 2, resume=True)
        with pytest.raises(sc.SourceControlError, match="restarted"):
            await client.request(start)
        with pytest.raises(sc.SourceControlError, match="not 'sX'"):
            await client.request(sc.SourceStart(125, "mem://x", "sX", "s1", [("s0", 1.0)], [("s1", 1.0)], 1))
        with pytest.raises(sc.SourceControlError, match="strategy"):
            await client.request(sc.SourceStart(126, "mem://x", "s0", "s1", [("s0", 1.0)], [("s1", 1.0)], 1,
                                                strategy="nope"))
        await client.close()
        assert await sc.hints_held(t, addr, ["s1"]) == 0
        assert await sc.deliver_hints(t, addr) == 0
        assert await sc.drop_hints(t, addr, "s1") == 0
    finally:
        await cluster.close()


async def test_source_registry_aborts_an_orphaned_stream(tmp_path):
    cluster = await Cluster(tmp_path, 2, replicas=1).start()
    try:
        await cluster.write_many(np.random.default_rng(12), 40, COLUMNS, rows=16)
        registry = cluster.endpoints["s0"].sources
        registry.orphan_after_s = 0.4
        client = sc.SourceClient(cluster.ops_transport, cluster.stream_addresses["s0"])
        start = sc.SourceStart(321, cluster.stream_addresses["s1"], "s0", "s1", [("s0", 1.0)],
                               [("s0", 1.0), ("s1", 1.0)], 2, chunk_bytes=512, rate_bytes_s=2_000, label="s0->s1")
        state, _ = await client.request(start)
        assert state.state == "streaming" and not state.finished
        again, _ = await client.request(start)  # idempotent: the same stream, not a second one
        assert again.stream_id == 321 and len(registry._sources) == 1
        other = sc.SourceStart(322, cluster.stream_addresses["s1"], "s0", "s1", [("s0", 1.0)],
                               [("s1", 1.0)], 1, label="another operation")
        with pytest.raises(sc.SourceControlError, match="one operation at a time"):
            await client.request(other)  # a different placement change while the first streams
        assert len(registry._sources) == 1
        await client.close()
        async with asyncio.timeout(10):  # nobody polls: the coordinator is gone
            while registry._sources[321].runner.state != "failed":
                await asyncio.sleep(0.05)
        assert "orphaned" in registry._sources[321].runner.error
        assert not cluster.services["s0"].core.store.observers  # no longer forwarding
    finally:
        await cluster.close()


async def test_topology_admin_join_and_replace(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        await cluster.write_many(np.random.default_rng(10), 40, COLUMNS)
        await cluster.add_node("s3")
        me = StorageNode("s3", cluster.addresses["s3"])
        control = RemoteControl(cluster, "s3")
        admin, no_node = FakeAdmin(), FakeAdmin()
        register_admin_routes(admin, control, local_node=lambda: me)
        register_admin_routes(no_node, control)
        with pytest.raises(AdminHTTPError) as err:
            await no_node.call("POST", "/v1/node/join-ring")
        assert err.value.status == 404
        with pytest.raises(AdminHTTPError) as err:
            await admin.call("POST", "/v1/node/join-ring", {"rate_bytes_s": "fast"})
        assert err.value.status == 400
        started = await admin.call("POST", "/v1/node/join-ring")
        assert started["op"] == "join"
        async with asyncio.timeout(30):
            while (await admin.call("GET", "/v1/node/topology"))["state"] not in ("done", "failed"):
                await asyncio.sleep(0.02)
        assert (await admin.call("GET", "/v1/node/topology"))["state"] == "done"
        await settle(cluster)
        assert "s3" in cluster.client_topology.names and cluster.mismatches() == []
    finally:
        await cluster.close()


async def test_topology_admin_replace_dead_member(tmp_path):
    # (a fresh cluster: after a join the old owners keep released rows, and a node that regains
    # such a column refuses a fresh stream for it: docs/topology.md, known gaps)
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        await cluster.write_many(np.random.default_rng(11), 40, COLUMNS)
        # s4 replaces s1 (dead): remove s1 + add s4, coordinated by s4
        await cluster.kill("s1")
        await cluster.add_node("s4")
        me4 = StorageNode("s4", cluster.addresses["s4"])
        admin4 = FakeAdmin()
        register_admin_routes(admin4, RemoteControl(cluster, "s4"), local_node=lambda: me4)
        with pytest.raises(AdminHTTPError) as err:
            await admin4.call("POST", "/v1/node/replace", {"node_id": "s0"})
        assert err.value.status == 409  # alive
        started = await admin4.call("POST", "/v1/node/replace", {"node_id": "s1"})
        assert started["op"] == "replace"
        async with asyncio.timeout(30):
            while (await admin4.call("GET", "/v1/node/topology"))["state"] not in ("done", "failed"):
                await asyncio.sleep(0.02)
        final = await admin4.call("GET", "/v1/node/topology")
        assert final["state"] == "done", final
        assert sorted(cluster.client_topology.names) == ["s0", "s2", "s4"]
        await settle(cluster)
        assert cluster.mismatches() == []
    finally:
        await cluster.close()
