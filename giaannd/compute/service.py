"""The compute role as a daemon Service: training jobs, evaluation, generation and export.

Glue only: the pipeline is in train.py, the sessions in infer.py, the node's vocabulary in
state.py. What this module adds is the wiring (which storage client, which row cache), the admin
routes and the metrics.

Admin routes (giaannctl has verbs for each; bodies are JSON):

==============================  ==================================================================
``POST /v1/train``              ``{"corpus": path, "workers"?, "coalesce"?, "epochs"?, "limit"?}`` →
                                ``{"job_id"}``; CoNLL-U is read as is, other files are tagged (cached)
``GET /v1/jobs``                every job document
``GET /v1/jobs/{job_id}``       ``{"state", "done", "total", "unit", "resumed_from", ...}`` (jobs.py)
``POST /v1/jobs/{id}/resume``   resume a failed journaled job → ``{"job_id"}``
``POST /v1/eval``               ``{"corpus"?, "limit"?, "constants": "train"|"test", "mode"?}`` → top-1
``POST /v1/generate``           ``{"prompt": text | [[form, lemma, upos, xpos], ...], "max_tokens"}``
``POST /v1/export``             ``{"path"}`` → JSONL export of every row of the cluster (storage scan)
==============================  ==================================================================

**Which storage client.** The constructor takes either a ready ``storage`` client or a
``storage_factory(ctx)``; without either, ``start`` looks in ``ctx.services`` for a service with a
``storage_client`` attribute (the node runtime) or for the local storage service's topology and
transports. Until one is found the routes answer 503, so a node whose storage view is not ready yet
still starts and serves status.

**Durable jobs.** A job started through ``POST /v1/train`` (``submit_corpus``) gets a journal
(job_journal.py) before its id is returned; on start the service reloads every journal: running
ones resume (config ``compute.resume-jobs``) once a storage client can read the flag row, failed
ones are listed as failed, corrupt ones are listed as failed with the file's error (and left on
disk). ``train`` / ``submit`` with in-memory sentences (tests, bench) keep no journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from giaannd.admin.api import AdminHTTPError
from giaannd.compute.client import ScanInterrupted, StorageClient, StorageRequestError
from giaannd.compute.flags import without_flag_row
from giaannd.compute.infer import DEFAULT_PREFETCH_DEPTH, Inference, RowCache, RowFetcher
from giaannd.compute.job_journal import (
    JobJournal,
    JobSpec,
    JournalCorrupt,
    JournalWriter,
    corpus_sha256,
    load_journals,
    sentences_digest,
)
from giaannd.compute.jobs import Job, JobRegistry, TrainProgress
from giaannd.compute.state import ComputeState
from giaannd.compute.train import (
    TrainingJob,
    TrainResult,
    TrainSettings,
    job_client,
    load_corpus,
    read_flags,
)
from giaannd.model.columns import ColumnAssigner
from giaannd.model.engine import constants_named
from giaannd.model.export import write_jsonl
from giaannd.model.ids import PRIME_FEATURE
from giaannd.model.vocab import IdCollisionError
from giaannd.model.lexicon import Lexicon
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.tokens import TaggedSentence, TaggerUnavailableError, Token, load_bundled_corpus
from peers.errors import PeersError

if TYPE_CHECKING:
    from aiohttp import web

    from giaannd.config import ComputeConfig, Config
    from giaannd.daemon import ServiceContext

__all__ = ["ComputeService", "VocabularyMissing", "create_service"]

log = logging.getLogger(__name__)

#: Prompts evaluated when ``/v1/eval`` names no limit.
DEFAULT_EVAL_LIMIT: Final = 200
#: Upper bounds on request sizes (admin requests are small; corpora travel by path).
MAX_EVAL_PROMPTS: Final = 100_000
MAX_GENERATE_TOKENS: Final = 1024
MAX_EPOCHS: Final = 1000
#: Rows per read while gathering an export.
EXPORT_READ_ROWS: Final = 32_768
#: Longest wait between tries to reach storage before resuming journaled jobs at start.
RESUME_RETRY_MAX_S: Final = 2.0
#: Whole-scan attempts of an export when the placement changes under it (ScanInterrupted).
EXPORT_SCAN_ATTEMPTS: Final = 3
TAG_CACHE_DIR: Final = "tag-cache"
_STORAGE_ERRORS: Final = (StorageRequestError, PeersError, OSError, LookupError)


class VocabularyMissing(ValueError):
    """An exported row names an id whose string neither this node nor storage holds."""


class _PromSink:
    """Training figures → one Prometheus counter labelled by figure."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter

    def add(self, name: str, amount: float) -> None:
        self._counter.labels(figure=name).inc(amount)


