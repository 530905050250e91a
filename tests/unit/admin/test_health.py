"""``GET /v1/health`` (issue 18.4): tokenless from any address, 200 only when ready; every other
``/v1/`` route still needs the token from a remote address. The AdminApi dispatch is fed mocked
requests from a non-loopback peer (no sockets: the unit tier). Then bad input of every kind, to the
API and to the handlers the roles bind: a 4xx with a message, never a 500."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from giaannd.admin.api import AdminApi, health_of
from giaannd.compute.routes import ComputeRoutes
from giaannd.metrics import Metrics
from giaannd.operations import OPERATIONS
from giaannd.services.membership import MembershipService
from giaannd.storage.rebalance.operations import OperationRegistry
from giaannd.storage.rebalance.routes import register_admin_routes

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


# -- bad input of every kind gets a 4xx with a message, never a 500 ---------------------------
# The AdminApi's own checks (token, path, body read) and the body parsing of the handlers the
# roles bind (membership, storage topology, compute), fed mocked requests as above.

TOKEN = "secret"


def _post(path: str, body: bytes, headers: dict[str, str] | None = None,
          error: BaseException | None = None) -> Any:
    """A POST from loopback with the right token and ``body`` (or a body that fails with ``error``,
    as aiohttp's payload does when the client goes away)."""
    transport = mock.Mock()
    transport.get_extra_info.side_effect = (lambda name, default=None:
                                            ("127.0.0.1", 40000) if name == "peername" else default)
    payload = StreamReader(mock.Mock(_reading_paused=False), 2 ** 16, loop=asyncio.get_running_loop())
    if error is not None:
        payload.set_exception(error)
    else:
        payload.feed_data(body)
        payload.feed_eof()
    return make_mocked_request("POST", path, transport=transport, payload=payload,
                               headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
                                        "Content-Length": str(len(body)), **(headers or {})})


async def _answer(api: AdminApi, request: Any) -> tuple[int, dict[str, Any]]:
    response = await api._dispatch(request)
    return response.status, json.loads(response.body)  # type: ignore[attr-defined]


class _Op:
    """The running topology operation, as the rate route sees it."""

    def __init__(self) -> None:
        self.rates: list[float | None] = []

    def set_rate(self, rate: float | None) -> None:
        self.rates.append(rate)

    def progress(self) -> dict[str, Any]:
        return {"rate": self.rates[-1] if self.rates else None}


class _Node:
    """A membership node that records joins."""

    addr = ("127.0.0.1", 7946)

    def __init__(self) -> None:
        self.joins: list[Any] = []

    async def join(self, seeds: Any) -> int:
        self.joins.append(seeds)
        return 1

    def members(self) -> list[Any]:
        return []


def _api_with_roles(tmp_path: Path) -> tuple[AdminApi, _Op, _Node, ComputeRoutes]:
    """An AdminApi with the membership, topology and compute handlers bound (on fakes)."""
    api = AdminApi(token=TOKEN, metrics=Metrics(), status=lambda: {"state": "running"})
    op, node = _Op(), _Node()
    registry = OperationRegistry()
    registry.current = op  # type: ignore[assignment]
    register_admin_routes(api, mock.Mock(), registry)
    membership = MembershipService(mock.Mock())
    membership.node = node  # type: ignore[assignment]
    membership._bind(SimpleNamespace(admin=api))  # type: ignore[arg-type]
    service = SimpleNamespace(corpus_dir=tmp_path, export_dir=tmp_path, data_dir=tmp_path,
                              settings=SimpleNamespace(cluster_jobs=False))
    compute = ComputeRoutes(service)  # type: ignore[arg-type]
    compute.register(api)
    return api, op, node, compute


async def _exchange(api: AdminApi, request: bytes) -> tuple[int, dict[str, Any]]:
    """``request`` (raw bytes, ``Connection: close``) sent to ``api`` served on loopback."""
    host, port = await api.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(), 30)  # the server closes the connection
        writer.close()
    finally:
        await api.stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", [b"/v1/status", b"/v1/nosuch"])
