"""Every declared admin operation is served by the service that declares it, and only there
(giaannd/operations.py): in-process daemons wired as ``giaannd`` wires them (runtime, membership,
one role each). Each route is requested over HTTP; requests that would change something get a body
that is not JSON (refused with 400 by the handler, which is what reached means here), and
``node leave`` goes last. Real loopback sockets; every wait is bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import pytest

from giaannd.operations import OPERATIONS, Operation, fill_path, path_params
from peers.keyring import Keyring
from tests.integration.test_column_info_inprocess import RoleNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROUTES = [op for op in OPERATIONS.values() if op.path is not None and op.id != "node.leave"]


async def _probe(node: RoleNode, op: Operation) -> tuple[int, object]:
    """Request ``op``'s route as an operator would reach it, but with a garbage body."""
    assert node.session is not None and node.daemon.admin_address is not None and op.path is not None
    host, port = node.daemon.admin_address
    url = f"http://{host}:{port}" + fill_path(op.path, {p: "x" for p in path_params(op.path)})
    async with node.session.request(op.method or "GET", url, data=b"{not json",
                                    headers={"Content-Type": "application/json"}) as resp:
        body = await resp.json() if resp.content_type == "application/json" else await resp.text()
        return resp.status, body


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ["storage", "compute"])
async def test_operations_each_route_is_served_by_its_service_only(
        tmp_path: Path, role: Literal["storage", "compute"]) -> None:
    key_file = str(tmp_path / "cluster.key")
    Keyring.generate().save(key_file)
    node = RoleNode(tmp_path, role, key_file, [role])
    await node.start()
    try:
        running = {"admin", "membership", role}
        for op in ROUTES:
            status, body = await _probe(node, op)
            served = not (status == 404 and isinstance(body, dict) and body.get("code") == "not_served")
            assert served == (op.service in running), (op.id, status, body)
            assert status not in (405, 500), (op.id, status, body)
            if not served:
                assert f"the {op.service} service is not running here" in str(body), body
        assert await node.call("POST", "/v1/node/leave") == (200, {"leaving": True, "node": role})
        assert node.task is not None
        async with asyncio.timeout(30):
            assert await node.task == 0  # leave stops the daemon, cleanly
    finally:
        await node.stop()
