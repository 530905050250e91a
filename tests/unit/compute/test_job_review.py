"""Node-local training jobs under cancellation and resume (review findings): a job cancelled more
than once ends only after its journal writes, and an operator's resume neither lowers nor
double-counts what the failed run acknowledged. Fakes of test_job_journal.py; no sleeps."""

import asyncio
import threading

import pytest

import giaannd.compute.job_journal as job_journal
from giaannd.compute.job_journal import JobJournal, JobSpec, JournalWriter, load_journals
from giaannd.compute.train import TrainingJob, TrainSettings
from giaannd.model.tokens import load_bundled_corpus
from tests.unit.compute.test_job_journal import Client, Storage


@pytest.fixture(scope="module")
def sentences():
    return load_bundled_corpus(240)


def _writer(tmp_path, workers=1):
    spec = JobSpec("/x", "00", None, 1, workers, 20)
    writer = JournalWriter(tmp_path, JobJournal.create(spec, job_id="feed", writer_id=42))
    writer.save_now()
    return writer


@pytest.mark.asyncio
@pytest.mark.parametrize("gated_write", [1, 2, 3])
async def test_training_job_cancelled_twice_ends_only_after_its_journal_write(tmp_path, sentences, monkeypatch,
                                                                            gated_write):
    """``train cancel`` then a second cancel (another ``train cancel``, or the node's shutdown
    cancelling its running jobs) while a journal write is in its thread: the run must not end
    before that write, or durable_jobs removes the journal first and the write puts it back (a
    cancelled job resumed by the next start). Write 1 is the job's start record (``begin``), 2
    window 0's start record, 3 a later one (window records and cursor moves)."""
    writer = _writer(tmp_path)
    entered, release, written = threading.Event(), threading.Event(), threading.Event()
    real = job_journal.atomic_write_bytes
    count = 0

    def gated(path, data):
        nonlocal count
        count += 1
        if count != gated_write:
            return real(path, data)
        entered.set()  # a slow fsync: this write is in its thread until released
        release.wait()
        real(path, data)
        written.set()

    monkeypatch.setattr(job_journal, "atomic_write_bytes", gated)
    job = TrainingJob(sentences, Client(Storage()), TrainSettings(coalesce_sentences=20, retry_backoff_s=0),
                      journal=writer)
    task = asyncio.create_task(job.run())
    await asyncio.to_thread(entered.wait)
    task.cancel()  # the operator's train cancel
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()  # a second one
    for _ in range(50):  # the event loop alone: the journal write stays blocked in its thread
        await asyncio.sleep(0)
    ended_early = task.done()
    if ended_early:
        writer.remove()  # what durable_jobs does for an operator's cancel once the run has ended
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(written.wait)
    if not ended_early:
        writer.remove()
    assert load_journals(tmp_path) == []  # the cancelled job's journal is gone for good
    assert not ended_early, "the run ended while its journal write was still in flight"


class FailingClient(Client):
    """``Client`` whose writes of some seqs fail (storage refusing them past the job's attempts)."""

    def __init__(self, storage, failing=(), **kw):
        super().__init__(storage, **kw)
        self.failing = set(failing)

    async def write(self, batch, batch_id):
        if batch_id.seq in self.failing:
            raise OSError(f"seq {batch_id.seq}: storage unreachable")
        await super().write(batch, batch_id)


class Sink:
    """/metrics: the sum of every increment the job documents pass on."""

    def __init__(self):
        self.totals = {}

    def add(self, name, amount):
        self.totals[name] = self.totals.get(name, 0) + amount


