"""The compute Service's admin routes, in-process: a mem:// storage cluster, the real AdminApi."""

import asyncio
import json
import threading
import time
import uuid

import aiohttp
import msgspec
import pytest

from giaannd.admin.api import AdminApi
from giaannd.compute.job_journal import load_journals
from giaannd.compute.service import ComputeService, create_service
from giaannd.compute.state import EvalHistory
from giaannd.config import ComputeConfig, Config
from giaannd.metrics import Metrics
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.service import ServiceContext
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(120)]
TOKEN = "compute-test-token"


class Harness:
    def __init__(self, tmp_path, profile="word"):
        self.tmp_path = tmp_path
        self.profile = profile

    async def __aenter__(self):
        self.cluster = await Cluster(self.tmp_path / "storage", 3).start()
        metrics = Metrics()
        self.admin = AdminApi(token=TOKEN, metrics=metrics, status=lambda: {})
        host, port = await self.admin.start("127.0.0.1", 0)
        self.base = f"http://{host}:{port}"
        self.service = ComputeService(ComputeConfig(train_workers=2, coalesce_k=64, model_profile=self.profile),
                                      self.tmp_path / "compute",
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
    sentences = load_bundled_corpus(300)
    async with Harness(tmp_path) as h:
        corpora, exports = _dirs(h)
        corpus = corpora / "corpus.conllu"
        write_conllu(sentences, corpus)
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "workers": 1, "cluster": False})
        assert status == 200, reply
        job_id = reply["job_id"]
        async with asyncio.timeout(60):
            while (doc := (await h.call("GET", f"/v1/jobs/{job_id}"))[1])["state"] == "running":
                await asyncio.sleep(0.05)
        assert doc["state"] == "succeeded", doc
        assert doc["done"] == doc["total"] == 300 and doc["unit"] == "sentences"
        assert doc["bytes_sent"] > 0 and doc["coalescing_ratio"] > 1 and doc["batches"] == 5
        tl = doc["timeline"]  # start, samples, end
        assert len(tl["t"]) >= 2 and tl["t"] == sorted(tl["t"]) and tl["done"][0] == 0
        assert tl["trained"][-1] == doc["trained"] and tl["bytes_sent"][-1] == doc["bytes_sent"]
        status, jobs = await h.call("GET", "/v1/jobs")
        assert status == 200 and [j["job_id"] for j in jobs["jobs"]] == [job_id]
        assert jobs["jobs"][0]["timeline"] == tl

        status, ev = await h.call("POST", "/v1/eval", {"corpus": str(corpus), "limit": 40, "constants": "train"})
        assert status == 200, ev
        assert ev["prompts"] > 20 and 0 < ev["top1"] <= 1 and ev["steps"] > 0
        status, ev2 = await h.call("POST", "/v1/eval", {"limit": 40, "constants": "test"})
        assert status == 200 and ev2["constants"] == "test"
        status, evals = await h.call("GET", "/v1/evals")  # both, in order, with what was trained then
        assert status == 200, evals
        assert [(e["source"], e["constants"], e["trained"]) for e in evals["evals"]] == [
            ("corpus.conllu", "train", doc["trained"]), ("bundled corpus, first 40", "test", doc["trained"])]
        assert evals["evals"][0]["top1"] == ev["top1"] and evals["evals"][1]["matches"] == ev2["matches"]
        assert evals["evals"][0]["at"] <= evals["evals"][1]["at"]
        kept = EvalHistory.load(h.service.data_dir, 1000)  # what a restarted node loads
        assert msgspec.to_builtins(kept.entries) == evals["evals"]

        prompt = [[t.form, t.lemma, t.upos, t.xpos] for t in sentences[5][:9]]
        status, gen = await h.call("POST", "/v1/generate", {"prompt": prompt, "max_tokens": 5})
        assert status == 200, gen
        assert gen["text"] == " ".join(gen["tokens"]) and len(gen["prompt"]) <= 9

        out = exports / "export.jsonl"
        status, ex = await h.call("POST", "/v1/export", {"path": str(out)})
        assert status == 200, ex
        first = json.loads(out.read_text().splitlines()[0])
        assert ex["lines"] > 1000 and set(first) >= {"source_lemma", "target_word", "strength"}

        status, metrics = await h.call("GET", "/metrics")
        assert "giaannd_compute_train_sentences_total 300.0" in metrics
        assert "giaannd_compute_row_cache_hits_total" in metrics


