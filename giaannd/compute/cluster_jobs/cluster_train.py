"""Cluster training jobs on one compute node: create, follow, report and cancel (issue 15).

Theory of operation
-------------------
* **create** (``train start`` with ``cluster``): the receiving node picks a job id and a writer id,
  stores the flags storage holds now (the fold's initial slot, flag_pass.py), streams the corpus
  into the cluster one window at a time (corpus_chunks.py) and only then follows the job with a
  :class:`LeaseDriver` whose ``Begin`` carries the new :class:`JobRow` (2 stages: the flag pass,
  then training). A job row therefore always has its whole corpus in the cluster. Until it is
  written the job is its upload row (uploads.py: renewed by the uploader; adopted by another
  node when the uploader stops renewing it, which finishes the upload from the same corpus file
  or marks the job failed), phase ``uploading``.
* **follow**: every node with ``compute.cluster-jobs`` runs a watcher that reads the job index
  (``jobs``) every probe interval and follows each job listed that it does not follow yet, nodes
  that join mid-job included. A followed job is one driver over one lease agent; its windows are
  run by a :class:`WindowRunner`. When the driver ends (``done``, ``failed``, ``cancelled``), the
  job is remembered as ended here (``MAX_ENDED_JOBS``) so the watcher does not follow it again
  while the index still lists it; on ``done`` the node folds every window's findings into its own
  flag state (prompts are then encoded with the flags the job learned), and the node whose write
  ended the job empties its corpus chunks.
* **report**: any node builds a job's document from the registers (job row and every shard of
  every stage), so ``train status`` / ``list`` / ``wait`` work on any node for any job.
  ``by_node`` comes from the shards' tallies (lease_table.py ``Tally``).
* **cancel**: through a driver (this node's, started for the purpose if it followed none): its
  agent writes ``cancelled`` and takes the job off the index. During the upload, the upload row
  is set ``failed`` (the uploader's task stops, or, on another node, its next renewal does); an
  uploader checks its row once more before writing the job row, and cancels the job through its
  driver if the row turns out cancelled when it ends it; a canceller whose upload row had just
  ended cancels the job row instead.
* **stop**: each driver halts (written windows completed, the rest released at once), bounded by
  ``STOP_TIMEOUT_S``; a node that dies instead loses its leases at their expiry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import numpy as np

from giaannd.client.registers import ABSENT
from giaannd.client.storage_client import StorageClient
from giaannd.compute.cluster_jobs.corpus_chunks import (
    GROUP_WINDOWS,
    clear_windows,
    encode_texts,
    encode_window,
    upload_windows,
)
from giaannd.compute.cluster_jobs.flag_pass import INITIAL, encode_findings, findings_key, initial_findings
from giaannd.compute.cluster_jobs.lease_driver import LeaseDriver
from giaannd.compute.cluster_jobs.lease_events import Begin, Finished, LeaseSettings, RunWindow
from giaannd.compute.cluster_jobs.lease_table import (
    INDEX_KEY,
    JobRow,
    Shard,
    decode_index,
    decode_job,
    decode_shard,
    job_key,
    shard_key,
)
from giaannd.compute.cluster_jobs.leases import LeaseAgent
from giaannd.compute.cluster_jobs.tagging import WindowTagger
from giaannd.compute.cluster_jobs.uploads import (
    MAX_UPLOADS,
    UPLOADS_KEY,
    UploadIndex,
    UploadRow,
    UploadWatch,
    decode_upload,
    decode_uploads,
    encode,
    upload_key,
)
from giaannd.compute.cluster_jobs.window_runner import (
    RETRYABLE,
    STAGES,
    TRAIN_STAGE,
    ClusterSpec,
    WindowRunner,
    decode_spec,
    encode_spec,
)
from giaannd.compute.jobs import ProgressSink, TrainProgress
from giaannd.compute.timeline import SERIES, merge_timelines
from giaannd.compute.train import TrainSettings, read_flags
from giaannd.errors import CorruptDataError, Refused
from giaannd.model.lexicon import Lexicon
from giaannd.model.rows import RowBatch
from giaannd.model.tokens import TaggedSentence
from giaannd.model.vocab import Vocabulary

__all__ = ["MAX_ENDED_JOBS", "STOP_TIMEOUT_S", "ClusterJobs"]

log = logging.getLogger(__name__)

#: Ended jobs a node remembers (not followed again while the index lists them; listed by ``list``).
MAX_ENDED_JOBS: Final = 256
#: How long ``stop`` waits for the drivers to hand their leases back before cancelling them.
STOP_TIMEOUT_S: Final = 5.0
#: The error of a job, or of an upload, the operator cancelled (``train cancel``).
CANCELLED: Final = "cancelled by the operator"
#: Job row states -> the job document's (jobs.py) states.
_STATES: Final = {"created": "running", "running": "running", "done": "succeeded", "cancelled": "cancelled",
                  "failed": "failed"}


@dataclass
class _Followed:
    driver: LeaseDriver
    agent: LeaseAgent
    progress: TrainProgress
    task: asyncio.Task[Finished] | None = None
    runner: WindowRunner | None = None
    #: set once the driver ended and, for a job done, the node folded its flags
    settled: asyncio.Event = field(default_factory=asyncio.Event)


#: Attempts of a read-modify-write of an upload row or the upload index lost to a concurrent
#: writer (or whose answer was lost) before giving up on that step.
_ROW_ATTEMPTS: Final = 20

#: Opens a corpus for an adopted upload: (path, limit, text) -> the sentences factory; raises
#: OSError / ValueError when this node may not or cannot read it.
OpenCorpus = Callable[[str, "int | None", bool], Callable[[], Iterator[TaggedSentence] | Iterator[str]]]


class _UploadLost(Refused):
    """The upload row is no longer this node's (adopted or cancelled): stop uploading."""

    reason = "upload_lost"


