"""A resumed training job's document continues every figure an earlier run of the job counted
(trained, tokens, batches, bytes...), not only ``done``. Fakes of test_job_journal.py; no sleeps."""

import msgspec
import pytest

from giaannd.compute.durable_jobs import journal_progress
from giaannd.compute.job_journal import JobFigures, JobJournal, JobSpec, JournalWriter, load_journals
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.train import TrainingJob, TrainSettings
from giaannd.model.tokens import load_bundled_corpus
from tests.unit.compute.test_job_journal import Client, Storage
from tests.unit.compute.test_job_review import FailingClient, Sink

#: the figures counted with each acknowledged window (``done`` is the journal's cursor)
WINDOW_FIGURES = ("trained", "skipped", "tokens", "batches", "bytes_sent", "entries_before", "entries_after",
                  "flags_sent")


@pytest.fixture(scope="module")
def sentences():
    return load_bundled_corpus(240)


@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [1, 3])
async def test_resumed_job_continues_the_figures_of_its_earlier_run(tmp_path, sentences, workers):
    """Window 2's write fails past its attempts, later windows are acknowledged: the job fails.
    Resumed from its journal as a restarted node does (the journal loaded from disk), the job's
    document ends with the figures of an uninterrupted run, while /metrics counts each once."""
    storage, sink = Storage(), Sink()
    settings = TrainSettings(workers=workers, coalesce_sentences=20, retry_backoff_s=0, max_attempts=1)
    writer = JournalWriter(tmp_path, JobJournal.create(JobSpec("/x", "00", None, 1, workers, 20),
                                                       job_id="feed", writer_id=42))
    writer.save_now()
    first = TrainingJob(sentences, FailingClient(storage, failing={3}), settings, TrainProgress(sink=sink),
                        journal=writer)
    with pytest.raises(OSError):
        await first.run()
    writer.journal.finish("failed", "OSError")  # what durable_jobs does when a run raises
    await writer.commit()
    assert first.progress.trained > 0

    [journal] = load_journals(tmp_path)  # a new process: only the journal is left
    listed = journal_progress(journal)  # the failed job as ``train list`` shows it after a restart
    assert (listed.done, listed.trained, listed.bytes_sent) == (
        first.progress.done, first.progress.trained, first.progress.bytes_sent)
    journal.reopen()
    again = TrainingJob(sentences, Client(storage), settings, TrainProgress(sink=sink),
                        journal=JournalWriter(tmp_path, journal))
    await again.run()
    reference = TrainingJob(sentences, Client(Storage()), settings)
    await reference.run()
    got = {name: getattr(again.progress, name) for name in WINDOW_FIGURES}
    want = {name: getattr(reference.progress, name) for name in WINDOW_FIGURES}
    assert again.progress.done == len(sentences)
    assert again.progress.trained + again.progress.skipped == again.progress.done
    assert got == want
    # the earlier run's figures are the job's, not new work: /metrics still counts each once
    assert {name: sink.totals.get(name, 0) for name in WINDOW_FIGURES} == want



def test_journal_figures_are_booked_with_their_window_and_kept_on_disk():
    j = JobJournal.create(JobSpec("/x", "00", None, 1, 1, 10), job_id="ab", writer_id=1)
    j.begin((), 40)
    before = j.encode()
    assert isinstance(j.doc.figures, msgspec.UnsetType)  # nothing counted: the old bytes (fixture test)
    assert not j.acknowledge(1, 0, {"trained": 9, "batches": 1})  # past the cursor: booked all the same
    assert j.acknowledge(0, 0, {"trained": 10, "batches": 1})
    assert not j.acknowledge(0, 0, {"trained": 10, "batches": 1})  # an old window is not counted again
    j.count(retries=2)
    back = JobJournal.decode(j.encode())
    assert back.doc.figures == JobFigures(trained=19, batches=2, retries=2)
    assert back.figures()["trained"] == 19 and JobJournal.decode(before).figures()["trained"] == 0


def test_a_resumed_jobs_rate_is_its_own_runs() -> None:
    """``sentences_per_s`` of a resumed job counts the sentences this run handled, not those an
    earlier run acknowledged (``resumed_from``) over this run's time (it showed 11× the rate here)."""
    progress = TrainProgress(total=200)
    progress.resume_at(100)
    progress.add(done=10)
    progress.started_at, progress.finished_at = 0.0, 2.0
    assert progress.as_dict()["sentences_per_s"] == 5.0
    assert progress.as_dict()["done"] == 110
