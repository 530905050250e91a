"""A training job that survives its compute node: crash mid-job, resume from the journal, count once.

In-process: a mem:// storage cluster of 3 (R=3), a ComputeService training through the admin API's
code path (``submit_corpus``: journaled), the job task cancelled mid-way (the crash: in-flight
writes may have reached some replicas), then a *new* service on the same data directory resumes the
job on start. The export must equal the single-process engine's exactly as a one-worker job without
a crash does (test_compute_cluster.py).
"""

import asyncio
import json

import pytest

from giaannd.compute.job_journal import load_journals
from giaannd.compute.service import ComputeService
from giaannd.config import ComputeConfig
from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(120)]

N_SENTENCES = 600


async def _wait(predicate, timeout_s=60.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def assert_export_equals_engine(path, engine, min_lines=5000):
    ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    got = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(got) == len(ref) > min_lines
    for a, b in zip(ref, got):
        assert {k: v for k, v in a.items() if k != "strength"} == {k: v for k, v in b.items() if k != "strength"}
        assert b["strength"] == pytest.approx(a["strength"], rel=1e-5)


@pytest.mark.asyncio
async def test_compute_job_resumes_after_crash_and_equals_engine(tmp_path):
    corpus = load_bundled_corpus(N_SENTENCES)
    path = tmp_path / "train.conllu"
    write_conllu(corpus, path)
    engine = Engine()
    engine.train(corpus)
    cluster = await Cluster(tmp_path / "storage", 3).start()
    data = tmp_path / "compute"
    cfg = ComputeConfig(train_workers=1, coalesce_k=16)
    try:
        first = ComputeService(cfg, data, storage=cluster.client)
        await first.start()
        job = await first.submit_corpus(path)
        await _wait(lambda: job.progress.done >= N_SENTENCES // 3 or job.state != "running")
        assert job.state == "running" and job.as_dict()["resumed_from"] is None
        job.task.cancel()  # the crash (kill -9 has no clean-up either: the journal says "running")
        await asyncio.gather(job.task, return_exceptions=True)
        [journal] = load_journals(data)
        assert journal.doc.state == "running" and 0 < journal.doc.cursor < -(-N_SENTENCES // 16)
        crashed_at = job.progress.done

        second = ComputeService(cfg, data, storage=cluster.client)
        await second.start()  # resumes the job from its journal
        await _wait(lambda: second.jobs.get(job.job_id) is not None)
        resumed = second.jobs.get(job.job_id)
        await asyncio.wait_for(asyncio.shield(resumed.task), 90)
        doc = resumed.as_dict()
        assert doc["state"] == "succeeded", doc
        assert doc["resumes"] == 1 and 0 < doc["resumed_from"] <= crashed_at
        assert doc["done"] == doc["total"] == N_SENTENCES
        # the resumed run's timeline starts where it resumed and ends at the job's end
        assert doc["timeline"]["done"][0] == doc["resumed_from"] and doc["timeline"]["done"][-1] == N_SENTENCES
        assert load_journals(data) == []  # a finished job leaves no journal
        out = tmp_path / "export.jsonl"
        await second.export(out)
        assert_export_equals_engine(out, engine)  # 0 lost, 0 double-counted
        await second.stop(graceful=True)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_compute_changed_corpus_fails_and_an_operator_resume_completes_it(tmp_path):
    corpus = load_bundled_corpus(200)
    path = tmp_path / "train.conllu"
    write_conllu(corpus, path)
    cluster = await Cluster(tmp_path / "storage", 3).start()
    data = tmp_path / "compute"
    cfg = ComputeConfig(train_workers=1, coalesce_k=8)
    try:
        first = ComputeService(cfg, data, storage=cluster.client)
        await first.start()
        job = await first.submit_corpus(path)
        await _wait(lambda: job.progress.done >= 40 or job.state != "running")
        job.task.cancel()
        await asyncio.gather(job.task, return_exceptions=True)
        write_conllu(corpus[:150], path)  # the file changes while the node is down
        second = ComputeService(cfg, data, storage=cluster.client)
        await second.start()
        await _wait(lambda: (j := second.jobs.get(job.job_id)) is not None and j.state != "running")
        doc = second.jobs.get(job.job_id).as_dict()
        assert doc["state"] == "failed" and "changed since the job started" in doc["error"]
        [journal] = load_journals(data)  # kept for the operator, not resumed again
        assert journal.doc.state == "failed"
        third = ComputeService(cfg, data, storage=cluster.client)
        await third.start()
        assert third.jobs.get(job.job_id).state == "failed"
        # the operator puts the file back and resumes (POST /v1/jobs/{id}/resume): counted once
        write_conllu(corpus, path)
        with pytest.raises(KeyError):
            await third.resume("no-such-job")
        again = await third.resume(job.job_id)
        with pytest.raises(ValueError):
            await third.resume(job.job_id)  # running
        await asyncio.wait_for(asyncio.shield(again.task), 60)
        doc = again.as_dict()
        assert doc["state"] == "succeeded" and doc["resumes"] == 2 and doc["done"] == 200, doc
        engine = Engine()
        engine.train(corpus)
        out = tmp_path / "export.jsonl"
        await third.export(out)
        assert_export_equals_engine(out, engine, min_lines=1000)
    finally:
        await cluster.close()
