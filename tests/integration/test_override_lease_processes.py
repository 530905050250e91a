"""Override leases across real ``giaannd`` processes (giaannd/services/override_lease.py).

A topology operation's coordinator sets a placement override on the compute nodes at its cutover
(``SetOverride``). Before leases, a coordinator killed in the cutover left that override in force
on every node it had switched for as long as they ran: writers kept a placement no ring holds.
Here the test process plays that coordinator: it sends a compute daemon the override a join of a
standby ``storage-3`` would send, with the lease naming ``storage-3``, then kills ``storage-3``
with SIGKILL; the compute daemon drops the override once membership declares the coordinator
dead. And an override whose lease names a live node that runs no such operation (a coordinator
restarted since) is dropped too, while one without a lease stays.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from giaannd import protocol as p
from giaannd.client.ring_calls import set_override
from giaannd.cluster.view import StorageNode
from giaannd.sdk.local_cluster import LocalCluster, Node
from peers.keyring import Keyring
from peers.transport import Identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
WAIT_S = 90.0


def _wait(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.2)


def _override_on(node: Node) -> bool:
    return bool(node.status()["services"]["runtime"]["ring"]["override"])


def _address(node: Node) -> str:
    return str(node.status()["services"]["runtime"]["advertised"]["tcp"])


def _send(cluster: LocalCluster, to: Node, members: list[StorageNode], lease: p.OverrideLease | None) -> None:
    identity = Identity("test-coordinator", "giaann-local", Keyring.load(cluster.key_file).keys)
    asyncio.run(set_override({}, identity, _address(to), members, flush=True, timeout_s=10.0, lease=lease))


def test_an_override_outlives_neither_its_coordinator_nor_its_operation(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", storage=2, compute=1, transport="tcp")
    try:
        cluster.start()
        compute, s1, s2 = cluster.node("compute-1"), cluster.node("storage-1"), cluster.node("storage-2")
        joiner = cluster.add_node("storage-3", ["storage"], join_mode="manual")
        cluster.wait_converged()
        after_join = [StorageNode(n.name, _address(n)) for n in (s1, s2, joiner)]

        # the coordinator (storage-3, the joining node) switched the writer, then died
        _send(cluster, compute, after_join, p.OverrideLease("storage-3", "join:test-cutover"))
        assert _override_on(compute)
        lease = compute.status()["services"]["membership"]["override_lease"]["lease"]
        assert lease == {"coordinator": "storage-3", "op_id": "join:test-cutover"}
        assert compute.admin.json("GET", "/v1/ring")["override_lease"] == lease
        cluster.kill(joiner)
        _wait(lambda: not _override_on(compute), "compute-1 dropped the dead coordinator's override")
        health = compute.status()["services"]["membership"]["override_lease"]
        assert health["dropped"] == 1 and "storage-3" in health["last_drop"], health

        # a live coordinator that runs no such operation (it restarted since): dropped too
        _send(cluster, compute, after_join, p.OverrideLease("storage-1", "join:not-running"))
        assert _override_on(compute)
        _wait(lambda: not _override_on(compute), "compute-1 dropped an override of no running operation")
        health = compute.status()["services"]["membership"]["override_lease"]
        assert health["dropped"] == 2 and "no such operation" in health["last_drop"], health

        # without a lease (a coordinator that predates leases) the override stays until cleared
        _send(cluster, compute, after_join, None)
        checks = health["checks"]
        time.sleep(12)  # (two lease checks)
        assert _override_on(compute)
        assert compute.status()["services"]["membership"]["override_lease"]["checks"] == checks
    finally:
        cluster.kill_all()
