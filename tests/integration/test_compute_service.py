"""The compute Service's admin routes, in-process: a mem:// storage cluster, the real AdminApi."""

import asyncio
import json
import uuid

import aiohttp
import pytest

from giaannd.admin.api import AdminApi
from giaannd.compute.service import ComputeService, create_service
from giaannd.config import ComputeConfig, Config
from giaannd.metrics import Metrics
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.service import ServiceContext
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(120)]
TOKEN = "compute-test-token"


class Harness:
    def __init__(self, tmp_path):
        self.tmp_path = tmp_path

    async def __aenter__(self):
        self.cluster = await Cluster(self.tmp_path / "storage", 3).start()
        metrics = Metrics()
        self.admin = AdminApi(token=TOKEN, metrics=metrics, status=lambda: {})
        host, port = await self.admin.start("127.0.0.1", 0)
        self.base = f"http://{host}:{port}"
        self.service = ComputeService(ComputeConfig(train_workers=2, coalesce_k=64), self.tmp_path / "compute",
                                      storage_factory=lambda ctx: self.cluster.client)
        self.tasks = []

        def spawn(coro, service, name):
            t = asyncio.get_running_loop().create_task(coro)
            self.tasks.append(t)
            return t

        ctx = ServiceContext(Config.loopback(str(self.tmp_path)), uuid.uuid4(), "c0", metrics, self.admin,
                             asyncio.Event(), {}, spawn, lambda reason: None, "compute")
        await self.service.start(ctx)
        self.http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"})
        return self

    async def call(self, method, path, body=None, raw=None):
        kw = {"data": raw} if raw is not None else ({"json": body} if body is not None else {})
        async with self.http.request(method, self.base + path, **kw) as r:
            text = await r.text()
            return r.status, (json.loads(text) if r.content_type == "application/json" else text)

    async def __aexit__(self, *exc):
        await self.http.close()
        await self.service.stop(graceful=False)
        await self.admin.stop()
        await self.cluster.close()


@pytest.mark.asyncio
async def test_compute_routes_train_eval_generate_export(tmp_path):
    corpus = tmp_path / "corpus.conllu"
    sentences = load_bundled_corpus(300)
    write_conllu(sentences, corpus)
    async with Harness(tmp_path) as h:
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "workers": 1})
        assert status == 200, reply
        job_id = reply["job_id"]
        async with asyncio.timeout(60):
            while (doc := (await h.call("GET", f"/v1/jobs/{job_id}"))[1])["state"] == "running":
                await asyncio.sleep(0.05)
        assert doc["state"] == "succeeded", doc
        assert doc["done"] == doc["total"] == 300 and doc["unit"] == "sentences"
        assert doc["bytes_sent"] > 0 and doc["coalescing_ratio"] > 1 and doc["batches"] == 5
        status, jobs = await h.call("GET", "/v1/jobs")
        assert status == 200 and [j["job_id"] for j in jobs["jobs"]] == [job_id]

        status, ev = await h.call("POST", "/v1/eval", {"corpus": str(corpus), "limit": 40, "constants": "train"})
        assert status == 200, ev
        assert ev["prompts"] > 20 and 0 < ev["top1"] <= 1 and ev["steps"] > 0
        status, ev2 = await h.call("POST", "/v1/eval", {"limit": 40, "constants": "test"})
        assert status == 200 and ev2["constants"] == "test"

        prompt = [[t.form, t.lemma, t.upos, t.xpos] for t in sentences[5][:9]]
        status, gen = await h.call("POST", "/v1/generate", {"prompt": prompt, "max_tokens": 5})
        assert status == 200, gen
        assert gen["text"] == " ".join(gen["tokens"]) and len(gen["prompt"]) <= 9

        out = tmp_path / "export.jsonl"
        status, ex = await h.call("POST", "/v1/export", {"path": str(out)})
        assert status == 200, ex
        first = json.loads(out.read_text().splitlines()[0])
        assert ex["lines"] > 1000 and set(first) >= {"source_lemma", "target_word", "strength"}

        status, metrics = await h.call("GET", "/metrics")
        assert 'giaannd_compute_train_total{figure="done"} 300.0' in metrics
        assert "giaannd_compute_row_cache_hits" in metrics


@pytest.mark.asyncio
async def test_compute_routes_reject_bad_input(tmp_path):
    async with Harness(tmp_path) as h:
        cases = [
            ("POST", "/v1/train", {}, None),
            ("POST", "/v1/train", {"corpus": str(tmp_path / "absent.conllu")}, None),
            ("POST", "/v1/train", {"corpus": str(tmp_path), "workers": 0}, None),
            ("POST", "/v1/train", None, b"{not json"),
            ("POST", "/v1/eval", {"constants": "nope"}, None),
            ("POST", "/v1/generate", {"prompt": ""}, None),
            ("POST", "/v1/generate", {"prompt": [["a", "b"]]}, None),
            ("POST", "/v1/export", {"path": "relative.jsonl"}, None),
            ("POST", "/v1/export", {"path": str(tmp_path / "no" / "dir.jsonl")}, None),
        ]
        for method, path, body, raw in cases:
            status, reply = await h.call(method, path, body, raw)
            assert status == 400, (path, body, reply)
            assert reply["code"] == "bad_request"
        status, reply = await h.call("GET", "/v1/jobs/nope")
        assert status == 404
        # a corpus that is not CoNLL-U and not text the job can parse fails the job, not the node
        bad = tmp_path / "bad.conllu"
        bad.write_text("1\tonly-two-columns\n\n")
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(bad)})
        assert status == 200
        async with asyncio.timeout(30):
            while (doc := (await h.call("GET", f"/v1/jobs/{reply['job_id']}"))[1])["state"] == "running":
                await asyncio.sleep(0.05)
        assert doc["state"] == "failed" and "CorpusFormatError" in doc["error"]


@pytest.mark.asyncio
async def test_compute_create_service_without_storage_answers_503(tmp_path):
    svc = create_service(Config.loopback(str(tmp_path), roles=["compute"]))
    assert svc.name == "compute"
    metrics = Metrics()
    admin = AdminApi(token=TOKEN, metrics=metrics, status=lambda: {})
    host, port = await admin.start("127.0.0.1", 0)
    ctx = ServiceContext(Config.loopback(str(tmp_path)), uuid.uuid4(), "c0", metrics, admin, asyncio.Event(), {},
                         lambda c, s, n: asyncio.get_running_loop().create_task(c), lambda r: None, "compute")
    try:
        await svc.start(ctx)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            async with http.post(f"http://{host}:{port}/v1/eval", json={}) as r:
                assert r.status == 503
        assert svc.health()["storage"] is False
    finally:
        await svc.stop(graceful=True)
        await admin.stop()


@pytest.mark.spacy
@pytest.mark.asyncio
async def test_compute_generate_from_text_prompt(tmp_path):
    pytest.importorskip("spacy")
    async with Harness(tmp_path) as h:
        await h.service.train(load_bundled_corpus(300), h.service.train_settings(workers=1))
        status, gen = await h.call("POST", "/v1/generate", {"prompt": "In the beginning God created the heavens",
                                                            "max_tokens": 6})
        if status == 503:
            pytest.skip(gen["error"])  # no English model installed
        assert status == 200, gen
        assert gen["prompt"][:2] == ["in", "the"] and len(gen["tokens"]) <= 6