class ComputeService:
    """The compute role (module docstring).

    Args:
        settings: the ``compute`` config section (workers, K, row cache bytes, max sessions).
        data_dir: where the node keeps its vocabulary and tag cache.
        storage: a ready storage client, or None (see ``storage_factory``).
        storage_factory: builds the client from the daemon context in ``start``.
        prefetch_depth: teacher-forced lookahead of inference sessions.
    """

    name = "compute"

    def __init__(self, settings: ComputeConfig, data_dir: str | Path, *, storage: StorageClient | None = None,
                 storage_factory: Callable[[ServiceContext], StorageClient | None] | None = None,
                 prefetch_depth: int = DEFAULT_PREFETCH_DEPTH) -> None:
        self.settings = settings
        self.data_dir = Path(data_dir)
        self.storage = storage
        self._factory = storage_factory
        self._ctx: ServiceContext | None = None
        self.jobs = JobRegistry()
        self.state = ComputeState()
        self.cache = RowCache(settings.row_cache_bytes)
        self._fetcher: RowFetcher | None = None
        self._inference: Inference | None = None
        self._prefetch_depth = prefetch_depth
        self._lexicon: Lexicon | None = None
        self._nlp: Any = None
        self._sink: _PromSink | None = None
        self._started = False
        self._resume_task: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, ctx: ServiceContext | None = None) -> None:
        """Load the node state, register routes and metrics (with a context), find storage."""
        self.state = await asyncio.to_thread(ComputeState.load, self.data_dir)
        self._lexicon = await asyncio.to_thread(Lexicon.default)
        self._ctx = ctx
        if ctx is not None:
            self._register(ctx)
        self._started = True
        journals = await asyncio.to_thread(load_journals, self.data_dir)
        pending: list[JobJournal] = []
        for item in journals:
            if isinstance(item, JournalCorrupt):
                log.error("training job journal is corrupt (left in place, job not resumed): %s", item)
                self.jobs.add_finished(Path(item.file_path).stem, "train", "failed", f"corrupt journal: {item}")
            elif item.doc.state == "failed":
                self.jobs.add_finished(item.job_id, "train", "failed", item.doc.error, self._journal_progress(item))
            elif item.doc.state == "running":
                pending.append(item)
        if pending and self.settings.resume_jobs:
            coro = self._resume(pending)
            self._resume_task = (ctx.spawn(coro, "resume-jobs") if ctx is not None
                                 else asyncio.get_running_loop().create_task(coro))
        elif pending:
            log.warning("%d unfinished training job(s) not resumed (compute.resume-jobs = false): %s",
                        len(pending), " ".join(j.job_id for j in pending))

    async def stop(self, graceful: bool) -> None:
        if self._resume_task is not None:
            self._resume_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resume_task
        if graceful:
            await self.jobs.wait_all()
        await self.jobs.cancel_all()
        if self.storage is not None:
            await self.storage.flush()

    def health(self) -> Mapping[str, Any]:
        return {"storage": self.storage is not None, "jobs_running": len(self.jobs.running()),
                "vocab_columns": self.state.vocab.num_columns, "vocab_features": self.state.vocab.num_features,
                "rows_written": int(self.state.row_column.shape[0]), "row_cache": self.cache.stats()}

    def _register(self, ctx: ServiceContext) -> None:
        add = ctx.admin.add_route
        add("POST", "/v1/train", self._post_train)
        add("GET", "/v1/jobs", self._get_jobs)
        add("GET", "/v1/jobs/{job_id}", self._get_job)
        add("POST", "/v1/jobs/{job_id}/resume", self._post_resume)
        add("POST", "/v1/eval", self._post_eval)
        add("POST", "/v1/generate", self._post_generate)
        add("POST", "/v1/export", self._post_export)
        m = ctx.metrics
        self._sink = _PromSink(m.counter("giaannd_compute_train_total",
                                         "Training figures summed over jobs (sentences, bytes, batches...).",
                                         ["figure"]))
        gauges = {
            "giaannd_compute_row_cache_hits": ("Row cache hits.", lambda: self.cache.hits),
            "giaannd_compute_row_cache_misses": ("Row cache misses.", lambda: self.cache.misses),
            "giaannd_compute_row_cache_bytes": ("Bytes of rows cached.", lambda: self.cache.bytes),
            "giaannd_compute_infer_steps": ("Inference steps run.", lambda: self._inference.steps
                                            if self._inference else 0),
            "giaannd_compute_jobs_running": ("Training jobs running.", lambda: len(self.jobs.running())),
        }
        for metric, (doc, fn) in gauges.items():
            m.gauge(metric, doc).set_function(fn)

    def _client(self) -> StorageClient:
        """The storage client, resolved on first use (module docstring). Raises 503 if none."""
        if self.storage is None and self._ctx is not None:
            try:
                if self._factory is not None:
                    self.storage = self._factory(self._ctx)
                else:
                    self.storage = _client_from_services(self._ctx.services)
            except Exception as exc:  # the node's storage view is not ready: retry on the next call
                log.warning("no storage client yet: %s", exc)
                raise AdminHTTPError(503, f"the compute role has no storage client yet: {exc}",
                                     "unavailable") from None
        if self.storage is None:
            raise AdminHTTPError(503, "the compute role has no storage client yet (no storage members known "
                                 "or not wired)", "unavailable")
        return self.storage

    def _infer(self) -> Inference:
        client = self._client()
        if self._inference is None:
            self._fetcher = RowFetcher(client.read_rows, self.cache)
            self._inference = Inference(self._fetcher, max_sessions=self.settings.max_sessions,
                                        prefetch_depth=self._prefetch_depth)
        return self._inference

    # -- programmatic API (routes, tests, bench) ----------------------------------------------
    def train_settings(self, workers: int | None = None, coalesce: int | None = None) -> TrainSettings:
        return TrainSettings(workers=workers or self.settings.train_workers,
                             coalesce_sentences=coalesce or self.settings.coalesce_k)

    async def train(self, sentences: Sequence[TaggedSentence], settings: TrainSettings,
                    progress: TrainProgress | None = None, journal: JournalWriter | None = None) -> TrainResult:
        """Run one training job to its end and fold its vocabulary and keys into the node state
        (with a journal: under the journal's writer id, resuming where it says)."""
        base = self._client()
        client = job_client(base, journal.journal.doc.writer_id if journal is not None else None)
        job = TrainingJob(sentences, client, settings, progress, lexicon=self._lexicon,
                          on_written=self.cache.invalidate_batch, journal=journal)
        try:
            result = await job.run()
        except BaseException:
            # keep what was acknowledged: its rows are in storage and must stay exportable
            self._absorb(job.partial_result())
            await asyncio.shield(asyncio.to_thread(self.state.save, self.data_dir))
            raise
        finally:
            await client.close()
        self._absorb(result)
        await asyncio.to_thread(self.state.save, self.data_dir)
        return result

    def _absorb(self, result: TrainResult) -> None:
        self.state.vocab.merge(result.vocab)
        for fid, flag in result.deterministic_flags.items():
            self.state.deterministic.setdefault(fid, flag)
        self.state.probabilistic |= result.probabilistic_flags
        self.state.add_keys(result.row_column, result.row_feature)

    def submit(self, sentences: Sequence[TaggedSentence] | Callable[[], Sequence[TaggedSentence]],
               settings: TrainSettings) -> Job:
        """Start a training job in the background; returns its registry entry."""
        self._client()
        progress = TrainProgress(sink=self._sink)

        async def run(job: Job) -> dict[str, Any]:
            data = await asyncio.to_thread(sentences) if callable(sentences) else sentences
            result = await self.train(data, settings, job.progress)
            return {"rows_written": int(result.row_column.shape[0]),
                    "vocab_columns": self.state.vocab.num_columns, "vocab_features": self.state.vocab.num_features,
                    "probabilistic_flags": len(result.probabilistic_flags)}

        spawn = (lambda c: self._ctx.spawn(c, "train-job")) if self._ctx is not None else None  # type: ignore[union-attr]
        return self.jobs.start("train", progress, run, spawn)

    async def submit_corpus(self, corpus: str | Path, *, workers: int | None = None, coalesce: int | None = None,
                            epochs: int = 1, limit: int | None = None) -> Job:
        """Start a durable training job on a corpus file (module docstring, "Durable jobs"): its
        journal is on disk before this returns, so a crash from here on resumes it on restart."""
        self._client()
        path = Path(corpus).resolve()
        settings = self.train_settings(workers, coalesce)
        digest = await asyncio.to_thread(corpus_sha256, path)
        spec = JobSpec(str(path), digest, limit, epochs, settings.workers, settings.coalesce_sentences)
        writer = JournalWriter(self.data_dir, JobJournal.create(spec))
        await asyncio.to_thread(writer.save_now)
        return self._start_journaled(writer)

    def _start_journaled(self, writer: JournalWriter) -> Job:
        journal = writer.journal
        spec = journal.doc.spec
        settings = TrainSettings(workers=spec.workers, coalesce_sentences=spec.coalesce)
        cache_dir = self.data_dir / TAG_CACHE_DIR

        def load() -> list[TaggedSentence]:
            if corpus_sha256(spec.corpus) != spec.corpus_sha256:
                raise ValueError(f"corpus {spec.corpus} changed since the job started (SHA-256 differs): "
                                 "not resumed, its windows would differ from those already sent")
            sentences = load_corpus(spec.corpus, cache_dir, spec.limit) * spec.epochs
            journal.check_sentences(sentences_digest(sentences), len(sentences))
            return sentences

        async def run(job: Job) -> dict[str, Any]:
            try:
                data = await asyncio.to_thread(load)
                result = await self.train(data, settings, job.progress, writer)
            except asyncio.CancelledError:
                raise  # a shutdown: the journal stays "running" and the job resumes on restart
            except Exception as exc:
                journal.finish("failed", f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(OSError):  # the job's own error is the one to report
                    await writer.commit()
                raise
            await asyncio.to_thread(writer.remove)
            return {"rows_written": int(result.row_column.shape[0]),
                    "vocab_columns": self.state.vocab.num_columns, "vocab_features": self.state.vocab.num_features,
                    "probabilistic_flags": len(result.probabilistic_flags)}

        spawn = (lambda c: self._ctx.spawn(c, "train-job")) if self._ctx is not None else None  # type: ignore[union-attr]
        return self.jobs.start("train", TrainProgress(sink=self._sink), run, spawn, job_id=journal.job_id,
                               resumes=journal.doc.resumes)

    async def resume(self, job_id: str) -> Job:
        """Resume a journaled job that failed (e.g. storage was down past its retries), under its
        writer id and from its cursor, as a restart would.

        Raises:
            KeyError: no journal for ``job_id``.
            ValueError: the job is running, or its journal is corrupt.
        """
        current = self.jobs.get(job_id)
        if current is not None and current.state == "running":
            raise ValueError(f"job {job_id} is running")
        self._client()
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
        return self._start_journaled(writer)

    @staticmethod
    def _journal_progress(journal: JobJournal) -> TrainProgress:
        """A finished job's figures as its journal knows them (sentences acknowledged)."""
        doc = journal.doc
        done = min(doc.cursor * doc.spec.coalesce, doc.total_sentences)
        return TrainProgress(total=doc.total_sentences, done=done)

    async def _resume(self, journals: Sequence[JobJournal]) -> None:
        """Resume unfinished journaled jobs once storage answers (the node's storage view may
        still be forming right after start)."""
        delay = 0.05
        while True:
            try:
                await read_flags(self._client())
                break
            except Exception as exc:  # never fail the node over this: keep waiting for storage
                log.info("waiting for storage before resuming %d job(s): %s", len(journals), exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RESUME_RETRY_MAX_S)
        for journal in journals:
            journal.reopen()
            writer = JournalWriter(self.data_dir, journal)
            try:
                await writer.commit()
            except OSError as exc:
                log.error("cannot update journal %s, job %s not resumed: %s", writer.path, journal.job_id, exc)
                continue
            log.info("resuming training job job=%s cursor=%d of %d windows", journal.job_id,
                     journal.doc.cursor, -(-journal.doc.total_sentences // journal.doc.spec.coalesce))
            self._start_journaled(writer)

    async def prompt_assigner(self) -> ColumnAssigner:
        """A column assigner for prompts: this node's vocabulary and deterministic flags, and the
        probabilistic flags as storage holds them now (the replicated set)."""
        flags = await read_flags(self._client())
        assigner = ColumnAssigner(self._lexicon, flags | self.state.probabilistic)
        assigner.add_deterministic_flags(self.state.deterministic)
        assigner.vocab = self.state.vocab
        return assigner

    async def evaluate(self, prompts: Sequence[TaggedSentence], constants: str = "train",
                       mode: str = "teacher") -> dict[str, Any]:
        """Top-1 over tagged prompts (encoded with flags unchanged); figures as a dict."""
        k = constants_named(constants)
        inference = self._infer()
        assigner = await self.prompt_assigner()
        encoded = [e for p in prompts if (e := assigner.encode(p, update_flags=False)) is not None]
        self.cache.clear()  # other nodes may have written since: start from storage's state
        report = await inference.evaluate(encoded, assigner, k, "free" if mode == "free" else "teacher")
        r = report.result
        steps = r.steps
        return {"constants": constants, "mode": mode, "prompts": r.prompts, "skipped": len(prompts) - r.prompts,
                "prediction_tokens": r.prediction_tokens, "matches": r.matches, "top1": round(r.top1, 6),
                "no_prediction": r.no_prediction, "steps": steps, "elapsed_s": round(report.elapsed_s, 3),
                "steps_per_s": round(steps / report.elapsed_s, 1) if report.elapsed_s else 0.0,
                "row_cache": self.cache.stats()}

    async def generate(self, prompt: TaggedSentence, max_tokens: int, constants: str = "train") -> dict[str, Any]:
        """Free-running continuation of one tagged prompt."""
        k = constants_named(constants)
        inference = self._infer()
        assigner = await self.prompt_assigner()
        # A generation prompt may be shorter than the evaluation minimum (9 tokens).
        enc = assigner.encode(prompt, update_flags=False, min_tokens=1)
        if enc is None:
            raise AdminHTTPError(400, "the prompt was skipped by column assignment (no noun, or empty)",
                                 "bad_request")
        nodes = await inference.generate(list(zip(enc.column.tolist(), enc.feature.tolist())), assigner, k,
                                         max_tokens)
        try:
            await self.resolve_vocab([c for c, _ in nodes], [f for _, f in nodes])
        except _STORAGE_ERRORS as exc:  # words still print, as hex, for what could not be fetched
            log.warning("vocabulary lookup failed: %s", exc)
        words = [self._word(c, f) for c, f in nodes]
        return {"prompt": list(enc.words), "tokens": words, "text": " ".join(words)}

    def _word(self, column: int, feature: int) -> str:
        """The word of a node, or ``<column:feature>`` in hex when neither this node's vocabulary
        nor storage's (``resolve_vocab``, called first) has it."""
        try:
            return self.state.vocab.word_of(column, feature)
        except KeyError:
            return f"<{column:x}:{feature:x}>"

    def _missing_vocab(self, columns: Any, features: Any) -> list[tuple[int, int]]:
        """(kind, id) keys of the given column and feature ids this node's vocabulary lacks."""
        vocab = self.state.vocab
        out: list[tuple[int, int]] = []
        for cid in np.unique(np.asarray(columns, np.uint64)).tolist():
            try:
                vocab.column_lemma(cid)
            except KeyError:
                out.append((0, cid))
        for fid in np.unique(np.asarray(features, np.uint64)).tolist():
            if fid == PRIME_FEATURE:
                continue
            try:
                vocab.feature_word(fid)
            except KeyError:
                out.append((1, fid))
        return out

    async def resolve_vocab(self, columns: Any, features: Any) -> int:
        """Fetch the strings of ids this node's vocabulary lacks from storage (where training jobs of
        any compute node put them) into the node's vocabulary, which is the local cache. Entries
        are re-checked against their ids. Returns the number of entries added.

        Raises:
            ReadFailed: every owner of some ids failed.
        """
        missing = self._missing_vocab(columns, features)
        if not missing:
            return 0
        found = await self._client().get_vocab(missing)
        added = 0
        vocab = self.state.vocab
        for (kind, ident), text in found.items():
            try:
                got = vocab.add_column(text) if kind == 0 else vocab.add_feature(text)
            except IdCollisionError as exc:
                log.error("vocabulary from storage collides with this node's: %s", exc)
                continue
            if got != ident:  # a foreign or damaged entry: the add above is harmless (content-addressed)
                log.warning("storage returned %r for id %#x, which hashes to %#x", text, ident, got)
                continue
            added += 1
        return added

    async def scan_cluster(self) -> RowBatch:
        """Every model row of the cluster (each exactly once; the flag row left out), by scanning
        storage (``StorageClient.scan_all``); restarted if the placement changes under it."""
        client = self._client()
        for attempt in range(EXPORT_SCAN_ATTEMPTS):
            try:
                parts = [page async for page in client.scan_all()]
                break
            except ScanInterrupted as exc:
                if attempt + 1 >= EXPORT_SCAN_ATTEMPTS:
                    raise
                log.info("export scan restarted (attempt %d): %s", attempt + 1, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        return without_flag_row(RowBatch.concat(parts)) if parts else RowBatch.empty()

    async def export(self, path: str | Path) -> dict[str, Any]:
        """JSONL export of every row of the cluster, whichever compute node trained it: a storage
        scan, words resolved through this node's vocabulary and then storage's.

        Raises:
            VocabularyMissing: some id has no string anywhere (rows written by a node that did not
                replicate its vocabulary); nothing is written.
        """
        batch = await self.scan_cluster()
        await self.resolve_vocab(np.concatenate([batch.row_column, batch.target_column]),
                                 np.concatenate([batch.row_feature, batch.target_feature]))
        store = RowStore.from_batch(batch)
        try:
            lines = await asyncio.to_thread(write_jsonl, store, self.state.vocab, path)
        except KeyError as exc:
            raise VocabularyMissing(str(exc.args[0] if exc.args else exc)) from None
        return {"path": str(path), "lines": lines, "rows": batch.num_rows, "entries": batch.num_entries,
                "source": "every row of the storage cluster (scan)"}

    # -- routes ---------------------------------------------------------------------------------
    async def _post_train(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await _body(request)
        corpus = _corpus_path(body.get("corpus"), required=True)
        workers = _opt_int(body, "workers", 1, 1024)
        coalesce = _opt_int(body, "coalesce", 1, 1 << 20)
        epochs = _opt_int(body, "epochs", 1, MAX_EPOCHS) or 1
        limit = _opt_int(body, "limit", 1, 1 << 31)
        assert corpus is not None  # required=True
        try:
            job = await self.submit_corpus(corpus, workers=workers, coalesce=coalesce, epochs=epochs, limit=limit)
        except OSError as exc:
            raise AdminHTTPError(400, f"corpus {corpus}: {exc}", "bad_request") from None
        return {"job_id": job.job_id}

    async def _get_jobs(self, request: web.Request, params: Mapping[str, str]) -> Any:
        return {"jobs": [j.as_dict() for j in self.jobs.all()]}

    async def _get_job(self, request: web.Request, params: Mapping[str, str]) -> Any:
        job = self.jobs.get(params["job_id"])
        if job is None:
            raise AdminHTTPError(404, f"no job {params['job_id']!r} on this node", "not_found")
        return job.as_dict()

    async def _post_resume(self, request: web.Request, params: Mapping[str, str]) -> Any:
        try:
            job = await self.resume(params["job_id"])
        except KeyError:
            raise AdminHTTPError(404, f"no journal for job {params['job_id']!r} on this node", "not_found") from None
        except ValueError as exc:
            raise AdminHTTPError(409, str(exc), "conflict") from None
        return {"job_id": job.job_id}

    async def _post_eval(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await _body(request)
        limit = _opt_int(body, "limit", 1, MAX_EVAL_PROMPTS) or DEFAULT_EVAL_LIMIT
        constants = body.get("constants") or "train"
        mode = body.get("mode") or "teacher"
        if constants not in ("train", "test") or mode not in ("teacher", "free"):
            raise AdminHTTPError(400, "constants must be 'train' or 'test', mode 'teacher' or 'free'", "bad_request")
        path = _corpus_path(body.get("corpus"), required=False)
        try:
            prompts = await asyncio.to_thread(
                (lambda: load_corpus(path, self.data_dir / TAG_CACHE_DIR, limit)) if path is not None
                else (lambda: load_bundled_corpus(limit)))
        except (ValueError, OSError) as exc:  # CorpusFormatError is a ValueError
            raise AdminHTTPError(400, str(exc), "bad_request") from None
        except TaggerUnavailableError as exc:
            raise AdminHTTPError(503, str(exc), "unavailable") from None
        try:
            return await self.evaluate(prompts, constants, mode)
        except _STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None

    async def _post_generate(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await _body(request)
        max_tokens = _opt_int(body, "max_tokens", 0, MAX_GENERATE_TOKENS)
        constants = body.get("constants") or "train"
        if constants not in ("train", "test"):
            raise AdminHTTPError(400, "constants must be 'train' or 'test'", "bad_request")
        prompt = await self._tagged_prompt(body.get("prompt"))
        try:
            return await self.generate(prompt, 20 if max_tokens is None else max_tokens, constants)
        except _STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None

    async def _tagged_prompt(self, prompt: Any) -> TaggedSentence:
        if isinstance(prompt, list) and prompt and all(isinstance(t, (list, tuple)) for t in prompt):
            if not all(len(t) == 4 and all(isinstance(x, str) and x for x in t) for t in prompt):
                raise AdminHTTPError(400, "prompt tokens must be [form, lemma, upos, xpos] strings", "bad_request")
            return tuple(Token(*t) for t in prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
            prompt = " ".join(prompt)
        if not isinstance(prompt, str) or not prompt.strip():
            raise AdminHTTPError(400, "prompt must be non-empty text or a list of tokens", "bad_request")
        return await asyncio.to_thread(self._tag, prompt)

    def _tag(self, text: str) -> TaggedSentence:
        from giaannd.model.tokens import load_english, tag_texts
        try:
            if self._nlp is None:
                self._nlp = load_english(sentences=True)
        except TaggerUnavailableError as exc:
            raise AdminHTTPError(503, str(exc), "unavailable") from None
        tokens = [t for s in tag_texts([text], nlp=self._nlp) for t in s]
        return tuple(tokens)

    async def _post_export(self, request: web.Request, params: Mapping[str, str]) -> Any:
        body = await _body(request)
        path = body.get("path")
        if not isinstance(path, str) or not path or not Path(path).is_absolute():
            raise AdminHTTPError(400, "path must be an absolute file path", "bad_request")
        if not Path(path).parent.is_dir():
            raise AdminHTTPError(400, f"directory {Path(path).parent} does not exist", "bad_request")
        try:
            return await self.export(path)
        except VocabularyMissing as exc:
            raise AdminHTTPError(409, f"{exc} (rows trained without a replicated vocabulary)",
                                 "conflict") from None
        except _STORAGE_ERRORS as exc:
            raise AdminHTTPError(503, f"storage: {exc}", "unavailable") from None


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json() if request.can_read_body else {}
    except ValueError:
        raise AdminHTTPError(400, "request body is not valid JSON", "bad_request") from None
    if not isinstance(body, dict):
        raise AdminHTTPError(400, "request body must be a JSON object", "bad_request")
    return body


def _opt_int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise AdminHTTPError(400, f"{key} must be an integer in [{lo}, {hi}]", "bad_request")
    return value


def _corpus_path(value: Any, *, required: bool) -> Path | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise AdminHTTPError(400, "corpus must be a file path", "bad_request")
    path = Path(value)
    if not path.is_file():
        raise AdminHTTPError(400, f"corpus {path} does not exist or is not a file", "bad_request")
    return path


def _client_from_services(services: Mapping[str, Any]) -> StorageClient | None:
    """A storage client from the node's other services: a runtime's ``storage_client``, else one
    built on the local storage service's topology and transports."""
    for svc in services.values():
        client = getattr(svc, "storage_client", None)
        if isinstance(client, StorageClient):
            return client
    storage = services.get("storage")
    topology = getattr(storage, "topology", None)
    if storage is not None and topology is not None:
        return StorageClient(topology, getattr(storage, "transports", None),
                             identity=getattr(storage, "identity", None))
    return None


def create_service(config: Config) -> ComputeService:
    """The daemon's factory (giaannd.daemon.ROLE_FACTORIES)."""
    return ComputeService(config.compute, config.data_path("compute"))

