"""The topology verbs on the admin API (handlers called as the AdminApi would call them)."""

import asyncio

import numpy as np
import pytest

from giaannd.errors import AdminHTTPError
from giaannd.operations import OPERATIONS, match_path, split_path
from giaannd.storage.rebalance.operations import OperationRegistry
from giaannd.storage.rebalance.routes import register_admin_routes
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(40).integers(1, 2**63, 60, dtype=np.uint64)


class FakeAdmin:
    """Routes like the AdminApi: operations bound by id, a request matched to the templates."""

    def __init__(self):
        self.routes = {}

    def bind(self, op_id, handler):
        op = OPERATIONS[op_id]
        self.routes[(op.method, op.path)] = handler

    async def call(self, method, path, body=None):
        for (m, template), handler in self.routes.items():
            params = match_path(split_path(template), split_path(path))
            if m == method and params is not None:
                return await handler(FakeRequest(body), params)
        raise AdminHTTPError(404, f"this node does not serve {path}", "not_served")


class FakeRequest:
    def __init__(self, body):
        self.body = body
        self.body_exists = body is not None

    async def json(self):
        if isinstance(self.body, str):
            raise ValueError("not json")
        return self.body


async def test_topology_admin_removenode_repair_and_errors(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        admin = FakeAdmin()
        register_admin_routes(admin, cluster.control())
        await cluster.write_many(np.random.default_rng(1), 30, COLUMNS)
        with pytest.raises(AdminHTTPError) as err:
            await admin.call("GET", "/v1/node/topology")
        assert err.value.status == 404
        with pytest.raises(AdminHTTPError) as err:
            await admin.call("POST", "/v1/node/removenode", {"node_id": "s1"})
        assert err.value.status == 409  # alive
        with pytest.raises(AdminHTTPError) as err:
            await admin.call("POST", "/v1/node/removenode", {"node_id": "nope"})
        assert err.value.status == 404
        with pytest.raises(AdminHTTPError) as err:
            await admin.call("POST", "/v1/node/removenode", "{garbage")
        assert err.value.status == 400
        with pytest.raises(AdminHTTPError) as err:
            await admin.call("POST", "/v1/node/decommission")
        assert err.value.status == 404  # this (client) view is not a storage member
        await cluster.kill("s2")
        started = await admin.call("POST", "/v1/node/removenode", {"node_id": "s2"})
        again = await admin.call("POST", "/v1/node/removenode", {"node_id": "s2"})
        assert started["op"] == again["op"] == "removenode"
        async with asyncio.timeout(30):
            while (await admin.call("GET", "/v1/node/topology"))["state"] != "done":
                await asyncio.sleep(0.02)
        assert "s2" not in cluster.client_topology.names
        report = await admin.call("POST", "/v1/node/repair")
        assert report["rows_divergent"] == [] and report["batches_shipped"] == 0
        assert cluster.mismatches() == []
        rate = await admin.call("POST", "/v1/node/topology/rate", {"rate_bytes_s": 5})
        assert rate["state"] == "done"
        with pytest.raises(AdminHTTPError):
            await admin.call("POST", "/v1/node/topology/explode", None)
    finally:
        await cluster.close()


class StubOp:
    """The registry's current operation, recording what the action verbs did to it."""

    def __init__(self):
        self.calls = []

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def cancel(self):
        self.calls.append("cancel")

    def set_rate(self, rate):
        self.calls.append(("rate", rate))

    def progress(self):
        return {"calls": list(self.calls)}


async def test_topology_admin_actions_act_on_the_current_operation():
    admin, registry = FakeAdmin(), OperationRegistry()
    register_admin_routes(admin, control=None, registry=registry)
    with pytest.raises(AdminHTTPError) as err:
        await admin.call("POST", "/v1/node/topology/pause")
    assert err.value.status == 404 and err.value.code == "not_found"
    registry.current = StubOp()
    for action in ("pause", "resume", "cancel"):
        await admin.call("POST", f"/v1/node/topology/{action}")
    assert await admin.call("POST", "/v1/node/topology/rate", {"rate_bytes_s": None}) == {
        "calls": ["pause", "resume", "cancel", ("rate", None)]}
    with pytest.raises(AdminHTTPError) as err:
        await admin.call("POST", "/v1/node/topology/rate", {"rate_bytes_s": "fast"})
    assert err.value.status == 400