@dataclass
class _Uploading:
    corpus: str
    progress: TrainProgress
    error: str = ""
    task: asyncio.Task[None] | None = None
    started: float = field(default_factory=time.time)
    path: str = ""
    limit: int | None = None
    windows: int = 0


class ClusterJobs:
    """This node's part in cluster training jobs (module docstring).

    Args:
        node: this node's name (lease holder).
        client: the node's storage client (raises while there is none).
        lexicon: the node's lexicon.
        lease: the lease protocol's times and sizes.
        train: retry policy of window writes.
        shards: lease shards per stage of a new job (capped by its windows).
        spawn: runs a background coroutine (the daemon's task group).
        sink: the node's training counters.
        on_trained: each window trained here: its vocabulary and acknowledged batch.
        on_flags: a job ended ``done``: its learned (probabilistic, deterministic) flags.
        tag_processes: processes tagging text windows (tagging.py; 0: a worker thread).
        open_corpus: opens the corpus of an upload this node adopts (uploads.py); None: an
            adopted upload is marked failed.
    """

    def __init__(self, node: str, client: Callable[[], StorageClient], lexicon: Callable[[], Lexicon],
                 lease: LeaseSettings, train: TrainSettings, *, shards: int = 1,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]] | None = None,
                 sink: ProgressSink | None = None,
                 on_trained: Callable[[Vocabulary, RowBatch], None] | None = None,
                 on_flags: Callable[[set[int], dict[int, bool]], None] | None = None,
                 tag_processes: int = 0, open_corpus: OpenCorpus | None = None) -> None:
        self.node, self._client, self._lexicon, self.lease, self.train = node, client, lexicon, lease, train
        self._shards = shards
        self._spawn = spawn or (lambda coro, name: asyncio.get_running_loop().create_task(coro, name=name))
        self._sink, self._on_trained, self._on_flags = sink, on_trained, on_flags
        self.followed: dict[str, _Followed] = {}
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.uploading: dict[str, _Uploading] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False
        self.tagger = WindowTagger(tag_processes)
        self._open_corpus = open_corpus
        self._uploads = UploadWatch(lease.lease_s)

    # -- create -----------------------------------------------------------------------------------
    def create(self, sentences: Callable[[], Iterator[TaggedSentence] | Iterator[str]], corpus: str, k: int, *,
               text: bool = False, path: str = "", limit: int | None = None) -> str:
        """Start a cluster job on the corpus ``sentences()`` yields (read as a stream, in a thread):
        tagged sentences, or with ``text`` sentence texts (tagged by the flag pass, on every node);
        returns its id at once (module docstring, "create"). ``path`` and ``limit``: what another
        node needs to finish the upload if this one dies (uploads.py)."""
        job_id = secrets.token_hex(8)
        self._start_upload(job_id, _Uploading(corpus, TrainProgress(sink=self._sink), path=path, limit=limit),
                           sentences, k, text, None)
        return job_id

    def _start_upload(self, job_id: str, up: _Uploading,
                      sentences: Callable[[], Iterator[TaggedSentence] | Iterator[str]], k: int, text: bool,
                      adopted: UploadRow | None) -> None:
        failed = [j for j, u in self.uploading.items() if u.error]
        for old in failed[: max(0, len(failed) - MAX_ENDED_JOBS)]:  # failed uploads are kept as ended jobs are
            del self.uploading[old]
        self.uploading[job_id] = up
        up.task = self._spawn(self._create(job_id, up, sentences, k, text, adopted), "cluster-job-create")

    async def _create(self, job_id: str, up: _Uploading,
                      sentences: Callable[[], Iterator[TaggedSentence] | Iterator[str]], k: int, text: bool,
                      adopted: UploadRow | None = None) -> None:
        renewing: asyncio.Task[None] | None = None
        uploading: asyncio.Task[tuple[int, int]] | None = None
        try:
            client = self._client()
            if adopted is None:
                upload = UploadRow(job_id, self.node, up.path, up.corpus, k, text, up.limit, up.started,
                                   group=GROUP_WINDOWS)
                await client.cas_register(upload_key(job_id), ABSENT, encode(upload))
                await self._list_upload(job_id, add=True)
            renewing = asyncio.get_running_loop().create_task(self._renew_upload(job_id, up))
            initial = await read_flags(client)
            data = encode_findings(initial_findings(initial))
            out = await client.cas_register(findings_key(job_id, INITIAL), ABSENT, data)
            if not out.ok and adopted is None:
                raise RuntimeError(f"register {findings_key(job_id, INITIAL)} already written (a job id used twice?)")
            stream = await asyncio.to_thread(sentences)
            # an adopted upload goes on as it began (its uploader may have known no groups)
            group = adopted.group if adopted is not None else GROUP_WINDOWS

            def on_window(windows: int, total: int) -> None:
                up.windows, up.progress.total = windows, total

            uploading = asyncio.get_running_loop().create_task(upload_windows(
                client.cas_register, job_id, stream, k, RETRYABLE, encode_texts if text else encode_window, on_window,
                group=group))
            await asyncio.wait([uploading, renewing], return_when=asyncio.FIRST_COMPLETED)
            if not uploading.done():  # the row was taken from us: the adopter finishes or fails it
                uploading.cancel()
                await asyncio.gather(uploading, return_exceptions=True)
                renewing.result()
            windows, total = uploading.result()
            if not windows:
                raise ValueError("the corpus holds no sentence")
            # a node may have cancelled the upload since the last renewal: the job row is not
            # written then (no quorum now: the check after it is written catches the cancel)
            with contextlib.suppress(*RETRYABLE):
                await self._confirm_upload(job_id, up)
            up.progress.total = total
            row = JobRow(job_id=job_id, windows=windows, shards=max(1, min(self._shards, windows)),
                         stages=STAGES, writer_id=secrets.randbits(63), created_by=self.node,
                         spec=encode_spec(ClusterSpec(k=k, sentences=total, corpus=up.corpus, text=text,
                                                      created_at=up.started, group=group)))
            log.info("cluster job created job=%s windows=%d sentences=%d", job_id, windows, total)
        except Exception as exc:  # reported by the job document (phase uploading, state failed)
            if isinstance(exc, _UploadLost):
                log.warning("cluster job upload given up job=%s: %s", job_id, exc)
                up.error = str(exc)
                return
            log.exception("cluster job upload failed job=%s", job_id)
            up.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await self._end_upload(job_id, "failed", up.error)
            return
        finally:  # also when this task is cancelled (a node stopping, a kill in tests)
            for task in (renewing, uploading):
                if task is not None and not task.done():
                    task.cancel()
        f = self._follow(job_id, row)
        # the record answers for the job until its row is in the registers (no 404 in between)
        while f.agent.job is None and f.task is not None and not f.task.done():
            await asyncio.sleep(self.lease.probe_interval_s / 4)
        try:
            if not await self._end_upload(job_id, "done") and await self._upload_cancelled(job_id):
                # cancelled (on another node) between the last check and the job row: cancel the job
                f.driver.cancel(CANCELLED)
        except Exception as exc:  # the row stays ``uploading``: a watcher finds the job row and ends it
            log.warning("cluster job upload row not closed job=%s: %s", job_id, exc)
        del self.uploading[job_id]

    # -- the upload row (uploads.py) ----------------------------------------------------------------
    async def _update(self, key: str, change: Callable[[bytes, int], bytes | None]) -> bool:
        """Read-modify-write register ``key``: ``change(value, counter)`` gives the new value or
        None (nothing to do). True once written; False when ``change`` declined."""
        client = self._client()
        cur = await client.cas_register(key, None)
        for _ in range(_ROW_ATTEMPTS):
            new = change(cur.value, cur.version[0])
            if new is None:
                return False
            try:
                out = await client.cas_register(key, cur.version, new)
            except RETRYABLE:
                await asyncio.sleep(self.lease.retry_s)
                out = await client.cas_register(key, None)
                if out.value == new:
                    return True
                cur = out
                continue
            if out.ok:
                return True
            cur = out
        raise RuntimeError(f"register {key}: {_ROW_ATTEMPTS} writes lost to concurrent writers")

    async def _list_upload(self, job_id: str, *, add: bool) -> None:
        def change(value: bytes, _: int) -> bytes | None:
            jobs = decode_uploads(value).jobs
            if (job_id in jobs) == add:
                return None
            if add and len(jobs) >= MAX_UPLOADS:
                raise RuntimeError(f"{MAX_UPLOADS} uploads are running already; try again when one ends")
            return encode(UploadIndex((*jobs, job_id) if add else tuple(j for j in jobs if j != job_id)))
        await self._update(UPLOADS_KEY, change)

    async def _renew_upload(self, job_id: str, up: _Uploading) -> None:
        """Every ``renew_s``: ``_confirm_upload``; returns (raising ``_UploadLost``) when the row is
        no longer this node's ``uploading`` row."""
        while True:
            await asyncio.sleep(self.lease.renew_s)
            try:
                await self._confirm_upload(job_id, up)
            except RETRYABLE as exc:  # no quorum now: try at the next renewal (adoption needs lease_s)
                log.debug("upload row renewal failed job=%s: %s", job_id, exc)

    async def _confirm_upload(self, job_id: str, up: _Uploading) -> None:
        """``beats`` + 1 and the windows written on the upload row.

        Raises:
            _UploadLost: the row is no longer this node's ``uploading`` row (adopted, cancelled).
        """
        lost = ""

        def change(value: bytes, counter: int) -> bytes | None:
            nonlocal lost
            row = decode_upload(value) if counter else None
            if row is None or row.node != self.node or row.state != "uploading":
                lost = ("cancelled" if row is not None and row.error.startswith("cancelled") else
                        f"the upload was taken over by {row.node if row else '?'} (this node stopped renewing it)")
                return None
            return encode(msgspec.structs.replace(row, beats=row.beats + 1, windows=up.windows))

        if not await self._update(upload_key(job_id), change):
            raise _UploadLost(lost)

    async def _upload_cancelled(self, job_id: str) -> bool:
        """Whether the job's upload row was ended by a cancel."""
        got = await self._client().read_register(upload_key(job_id))
        row = decode_upload(got.value) if got.version[0] else None
        return row is not None and row.state == "failed" and row.error.startswith("cancelled")

    async def _end_upload(self, job_id: str, state: str, error: str = "", *, adopt: bool = False) -> bool:
        """Set the upload row ``done`` / ``failed`` (if still ``uploading`` and, unless ``adopt``,
        this node's) and take it off the index."""
        def change(value: bytes, counter: int) -> bytes | None:
            row = decode_upload(value) if counter else None
            if row is None or row.state != "uploading" or (row.node != self.node and not adopt):
                return None
            return encode(msgspec.structs.replace(row, state=state, error=error))
        written = await self._update(upload_key(job_id), change)
        await self._list_upload(job_id, add=False)
        return written

    async def _watch_uploads(self) -> None:
        """Adopt the listed uploads whose uploader stopped renewing them (uploads.py)."""
        client = self._client()
        listed = decode_uploads((await client.read_register(UPLOADS_KEY)).value).jobs
        self._uploads.forget(set(listed))
        for job_id in listed:
            if job_id in self.uploading:
                continue
            got = await client.read_register(upload_key(job_id))
            if not got.version[0]:
                continue
            row = decode_upload(got.value)
            if row.state != "uploading":  # ended, but its remover died before unlisting it
                await self._list_upload(job_id, add=False)
                continue
            if self._uploads.expired(time.monotonic(), row):
                await self._adopt(row, got.version)

    async def _adopt(self, row: UploadRow, version: tuple[int, int, int]) -> None:
        client = self._client()
        mine = msgspec.structs.replace(row, node=self.node, beats=row.beats + 1, adoptions=row.adoptions + 1)
        if not (await client.cas_register(upload_key(row.job_id), version, encode(mine))).ok:
            return  # another node adopted it (or the uploader renewed it) first
        log.warning("cluster job upload adopted job=%s from=%s windows=%d", row.job_id, row.node, row.windows)
        if (await client.read_register(job_key(row.job_id))).version[0]:  # the uploader wrote the job row
            # ...but may have died before listing it: follow it, so that its creation is finished
            # (leases.py: whoever sees it ``created`` for a lease time lists it and starts it)
            if row.job_id not in self.followed and row.job_id not in self.ended and not self._stopping:
                self._follow(row.job_id)
            await self._end_upload(row.job_id, "done")
            return
        try:
            if self._open_corpus is None:
                raise OSError("this node does not adopt uploads")
            sentences = self._open_corpus(row.path, row.limit, row.text)
        except (OSError, ValueError) as exc:
            reason = (f"uploader {row.node} stopped during the upload ({row.windows} windows written) and "
                      f"{self.node} cannot read the corpus {row.path!r} ({exc}): start the job again")
            log.warning("cluster job upload failed job=%s: %s", row.job_id, reason)
            await self._end_upload(row.job_id, "failed", reason)
            return
        up = _Uploading(row.name, TrainProgress(sink=self._sink), started=row.started, path=row.path,
                        limit=row.limit, windows=row.windows)
        self._start_upload(row.job_id, up, sentences, row.k, row.text, mine)

    # -- follow -----------------------------------------------------------------------------------
    def start_watcher(self) -> None:
        """Follow every job of the index (module docstring, "follow")."""
        if self._watcher is None:
            self._watcher = self._spawn(self._watch(), "cluster-job-watcher")

    async def _watch(self) -> None:
        while not self._stopping:
            try:
                got = await self._client().read_register(INDEX_KEY)
                for job_id in decode_index(got.value).jobs:
                    if job_id not in self.followed and job_id not in self.ended:
                        self._follow(job_id)
            except Exception as exc:  # no storage yet, no quorum: the next interval tries again
                log.debug("job index read failed: %s", exc)
            try:
                await self._watch_uploads()
            except Exception as exc:
                log.debug("upload index read failed: %s", exc)
            await asyncio.sleep(self.lease.probe_interval_s)

    def _follow(self, job_id: str, create: JobRow | None = None) -> _Followed:
        if self._stopping:
            raise RuntimeError("the node is stopping")
        agent = LeaseAgent(self.node, job_id, self.lease, random.Random(f"{self.node}/{job_id}"))
        progress = TrainProgress(sink=self._sink)
        f = _Followed(LeaseDriver(agent, self._client(), lambda a: self._run(f, a)), agent, progress)
        self.followed[job_id] = f
        f.task = self._spawn(self._drive(job_id, f, create), "cluster-job")
        return f

    async def _drive(self, job_id: str, f: _Followed, create: JobRow | None) -> Finished:
        try:
            end = await f.driver.run(Begin(create))
            # (a row this node cannot decode, or a write rejected, ends here as ``failed``: leases.py)
            log.log(logging.ERROR if end.state == "failed" else logging.INFO,
                    "cluster job left job=%s state=%s grants=%d takeovers=%d %s", job_id, end.state,
                    f.agent.grants, f.agent.takeovers, end.error)
            if end.state != "released":
                self.ended[job_id] = end.state
                while len(self.ended) > MAX_ENDED_JOBS:
                    self.ended.popitem(last=False)
            job = f.agent.job
            if end.state == "done" and job is not None and self._on_flags is not None:
                try:
                    fold = await self._runner(f).extend_fold(job.windows)
                    self._on_flags(*fold.flags_before(job.windows))
                except Exception as exc:  # the model is in storage; only prompts' flags are behind
                    log.warning("cluster job flags not folded job=%s: %s", job_id, exc)
            f.settled.set()
            if end.state != "released" and f.agent.ended_it and job is not None:
                try:  # the corpus chunks are not needed any more (corpus_chunks.py)
                    client = self._client()
                    cleared = await clear_windows(client.cas_register, client.read_register, job_id, job.windows,
                                                  RETRYABLE, text=decode_spec(job.spec).text,
                                                  group=decode_spec(job.spec).group)
                    log.info("cluster job chunks emptied job=%s parts=%d", job_id, cleared)
                except Exception as exc:
                    log.warning("cluster job chunks not emptied job=%s: %s", job_id, exc)
            return end
        finally:
            f.settled.set()
            self.followed.pop(job_id, None)

    def _runner(self, f: _Followed) -> WindowRunner:
        if f.runner is None:
            job = f.agent.job
            assert job is not None  # a window is run, or the job done, only once the row is read
            # storage failures are retried past the node's own lease deadline (window_runner.py,
            # "Storage failures"): a node cut off from storage loses the window, not the job
            f.runner = WindowRunner(self._client(), job.job_id, decode_spec(job.spec), self._lexicon(), self.train,
                                    f.progress, self._on_trained, self.tagger, patience_s=2 * self.lease.lease_s)
        return f.runner

    async def _run(self, f: _Followed, action: RunWindow) -> int:
        return await self._runner(f)(action)

    # -- cancel, resume, stop ---------------------------------------------------------------------
    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job (through a driver of this node); returns its document.

        Raises:
            KeyError: no such job.
        """
        doc = await self.document(job_id)
        if doc is None:
            raise KeyError(job_id)
        up = self.uploading.get(job_id)
        if job_id in self.followed and doc["state"] == "running":
            # also while this node's driver writes the new job's row (the upload is over): cancelling
            # the upload task then stopped nothing, and the job ran
            self.followed[job_id].driver.cancel(CANCELLED)
        elif up is not None and up.task is not None:
            up.task.cancel()
            up.error = "cancelled"
            with contextlib.suppress(Exception):
                await self._end_upload(job_id, "failed", CANCELLED)
        elif doc.get("phase") == "uploading" and doc["state"] == "running":  # uploading on another node
            if not await self._end_upload(job_id, "failed", CANCELLED, adopt=True) and \
                    (await self._client().read_register(job_key(job_id))).version[0]:
                # the upload ended since the document was read: its job row is written; cancel that
                (self.followed.get(job_id) or self._follow(job_id)).driver.cancel(CANCELLED)
        elif doc["state"] == "running":
            f = self.followed.get(job_id) or self._follow(job_id)
            f.driver.cancel(CANCELLED)
        return doc

    def follow(self, job_id: str) -> bool:
        """``train resume`` of a cluster job: follow it here if this node does not; False if it did."""
        if job_id in self.followed:
            return False
        self.ended.pop(job_id, None)
        self._follow(job_id)
        return True

    async def stop(self) -> None:
        """Halt every driver (module docstring, "stop")."""
        self._stopping = True
        tasks: list[asyncio.Task[Any]] = [t for t in (self._watcher, *(u.task for u in self.uploading.values()))
                                          if t is not None]
        for t in tasks:
            t.cancel()
        for f in self.followed.values():
            f.driver.halt()
        drives: list[asyncio.Task[Any]] = [f.task for f in self.followed.values() if f.task is not None]
        if drives:
            _, late = await asyncio.wait(drives, timeout=STOP_TIMEOUT_S)
            for t in late:
                t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, *drives, return_exceptions=True)
        self.tagger.close()

    # -- report -----------------------------------------------------------------------------------
    async def document(self, job_id: str) -> dict[str, Any] | None:
        """The job's document from the registers (None: no such job anywhere)."""
        client = self._client()
        got = await client.read_register(job_key(job_id))
        up = self.uploading.get(job_id)
        if not got.version[0] and up is not None:
            state = "failed" if up.error else "running"
            return {"job_id": job_id, "kind": "train", "cluster": True, "state": state, "phase": "uploading",
                    "done": 0, "total": up.progress.total, "unit": "sentences", "resumed_from": None,
                    "resumes": 0, "corpus": up.corpus, "timeline": up.progress.timeline.as_dict(),
                    **({"error": up.error} if up.error else {})}
        if not got.version[0]:
            return await self._upload_document(job_id)
        job = decode_job(got.value)
        f = self.followed.get(job_id)
        if job.state == "done" and f is not None:
            # this node's driver sees ``done`` at its next read and folds the job's flags: answer
            # ``succeeded`` once the node's prompts get them (an eval right after the job)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(f.settled.wait(), self.lease.lease_s)
        keys = [shard_key(job_id, st, s) for st in range(job.stages) for s in range(job.shards)]
        reads = await asyncio.gather(*(client.read_register(k) for k in keys))
        shards = [decode_shard(r.value) for r in reads if r.version[0]]
        return job_document(job, shards, f)

    async def _upload_document(self, job_id: str) -> dict[str, Any] | None:
        """A job uploading on another node, or whose upload failed (its upload row)."""
        got = await self._client().read_register(upload_key(job_id))
        if not got.version[0]:
            return None
        row = decode_upload(got.value)
        if row.state == "done":
            return None  # (cannot be: the job row is written first)
        return {"job_id": job_id, "kind": "train", "cluster": True,
                "state": "failed" if row.state == "failed" else "running", "phase": "uploading", "done": 0,
                "total": 0, "unit": "sentences", "resumed_from": None, "resumes": 0, "corpus": row.name,
                "uploader": row.node, "windows_uploaded": row.windows, "adoptions": row.adoptions,
                **({"error": row.error} if row.error else {})}

    async def list_ids(self) -> list[str]:
        """Jobs of the index, then those that ended on this node (newest last)."""
        client = self._client()
        got = await client.read_register(INDEX_KEY)
        uploads = decode_uploads((await client.read_register(UPLOADS_KEY)).value).jobs
        ids = list(dict.fromkeys([*self.uploading, *uploads, *decode_index(got.value).jobs]))
        return ids + [j for j in self.ended if j not in ids]


