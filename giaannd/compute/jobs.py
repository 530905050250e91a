"""Job registry and training progress: what ``GET /v1/jobs/{id}`` and ``/metrics`` show.

A job is one asyncio task (a training run) with a :class:`TrainProgress` that the pipeline updates
as batches are acknowledged. ``as_dict`` is the admin API's job document: ``state`` (running |
succeeded | failed | cancelled), ``done`` / ``total`` / ``unit`` (what giaannctl's progress bar
draws), and the pipeline's figures (sentences/s, bytes sent, coalescing ratio, retries, batches).
A job resumed from its journal after a restart keeps its id and shows ``resumed_from`` (the
sentences an earlier run had acknowledged; ``done`` starts there, and the other counters at what
earlier runs counted, job_journal.py ``figures``) and ``resumes`` (how many times).

Counters also go to a :class:`ProgressSink` (the service's Prometheus counters) as they change, so
``/metrics`` sees totals across jobs without polling the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from giaannd.compute.timeline import Timeline

__all__ = ["Job", "JobRegistry", "JobState", "ProgressSink", "TrainProgress"]

log = logging.getLogger(__name__)

JobState = Literal["running", "succeeded", "failed", "cancelled"]

#: Finished jobs kept for ``GET /v1/jobs/{id}``; older ones are forgotten first.
MAX_FINISHED_JOBS: Final = 64


class ProgressSink(Protocol):
    """Receives counter increments (e.g. Prometheus counters)."""

    def add(self, name: str, amount: float) -> None: ...


@dataclass
class TrainProgress:
    """Figures of one training job (all counters only grow)."""

    total: int = 0
    #: sentences read from the corpus and handled (trained, or skipped by column assignment)
    done: int = 0
    trained: int = 0
    skipped: int = 0
    tokens: int = 0
    batches: int = 0
    retries: int = 0
    bytes_sent: int = 0
    #: entries of the per-micro-batch deltas, and of the coalesced batches actually sent
    entries_before: int = 0
    entries_after: int = 0
    flags_sent: int = 0
    flags_learned: int = 0
    #: sentences of raw text this node tagged for cluster jobs (their flag pass)
    tagged: int = 0
    #: sentences an earlier run of this job had acknowledged when this run resumed it (None: not
    #: resumed); ``done`` starts there
    resumed_from: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    sink: ProgressSink | None = None
    #: done / trained / bytes_sent sampled over the job's life (timeline.py); its first point is
    #: taken here, at creation (the counters a resumed job starts from: ``resume_at``)
    timeline: Timeline = field(default_factory=Timeline)

    def __post_init__(self) -> None:
        self._sample(time.time())

    def add(self, **amounts: int) -> None:
        """Increase counters by name (and tell the sink); samples the timeline when due."""
        for name, amount in amounts.items():
            setattr(self, name, getattr(self, name) + amount)
            if self.sink is not None and amount:
                self.sink.add(name, amount)
        now = time.time()
        if self.timeline.due(now):
            self._sample(now)

    def resume_at(self, done: int, figures: Mapping[str, int] | None = None) -> None:
        """A resumed run starts at ``done`` sentences an earlier run acknowledged (``resumed_from``)
        and at the ``figures`` it counted (other counters, by name). Not told to the sink: the
        earlier run did, and ``/metrics`` counts each window once."""
        self.done = self.resumed_from = done
        for name, amount in (figures or {}).items():
            setattr(self, name, amount)
        if len(self.timeline.points) == 1:  # nothing happened since the start point: it starts here
            self.timeline.points.clear()
        self._sample(time.time())

    def finish(self) -> None:
        """The job ended: its end time and the timeline's final point."""
        self.finished_at = time.monotonic()
        self._sample(time.time())

    def _sample(self, now: float) -> None:
        self.timeline.record(now, self.done, self.trained, self.bytes_sent)

    @property
    def elapsed_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return max(end - self.started_at, 1e-9)

    @property
    def coalescing_ratio(self) -> float:
        """entries before / after coalescing (≥ 1; 1.0 before anything was sent)."""
        return self.entries_before / self.entries_after if self.entries_after else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "done": self.done, "total": self.total, "unit": "sentences",
            "trained": self.trained, "skipped": self.skipped, "tokens": self.tokens,
            # this run's rate: what earlier runs acknowledged (``resumed_from``) took their time
            "sentences_per_s": round((self.done - (self.resumed_from or 0)) / self.elapsed_s, 1),
            "batches": self.batches, "retries": self.retries, "bytes_sent": self.bytes_sent,
            "bytes_per_sentence": round(self.bytes_sent / self.done, 1) if self.done else 0.0,
            "entries_before": self.entries_before, "entries_after": self.entries_after,
            "coalescing_ratio": round(self.coalescing_ratio, 4),
            "flags_sent": self.flags_sent, "flags_learned": self.flags_learned, "tagged": self.tagged,
            "elapsed_s": round(self.elapsed_s, 3), "resumed_from": self.resumed_from,
            "timeline": self.timeline.as_dict(),
        }