@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [1, 3])
async def test_operator_resume_neither_lowers_nor_double_counts_what_the_failed_run_acknowledged(
        tmp_path, sentences, workers):
    """Window 2's write fails past its attempts while later windows are acknowledged (they were in
    flight together): the job fails with its cursor at 2. ``train resume`` (same process, same
    job id) must start ``done`` from everything the failed run acknowledged (``resumed_from``: "the
    sentences an earlier run had acknowledged"), not from the cursor, and must not count those
    later windows a second time in the node's counters."""
    from giaannd.compute.jobs import TrainProgress

    storage, sink = Storage(), Sink()
    settings = TrainSettings(workers=workers, coalesce_sentences=20, retry_backoff_s=0, max_attempts=1)
    writer = _writer(tmp_path, workers)
    first = TrainingJob(sentences, FailingClient(storage, failing={3}), settings, TrainProgress(sink=sink),
                        journal=writer)
    with pytest.raises(OSError):
        await first.run()
    # what durable_jobs does when a run raises, then what ``train resume`` does
    writer.journal.finish("failed", "OSError")
    await writer.commit()
    acknowledged = first.progress.done
    assert writer.journal.doc.cursor == 2 and acknowledged > 40  # windows past the failed one landed
    [journal] = load_journals(tmp_path)
    journal.reopen()
    again = TrainingJob(sentences, Client(storage), settings, TrainProgress(sink=sink),
                        journal=JournalWriter(tmp_path, journal))
    await again.run()
    assert again.progress.done == len(sentences)
    assert again.progress.resumed_from == acknowledged  # done never goes backwards for the job
    assert sink.totals["done"] == len(sentences)  # each sentence counted once across both runs
    reference = TrainingJob(sentences, Client(Storage()), settings)
    await reference.run()
    assert sink.totals["trained"] == reference.progress.trained
    assert sink.totals["tokens"] == reference.progress.tokens


def test_journal_keeps_windows_acknowledged_past_the_cursor():
    j = JobJournal.create(JobSpec("/x", "00", None, 1, 1, 10), job_id="ab", writer_id=1)
    j.begin((), 95)  # 10 windows, the last of 5 sentences
    assert not j.acknowledge(2, 0) and not j.acknowledge(9, 0)
    back = JobJournal.decode(j.encode())
    assert back.doc.acked == [2, 9]
    assert back.acknowledged_sentences(95) == 15
    assert back.acknowledge(0, 0) and back.acknowledge(1, 0)  # the gap closes: the cursor takes them
    assert back.doc.cursor == 3 and back.doc.acked == [9] and back.acknowledged_sentences(95) == 35
    back.doc.acked = [2]  # at or below the cursor: not a journal this code writes
    with pytest.raises(job_journal.JournalCorrupt, match="acknowledged windows"):
        JobJournal.decode(back.encode())


@pytest.mark.asyncio
async def test_durable_job_trains_with_the_settings_it_was_submitted_with(tmp_path):
    """``POST /v1/train`` (``submit_corpus``) journals the job and starts it with the node's
    settings (``train_settings``: ``compute.device`` among them); the run must get them, not a
    default ``TrainSettings`` (a node with ``compute.device = cuda`` trained on the CPU)."""
    from giaannd.compute.durable_jobs import DurableJobs
    from giaannd.compute.jobs import JobRegistry, TrainProgress
    from giaannd.compute.train import TrainResult
    from giaannd.model.tokens import write_conllu
    from giaannd.model.vocab import Vocabulary

    seen = []

    async def train(data, settings, progress, writer):
        seen.append(settings)
        return TrainResult(Vocabulary(), {}, set())

    registry = JobRegistry()
    durable = DurableJobs(tmp_path, registry, train=train, summary=lambda result: {},
                          launch=lambda run, **kw: registry.start("train", TrainProgress(), run, **kw),
                          require_storage=lambda: None)
    corpus = tmp_path / "c.conllu"
    write_conllu(load_bundled_corpus(10), corpus)
    settings = TrainSettings(workers=2, coalesce_sentences=5, device="cuda", max_attempts=9)
    job = await durable.submit(corpus, settings, 1, None)
    await job.task
    assert job.state == "succeeded" and seen == [settings]
