"""Equivalence on a real loopback cluster: 3 storage *processes* (``giaannd`` daemons, tcp, R=3, W=2),
compute here (on the cluster harness's client)."""

import asyncio
import json

import pytest

from giaannd.compute.service import ComputeService
from giaannd.compute.train import TrainSettings
from giaannd.config import ComputeConfig
from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl
from giaannd.model.tokens import load_bundled_corpus
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_compute_processes_one_worker_export_and_predictions_equal_engine(tmp_path):
    corpus = load_bundled_corpus(400)
    engine = Engine()
    engine.train(corpus)

    async def run():
        cluster = await Cluster(tmp_path / "storage", processes=True, replicas=3, write_quorum=2,
                                request_timeout_s=10.0).start()
        svc = ComputeService(ComputeConfig(), tmp_path / "compute", storage=cluster.client)
        await svc.start()
        try:
            await svc.train(corpus, TrainSettings(workers=1, coalesce_sentences=100))
            out = tmp_path / "cluster.jsonl"
            await svc.export(out)
            ev = await svc.evaluate(corpus[:80], "train")
            ev_test = await svc.evaluate(corpus[:80], "test")
            return out, ev, ev_test
        finally:
            await svc.stop(graceful=True)
            await cluster.close()

    out, ev, ev_test = asyncio.run(asyncio.wait_for(run(), 150))
    ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == len(ref) > 5000
    for a, b in zip(ref, got):
        assert a["source_word"] == b["source_word"] and a["target_word"] == b["target_word"]
        assert a["segment"] == b["segment"] and b["strength"] == pytest.approx(a["strength"], rel=1e-5)
    for name, ev_ in (("train", ev), ("test", ev_test)):
        from giaannd.model.engine import constants_named
        expected = engine.evaluate(corpus[:80], constants=constants_named(name))
        assert (ev_["matches"], ev_["prediction_tokens"]) == (expected.matches, expected.prediction_tokens)


def test_compute_daemons_equal_engine_export_and_top1(tmp_path):
    """3 storage daemons + 1 compute daemon (real ``python -m giaannd`` processes, tcp): train with
    one worker through the admin API; the export equals the core's and so do the top-1 counts."""
    import time

    from giaannd.model.engine import constants_named
    from giaannd.model.tokens import write_conllu
    from giaannd.sdk.local_cluster import running_cluster

    corpus = load_bundled_corpus(300)
    engine = Engine()
    engine.train(corpus)
    with running_cluster(tmp_path / "cluster", storage=3, compute=1, transport="tcp") as cluster:
        path = cluster.corpus_dir / "train.conllu"  # the nodes' compute.corpus-dir
        write_conllu(corpus, path)
        cluster.wait_converged()
        admin = cluster.compute_nodes[0].admin
        job = admin.json("POST", "/v1/train", {"corpus": str(path), "workers": 1, "cluster": False})
        deadline = time.monotonic() + 90
        while (doc := admin.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert doc["state"] == "succeeded", doc
        out = cluster.export_dir / "cluster.jsonl"
        admin.json("POST", "/v1/export", {"path": str(out)})
        evals = {name: admin.json("POST", "/v1/eval", {"corpus": str(path), "limit": 60, "constants": name})
                 for name in ("train", "test")}
    ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == len(ref) > 5000
    for a, b in zip(ref, got):
        assert (a["source_word"], a["segment"], a["target_word"]) == (b["source_word"], b["segment"], b["target_word"])
        assert b["strength"] == pytest.approx(a["strength"], rel=1e-5)
    for name, ev in evals.items():
        expected = engine.evaluate(corpus[:60], constants=constants_named(name))
        assert (ev["matches"], ev["prediction_tokens"]) == (expected.matches, expected.prediction_tokens)