def job_document(job: JobRow, shards: list[Shard], here: _Followed | None = None) -> dict[str, Any]:
    """``GET /v1/jobs/{id}`` of a cluster job: the jobs.py document's keys plus ``stage``,
    ``flag_pass`` and ``by_node`` (node -> sentences handled and trained, windows trained, windows
    of the flag pass it completed and their sentences of a text corpus, ``tagged``: by it or by a
    run of the window whose lease it took over, leases held now, leases it let expire, leases it
    took over, and its ``timeline``; ``lease_table.OTHERS``: nodes whose tallies were folded) and
    ``timeline`` (``_timelines``)."""
    try:
        spec = decode_spec(job.spec)
    except Exception as exc:
        raise CorruptDataError(f"job {job.job_id}: the spec is not a cluster training spec: {exc}") from None
    by_node: dict[str, dict[str, Any]] = {}

    def entry(node: str) -> dict[str, Any]:
        return by_node.setdefault(node, {"sentences": 0, "trained": 0, "windows": 0, "flag_windows": 0,
                                         "tagged": 0, "leases_held": 0, "leases_expired": 0,
                                         "leases_taken_over": 0})

    done_windows = [0] * job.stages
    for shard in shards:
        done_windows[shard.stage] += shard.done
        for lease in shard.leases:
            entry(lease.node)["leases_held"] += 1
        for t in shard.tallies:
            e = entry(t.node)
            e["leases_expired"] += t.lost
            e["leases_taken_over"] += t.won
            if shard.stage != TRAIN_STAGE:
                e["flag_windows"] += t.windows
                e["tagged"] += t.units
                continue
            e["windows"] += t.windows
            e["trained"] += t.units
            # every window holds K sentences but the job's last, which may hold fewer
            short = job.windows * spec.k - spec.sentences if t.tail and shard.stop == job.windows else 0
            e["sentences"] += t.windows * spec.k - short
    timeline = _timelines(job, spec, shards, by_node)
    done = sum(e["sentences"] for e in by_node.values())
    trained = sum(e["trained"] for e in by_node.values())
    doc: dict[str, Any] = {
        "job_id": job.job_id, "kind": "train", "cluster": True, "state": _STATES[job.state],
        "phase": "flag_pass" if job.state in ("created", "running") and job.stage == 0 else "training",
        "done": done, "total": spec.sentences, "unit": "sentences", "trained": trained,
        "skipped": done - trained, "resumed_from": None,
        "resumes": 0, "windows": job.windows, "k": spec.k, "shards": job.shards, "stage": job.stage,
        "corpus": spec.corpus, "text": spec.text, "created_by": job.created_by,
        "flag_pass": {"done": done_windows[0], "total": job.windows},
        "train_windows": {"done": done_windows[TRAIN_STAGE] if job.stages > TRAIN_STAGE else 0,
                          "total": job.windows},
        "by_node": by_node, "timeline": timeline,
    }
    # the rate over the job's life as the registers saw it: its creation (the timeline's first point)
    # to the last window completed; a node-local job's document has the same two fields
    times = timeline.get("t", [])
    elapsed = float(times[-1] - times[0]) if spec.created_at and len(times) >= 2 else 0.0
    doc["elapsed_s"] = round(elapsed, 3)
    doc["sentences_per_s"] = round(done / elapsed, 1) if elapsed > 0 else 0.0
    if here is not None:
        doc["this_node"] = here.progress.as_dict()
    if job.error:
        doc["error"] = job.error
    return doc