@pytest.mark.asyncio
async def test_compute_routes_reject_bad_input(tmp_path):
    async with Harness(tmp_path) as h:
        corpora, exports = _dirs(h)
        cases = [
            ("POST", "/v1/train", {}, None),
            ("POST", "/v1/train", {"corpus": str(corpora / "absent.conllu")}, None),
            ("POST", "/v1/train", {"corpus": str(corpora), "workers": 0}, None),
            ("POST", "/v1/train", None, b"{not json"),
            ("POST", "/v1/eval", {"constants": "nope"}, None),
            ("POST", "/v1/generate", {"prompt": ""}, None),
            ("POST", "/v1/generate", {"prompt": [["a", "b"]]}, None),
            ("POST", "/v1/export", {"path": ""}, None),
            ("POST", "/v1/export", {"path": str(exports / "no" / "dir.jsonl")}, None),
        ]
        for method, path, body, raw in cases:
            status, reply = await h.call(method, path, body, raw)
            assert status == 400, (path, body, reply)
            assert reply["code"] == "bad_request"
        status, reply = await h.call("GET", "/v1/jobs/nope")
        assert status == 404
        # a corpus that is not CoNLL-U and not text the job can parse fails the job, not the node
        bad = corpora / "bad.conllu"
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


# -- what paths the admin token can reach (issue 16 items 5 and 6) ------------------------------

def _dirs(h):
    """The compute node's corpus and export directories (defaults: under its data dir)."""
    corpora, exports = h.tmp_path / "compute" / "corpora", h.tmp_path / "compute" / "exports"
    corpora.mkdir(parents=True, exist_ok=True)
    exports.mkdir(parents=True, exist_ok=True)
    return corpora, exports


@pytest.mark.asyncio
async def test_compute_paths_outside_the_allowed_directories_are_refused_403(tmp_path):
    outside = tmp_path / "outside.conllu"
    write_conllu(load_bundled_corpus(20), outside)
    async with Harness(tmp_path) as h:
        corpora, exports = _dirs(h)
        (corpora / "escape.conllu").symlink_to(outside)  # symlinks are resolved before the check
        secret = tmp_path / "compute" / "ring.json"  # a daemon file export must never replace
        secret.write_text('{"ring": []}')
        cases = [
            ("/v1/train", {"corpus": str(outside)}, outside, corpora),
            ("/v1/train", {"corpus": "escape.conllu"}, outside, corpora),
            ("/v1/train", {"corpus": "../outside.conllu"}, None, corpora),
            ("/v1/eval", {"corpus": str(outside)}, outside, corpora),
            ("/v1/eval", {"prompts": str(outside)}, outside, corpora),
            ("/v1/eval", {"prompts": "../../outside.conllu"}, None, corpora),
            ("/v1/export", {"path": str(secret)}, secret, exports),
            ("/v1/export", {"path": "/proc/self/mem"}, "/proc/self/mem", exports),
        ]
        for path, body, named, allowed in cases:
            status, reply = await h.call("POST", path, body)
            assert status == 403, (path, body, reply)
            assert reply["code"] == "forbidden" and str(allowed) in reply["error"], reply
            assert named is None or str(named) in reply["error"], reply
        assert secret.read_text() == '{"ring": []}'
        assert [j["job_id"] for j in (await h.call("GET", "/v1/jobs"))[1]["jobs"]] == []


