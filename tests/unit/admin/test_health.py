"""``GET /v1/health`` (issue 18.4): tokenless from any address, 200 only when ready; every other
``/v1/`` route still needs the token from a remote address. The AdminApi dispatch is fed mocked
requests from a non-loopback peer (no sockets: the unit tier)."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from giaannd.admin.api import AdminApi, health_of
from giaannd.metrics import Metrics
from giaannd.operations import OPERATIONS

REMOTE = ("192.0.2.7", 40000)  # TEST-NET-1: never loopback


def _request(method: str, path: str, peer: tuple[str, int], token: str | None = None) -> Any:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: peer if name == "peername" else default
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return make_mocked_request(method, path, headers=headers, transport=transport)


@pytest.mark.parametrize(("status", "readiness"), [
    ({"state": "starting"}, "starting"), ({"state": "running"}, "ready"),
    ({"state": "running", "draining": False}, "ready"), ({"state": "running", "draining": True}, "draining"),
    ({"state": "stopping"}, "draining"), ({"state": "stopped"}, "draining"), ({}, "draining"),
])
def test_health_of_the_status_document(status: dict[str, Any], readiness: str) -> None:
    assert health_of(status) == readiness


@pytest.mark.asyncio
@pytest.mark.parametrize(("state", "draining", "code", "answer"), [
    ("running", False, 200, "ready"), ("starting", False, 503, "starting"),
    ("running", True, 503, "draining"), ("stopping", False, 503, "draining"),
])
async def test_health_is_tokenless_from_any_address(state: str, draining: bool, code: int, answer: str) -> None:
    api = AdminApi(token="secret", metrics=Metrics(), status=lambda: {"state": state, "draining": draining})
    for peer in (REMOTE, ("127.0.0.1", 40000)):
        for method in ("GET", "HEAD"):
            response = await api._dispatch(_request(method, "/v1/health", peer))
            assert response.status == code
        response = await api._dispatch(_request("GET", "/v1/health", peer))
        assert json.loads(response.body) == {"status": answer}  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_health_leaves_every_other_route_behind_the_token() -> None:
    api = AdminApi(token="secret", metrics=Metrics(), status=lambda: {"state": "running"})
    assert [op.id for op in OPERATIONS.values() if op.public] == ["node.health"]
    for path in ("/v1/status", "/v1/members", "/metrics", "/", "/v1/nosuch", "/v1/health/x", "/v1/healthz"):
        assert (await api._dispatch(_request("GET", path, REMOTE))).status == 401, path
    assert (await api._dispatch(_request("POST", "/v1/health", REMOTE))).status == 401
    assert (await api._dispatch(_request("GET", "/v1/status", REMOTE, "secret"))).status == 200