def _timelines(job: JobRow, spec: ClusterSpec, shards: list[Shard],
               by_node: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """Each node's timeline (into ``by_node``) and the job's, their sum (timeline.py ``merge``),
    from the training stage's tallies: ``done`` at a point is the windows completed by then times K
    (capped at the tally's sentences: only the job's last window may hold fewer, so a point before
    the end may count up to K - 1 too many), ``trained`` the units, ``bytes_sent`` 0 (bytes are
    not tracked per node in the registers; ``this_node`` has this node's). The job's first point is
    its creation (all 0)."""
    per_node: dict[str, list[dict[str, Any]]] = {}
    for shard in shards:
        if shard.stage != TRAIN_STAGE:
            continue
        for t in shard.tallies:
            if not t.timeline:
                continue
            pts = np.asarray(t.timeline, dtype=np.float64)
            short = job.windows * spec.k - spec.sentences if t.tail and shard.stop == job.windows else 0
            done = np.minimum(pts[:, 1].astype(np.int64) * spec.k, t.windows * spec.k - short)
            per_node.setdefault(t.node, []).append({
                "t": pts[:, 0], "done": done, "trained": pts[:, 2].astype(np.int64),
                "bytes_sent": np.zeros(len(pts), dtype=np.int64)})
    for node, parts in per_node.items():
        by_node[node]["timeline"] = merge_timelines(parts)
    start: list[dict[str, Any]] = [{"t": [spec.created_at], **{name: [0] for name in SERIES}}] \
        if spec.created_at else []
    return merge_timelines([*start, *(p for parts in per_node.values() for p in parts)])
