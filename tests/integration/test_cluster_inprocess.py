"""Two daemons in one process (runtime + membership + storage, as ``giaannd`` wires them): join
through the admin API, key rotation over live gossip, drain, leave, metrics, bad input.

Real sockets on loopback with OS-chosen ports; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest

from giaannd.client.storage_client import RemoteUnavailable
from giaannd.config import ClusterConfig, Config, TransportConfig
from giaannd.daemon import Daemon, build_role_services
from giaannd.model.ids import parse_column
from giaannd.protocol import BatchId
from giaannd.runtime.node import NodeRuntime
from giaannd.services.membership import MembershipService, key_id, parse_seed
from peers.keyring import Keyring
from tools.cluster_harness import make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
WAIT_S = 15.0


class Node:
    def __init__(self, root: Path, name: str, key_file: str, seeds: list[str]) -> None:
        base = Config.loopback(str(root / name), name=name, roles=["storage"])
        self.config = msgspec.structs.replace(
            base, cluster=ClusterConfig(name="inproc", key_file=key_file, seeds=seeds),
            transport=TransportConfig(bind=["tcp://127.0.0.1:0"]),
            # each starts as its own one-node cluster; joining merges the storage rings
            storage=msgspec.structs.replace(base.storage, join_mode="bootstrap"))
        self.runtime = NodeRuntime(self.config)
        self.membership = MembershipService(self.runtime)
        roles, unavailable = build_role_services(self.config, self.runtime)
        assert not unavailable
        self.daemon = Daemon(self.config, [self.runtime, self.membership, *roles],
                             handle_signals=False, runtime=self.runtime)
        self.task: asyncio.Task[int] | None = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.daemon.run())
        await wait_for(lambda: self.daemon.state == "running" or self.task.done(), "ready")
        assert self.daemon.state == "running", self.task.exception() if self.task.done() else None
        token = self.config.data_path("admin.token").read_text().strip()
        self.session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"})

    @property
    def gossip_addr(self) -> str:
        assert self.membership.node is not None
        host, port = self.membership.node.addr
        return f"{host}:{port}"

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert self.session is not None and self.daemon.admin_address is not None
        host, port = self.daemon.admin_address
        async with self.session.request(method, f"http://{host}:{port}{path}",
                                        json=body) as resp:
            return resp.status, json.loads(await resp.read()) if resp.content_type == \
                "application/json" else await resp.text()

    async def members(self) -> dict[str, dict[str, Any]]:
        status, doc = await self.call("GET", "/v1/members")
        assert status == 200, doc
        return {m["name"]: m for m in doc["members"]}

    async def stop(self) -> int | None:
        if self.session is not None:
            await self.session.close()
        if self.task is None:
            return None
        self.daemon.request_stop("test over")
        async with asyncio.timeout(WAIT_S):
            return await self.task


async def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


async def wait_async(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not await predicate():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}") from None


@asynccontextmanager
async def pair(tmp_path: Path, key_file: str = "") -> AsyncIterator[tuple[Node, Node]]:
    if key_file == "":
        key_file = str(tmp_path / "cluster.key")
        Keyring.generate().save(key_file)
    a = Node(tmp_path, "a", key_file if key_file != "none" else "", [])
    b: Node | None = None
    try:
        await a.start()
        b = Node(tmp_path, "b", key_file if key_file != "none" else "", [])
        await b.start()
        yield a, b
    finally:
        for node in (b, a):
            if node is not None:
                await node.stop()


@pytest.mark.asyncio
async def test_cluster_inprocess_join_ring_keys_drain_leave(tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b):
        status, doc = await b.call("POST", "/v1/node/join", {"seeds": [a.gossip_addr]})
        assert status == 200 and doc["joined"] and doc["seeds_answered"] == 1, doc

        async def both_see_both() -> bool:
            views = [set(await n.members()) for n in (a, b)]
            return all(v == {"a", "b"} for v in views)
        await wait_async(both_see_both, "join converged")
        row = (await a.members())["b"]
        assert row["roles"] == "storage" and row["data_plane"].startswith("tcp://127.0.0.1:")
        assert row["status"] == "alive"

        async def rings_agree() -> bool:  # ring sync pulls on the digest mismatch
            docs = [(await n.call("GET", "/v1/ring"))[1] for n in (a, b)]
            return all([m["name"] for m in d["members"]] == ["a", "b"] for d in docs) and \
                docs[0]["ring"]["digest"] == docs[1]["ring"]["digest"]
        await wait_async(rings_agree, "storage rings merged")
        _, ring = await a.call("GET", "/v1/ring")
        assert ring["ring"]["active"] == ["a", "b"] and ring["ring"]["removed"] == []
        assert [(e["name"], e["state"], e["stamp"]) for e in ring["ring_entries"]] == \
            [("a", "active", 1), ("b", "active", 1)]
        assert ring["override"] is None and ring["standby"] == []
        owners = [(await n.call("GET", "/v1/ring/owners/water"))[1] for n in (a, b)]
        assert owners[0]["owners"] == owners[1]["owners"] and owners[0]["epoch"]

        # Key rotation on both nodes, gossip keeps flowing at every step.
        new = Keyring.generate().primary
        for node in (a, b):
            assert (await node.call("POST", "/v1/keys", {"key": Keyring.encode_key(new)}))[0] == 200
        for node in (a, b):
            status, doc = await node.call("POST", f"/v1/keys/{key_id(new)}/use")
            assert status == 200 and doc["primary"] == key_id(new)
        _, keys = await a.call("GET", "/v1/keys")
        old = next(k["id"] for k in keys["keys"] if not k["primary"])
        status, doc = await a.call("DELETE", f"/v1/keys/{key_id(new)}")
        assert status == 409 and "primary" in doc["error"]  # the key in use cannot go
        for node in (a, b):
            assert (await node.call("DELETE", f"/v1/keys/{old}"))[0] == 200
            saved = Keyring.load(node.config.cluster.key_file)
            assert saved.keys == (new,)
        await asyncio.sleep(1.0)  # several loopback probe rounds sealed with the new key
        assert (await a.members())["b"]["status"] == "alive"
        assert (await b.members())["a"]["status"] == "alive"

        # Drain: b refuses writes (typed Unavailable), and gossips that it is full.
        status, doc = await b.call("POST", "/v1/node/drain")
        assert status == 200 and doc["draining"]

        async def a_sees_b_full() -> bool:
            return bool((await a.members())["b"]["full"])
        await wait_async(a_sees_b_full, "drain gossiped")
        client = a.runtime.storage_client(request_timeout_s=5.0)
        column = np.array([parse_column("water")[0]], np.uint64)
        batch = make_batch(np.random.default_rng(1), 1, columns=column)
        with pytest.raises(RemoteUnavailable, match="draining"):
            await client.apply_to("b", BatchId(7, 1), batch)
        # The hook membership calls on MemberFailed: a's connection to b fails at once.
        assert a.runtime.fail_peer(b.runtime.node_id, "test") == 1
        assert a.runtime.fail_peer(b.runtime.node_id, "test") == 0  # already closed

        # Leave: b's daemon stops cleanly; a records the leave.
        status, doc = await b.call("POST", "/v1/node/leave")
        assert status == 200 and doc["leaving"]
        assert b.task is not None
        async with asyncio.timeout(WAIT_S):
            assert await asyncio.shield(b.task) == 0

        async def a_sees_b_left() -> bool:
            return (await a.members())["b"]["status"] == "left"
        await wait_async(a_sees_b_left, "leave seen")

        status, metrics = await a.call("GET", "/metrics")
        assert "giaannd_membership_members_live" in metrics
        assert "giaannd_transport_sent_bytes_total" in metrics


@pytest.mark.asyncio
async def test_cluster_inprocess_bad_requests_and_unkeyed_cluster(tmp_path: Path) -> None:
    async with pair(tmp_path, key_file="none") as (a, _b):
        for body in (None, {"seeds": []}, {"seeds": "x:1"}, {"seeds": ["nohost"]},
                     {"seeds": ["h:99999"]}):
            status, doc = await a.call("POST", "/v1/node/join", body)
            assert status == 400, (body, doc)
        status, doc = await a.call("POST", "/v1/keys", {"key": Keyring.encode_key(b"k" * 32)})
        assert status == 409 and doc["code"] == "no_key_file"
        status, doc = await a.call("GET", "/v1/keys")
        assert status == 200 and len(doc["keys"]) == 1 and "none" in doc["file"]
        status, doc = await a.call("GET", "/v1/ring/owners/" + "9" * 30)
        assert status == 400 and "64-bit" in doc["error"]
        status, doc = await a.call("GET", "/v1/ring")
        assert status == 200 and [m["name"] for m in doc["members"]] == ["a"]


def test_cluster_parse_seed_and_column() -> None:
    assert parse_seed("127.0.0.1:7946") == ("127.0.0.1", 7946)
    assert parse_seed("[::1]:7946") == ("::1", 7946)
    # "host:٣": a non-ASCII digit, which int() reads as 3 (a join to port 3)
    for bad in ("7946", "host:", ":7946", "host:0", "host:70000", "host:x", "host:\u0663", "host:\uff17946"):
        with pytest.raises(ValueError):
            parse_seed(bad)
    assert parse_column("42") == (42, "id")
    assert parse_column("0x2a") == (42, "id")
    assert parse_column("Water") == parse_column("water")
    assert parse_column("water")[1] == "word"
    with pytest.raises(ValueError):
        parse_column(str(1 << 64))


@pytest.mark.asyncio
async def test_cluster_inprocess_one_node_with_both_roles_trains_and_evaluates(
        tmp_path: Path) -> None:
    """roles = ["storage", "compute"]: compute writes to and reads from the storage role of its
    own node through the runtime's one transport and topology (R = 1)."""
    from giaannd.sdk.local_cluster import split_corpus

    node = Node(tmp_path, "both", "", [])
    node.config = msgspec.structs.replace(
        node.config, node=msgspec.structs.replace(node.config.node,
                                                  roles=["storage", "compute"]))
    # the default compute.corpus-dir: <data-dir>/corpora
    train, held, _, _ = split_corpus(node.config.data_path("corpora"), 60, 15)
    node.runtime = NodeRuntime(node.config)
    node.membership = MembershipService(node.runtime)
    roles, unavailable = build_role_services(node.config, node.runtime)
    assert [r.name for r in roles] == ["storage", "compute"] and not unavailable
    node.daemon = Daemon(node.config, [node.runtime, node.membership, *roles],
                         handle_signals=False, runtime=node.runtime)
    try:
        await node.start()
        status, job = await node.call("POST", "/v1/train", {"corpus": str(train)})
        assert status == 200, job

        async def done() -> bool:
            _, doc = await node.call("GET", f"/v1/jobs/{job['job_id']}")
            return doc["state"] in ("succeeded", "failed")
        await wait_async(done, "training job ends", timeout_s=60)
        _, doc = await node.call("GET", f"/v1/jobs/{job['job_id']}")
        assert doc["state"] == "succeeded" and doc["trained"] > 0, doc
        _, health = await node.call("GET", "/v1/status")
        assert health["services"]["storage"]["rows"] > 0
        status, ev = await node.call("POST", "/v1/eval", {"corpus": str(held)})
        assert status == 200 and ev["prediction_tokens"] > 0, ev
    finally:
        assert await node.stop() == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(("change", "path"), [
    ({"cluster": ClusterConfig(key_file="/nonexistent/cluster.key")}, "$.cluster.key-file"),
    ({"cluster": ClusterConfig(seeds=["no-port"])}, "$.cluster.seeds"),
    ({"transport": TransportConfig(bind=["tcp://0.0.0.0:0"])}, "$.transport.advertise"),
    ({"transport": TransportConfig(bind=["tcp://127.0.0.1:0"], advertise=["ucx://h:1"])},
     "$.transport.advertise"),
    ({"transport": TransportConfig(bind=["udp://127.0.0.1:0"])}, "$.transport.bind"),
])
async def test_cluster_inprocess_bad_node_config_is_a_config_error(
        tmp_path: Path, change: dict[str, Any], path: str) -> None:
    from giaannd.errors import ConfigError

    cfg = msgspec.structs.replace(Config.loopback(str(tmp_path / "n"), name="n",
                                                  roles=["storage"]), **change)
    runtime = NodeRuntime(cfg)
    daemon = Daemon(cfg, [runtime, MembershipService(runtime)], handle_signals=False,
                    runtime=runtime)
    with pytest.raises(ConfigError) as info:
        async with asyncio.timeout(WAIT_S):
            await daemon.run()
    assert info.value.path == path and info.value.exit_code == 2
