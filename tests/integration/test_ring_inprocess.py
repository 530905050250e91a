"""The storage ring across daemons in one process (runtime + membership + roles, as ``giaannd``
wires them): join modes, ring sync to storage and compute nodes, the runtime requests
(RingGet / RingPush / SetOverride) and ``GET /v1/ring``.

Real sockets on loopback with OS-chosen ports; every wait is bounded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from giaannd.admin import ctl
from giaannd.client.ring_calls import RingRequestError, get_ring, push_ring, set_override
from giaannd.client.storage_client import RemoteNotOwner
from giaannd.cluster.ring import RING_FILE, Ring
from giaannd.cluster.view import StorageNode
from giaannd.config import ClusterConfig, Config, Role, TransportConfig
from giaannd.daemon import Daemon, build_role_services
from giaannd.protocol import BatchId
from giaannd.runtime.node import NodeRuntime
from giaannd.services.membership import MembershipService
from giaannd.storage.rebalance import daemon as daemon_topology
from peers.keyring import Keyring
from peers.placement import Member, Placement
from tests.integration.test_cluster_inprocess import Node, wait_async
from tools.cluster_harness import make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class RingNode(Node):
    """``Node`` of test_cluster_inprocess with chosen roles, seeds and join mode."""

    def __init__(self, root: Path, name: str, key_file: str, roles: list[Role], seeds: list[str],
                 join_mode: str = "bootstrap") -> None:
        base = Config.loopback(str(root / name), name=name, roles=roles)
        self.config = msgspec.structs.replace(
            base, cluster=ClusterConfig(name="ring", key_file=key_file, seeds=seeds),
            transport=TransportConfig(bind=["tcp://127.0.0.1:0"]),
            storage=msgspec.structs.replace(base.storage, replication_factor=2, write_quorum=1,
                                            join_mode=join_mode))
        self.runtime = NodeRuntime(self.config)
        self.membership = MembershipService(self.runtime)
        services, unavailable = build_role_services(self.config, self.runtime)
        assert not unavailable
        self.daemon = Daemon(self.config, [self.runtime, self.membership, *services],
                             handle_signals=False, runtime=self.runtime)
        self.task = None
        self.session = None

    @property
    def data_address(self) -> str:
        return self.runtime.advertised["tcp"]

    async def ring_doc(self) -> dict[str, Any]:
        status, doc = await self.call("GET", "/v1/ring")
        assert status == 200, doc
        return doc


@pytest.mark.asyncio
async def test_ring_join_modes_sync_push_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    key_file = str(tmp_path / "cluster.key")
    Keyring.generate().save(key_file)
    started: list[RingNode] = []

    async def start(name: str, roles: list[Role], join_mode: str = "bootstrap") -> RingNode:
        seeds = [started[0].gossip_addr] if started else []
        node = RingNode(tmp_path, name, key_file, roles, seeds, join_mode)
        await node.start()
        started.append(node)
        return node

    try:
        a = await start("a", ["storage"])  # the first node of a new cluster
        b = await start("b", ["storage"], "manual")  # stays standby
        c = await start("c", ["compute"])
        assert a.runtime.ring.active() == [("a", 1.0)]
        # b and c pulled the ring when they joined: before their start returned
        assert b.runtime.ring == a.runtime.ring and c.runtime.ring == a.runtime.ring
        assert b.runtime.topology.standby() == ["b"] and b.runtime.topology.names == ("a",)

        async def a_lists_b_standby() -> bool:
            doc = await a.ring_doc()
            return [s["name"] for s in doc["standby"]] == ["b"]
        await wait_async(a_lists_b_standby, "a lists b as standby")
        doc = await a.ring_doc()
        assert [m["name"] for m in doc["members"]] == ["a"] and doc["override"] is None
        assert doc["standby"][0]["address"] == b.data_address
        assert doc["ring"] == {"digest": f"{a.runtime.ring.digest():016x}", "active": ["a"],
                               "removed": []}
        assert a.daemon.admin_address is not None
        host, port = a.daemon.admin_address
        capsys.readouterr()
        assert await asyncio.to_thread(ctl.main, [
            "--addr", f"http://{host}:{port}", "--token-file", str(a.config.data_path("admin.token")),
            "ring", "show"]) == 0
        text = capsys.readouterr().out
        assert "ring_entries:" in text and "STAMP" in text and f"digest: {doc['ring']['digest']}" in text
        assert "standby:" in text and b.data_address in text

        # a standby node owns nothing: a write sent to it anyway is refused (NotOwner)
        client = a.runtime.storage_client(request_timeout_s=5.0)
        batch = make_batch(np.random.default_rng(1), 2)
        with pytest.raises(RemoteNotOwner, match="standby"):
            await client.apply_to("b", BatchId(7, 1), batch)

        # RingGet / RingPush over the data plane (what a topology operation's coordinator does).
        transports: dict[str, Any] = {}
        ident = a.runtime.identity
        assert await get_ring(transports, ident, c.data_address) == a.runtime.ring  # compute answers too
        pushed = await push_ring(transports, ident, a.data_address, a.runtime.ring.with_active("b"))
        assert pushed.active() == [("a", 1.0), ("b", 1.0)]

        # ring sync: the change reaches every node, the compute-only one included
        async def all_have(ring: Ring) -> bool:
            return all(n.runtime.ring == ring for n in started)
        await wait_async(lambda: all_have(pushed), "pushed ring reached every node")
        for node in started:
            assert node.runtime.topology.names == ("a", "b") and node.runtime.topology.standby() == []
            assert Ring.load(node.config.data_path(RING_FILE)) == pushed  # persisted, every role

        # SetOverride with flush on the compute node: its writers now use exactly [a]
        only_a = [StorageNode("a", a.data_address)]
        epoch = await set_override(transports, ident, c.data_address, only_a, flush=True, timeout_s=5.0)
        assert epoch == Placement((Member("a"),), 2).epoch == c.runtime.topology.epoch
        doc = await c.ring_doc()
        assert [m["name"] for m in doc["members"]] == ["a"] and doc["override"][0]["name"] == "a"
        assert await set_override(transports, ident, c.data_address, None, flush=False) != epoch
        assert c.runtime.topology.override is None and c.runtime.topology.names == ("a", "b")
        # an override ends by itself once the ring's active set equals it (the operation committed)
        await set_override(transports, ident, c.data_address, only_a, flush=False)
        removed = await push_ring(transports, ident, a.data_address, pushed.with_removed("b"))
        await wait_async(lambda: all_have(removed), "removal reached every node")
        assert c.runtime.topology.override is None and c.runtime.topology.names == ("a",)
        assert b.runtime.topology.standby() == ["b"]  # decommissioned: standby again

        # bad requests are refused without any change
        with pytest.raises(RingRequestError, match="BadRequest"):
            await set_override(transports, ident, c.data_address, [], flush=False)
        assert c.runtime.ring == removed

        # auto join mode in a cluster with active members: standby, and the join callback runs
        # once the storage role serves and the callback is set (a role sets it after membership
        # started: here, after the whole daemon started)
        # (the storage role sets the callback to its streaming join: replaced here by a probe)
        d = RingNode(tmp_path, "d", key_file, ["storage"], [a.gossip_addr], "auto")
        called = asyncio.Event()

        async def join(self: object) -> dict[str, Any]:
            assert d.runtime.serving.is_set()
            called.set()
            return {}
        monkeypatch.setattr(daemon_topology.StorageTopology, "join", join)
        await d.start()
        started.append(d)
        async with asyncio.timeout(15):
            await called.wait()
        assert not d.runtime.ring.is_active("d") and d.runtime.topology.standby() == ["b", "d"]

        # a removed node restarted with join-mode bootstrap does not re-add itself
        await b.stop()
        started.remove(b)
        b2 = RingNode(tmp_path, "b", key_file, ["storage"], [a.gossip_addr], "bootstrap")
        await b2.start()
        started.append(b2)
        assert b2.runtime.ring.get("b").state == "removed" and b2.runtime.topology.standby() == ["b", "d"]
    finally:
        for node in reversed(started):
            await node.stop()
