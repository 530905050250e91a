"""Bad input of every kind on the admin API: a JSON ``{"error", "code"}`` with the right 4xx, nothing
done, no 500, no hang (docs/operations.md, "Admin API").

The server is the real ``AdminApi`` on loopback with the real compute routes of a compute service
that has no storage (so a request that passes its checks answers 503, never does work), plus
recording handlers bound to a few operations of other services (what the membership service's
``node.drain`` does is flip a flag: here the handler counts calls).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from giaannd.admin.api import AdminApi
from giaannd.compute.service import ComputeService, create_service
from giaannd.config import ComputeConfig, Config
from giaannd.metrics import Metrics
from giaannd.service import ServiceContext
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.asyncio]
TOKEN = "bad-input-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Served:
    base: str
    corpora: Path
    exports: Path
    calls: dict[str, int] = field(default_factory=dict)
    http: aiohttp.ClientSession | None = None

    async def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                   headers: Mapping[str, str] | None = None) -> tuple[int, Any, Mapping[str, str]]:
        assert self.http is not None
        kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body} if body is not None else {}
        async with asyncio.timeout(20):  # never a hang
            async with self.http.request(method, self.base + path, headers={**AUTH, **(headers or {})},
                                         **kw) as r:
                text = await r.text()
                doc = json.loads(text) if r.content_type == "application/json" and text else text
                return r.status, doc, r.headers

    async def refused(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                      status: int = 400, code: str = "bad_request") -> dict[str, Any]:
        got, doc, _ = await self.call(method, path, body, raw=raw)
        assert (got, isinstance(doc, dict) and doc.get("code")) == (status, code), (method, path, body, raw, doc)
        assert isinstance(doc["error"], str) and doc["error"], doc
        return doc


async def _raw(base: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the server answers before closing."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


@asynccontextmanager
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    config = Config.loopback(str(tmp_path), roles=["compute"])
    metrics = Metrics()
    admin = AdminApi(token=TOKEN, metrics=metrics, status=lambda: {"state": "running"})
    host, port = await admin.start("127.0.0.1", 0)
    svc = create_service(config)
    ctx = ServiceContext(config, uuid.uuid4(), "c0", metrics, admin, asyncio.Event(), {},
                         lambda c, s, n: asyncio.get_running_loop().create_task(c), lambda r: None, "compute")
    calls: dict[str, int] = {}

    def recording(op_id: str) -> Any:
        async def handler(request: Any, params: Mapping[str, str]) -> Any:
            calls[op_id] = calls.get(op_id, 0) + 1
            return {"done": op_id}
        return handler

    for op_id in ("node.drain", "node.leave", "keys.use", "node.topology.pause"):
        admin.bind(op_id, recording(op_id))
    try:
        await svc.start(ctx)
        corpora, exports = Path(svc.corpus_dir), Path(svc.export_dir)
        corpora.mkdir(parents=True, exist_ok=True)
        exports.mkdir(parents=True, exist_ok=True)
        async with aiohttp.ClientSession() as http:
            yield Served(f"http://{host}:{port}", corpora, exports, calls, http)
    finally:
        await svc.stop(graceful=False)
        await admin.stop()


async def test_admin_body_on_an_operation_that_takes_none_is_refused(tmp_path: Path) -> None:
    """docs/operations.md: a body holding a field the route does not take is a 400 and nothing is
    done; ``node drain`` takes no body, so ``{"node": "other"}`` must not drain this node."""
    async with served(tmp_path) as s:
        for path, body, raw in (("/v1/node/drain", {"node": "other"}, None),
                                ("/v1/node/leave", {"graceful": False}, None),
                                ("/v1/keys/k1/use", [1], None),
                                ("/v1/node/topology/pause", None, b"{not json")):
            await s.refused("POST", path, body, raw=raw)
        assert s.calls == {}
        # no body, an empty object or null still do what the verb says
        for body, raw in ((None, None), ({}, None), (None, b"null"), (None, b"")):
            status, doc, _ = await s.call("POST", "/v1/node/drain", body, raw=raw)
            assert status == 200 and doc == {"done": "node.drain"}, (body, raw, doc)
        assert s.calls == {"node.drain": 4}


async def test_admin_405_names_the_allowed_methods(tmp_path: Path) -> None:
    """RFC 9110 §15.5.6: a 405 carries ``Allow``; HEAD is allowed wherever GET is."""
    async with served(tmp_path) as s:
        for method, path, allowed in (("POST", "/v1/status", {"GET", "HEAD"}),
                                      ("DELETE", "/v1/train", {"POST"}),
                                      ("PUT", "/v1/jobs", {"GET", "HEAD"}),
                                      ("PATCH", "/v1/jobs/abc", {"GET", "HEAD"})):
            status, doc, headers = await s.call(method, path)
            assert status == 405 and doc["code"] == "method_not_allowed", (method, path, doc)
            assert set(headers.get("Allow", "").replace(" ", "").split(",")) == allowed, (method, path, headers)
        status, doc, _ = await s.call("HEAD", "/v1/jobs")
        assert status == 200 and doc == ""


async def test_admin_malformed_http_gets_the_json_error_shape(tmp_path: Path) -> None:
    """A request aiohttp cannot parse (a control character in the path, a request line over its
    limit) is answered in the same JSON shape as every other error."""
    async with served(tmp_path) as s:
        for request in (b"GET /v1/jobs/\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET /v1/jobs/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET /v1/jobs/" + b"x" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET /v1/status HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n"):
            answer = await _raw(s.base, request)
            head, _, body = answer.partition(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            assert 400 <= status < 500 and b"application/json" in head, (request[:40], answer[:300])
            doc = json.loads(body)
            assert doc["error"] and doc["code"], doc
        status, _, _ = await s.call("GET", "/v1/jobs")  # still serving
        assert status == 200


async def test_compute_fields_of_the_wrong_type_are_refused(tmp_path: Path) -> None:
    """Each field of each compute route, given the wrong JSON type or an out-of-range number:
    400 before anything is done (the service has no storage: a request that got past its checks
    would answer 503)."""
    async with served(tmp_path) as s:
        (s.corpora / "c.conllu").write_text("")
        corpus = "c.conllu"
        cases: list[tuple[str, Any]] = []
        for key, bad in (("workers", ["1", 1.0, True, 0, -1, 1025, 1e308, -0.0, [1], {"n": 1}]),
                         ("coalesce", [0, "2", 2.5, False]),
                         ("epochs", [0, 1001, "1", 1.5, True]),
                         ("limit", [0, -5, 1.0, "9"]),
                         ("cluster", ["yes", 1, 0, None, [], {}])):
            cases += [("/v1/train", {"corpus": corpus, key: v}) for v in bad]
        cases += [("/v1/train", {"corpus": v}) for v in (None, 1, True, [], {}, "")]
        for key, bad in (("limit", [0, 100_001, True, 1.0, "5"]),
                         ("constants", [0, False, [], {}, "", "both", ["train"]]),
                         ("mode", [0, False, [], {}, "", "greedy"]),
                         ("spread", [1, "true", []]),
                         ("corpus", [1, True, [], {}, ""]),
                         ("prompts", [1, [], ""]),
                         ("prompt_lines", ["a line", [], [1], ["two\nlines"], [""], {}, True])):
            cases += [("/v1/eval", {key: v}) for v in bad]
        for key, bad in (("max_tokens", [-1, 1025, "5", 2.0, True]),
                         ("constants", [0, False, [], {}, "", "x"]),
                         ("prompt", [None, "", "  ", 5, True, {}, [], [["a", "b"]], [["a", "b", "c", 4]],
                                     [[]], [["a", "b", "c", ""]]])):
            cases += [("/v1/generate", {"prompt": "god", key: v}) for v in bad]
        cases += [("/v1/export", {"path": v}) for v in (None, 1, [], {}, "")]
        cases += [("/v1/export", {"path": "x.jsonl", "overwrite": v}) for v in ("yes", 1, None, [])]
        for path, body in cases:
            await s.refused("POST", path, body)


async def test_compute_bodies_that_are_not_json_objects_are_refused(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        raws = [b"[]", b"5", b'"text"', b"true", b"{", b"{}}", b'{"limit": NaN}', b'{"limit": Infinity}',
                b'{"limit": -Infinity}', b'{"limit": 1e999}', b'{"corpus": "\\ud800"}', b'{"corpus": "\xff"}',
                b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 990 + b"1" + b"}" * 990, b'{"limit": 1, "bogus": 2}',
                b"\x00"]
        for path in ("/v1/train", "/v1/eval", "/v1/generate", "/v1/export"):
            for raw in raws:
                await s.refused("POST", path, raw=raw)


async def test_compute_paths_that_cannot_be_files_are_refused(tmp_path: Path) -> None:
    """Corpus, prompt and export paths: NUL bytes, names too long, directories, FIFOs (which must
    not be opened: that would block a thread until a writer came), links and ``..`` out of the
    allowed directory (403)."""
    async with served(tmp_path) as s:
        os.mkfifo(s.corpora / "fifo")
        os.mkfifo(s.exports / "fifo.jsonl")
        (s.corpora / "dir").mkdir()
        (tmp_path / "outside.txt").write_text("secret\n")
        (s.corpora / "link").symlink_to(tmp_path / "outside.txt")
        (s.exports / "link.jsonl").symlink_to(tmp_path / "outside.txt")
        (s.corpora / "dirlink").symlink_to(tmp_path)
        for key in ("corpus", "prompts"):
            for value in ("fifo", "dir", "absent", "a\x00b", "x" * 5000, ".", str(s.corpora)):
                await s.refused("POST", "/v1/eval", {key: value})
            for value in ("link", "../outside.txt", "dirlink/outside.txt", str(tmp_path / "outside.txt"), "/",
                          "/proc/self/environ", "/" + "x/" * 3000):
                await s.refused("POST", "/v1/eval", {key: value}, status=403, code="forbidden")
        for value in ("fifo", "dir", "a\x00b", "x" * 5000):
            await s.refused("POST", "/v1/train", {"corpus": value})
        await s.refused("POST", "/v1/train", {"corpus": "link"}, status=403, code="forbidden")
        for value in ("fifo.jsonl", ".", "no/dir.jsonl", "a\x00b", "x" * 5000):
            await s.refused("POST", "/v1/export", {"path": value, "overwrite": True})
        for value in ("link.jsonl", "../outside.txt", "/etc/passwd"):
            await s.refused("POST", "/v1/export", {"path": value, "overwrite": True}, status=403, code="forbidden")
        assert (tmp_path / "outside.txt").read_text() == "secret\n"


async def test_compute_path_and_query_parameters(tmp_path: Path) -> None:
    """Path parameters (percent-encoded slashes, ``..``, NUL, long words) and the ``limit`` query
    parameter of ``column rows`` (malformed, out of range, repeated)."""
    async with served(tmp_path) as s:
        for query in ("limit=", "limit=abc", "limit=0", "limit=-1", "limit=1.5", "limit=10000001", "limit=%00",
                      "limit=" + "9" * 5000, "limit=1&limit=2", "limit=5&limit=5"):
            await s.refused("GET", f"/v1/columns/god/rows?{query}")
        for column in ("-1", "0x", "0x" + "f" * 17, "18446744073709551616", "%20"):
            if column in ("0x",):
                continue  # a word ("0x"), not an id
            await s.refused("GET", f"/v1/columns/{column}/rows")
        # a job id no job can have (ids are 16 hex digits) names no job: 404 without asking
        # storage (with storage, the register keys made from it were refused as undecodable: 503)
        for method, path in (("GET", "/v1/jobs/{}"), ("POST", "/v1/jobs/{}/cancel")):
            await s.refused(method, path.format("x" * 300), status=404, code="not_found")
        # other odd ids are looked up as they are (here: no storage to ask)
        for job in ("%00", "..%2F..", "a%2Fb", "%ff%fe", "%F0%9F%98%80"):
            await s.refused("GET", f"/v1/jobs/{job}", status=503, code="unavailable")


async def test_compute_job_id_too_long_for_a_job_is_404_with_storage_running(tmp_path: Path) -> None:
    """With storage up, a job id longer than any job's was sent on to storage, whose nodes refused
    the register read as undecodable (its key over ``MAX_REGISTER_KEY_CHARS``): a 503 blaming
    storage for the client's input."""
    cluster = await Cluster(tmp_path / "storage", 3).start()
    metrics = Metrics()
    admin = AdminApi(token=TOKEN, metrics=metrics, status=lambda: {})
    host, port = await admin.start("127.0.0.1", 0)
    svc = ComputeService(ComputeConfig(), tmp_path / "compute", storage_factory=lambda ctx: cluster.client)
    ctx = ServiceContext(Config.loopback(str(tmp_path)), uuid.uuid4(), "c0", metrics, admin, asyncio.Event(), {},
                         lambda c, s, n: asyncio.get_running_loop().create_task(c), lambda r: None, "compute")
    try:
        await svc.start(ctx)
        async with aiohttp.ClientSession() as http:
            s = Served(f"http://{host}:{port}", tmp_path, tmp_path, http=http)
            for method, path in (("GET", "/v1/jobs/{}"), ("POST", "/v1/jobs/{}/cancel"),
                                 ("POST", "/v1/jobs/{}/resume")):
                for job in ("x" * 300, "feedface" * 8, "%00", "..%2F..", "%F0%9F%98%80"):
                    await s.refused(method, path.format(job), status=404, code="not_found")
    finally:
        await svc.stop(graceful=False)
        await admin.stop()
        await cluster.close()
