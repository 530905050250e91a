"""Cluster training jobs on real daemons (issue 15): 3 storage + 3 compute ``giaannd`` processes on
loopback (tcp, R = 3, W = 2) with ``compute.cluster-jobs``; ``kill -9`` of a compute node while it
holds leases in the training stage (the node that received ``train start`` in one test, another
one in the second, where a fourth compute node also joins mid-job); the job ends on the others
and the export equals the single-process core's. Every wait is bounded."""

import json
import time

import pytest

from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.sdk.local_cluster import running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N_SENTENCES = 800
K = 25
COMPUTE = {"cluster_jobs": True, "coalesce_k": K, "train_workers": 1, "lease_s": 2.0,
           "lease_probe_interval_s": 0.2, "lease_windows": 2}


@pytest.fixture(scope="module")
def corpus():
    return load_bundled_corpus(N_SENTENCES)


@pytest.fixture(scope="module")
def engine(corpus):
    e = Engine()
    e.train(corpus)
    return e


def wait_doc(admin, job_id, until, timeout_s):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            doc = admin.json("GET", f"/v1/jobs/{job_id}")
        except Exception as exc:  # a 404 while the corpus is still uploading on the receiving node
            doc = {"error": str(exc)}
        if until(doc):
            return doc
        assert time.monotonic() < deadline, doc
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["compute-1", "compute-2"])
def test_cluster_job_daemons_kill_9_mid_job_export_equals_engine(tmp_path, corpus, engine, victim):
    with running_cluster(tmp_path / "cluster", storage=3, compute=3, transport="tcp",
                         compute_options=COMPUTE) as cluster:
        path = cluster.corpus_dir / "train.conllu"
        write_conllu(corpus, path)
        cluster.wait_converged()
        receiver = cluster.node("compute-1")
        other = cluster.node("compute-3")  # never killed: asked for the job throughout
        job = receiver.admin.json("POST", "/v1/train", {"corpus": str(path)})
        doc = wait_doc(other.admin, job["job_id"], lambda d: d.get("state") not in ("running", None) or (
            d.get("phase") == "training" and d["by_node"].get(victim, {}).get("leases_held", 0) > 0), 40)
        assert doc["state"] == "running", doc  # the victim holds a lease of the training stage
        cluster.kill(cluster.node(victim))
        if victim != "compute-1":
            cluster.add_node("compute-4", ["compute"])  # joins mid-job and takes part
        doc = wait_doc(other.admin, job["job_id"], lambda d: d.get("state") not in ("running", None), 45)
        assert doc["state"] == "succeeded", doc
        assert doc["done"] == doc["total"] == N_SENTENCES
        assert doc["by_node"][victim]["leases_expired"] >= 1, doc["by_node"]
        out = cluster.export_dir / "cluster.jsonl"
        other.admin.json("POST", "/v1/export", {"path": str(out)})
    ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == len(ref) > 5000
    for a, b in zip(ref, got):
        assert (a["source_word"], a["segment"], a["target_word"]) == (b["source_word"], b["segment"], b["target_word"])
        assert b["strength"] == pytest.approx(a["strength"], rel=1e-5)
