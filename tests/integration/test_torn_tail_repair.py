"""A replica whose update log lost acknowledged bytes repairs itself (issue 16 item 7).

Three storage daemons in one process (runtime + membership + storage, as ``giaannd`` wires them),
replication factor 3: batches are written, one node crashes (no final snapshot), the tail of its
last log segment is cut in the middle of a record, and it is restarted. Recovery cuts the torn
record; the node must then repair the affected ranges from its peers by itself once it has joined,
say so in ``/v1/status`` (``torn_tail_bytes``, ``auto_repair``) and in metrics, and end up holding
the same rows as the others. Real sockets on loopback; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from giaannd.config import ClusterConfig, Config, TransportConfig
from giaannd.daemon import Daemon, build_role_services
from giaannd.runtime.node import NodeRuntime
from giaannd.services.membership import MembershipService
from giaannd.storage.engine.update_log import LOG_RECORD, list_segments
from peers.keyring import Keyring
from tools.cluster_harness import make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WAIT_S = 60.0
COLUMNS = np.random.default_rng(16).integers(1, 2**63, 12, dtype=np.uint64)


class Node:
    """One daemon with the storage role, in this process."""

    def __init__(self, root: Path, name: str, key_file: str, seeds: list[str]) -> None:
        base = Config.loopback(str(root / name), name=name, roles=["storage"])
        self.config = msgspec.structs.replace(
            base, cluster=ClusterConfig(name="torn", key_file=key_file, seeds=seeds),
            transport=TransportConfig(bind=["tcp://127.0.0.1:0"]),
            storage=msgspec.structs.replace(base.storage, replication_factor=3, write_quorum=2,
                                            join_mode="bootstrap", retry_base_s=0.2, retry_cap_s=1.0))
        self.runtime = NodeRuntime(self.config)
        self.membership = MembershipService(self.runtime)
        roles, unavailable = build_role_services(self.config, self.runtime)
        assert not unavailable
        self.daemon = Daemon(self.config, [self.runtime, self.membership, *roles], handle_signals=False,
                             runtime=self.runtime)
        self.task: asyncio.Task[int] | None = None

    async def start(self) -> Node:
        self.task = asyncio.create_task(self.daemon.run())
        await wait_until(lambda: self.daemon.state != "starting" or self.task.done(), "started")
        assert self.daemon.state == "running", self.task.exception() if self.task.done() else None
        return self

    @property
    def gossip_addr(self) -> str:
        assert self.membership.node is not None
        host, port = self.membership.node.addr
        return f"{host}:{port}"

    def storage(self) -> dict[str, Any]:
        return dict(self.daemon.status()["services"]["storage"])

    async def stop(self) -> int:
        assert self.task is not None
        self.daemon.request_stop("test over")
        async with asyncio.timeout(WAIT_S):
            return await asyncio.shield(self.task)


async def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            while not (value := predicate()):
                await asyncio.sleep(0.05)
            return value
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}") from None


def cut_last_segment_mid_record(store_dir: Path) -> tuple[int, int]:
    """Truncate the last non-empty log segment inside its middle record; returns (records cut,
    bytes cut)."""
    segments = [path for _, path in list_segments(store_dir) if path.stat().st_size]
    path = segments[-1]
    data = path.read_bytes()
    records = list(LOG_RECORD.scan(data, torn_tail=False))
    assert len(records) >= 4, len(records)
    victim = records[len(records) // 2]
    cut = victim.header.offset + victim.header.header_bytes + 5
    with open(path, "r+b") as f:
        f.truncate(cut)
    return len(records) - len(records) // 2, len(data) - cut


async def replicas_agree(node: Node) -> list[str]:
    """Columns whose live replicas disagree (ColumnInfo digests over the data plane)."""
    client = node.runtime.storage_client(request_timeout_s=5.0)
    bad = []
    for column in COLUMNS.tolist():
        report = await client.column_info(column)
        live = [r for r in report.replicas if r.live and r.error is None]
        if len(live) != 3 or not (report.keys_agree and report.strength_agree):
            bad.append(f"{column:#x}: {[(r.node, r.rows, r.error) for r in report.replicas]}")
    return bad


@pytest.mark.asyncio
async def test_torn_tail_of_acknowledged_records_is_repaired_by_the_node_itself(tmp_path: Path) -> None:
    key_file = str(tmp_path / "cluster.key")
    Keyring.generate().save(key_file)
    nodes: dict[str, Node] = {}
    try:
        nodes["a"] = await Node(tmp_path, "a", key_file, []).start()
        for name in ("b", "c"):
            nodes[name] = await Node(tmp_path, name, key_file, [nodes["a"].gossip_addr]).start()
        await wait_until(lambda: all(len(n.runtime.ring.active()) == 3 and len(n.runtime.topology.live()) == 3
                                     for n in nodes.values()), "ring of three, all live")

        writer = nodes["a"].runtime.storage_client(request_timeout_s=5.0)
        rng = np.random.default_rng(5)
        for _ in range(40):
            await writer.write(make_batch(rng, 6, 4, rng.choice(COLUMNS, 6)))
        await writer.flush()
        assert await replicas_agree(nodes["a"]) == []

        # c "crashes": its store directory as it is now (every write synced, no final snapshot)
        # is what it restarts with
        store_dir = tmp_path / "c" / "storage" / "store"
        shutil.copytree(store_dir, tmp_path / "c-store-at-crash")
        assert await nodes["c"].stop() == 0
        shutil.rmtree(store_dir)
        shutil.move(tmp_path / "c-store-at-crash", store_dir)
        records_cut, bytes_cut = cut_last_segment_mid_record(store_dir)
        assert records_cut >= 2 and bytes_cut > 0

        nodes["c"] = await Node(tmp_path, "c", key_file, [nodes["a"].gossip_addr]).start()
        c = nodes["c"]
        await wait_until(lambda: len(c.runtime.topology.live()) == 3, "c sees all three live")
        assert c.storage()["torn_tail_bytes"] > 0
        done = await wait_until(lambda: c.storage().get("auto_repair", {}).get("state") in ("done", "failed"),
                                "automatic repair finished")
        repair = c.storage()["auto_repair"]
        assert done and repair["state"] == "done", repair
        assert repair["result"]["batches_shipped"] > 0 and not repair["result"]["peers_failed"], repair
        assert await replicas_agree(c) == []
        metrics = c.daemon.metrics.render().decode()
        assert "giaannd_storage_torn_tail_bytes" in metrics
        assert 'giaannd_storage_auto_repair{state="done"} 1.0' in metrics
        # the others recovered cleanly: nothing to repair there
        assert "auto_repair" not in nodes["a"].storage() and nodes["a"].storage()["torn_tail_bytes"] == 0
    finally:
        for node in reversed(list(nodes.values())):
            if node.task is not None and not node.task.done():
                await node.stop()
