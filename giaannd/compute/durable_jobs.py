"""Durable training jobs of one compute node: journal first, resume after a crash or a failure.

Theory of operation
-------------------
A job started on a corpus file (``submit``, behind ``POST /v1/train``) gets a journal
(job_journal.py: the job's spec, its writer id, its window cursor) on disk *before* its id is
returned, so from then on a crash of the node cannot lose it. The journal moves through:

- ``running``: while the job runs, and when the node stops under it (a shutdown's cancellation
  leaves the journal as it is);
- ``failed``: the job raised; the journal is kept with the error, so an operator can ``resume`` it;
- removed: the job succeeded, or an operator cancelled it (``Job.cancel``: it is over, and a
  restart must not train it again), even while a failed run was writing its ``failed`` record
  (removed once that write is on disk).

One run of a job at a time: ``resume`` refuses a job that is running or being resumed, and
``resume_all`` leaves a job an operator resumed while it waited for storage to that run.

On start the service calls ``reload``: every journal found is classified. Running ones are handed
back to be resumed (config ``compute.resume-jobs``); ``resume_all`` waits until storage answers
(``probe``, with full-jitter backoff doubling up to ``RESUME_RETRY_MAX_S``, peers/retry.py: right after
start the node's storage view may still be forming), then restarts each under its writer id from its
cursor. Failed ones are listed as failed jobs; corrupt ones are listed as failed with the file's
error and left on disk.

A resumed job re-reads its corpus and checks it is the one it started with (SHA-256 of the file
here, then train.py checks a digest of the sequences it trains: the tagged sentences, joined three
by three under giaann-v2): a changed corpus would make its windows differ from those
already sent, so it is not resumed. Resuming reuses the job's writer id and batch ids on purpose:
storage drops the batches it already applied.

``train`` / ``submit`` with in-memory sentences (tests, bench) keep no journal; they are the
service's, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Final

from giaannd.compute.job_journal import (
    JobJournal,
    JobSpec,
    JournalCorrupt,
    JournalWriter,
    corpus_sha256,
    load_journals,
)
from giaannd.compute.jobs import Job, JobRegistry, TrainProgress
from giaannd.compute.train import TrainResult, TrainSettings, load_corpus
from giaannd.model.tokens import TaggedSentence
from peers.retry import RetryPolicy, retry

__all__ = ["RESUME_RETRY_MAX_S", "TAG_CACHE_DIR", "DurableJobs", "journal_progress"]

# Logged under the compute service's name, as before this module left service.py.
log = logging.getLogger("giaannd.compute.service")

#: Longest wait between tries to reach storage before resuming journaled jobs at start.
RESUME_RETRY_MAX_S: Final = 2.0
#: Those tries: a first wait of up to 0.1 s (full jitter, peers/retry.py), doubling to the cap, forever.
RESUME_PROBE_RETRY: Final = RetryPolicy(0.1, RESUME_RETRY_MAX_S)
#: Under the node's data directory: tagged text corpora, cached (train.py ``load_corpus``).
TAG_CACHE_DIR: Final = "tag-cache"

#: Runs one training job to its end (``ComputeService.train``).
Train = Callable[[Sequence[TaggedSentence], TrainSettings, TrainProgress, JournalWriter],
                 Awaitable[TrainResult]]
#: Starts a registered job: ``run(job)`` as a task (``ComputeService._launch``).
Launch = Callable[..., Job]


def journal_progress(journal: JobJournal) -> TrainProgress:
    """A finished job's figures as its journal knows them (sentences acknowledged, the counters
    of those windows)."""
    total = journal.doc.total_sentences
    progress = TrainProgress(total=total, done=journal.acknowledged_sentences(total))
    for name, amount in journal.figures().items():
        setattr(progress, name, amount)
    return progress


async def _cancelled(job: Job, writer: JournalWriter) -> None:
    """A run of ``job`` was cancelled: an operator's ``train cancel`` ends the job for good (its
    journal removed, nothing to resume); a shutdown's cancellation leaves the journal as it is."""
    if job.cancel_requested:
        await asyncio.shield(asyncio.to_thread(writer.remove))