@pytest.mark.asyncio
async def test_compute_relative_paths_resolve_inside_the_allowed_directories(tmp_path):
    async with Harness(tmp_path) as h:
        corpora, exports = _dirs(h)
        write_conllu(load_bundled_corpus(100), corpora / "train.conllu")
        status, reply = await h.call("POST", "/v1/train", {"corpus": "train.conllu", "workers": 1, "cluster": False})
        assert status == 200, reply
        async with asyncio.timeout(60):
            while (doc := (await h.call("GET", f"/v1/jobs/{reply['job_id']}"))[1])["state"] == "running":
                await asyncio.sleep(0.05)
        assert doc["state"] == "succeeded", doc
        status, ev = await h.call("POST", "/v1/eval", {"corpus": "train.conllu", "limit": 10})
        assert status == 200, ev
        status, ex = await h.call("POST", "/v1/export", {"path": "model.jsonl"})
        assert status == 200, ex
        assert ex["path"] == str(exports / "model.jsonl") and (exports / "model.jsonl").stat().st_size > 0


@pytest.mark.asyncio
async def test_compute_export_replaces_only_previous_exports_unless_told(tmp_path):
    async with Harness(tmp_path) as h:
        _, exports = _dirs(h)
        await h.service.train(load_bundled_corpus(50), h.service.train_settings(workers=1))
        notes = exports / "notes.txt"
        notes.write_text("not an export\n")
        status, reply = await h.call("POST", "/v1/export", {"path": str(notes)})
        assert status == 409 and reply["code"] == "not_an_export" and str(notes) in reply["error"], reply
        assert notes.read_text() == "not an export\n"
        status, reply = await h.call("POST", "/v1/export", {"path": str(notes), "overwrite": True})
        assert status == 200, reply
        again = notes.read_text()
        status, reply = await h.call("POST", "/v1/export", {"path": str(notes)})  # a previous export
        assert status == 200 and notes.read_text() == again, reply
        status, reply = await h.call("POST", "/v1/export", {"path": str(notes), "overwrite": "yes"})
        assert status == 400 and reply["code"] == "bad_request", reply


@pytest.mark.asyncio
async def test_compute_export_to_a_directory_is_400_naming_the_path(tmp_path):
    async with Harness(tmp_path) as h:
        _, exports = _dirs(h)
        await h.service.train(load_bundled_corpus(20), h.service.train_settings(workers=1))
        target = exports / "a-directory"
        target.mkdir()
        status, reply = await h.call("POST", "/v1/export", {"path": str(target)})
        assert status == 400 and reply["code"] == "bad_request" and str(target) in reply["error"], reply


@pytest.mark.spacy
@pytest.mark.asyncio
async def test_compute_tag_cache_files_are_private(tmp_path):
    pytest.importorskip("spacy")
    async with Harness(tmp_path) as h:
        corpora, _ = _dirs(h)
        await h.service.train(load_bundled_corpus(50), h.service.train_settings(workers=1))
        (corpora / "held.txt").write_text("In the beginning God created the heavens and the earth.\n")
        status, ev = await h.call("POST", "/v1/eval", {"corpus": str(corpora / "held.txt")})
        if status == 503:
            pytest.skip(ev["error"])  # no English model installed
        assert status == 200, ev
        cache = tmp_path / "compute" / "tag-cache"
        files = list(cache.iterdir())
        assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files), files
        assert cache.stat().st_mode & 0o777 == 0o700


async def _train(h, corpus):
    status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "workers": 1, "cluster": False})
    assert status == 200, reply
    async with asyncio.timeout(60):
        while (doc := (await h.call("GET", f"/v1/jobs/{reply['job_id']}"))[1])["state"] == "running":
            await asyncio.sleep(0.05)
    assert doc["state"] == "succeeded", doc


@pytest.mark.asyncio
async def test_eval_reads_a_prompt_file(tmp_path):
    sentences = load_bundled_corpus(120)
    async with Harness(tmp_path) as h:
        corpora, _ = _dirs(h)
        corpus, prompts = corpora / "corpus.conllu", corpora / "prompts.conllu"
        write_conllu(sentences, corpus)
        write_conllu(sentences[:30], prompts)
        await _train(h, corpus)
        status, ev = await h.call("POST", "/v1/eval", {"prompts": str(prompts), "constants": "train"})
        assert status == 200, ev
        # the whole file is evaluated (no default limit of 200 applies to a prompt file)
        assert ev["prompts"] + ev["skipped"] == 30 and ev["prompts"] > 20 and ev["top1"] > 0.5
        status, ev = await h.call("POST", "/v1/eval", {"prompts": str(prompts), "limit": 10})
        assert status == 200 and ev["prompts"] + ev["skipped"] == 10
        for body in ({"prompts": str(prompts), "corpus": str(corpus)}, {"prompts": str(corpora / "absent.txt")},
                     {"prompts": 7}):
            status, reply = await h.call("POST", "/v1/eval", body)
            assert status == 400 and reply["code"] == "bad_request", (body, reply)
        assert "prompts must be a file path" in reply["error"]