async def test_admin_token_of_bytes_that_are_not_utf8_is_refused_not_a_500(path: bytes) -> None:
    api = AdminApi(token=TOKEN, metrics=Metrics(), status=lambda: {"state": "running"})
    status, doc = await _exchange(api, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n"
                                  b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
    assert (status, doc["code"]) == (401, "unauthorized")


@pytest.mark.asyncio
async def test_admin_path_parameter_with_an_encoded_slash_stays_one_segment() -> None:
    # fill_path sends a value (a base64 key, a concept word) as exactly one segment, "/" as %2F
    api = AdminApi(token=TOKEN, metrics=Metrics(), status=lambda: {"state": "running"})

    def echo(op_id: str) -> Any:
        async def handler(request: Any, params: Any) -> Any:
            return {"op": op_id, **params}
        return handler

    for op_id in ("ring.owners", "column.info", "column.rows", "keys.use"):
        api.bind(op_id, echo(op_id))
    for path, answer in [
        ("/v1/ring/owners/a%2Fb", {"op": "ring.owners", "column": "a/b"}),
        ("/v1/columns/x%2Frows", {"op": "column.info", "column": "x/rows"}),
        ("/v1/columns/x/rows", {"op": "column.rows", "column": "x"}),
        ("/v1/columns/caf%C3%A9", {"op": "column.info", "column": "café"}),
        ("/v1/keys/ab%2Bc%2Fd%3D/use", {"op": "keys.use", "key_id": "ab+c/d="}),
    ]:
        response = await api._dispatch(_request("GET" if "keys" not in path else "POST", path, REMOTE, TOKEN))
        assert (response.status, json.loads(response.body)) == (200, answer), path  # type: ignore[attr-defined]


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/node/join", "/v1/keys", "/v1/node/topology/rate", "/v1/train",
                                  "/v1/eval", "/v1/generate", "/v1/export"])
@pytest.mark.parametrize(("body", "headers"), [
    (b"{}", {"Content-Type": "application/json; charset=no-such-charset"}),  # LookupError
    (b"[" * 100_000 + b"]" * 100_000, {}),  # RecursionError
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, {}),
])
async def test_admin_bodies_that_do_not_decode_are_a_400(path: str, body: bytes, headers: dict[str, str],
                                                        tmp_path: Path) -> None:
    api, *_ = _api_with_roles(tmp_path)
    status, doc = await _answer(api, _post(path, body, headers))
    assert (status, doc["code"]) == (400, "bad_request"), doc
    assert "JSON" in doc["error"]


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/node/topology/rate", {"rate": 5}),  # a typo that would leave the streams unthrottled
    ("/v1/node/join", {"seeds": ["127.0.0.1:7000"], "seed": "x"}),
    ("/v1/keys", {"key": "x", "primary": True}),
    ("/v1/train", {"corpus": "c.conllu", "epoch": 3}),
    ("/v1/eval", {"limits": 5}),
    ("/v1/generate", {"prompt": "the cat", "max_token": 5}),
    ("/v1/export", {"path": "out.jsonl", "overwite": True}),
])
async def test_admin_unknown_body_fields_are_a_400_naming_them(path: str, body: dict[str, Any],
                                                              tmp_path: Path) -> None:
    api, op, node, _ = _api_with_roles(tmp_path)
    status, doc = await _answer(api, _post(path, json.dumps(body).encode()))
    assert (status, doc["code"]) == (400, "bad_request"), doc
    assert "unknown field" in doc["error"]
    assert op.rates == [] and node.joins == []  # nothing was done


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [b'{"rate_bytes_s": true}', b'{"rate_bytes_s": NaN}', b'{"rate_bytes_s": -1}',
                                  b'{"rate_bytes_s": 0}', b'{"rate_bytes_s": "fast"}'])
