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


async def _crashed_job(tmp_path, cfg, n_sentences, at_least):
    """A journaled job on a mem:// cluster, its task cancelled once ``at_least`` sentences are done
    (the crash): (cluster, data dir, job id)."""
    path = tmp_path / "train.conllu"
    write_conllu(load_bundled_corpus(n_sentences), path)
    cluster = await Cluster(tmp_path / "storage", 3).start()
    data = tmp_path / "compute"
    first = ComputeService(cfg, data, storage=cluster.client)
    await first.start()
    job = await first.submit_corpus(path)
    await _wait(lambda: job.progress.done >= at_least or job.state != "running")
    assert job.state == "running"
    job.task.cancel()
    await asyncio.gather(job.task, return_exceptions=True)
    [journal] = load_journals(data)
    assert journal.doc.state == "running" and journal.doc.cursor > 0
    return cluster, data, job.job_id


@pytest.mark.asyncio
async def test_compute_giaann_v2_job_resumes_after_crash(tmp_path):
    """A giaann-v2 job trains sequences of three sentences: its journal must bind it to what it
    trains, so that the restarted node resumes it (it failed: "the corpus now reads as 300
    sentences ..., the job started on 100")."""
    cfg = ComputeConfig(train_workers=1, coalesce_k=4, model_profile="giaann-v2")
    cluster, data, job_id = await _crashed_job(tmp_path, cfg, 300, 30)
    try:
        second = ComputeService(cfg, data, storage=cluster.client)
        await second.start()
        await _wait(lambda: second.jobs.get(job_id) is not None)
        resumed = second.jobs.get(job_id)
        await asyncio.wait_for(asyncio.shield(resumed.task), 60)
        doc = resumed.as_dict()
        assert doc["state"] == "succeeded", doc
        assert doc["resumes"] == 1 and doc["resumed_from"] > 0 and doc["done"] == doc["total"] == 100
        assert load_journals(data) == []
        await second.stop(graceful=True)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_compute_concurrent_resumes_start_one_run(tmp_path):
    """Two ``train resume`` of one job at once (a retried request): one run starts, the other is
    refused as running. Both started before, the first run untracked (``train cancel`` could not
    reach it) and both writing the job's journal."""
    cfg = ComputeConfig(train_workers=1, coalesce_k=8, resume_jobs=False)
    cluster, data, job_id = await _crashed_job(tmp_path, cfg, 400, 40)
    try:
        second = ComputeService(cfg, data, storage=cluster.client)
        await second.start()  # compute.resume-jobs = false: the operator resumes it
        results = await asyncio.gather(second.resume(job_id), second.resume(job_id), return_exceptions=True)
        jobs = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, ValueError)]
        try:
            assert len(jobs) == 1 and len(refused) == 1, results
            assert "running" in str(refused[0])
        finally:
            await asyncio.gather(*(j.task for j in jobs), return_exceptions=True)
        [job] = jobs
        assert second.jobs.get(job_id) is job and job.state == "succeeded", job.as_dict()
        assert load_journals(data) == []
        await second.stop(graceful=True)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_compute_operator_resume_while_start_waits_for_storage_runs_once(tmp_path):
    """A node restarts while storage does not answer yet (its resume at start waits) and the
    operator resumes the job meanwhile: the start-up resume leaves it to that run instead of
    starting a second one over it."""
    cfg = ComputeConfig(train_workers=1, coalesce_k=8, resume_jobs=False)
    cluster, data, job_id = await _crashed_job(tmp_path, cfg, 400, 40)
    try:
        second = ComputeService(cfg, data, storage=cluster.client)
        await second.start()
        pending = await second.durable.reload()
        assert [j.job_id for j in pending] == [job_id]
        storage_up = asyncio.Event()
        waiting = asyncio.create_task(second.durable.resume_all(pending, storage_up.wait))
        await asyncio.sleep(0.05)
        job = await second.resume(job_id)  # the operator's
        storage_up.set()
        await asyncio.wait_for(waiting, 10)
        assert second.jobs.get(job_id) is job, "a second run of the job was started"
        await asyncio.wait_for(asyncio.shield(job.task), 60)
        assert job.state == "succeeded" and job.as_dict()["resumes"] == 1, job.as_dict()
        assert load_journals(data) == []
        await second.stop(graceful=True)
    finally:
        await cluster.close()