@pytest.mark.spacy
@pytest.mark.asyncio
async def test_eval_tags_a_text_prompt_file_line_by_line(tmp_path):
    story = ("The old man walked to the river with his dog. The dog jumped into the cold water near the "
             "bridge. ")
    async with Harness(tmp_path) as h:
        corpora, _ = _dirs(h)
        corpus, prompts = corpora / "corpus.txt", corpora / "prompts.txt"
        corpus.write_text((story * 3 + "\n\n") * 4, encoding="utf-8")
        prompts.write_text("The old man walked to the river with his dog. The dog jumped into the cold water.\n"
                           "\nToo short.\nThe dog jumped into the cold water near the bridge.\n", encoding="utf-8")
        await _train(h, corpus)
        status, ev = await h.call("POST", "/v1/eval", {"prompts": str(prompts)})
        assert status == 200, ev
        # three non-blank lines, each one prompt (the first holds two sentences); one is too short
        assert ev["prompts"] == 2 and ev["skipped"] == 1 and ev["top1"] > 0.5
        # the same prompts inline (the Python client's list): the same figures as the file
        lines = [x for x in prompts.read_text(encoding="utf-8").splitlines() if x.strip()]
        status, inline = await h.call("POST", "/v1/eval", {"prompt_lines": lines})
        assert status == 200, inline
        figures = ("prompts", "skipped", "matches")
        assert [inline[k] for k in figures] == [ev[k] for k in figures]
        for body in ({"prompt_lines": []}, {"prompt_lines": ["two\nlines"]}, {"prompt_lines": [" "]},
                     {"prompt_lines": ["x"], "prompts": str(prompts)}, {"prompt_lines": "one string"}):
            status, reply = await h.call("POST", "/v1/eval", body)
            assert status == 400 and reply["code"] == "bad_request", (body, reply)


@pytest.mark.asyncio
async def test_compute_routes_cluster_job_refused_on_a_giaann_v2_node(tmp_path):
    """Cluster jobs encode with the word profile's assigner: a giaann-v2 node refuses to start one
    (before anything is uploaded) instead of training word-level rows into a v2 cluster."""
    async with Harness(tmp_path, profile="giaann-v2") as h:
        corpora, _ = _dirs(h)
        corpus = corpora / "corpus.conllu"
        write_conllu(load_bundled_corpus(20), corpus)
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "cluster": True})
        assert status == 400 and reply["code"] == "profile_mismatch", reply
        assert "word profile only" in reply["error"], reply
        status, jobs = await h.call("GET", "/v1/jobs")
        assert status == 200 and jobs["jobs"] == [], jobs


@pytest.mark.asyncio
async def test_compute_routes_cluster_job_status_list_cancel_resume(tmp_path):
    """``"cluster": true`` makes a cluster job (issue 15): its document (from the registers) says so;
    list, cancel, resume and bad input answer as documented."""
    sentences = load_bundled_corpus(200)
    async with Harness(tmp_path) as h:
        corpora, _ = _dirs(h)
        corpus = corpora / "corpus.conllu"
        write_conllu(sentences, corpus)
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "cluster": True, "epochs": 2})
        assert status == 400 and "one epoch" in json.dumps(reply), reply
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "cluster": "yes"})
        assert status == 400, reply
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "cluster": True})
        assert status == 200, reply
        job_id = reply["job_id"]
        async with asyncio.timeout(60):
            while (doc := (await h.call("GET", f"/v1/jobs/{job_id}"))[1])["state"] == "running":
                await asyncio.sleep(0.05)
        assert doc["state"] == "succeeded" and doc["cluster"] is True, doc
        assert doc["done"] == doc["total"] == 200 and set(doc["by_node"]) == {"c0"}
        status, jobs = await h.call("GET", "/v1/jobs")
        assert status == 200 and job_id in [j["job_id"] for j in jobs["jobs"]]
        status, reply = await h.call("POST", f"/v1/jobs/{job_id}/resume")
        assert status == 409, reply
        for method, path in (("POST", "/v1/jobs/feedface/cancel"), ("GET", "/v1/jobs/feedface"),
                             ("POST", "/v1/jobs/feedface/resume")):
            status, reply = await h.call(method, path)
            assert status == 404, (path, reply)
        status, reply = await h.call("POST", f"/v1/jobs/{job_id}/cancel")  # over: nothing changes
        assert status == 200 and reply["state"] == "succeeded", reply