async def test_admin_topology_rate_must_be_a_positive_number(body: bytes, tmp_path: Path) -> None:
    api, op, _, _ = _api_with_roles(tmp_path)
    status, doc = await _answer(api, _post("/v1/node/topology/rate", body))
    assert (status, doc["code"]) == (400, "bad_request"), doc
    assert op.rates == []
    for good, rate in ((b'{"rate_bytes_s": 5}', 5), (b'{"rate_bytes_s": 2.5}', 2.5), (b'{"rate_bytes_s": null}', None)):
        assert await _answer(api, _post("/v1/node/topology/rate", good)) == (200, {"rate": rate})


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", ["node..example:7946", "a" * 64 + ".example:7946", "a\x00b:7946", "\udcff:7946"])
async def test_admin_join_refuses_a_seed_host_the_resolver_cannot_take(seed: str, tmp_path: Path) -> None:
    # such a host failed inside gossip's connect task (an unhandled exception in the log), so the
    # join waited for an answer that never came, until JOIN_TIMEOUT_S (60 s), then a 502
    api, _, node, _ = _api_with_roles(tmp_path)
    status, doc = await _answer(api, _post("/v1/node/join", json.dumps({"seeds": [seed]}).encode()))
    assert (status, doc["code"]) == (400, "bad_request"), doc
    assert node.joins == []
    assert await _answer(api, _post("/v1/node/join", b'{"seeds": ["[::1]:7946", "node-1.example:7946"]}')) == (
        200, {"joined": True, "seeds_answered": 1, "members": 0})


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "field"), [("/v1/train", "corpus"), ("/v1/eval", "corpus"),
                                             ("/v1/eval", "prompts"), ("/v1/export", "path")])
@pytest.mark.parametrize("value", ["a\x00b", "x" * 5000])
async def test_admin_paths_that_cannot_be_resolved_are_a_400(path: str, field: str, value: str,
                                                            tmp_path: Path) -> None:
    api, *_ = _api_with_roles(tmp_path)
    status, doc = await _answer(api, _post(path, json.dumps({field: value}).encode()))
    assert (status, doc["code"]) == (400, "bad_request"), doc


@pytest.mark.asyncio
async def test_admin_generate_prompt_over_the_taggers_length_is_a_400(tmp_path: Path) -> None:
    spacy = pytest.importorskip("spacy")
    api, _, _, compute = _api_with_roles(tmp_path)
    compute._nlp = spacy.blank("en")  # max_length 1,000,000 characters, as the English model's
    body = json.dumps({"prompt": "a " * 500_001}).encode()  # under admin.max-body-bytes (1 MiB)
    status, doc = await _answer(api, _post("/v1/generate", body))
    assert (status, doc["code"]) == (400, "bad_request"), doc


@pytest.mark.asyncio
async def test_admin_body_cut_off_by_the_client_is_not_an_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    api = AdminApi(token=TOKEN, metrics=Metrics(), status=lambda: {"state": "running"})

    async def echo(request: Any, params: Any) -> Any:
        return {"got": len(await request.read())}

    api.bind("node.join", echo)
    # what aiohttp's payload raises when the connection is lost mid-body
    request = _post("/v1/node/join", b'{"seeds": []}', error=ConnectionResetError("Connection lost"))
    with caplog.at_level(logging.ERROR):
        status, doc = await _answer(api, request)
    assert (status, doc["code"]) == (400, "bad_request")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.asyncio
async def test_admin_body_that_does_not_decode_as_its_content_encoding_is_a_400(
        caplog: pytest.LogCaptureFixture) -> None:
    # over loopback: aiohttp's parser decodes Content-Encoding before the handler reads the body
    api = AdminApi(token=TOKEN, metrics=Metrics(), status=lambda: {"state": "running"})

    async def echo(request: Any, params: Any) -> Any:
        return {"got": len(await request.read())}

    api.bind("node.join", echo)
    for encoding in ("gzip", "deflate"):
        with caplog.at_level(logging.ERROR):
            status, doc = await _exchange(api, (
                f"POST /v1/node/join HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n"
                f"Content-Encoding: {encoding}\r\nContent-Length: 10\r\n\r\n0123456789").encode())
        assert (status, doc["code"]) == (400, "bad_request"), doc
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.asyncio
async def test_admin_requests_metric_counts_unknown_methods_as_other() -> None:
    """The method label of giaannd_admin_requests_total is one of a fixed set: a client's own word
    (passed by aiohttp's pure-Python parser) counts as ``other``. Before, each new word was a new
    series: anyone on the network could grow the registry without bound."""
    metrics = Metrics()
    api = AdminApi(token="secret", metrics=metrics, status=lambda: {"state": "running"})
    for word in ("XYZ", "BREW", "QWERTY1"):
        await api._dispatch(_request(word, "/v1/whatever", REMOTE))
    await api._dispatch(_request("GET", "/v1/status", REMOTE, "secret"))
    text = metrics.render().decode()
    methods = {line.split('method="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("giaannd_admin_requests_total{")}
    assert methods == {"other", "GET"}