@dataclass(eq=False)
class Job:
    """One job: its task, state and progress."""

    job_id: str
    kind: str
    progress: TrainProgress
    state: JobState = "running"
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    task: asyncio.Task[Any] | None = None
    #: how many times this job was resumed from its journal (0: a first run)
    resumes: int = 0
    #: an operator's ``train cancel`` ended it (``cancel``): over for good, unlike a shutdown's
    #: cancellation, after which a journaled job resumes on the node's next start
    cancel_requested: bool = False

    def cancel(self) -> None:
        """End the job at an operator's request (``train cancel``): its task is cancelled and a
        journaled job's journal removed (durable_jobs.py), so no restart resumes it."""
        if self.task is not None and self.state == "running":
            self.cancel_requested = True
            self.task.cancel()

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"job_id": self.job_id, "kind": self.kind, "state": self.state}
        doc.update(self.progress.as_dict())
        doc["resumes"] = self.resumes
        if self.error:
            doc["error"] = self.error
        if self.result:
            doc["result"] = self.result
        return doc


class JobRegistry:
    """Running and recently finished jobs of this node."""

    def __init__(self, max_finished: int = MAX_FINISHED_JOBS) -> None:
        self._jobs: dict[str, Job] = {}
        self._max_finished = max_finished

    def start(self, kind: str, progress: TrainProgress,
              run: Callable[[Job], Coroutine[Any, Any, dict[str, Any]]],
              spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]] | None = None,
              *, job_id: str | None = None, resumes: int = 0) -> Job:
        """Register a job and start ``run(job)`` as a task; its return value becomes ``result``.
        ``job_id`` keeps a journaled job's id across restarts (default: a fresh random id)."""
        job = Job(job_id or secrets.token_hex(8), kind, progress, resumes=resumes)
        self._jobs[job.job_id] = job
        self._forget_old()
        coro = self._supervise(job, run)
        job.task = spawn(coro) if spawn is not None else asyncio.get_running_loop().create_task(coro)
        return job

    async def _supervise(self, job: Job, run: Callable[[Job], Coroutine[Any, Any, dict[str, Any]]]) -> None:
        try:
            job.result = await run(job)
            job.state = "succeeded"
        except asyncio.CancelledError:
            job.state = "cancelled"
            job.error = job.error or "cancelled"
        except Exception as exc:  # a job's failure is reported through its state, not raised
            log.exception("job failed job=%s kind=%s", job.job_id, job.kind)
            job.state = "failed"
            job.error = f"{type(exc).__name__}: {exc}"
        finally:
            job.progress.finish()

    def add_finished(self, job_id: str, kind: str, state: JobState, error: str,
                     progress: TrainProgress | None = None) -> Job:
        """Register a job that is over without a task (a failed or corrupt journal found at start)."""
        job = Job(job_id, kind, progress or TrainProgress(), state=state, error=error)
        job.progress.finish()
        job.progress.finished_at = job.progress.started_at
        self._jobs[job_id] = job
        self._forget_old()
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def running(self) -> list[Job]:
        return [j for j in self._jobs.values() if j.state == "running"]

    def all(self) -> list[Job]:
        return list(self._jobs.values())

    async def cancel_all(self) -> None:
        """Cancel every running job and wait for them to end."""
        tasks = [j.task for j in self.running() if j.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def wait_all(self, timeout_s: float | None = None) -> bool:
        """Wait for running jobs to finish; False if some were still running at the timeout."""
        tasks = {j.task for j in self.running() if j.task is not None}
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        return not pending

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if j.state != "running"]
        for job in finished[: max(0, len(finished) - self._max_finished)]:
            del self._jobs[job.job_id]