@pytest.mark.asyncio
async def test_compute_routes_train_is_a_cluster_job_by_default(tmp_path):
    """Issue 15 item 2: with the default config a request naming no ``cluster`` makes a cluster
    job; ``"cluster": false`` (giaannctl ``train start --local``), or more than one epoch with no
    ``cluster``, makes a node-local job."""
    async with Harness(tmp_path) as h:
        corpora, _ = _dirs(h)
        corpus = corpora / "corpus.conllu"
        write_conllu(load_bundled_corpus(100), corpus)
        kinds = {}
        for name, body in (("default", {}), ("local", {"cluster": False}), ("epochs", {"epochs": 2})):
            status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), **body})
            assert status == 200, reply
            async with asyncio.timeout(60):
                while (doc := (await h.call("GET", f"/v1/jobs/{reply['job_id']}"))[1])["state"] == "running":
                    await asyncio.sleep(0.05)
            assert doc["state"] == "succeeded", doc
            kinds[name] = bool(doc.get("cluster"))
        assert kinds == {"default": True, "local": False, "epochs": False}


@pytest.mark.asyncio
@pytest.mark.parametrize("slow_journal", [False, True])
async def test_compute_routes_cancelled_local_job_leaves_no_journal(tmp_path, monkeypatch, slow_journal):
    """``train cancel`` of a node-local job ends it: its journal goes (it stayed "running", so the
    node's next start resumed and finished the cancelled job), also when a journal write was in
    flight at the cancel (its thread must not put the file back after the removal). A shutdown's
    cancel keeps it (test_compute_resume.py)."""
    writing = threading.Event()  # a journal write is in its thread now
    if slow_journal:
        import giaannd.compute.job_journal as job_journal
        real = job_journal.atomic_write_bytes

        def slow(path, data):
            writing.set()
            time.sleep(2.0)  # longer than the job's cancellation takes (its client's close)
            real(path, data)
            writing.clear()

        monkeypatch.setattr(job_journal, "atomic_write_bytes", slow)
    async with Harness(tmp_path) as h:
        corpora, _ = _dirs(h)
        corpus = corpora / "corpus.conllu"
        write_conllu(load_bundled_corpus(2000), corpus)
        status, reply = await h.call("POST", "/v1/train", {"corpus": str(corpus), "workers": 1, "coalesce": 8,
                                                           "cluster": False})
        assert status == 200, reply
        job_id = reply["job_id"]
        async with asyncio.timeout(60):  # slow: until a journal write is in its thread
            while not (writing.is_set() if slow_journal else
                       (await h.call("GET", f"/v1/jobs/{job_id}"))[1]["done"] >= 16):
                await asyncio.sleep(0.005)
        status, doc = await h.call("POST", f"/v1/jobs/{job_id}/cancel")
        assert status == 200 and doc["state"] == "cancelled", doc
        async with asyncio.timeout(10):
            while writing.is_set():  # a journal write in flight at the cancel has ended
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert load_journals(h.tmp_path / "compute") == []
        # a restart of the node does not train it again
        again = ComputeService(ComputeConfig(train_workers=2, coalesce_k=64), h.tmp_path / "compute",
                               storage=h.cluster.client)
        await again.start()
        assert again.jobs.all() == [] and again._resume_task is None
        await again.stop(graceful=False)
