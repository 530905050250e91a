"""``GET /v1/columns/{column}`` / ``giaannctl column info`` (issue 7) on in-process daemons wired as
``giaannd`` wires them: two storage nodes and a compute node (it answers through the
storage cluster too). Real loopback sockets; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import pytest

from giaannd.admin import ctl
from giaannd.config import ClusterConfig, Config, TransportConfig
from giaannd.daemon import Daemon, build_role_services
from giaannd.model.ids import parse_column
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.runtime.node import NodeRuntime
from giaannd.services.membership import MembershipService
from peers.keyring import Keyring
from tests.integration.test_cluster_inprocess import Node, wait_async

Role = Literal["storage", "compute"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class RoleNode(Node):
    """``Node`` of test_cluster_inprocess with chosen roles."""

    def __init__(self, root: Path, name: str, key_file: str, roles: list[Role]) -> None:
        base = Config.loopback(str(root / name), name=name, roles=roles)
        self.config = msgspec.structs.replace(
            base, cluster=ClusterConfig(name="colinfo", key_file=key_file, seeds=[]),
            transport=TransportConfig(bind=["tcp://127.0.0.1:0"]),
            storage=msgspec.structs.replace(base.storage, replication_factor=2, write_quorum=2,
                                            join_mode="bootstrap"))
        self.runtime = NodeRuntime(self.config)
        self.membership = MembershipService(self.runtime)
        services, unavailable = build_role_services(self.config, self.runtime)
        assert not unavailable
        self.daemon = Daemon(self.config, [self.runtime, self.membership, *services],
                             handle_signals=False, runtime=self.runtime)
        self.task = None
        self.session = None


def _rows(column: int, features: list[int], seed: int) -> RowBatch:
    rng = np.random.default_rng(seed)
    n = 3 * len(features)
    return RowBatch.from_entries(np.full(n, column, np.uint64), np.repeat(np.array(features, np.uint64), 3),
                                 np.zeros(n, np.uint8), rng.integers(1, 1 << 40, n, dtype=np.uint64),
                                 np.tile(np.arange(3, dtype=np.uint64), len(features)),
                                 np.ones(n, np.float32))


@pytest.mark.asyncio
async def test_column_info_route_and_ctl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_file = str(tmp_path / "cluster.key")
    Keyring.generate().save(key_file)
    nodes = [RoleNode(tmp_path, "a", key_file, ["storage"]), RoleNode(tmp_path, "b", key_file, ["storage"]),
             RoleNode(tmp_path, "c", key_file, ["compute"])]
    started: list[RoleNode] = []
    try:
        for node in nodes:
            await node.start()
            started.append(node)
        a, b, c = nodes
        for node in (b, c):
            status, doc = await node.call("POST", "/v1/node/join", {"seeds": [a.gossip_addr]})
            assert status == 200 and doc["joined"], doc

        async def storage_seen_everywhere() -> bool:
            return all(len(n.runtime.topology.live()) == 2 for n in nodes)
        await wait_async(storage_seen_everywhere, "every node sees both storage nodes")

        water, _ = parse_column("water")
        client = a.runtime.storage_client(request_timeout_s=5.0)
        result = await client.write(_rows(water, [0, 2, 5, 9], seed=1))
        assert result is not None
        await client.write(_rows(water + 1, [0, 1], seed=2))  # a neighbour column is not counted
        await client.flush()

        docs = []
        for node in nodes:
            status, doc = await node.call("GET", "/v1/columns/water")
            assert status == 200, doc
            docs.append(doc)
        for doc in docs:
            assert doc["column_id"] == str(water) and doc["named_by"] == "word"
            assert {o["name"] for o in doc["owners"]} == {"a", "b"}
            assert all(o["live"] and o["rows"] == 4 and o["entries"] == 12 and o["error"] is None
                       for o in doc["owners"]), doc
            assert doc["keys_agree"] is True and doc["strength_agree"] is True
        assert docs[0]["owners"] == docs[2]["owners"]  # the compute node sees the same
        status, doc = await a.call("GET", f"/v1/columns/{water}")
        assert status == 200 and doc["named_by"] == "id" and doc["owners"] == docs[0]["owners"]

        # A replica that diverges (a row only b got) is shown as disagreeing.
        await client.apply_to("b", BatchId(99, 1), _rows(water, [11], seed=3))
        status, doc = await c.call("GET", "/v1/columns/water")
        by_name = {o["name"]: o for o in doc["owners"]}
        assert by_name["b"]["rows"] == 5 and by_name["a"]["rows"] == 4
        assert doc["keys_agree"] is False

        # An absent column: owners listed, nothing held.
        status, doc = await a.call("GET", "/v1/columns/0x1")
        assert status == 200 and all(o["rows"] == 0 for o in doc["owners"])
        for bad in ("9" * 30, "%20"):
            status, doc = await a.call("GET", f"/v1/columns/{bad}")
            assert status == 400, doc

        # giaannctl, table and --json (the blocking client runs off the event loop).
        host, port = c.daemon.admin_address  # type: ignore[misc]
        base = ["--addr", f"http://{host}:{port}", "--token-file", str(c.config.data_path("admin.token"))]
        capsys.readouterr()
        assert await asyncio.to_thread(ctl.main, [*base, "column", "info", "water"]) == 0
        text = capsys.readouterr().out
        assert "keys_agree: no" in text and "KEYS_DIGEST" in text and "\n  a " in text
        assert await asyncio.to_thread(ctl.main, [*base, "--json", "column", "info", "water"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert {o["name"]: o["rows"] for o in out["owners"]} == {"a": 4, "b": 5}

        # b leaves: it stays in the placement (the storage ring keeps it; only a decommission
        # removes it), down; a is the only live owner, so there is nothing to compare.
        await b.stop()
        started.remove(b)

        async def a_sees_b_gone() -> bool:
            return not a.runtime.topology.is_live("b")
        await wait_async(a_sees_b_gone, "b left")
        status, doc = await a.call("GET", "/v1/columns/water")
        assert status == 200 and {o["name"]: o["live"] for o in doc["owners"]} == \
            {"a": True, "b": False}, doc
        assert next(o for o in doc["owners"] if o["name"] == "a")["rows"] == 4
        assert doc["keys_agree"] is None
    finally:
        for node in reversed(started):
            await node.stop()