class DurableJobs:
    """The journaled training jobs under ``data_dir`` (module docstring).

    Args:
        data_dir: the compute role's data directory (journals, tag cache).
        registry: the node's job registry (failed and corrupt journals are listed there).
        train: runs one job with its journal writer.
        summary: a succeeded job's result document.
        launch: ``launch(run, job_id=..., resumes=...)`` registers and starts a job.
        require_storage: raises if the node has no storage client yet (called before any work).
        settings: ``settings(workers, coalesce)``: the node's training settings for a job resumed
            here (``ComputeService.train_settings``: ``compute.device`` among them); default
            ``TrainSettings`` with those two. A submitted job runs with the settings given to ``submit``.
    """

    def __init__(self, data_dir: Path, registry: JobRegistry, *, train: Train,
                 summary: Callable[[TrainResult], dict[str, Any]],
                 launch: Launch, require_storage: Callable[[], object],
                 settings: Callable[[int, int], TrainSettings] | None = None) -> None:
        self.data_dir = data_dir
        self.registry = registry
        self._train = train
        self._summary = summary
        self._launch = launch
        self._require_storage = require_storage
        self._settings = settings or (lambda workers, k: TrainSettings(workers=workers, coalesce_sentences=k))
        #: jobs ``resume`` / ``resume_all`` are starting (not yet running in the registry)
        self._resuming: set[str] = set()

    async def submit(self, corpus: str | Path, settings: TrainSettings, epochs: int,
                     limit: int | None) -> Job:
        """Journal a job on ``corpus`` (on disk before this returns), then start it."""
        path = Path(corpus).resolve()
        digest = await asyncio.to_thread(corpus_sha256, path)
        spec = JobSpec(str(path), digest, limit, epochs, settings.workers, settings.coalesce_sentences)
        writer = JournalWriter(self.data_dir, JobJournal.create(spec))
        await asyncio.to_thread(writer.save_now)
        return self.start(writer, settings)

    def start(self, writer: JournalWriter, settings: TrainSettings | None = None) -> Job:
        """Run the journaled job of ``writer`` from its cursor (module docstring), with ``settings``
        (default: the node's, ``settings`` of the constructor); workers and K are the journal's."""
        journal = writer.journal
        spec = journal.doc.spec
        if settings is None:
            settings = self._settings(spec.workers, spec.coalesce)
        settings = dataclasses.replace(settings, workers=spec.workers, coalesce_sentences=spec.coalesce)
        cache_dir = self.data_dir / TAG_CACHE_DIR

        def load() -> list[TaggedSentence]:
            if corpus_sha256(spec.corpus) != spec.corpus_sha256:
                raise ValueError(f"corpus {spec.corpus} changed since the job started (SHA-256 differs): "
                                 "not resumed, its windows would differ from those already sent")
            # the digest of what is trained is checked by the job (train.py), which knows the profile
            return load_corpus(spec.corpus, cache_dir, spec.limit) * spec.epochs

        async def run(job: Job) -> dict[str, Any]:
            try:
                data = await asyncio.to_thread(load)
                result = await self._train(data, settings, job.progress, writer)
            except asyncio.CancelledError:
                await _cancelled(job, writer)
                raise  # a shutdown: the journal stays "running" and the job resumes on restart
            except Exception as exc:
                journal.finish("failed", f"{type(exc).__name__}: {exc}")
                try:
                    with contextlib.suppress(OSError):  # the job's own error is the one to report
                        await writer.commit()
                except asyncio.CancelledError:
                    # a ``train cancel`` landed while the failure was written (the job still
                    # showed running): the commit ended after its write, so removing comes last
                    await _cancelled(job, writer)
                    raise
                raise
            await asyncio.to_thread(writer.remove)
            return self._summary(result)

        return self._launch(run, job_id=journal.job_id, resumes=journal.doc.resumes)

    async def resume(self, job_id: str) -> Job:
        """``ComputeService.resume`` (its docstring)."""
        if self._busy(job_id):
            raise ValueError(f"job {job_id} is running")
        self._require_storage()
        self._resuming.add(job_id)
        try:
            found = [j for j in await asyncio.to_thread(load_journals, self.data_dir)
                     if (j.job_id if isinstance(j, JobJournal) else Path(j.file_path).stem) == job_id]
            if not found:
                raise KeyError(job_id)
            journal = found[0]
            if isinstance(journal, JournalCorrupt):
                raise ValueError(str(journal))
            journal.reopen()
            writer = JournalWriter(self.data_dir, journal)
            await writer.commit()
            return self.start(writer)
        finally:
            self._resuming.discard(job_id)

    def _busy(self, job_id: str) -> bool:
        """Whether a run of ``job_id`` is running or being started (``resume``)."""
        current = self.registry.get(job_id)
        return job_id in self._resuming or (current is not None and current.state == "running")

    async def reload(self) -> list[JobJournal]:
        """Classify the journals on disk (module docstring): failed and corrupt ones go to the
        registry; returns the running ones, to resume."""
        journals = await asyncio.to_thread(load_journals, self.data_dir)
        pending: list[JobJournal] = []
        for item in journals:
            if isinstance(item, JournalCorrupt):
                log.error("training job journal is corrupt (left in place, job not resumed): %s", item)
                self.registry.add_finished(Path(item.file_path).stem, "train", "failed", f"corrupt journal: {item}")
            elif item.doc.state == "failed":
                self.registry.add_finished(item.job_id, "train", "failed", item.doc.error, journal_progress(item))
            elif item.doc.state == "running":
                pending.append(item)
        return pending

    async def resume_all(self, journals: Sequence[JobJournal],
                         probe: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Resume unfinished journaled jobs once ``probe()`` (a storage read) succeeds."""
        # never fail the node over this: keep waiting for storage (no attempt limit)
        await retry(probe, RESUME_PROBE_RETRY, retry_on=Exception,
                    on_retry=lambda failures, exc, wait_s: log.info(
                        "waiting for storage before resuming %d job(s): %s", len(journals), exc))
        for journal in journals:
            if journal.job_id in self._resuming or self.registry.get(journal.job_id) is not None:
                # an operator resumed it meanwhile (``resume``): that run goes on, or has ended
                log.info("training job job=%s already resumed", journal.job_id)
                continue
            journal.reopen()
            writer = JournalWriter(self.data_dir, journal)
            self._resuming.add(journal.job_id)
            try:
                await writer.commit()
            except OSError as exc:
                log.error("cannot update journal %s, job %s not resumed: %s", writer.path, journal.job_id, exc)
                continue
            finally:
                self._resuming.discard(journal.job_id)
            log.info("resuming training job job=%s cursor=%d of %d windows", journal.job_id,
                     journal.doc.cursor, -(-journal.doc.total_sentences // journal.doc.spec.coalesce))
            self.start(writer)
