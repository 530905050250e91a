"""The topology verbs on the admin API (handlers called as the AdminApi would call them)."""

import asyncio

import numpy as np
import pytest

from giaannd.errors import AdminHTTPError
from giaannd.storage.rebalance.routes import register_admin_routes
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(40).integers(1, 2**63, 60, dtype=np.uint64)


class FakeAdmin:
    def __init__(self):
        self.routes = {}

    def add_route(self, method, path, handler, **kw):
        self.routes[(method, path)] = handler

    async def call(self, method, path, body=None, **params):
        return await self.routes[(method, path)](FakeRequest(body), params)


class FakeRequest:
    def __init__(self, body):
        self.body = body
        self.can_read_body = body is not None

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
        rate = await admin.call("POST", "/v1/node/topology/{action}", {"rate_bytes_s": 5}, action="rate")
        assert rate["state"] == "done"
        with pytest.raises(AdminHTTPError):
            await admin.call("POST", "/v1/node/topology/{action}", None, action="explode")
    finally:
        await cluster.close()
