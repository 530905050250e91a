"""Durable jobs (durable_jobs.py) and an operator's ``train cancel`` that lands while a failed job
writes its "failed" journal: the cancel must still remove the journal (the job is over for good).
No sleeps: the journal write is held in its thread by an event."""

import asyncio
import threading

import pytest

import giaannd.compute.job_journal as job_journal
from giaannd.compute.durable_jobs import DurableJobs
from giaannd.compute.job_journal import JobJournal, JobSpec, JournalWriter, corpus_sha256, load_journals
from giaannd.compute.jobs import JobRegistry, TrainProgress
from giaannd.compute.train import TrainSettings


def _durable(tmp_path, registry, train):
    def launch(run, *, job_id, resumes):
        return registry.start("train", TrainProgress(), run, job_id=job_id, resumes=resumes)

    return DurableJobs(tmp_path, registry, train=train, summary=lambda result: {}, launch=launch,
                       require_storage=lambda: None)


@pytest.mark.asyncio
async def test_durable_job_cancelled_while_its_failure_is_written_is_not_kept(tmp_path, monkeypatch):
    corpus = tmp_path / "empty.conllu"  # no sentences: the job's train fails at once anyway
    corpus.write_bytes(b"")
    spec = JobSpec(str(corpus), corpus_sha256(corpus), None, 1, 1, 10)
    writer = JournalWriter(tmp_path, JobJournal.create(spec, job_id="feed", writer_id=42))
    writer.save_now()

    entered, release = threading.Event(), threading.Event()
    real = job_journal.atomic_write_bytes

    def gated(path, data):  # the "failed" record's write: a slow fsync, held until released
        entered.set()
        release.wait(10)
        real(path, data)

    monkeypatch.setattr(job_journal, "atomic_write_bytes", gated)

    async def train(data, settings, progress, journal_writer):
        raise OSError("storage unreachable")

    registry = JobRegistry()
    job = _durable(tmp_path, registry, train).start(writer, TrainSettings())
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        job.cancel()  # the operator's ``train cancel`` while the failure is being written
    finally:
        release.set()
    assert job.task is not None
    await asyncio.wait_for(job.task, 10)
    assert job.state == "cancelled"
    # an operator-cancelled job leaves no journal: no restart or ``train resume`` trains it again
    assert load_journals(tmp_path) == []
