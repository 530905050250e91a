"""The compute role as a daemon Service: training jobs, evaluation, generation and export.

Glue only: the pipeline is in train.py, the sessions in infer.py, the node's vocabulary in
state.py. What this module adds is the wiring (which storage client, which row cache), the
service lifecycle and the metrics; the rest of the role lives beside it:

- routes.py: the handlers of the compute admin operations (``train.*``, ``eval``, ``generate``,
  ``export``, declared in giaannd/operations.py), request checking and error mapping;
- durable_jobs.py: journaled training jobs and their resume after a crash or failure;
- cluster_export.py: the storage scan, vocabulary resolution and the JSONL export.

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
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from giaannd.client.storage_client import StorageClient
from giaannd.compute.cluster_export import EXPORT_READ_ROWS as EXPORT_READ_ROWS
from giaannd.compute.cluster_export import EXPORT_SCAN_ATTEMPTS as EXPORT_SCAN_ATTEMPTS
from giaannd.compute.cluster_export import (
    VocabularyMissing,
    column_contents,
    export_cluster,
    resolve_vocab,
    scan_cluster,
    word_of,
)
from giaannd.compute.cluster_jobs.cluster_train import ClusterJobs
from giaannd.compute.cluster_jobs.lease_events import LeaseSettings
from giaannd.compute.durable_jobs import RESUME_RETRY_MAX_S as RESUME_RETRY_MAX_S
from giaannd.compute.durable_jobs import TAG_CACHE_DIR as TAG_CACHE_DIR
from giaannd.compute.durable_jobs import DurableJobs
from giaannd.compute.eval_spread import (
    EvalShare,
    RemoteShare,
    ShareFigures,
    make_share,
    share_prompts,
    spread_evaluate,
)
from giaannd.compute.infer import DEFAULT_PREFETCH_DEPTH, Inference, RowCache, RowFetcher, inference_reader
from giaannd.compute.job_journal import JournalWriter
from giaannd.compute.jobs import Job, JobRegistry, TrainProgress
from giaannd.compute.routes import DEFAULT_EVAL_LIMIT as DEFAULT_EVAL_LIMIT
from giaannd.compute.routes import MAX_EPOCHS as MAX_EPOCHS
from giaannd.compute.routes import MAX_EVAL_PROMPTS as MAX_EVAL_PROMPTS
from giaannd.compute.routes import MAX_GENERATE_TOKENS as MAX_GENERATE_TOKENS
from giaannd.compute.routes import STORAGE_ERRORS, ComputeRoutes
from giaannd.compute.state import ComputeState, EvalHistory, EvalRecord
from giaannd.compute.train import CONLLU_SUFFIXES, TrainingJob, TrainResult, TrainSettings, job_client, read_flags
from giaannd.errors import AdminHTTPError, HostEnvironmentError
from giaannd.model.columns import ColumnAssigner
from giaannd.model.engine import constants_named
from giaannd.model.gpu.device import Device, resolve_device
from giaannd.model.infer import DelimiterFlags, LifConstants
from giaannd.model.lexicon import Lexicon, load_lexicon
from giaannd.model.rows import RowBatch
from giaannd.model.sentence import EncodedSentence
from giaannd.model.subwords import ProfileMismatchError, SubwordVocabulary, make_assigner
from giaannd.model.tokens import TaggedSentence, stream_conllu, stream_sentence_texts
from giaannd.model.vocab import Vocabulary

if TYPE_CHECKING:
    from giaannd.config import ComputeConfig, Config
    from giaannd.service import ServiceContext

__all__ = ["TRAIN_COUNTERS", "ComputeService", "VocabularyMissing", "create_service"]

log = logging.getLogger(__name__)

#: ``TrainProgress`` figure -> (metric, HELP): one counter per quantity, summed over jobs, counted
#: as each window's batch is acknowledged by storage (a resumed job does not count its acknowledged
#: windows again). They count the work this node did: a cluster job's window redone after a
#: take-over counts on both nodes that wrote it (the job document counts it once; docs/compute.md).
TRAIN_COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "done": ("giaannd_compute_train_sentences_total",
             "Corpus sentences handled by training jobs (trained, or skipped by column assignment)."),
    "trained": ("giaannd_compute_train_sentences_trained_total",
                "Corpus sentences whose updates training jobs wrote to storage."),
    "skipped": ("giaannd_compute_train_sentences_skipped_total",
                "Corpus sentences training jobs skipped (column assignment found no noun, or empty)."),
    "tokens": ("giaannd_compute_train_tokens_total", "Tokens of the sentences training jobs trained on."),
    "batches": ("giaannd_compute_train_batches_total",
                "Coalesced row batches training jobs wrote, counted once storage acknowledged them."),
    "retries": ("giaannd_compute_train_retries_total",
                "Storage calls training jobs retried (batch writes, vocabulary writes, flag reads)."),
    "bytes_sent": ("giaannd_compute_train_sent_bytes_total",
                   "Bytes of the coalesced row batches training jobs wrote (array buffers, once per batch)."),
    "entries_before": ("giaannd_compute_train_delta_entries_total",
                       "Entries of the per-micro-batch deltas before coalescing (over sent_entries: the ratio)."),
    "entries_after": ("giaannd_compute_train_sent_entries_total",
                      "Entries of the coalesced row batches training jobs wrote."),
    "flags_sent": ("giaannd_compute_train_flags_sent_total",
                   "Delimiter flags training jobs wrote to the replicated flag row."),
    "flags_learned": ("giaannd_compute_train_flags_learned_total",
                      "Delimiter flags training jobs read from the flag row that they had not seen."),
    "tagged": ("giaannd_compute_train_sentences_tagged_total",
               "Raw-text sentences this node tagged for cluster jobs (their flag pass; each window once in "
               "the cluster)."),
}


class _PromSink:
    """Training figures -> their Prometheus counters (``TRAIN_COUNTERS``)."""

    def __init__(self, counters: Mapping[str, Any]) -> None:
        self._counters = counters

    def add(self, name: str, amount: float) -> None:
        # A figure without a metric is not exported rather than failing a job;
        # tests/unit/daemon/test_metric_tables.py keeps TRAIN_COUNTERS complete.
        counter = self._counters.get(name)
        if counter is not None:
            counter.inc(amount)


class ComputeService:
    """The compute role (module docstring).

    Args:
        settings: the ``compute`` config section (workers, K, row cache bytes, max sessions).
        data_dir: where the node keeps its vocabulary and tag cache.
        corpus_dir / export_dir: the only directories the admin operations read corpora from and
            write exports to (paths.py; config ``compute.corpus-dir``/``export-dir``); default
            ``<data_dir>/corpora`` and ``<data_dir>/exports``. Created on start.
        storage: a ready storage client, or None (see ``storage_factory``).
        storage_factory: builds the client from the daemon context in ``start``.
        prefetch_depth: teacher-forced lookahead of inference sessions.
        lexicon: the ever-POS lexicon file (config ``compute.lexicon``); None for the shipped one.
    """

    name = "compute"

    def __init__(self, settings: ComputeConfig, data_dir: str | Path, *, storage: StorageClient | None = None,
                 storage_factory: Callable[[ServiceContext], StorageClient | None] | None = None,
                 prefetch_depth: int = DEFAULT_PREFETCH_DEPTH, lexicon: str | Path | None = None,
                 corpus_dir: str | Path | None = None, export_dir: str | Path | None = None,
                 node_name: str | None = None) -> None:
        self.settings = settings
        self._node_name = node_name
        self._lexicon_path = lexicon
        self.data_dir = Path(data_dir)
        self.corpus_dir = Path(corpus_dir) if corpus_dir is not None else self.data_dir / "corpora"
        self.export_dir = Path(export_dir) if export_dir is not None else self.data_dir / "exports"
        self.storage = storage
        self._factory = storage_factory
        self._ctx: ServiceContext | None = None
        self.jobs = JobRegistry()
        self.durable = DurableJobs(self.data_dir, self.jobs, train=self.train, summary=self._summary,
                                   launch=self._launch, require_storage=self._client,
                                   settings=self.train_settings)  # (a resumed job: the node's device too)
        self.state = ComputeState()
        #: ``GET /v1/evals`` (state.py; loaded by ``start``, saved after each eval under ``_evals_lock``)
        self.evals = EvalHistory(settings.eval_history)
        self._evals_lock = asyncio.Lock()
        self.cache = RowCache(settings.row_cache_bytes)
        self._fetcher: RowFetcher | None = None
        self._inference: Inference | None = None
        self._prefetch_depth = prefetch_depth
        self._lexicon: Lexicon | None = None
        self._routes = ComputeRoutes(self)
        #: ``compute.device`` resolved by ``start`` (cpu until then: a service never started, as in
        #: unit tests, computes on the CPU)
        self.device: Device = "cpu"
        self._sink: _PromSink | None = None
        self._started = False
        self._resume_task: asyncio.Task[None] | None = None
        #: cluster training jobs (cluster_jobs/cluster_train.py); set by ``start``
        self.cluster: ClusterJobs | None = None
        #: the other live compute nodes -> a call that runs an eval share there (eval_spread.py);
        #: set by the daemon's role adapter (the data plane) or by tests; None: eval runs here only
        self.eval_peers: Callable[[], Mapping[str, RemoteShare]] | None = None

    @classmethod
    def from_config(cls, config: Config,
                    storage_factory: Callable[[ServiceContext], StorageClient | None] | None = None) -> ComputeService:
        """The service a daemon runs: state under ``<data-dir>/compute``, the lexicon of
        ``compute.lexicon`` (the shipped one if empty), the corpus and export directories of
        ``compute.corpus-dir``/``export-dir`` (default ``<data-dir>/corpora`` and
        ``<data-dir>/exports``)."""
        c = config.compute
        return cls(c, config.data_path("compute"), storage_factory=storage_factory, node_name=config.node.name,
                   lexicon=config.data_path(c.lexicon) if c.lexicon else None,
                   corpus_dir=config.data_path(c.corpus_dir or "corpora"),
                   export_dir=config.data_path(c.export_dir or "exports"))

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, ctx: ServiceContext | None = None) -> None:
        """Load the node state, create the corpus and export directories, register routes and
        metrics (with a context), find storage.

        Raises:
            ConfigError: ``compute.device = cuda`` and no CUDA device is usable (exit 2).
            HostEnvironmentError: a corpus or export directory cannot be created.
        """
        # first: a node asked to run on a GPU it lacks stops before it creates or loads anything
        self.device = await asyncio.to_thread(resolve_device, self.settings.device)
        log.info("compute device=%s (compute.device = %s)", self.device, self.settings.device)
        for path, knob in ((self.corpus_dir, "$.compute.corpus-dir"), (self.export_dir, "$.compute.export-dir")):
            try:
                await asyncio.to_thread(path.mkdir, mode=0o750, parents=True, exist_ok=True)
            except OSError as exc:
                raise HostEnvironmentError(f"cannot create {path}: {exc.strerror or exc} (set by {knob})",
                                           reason="data_dir_unusable") from None
        self.state = await asyncio.to_thread(ComputeState.load, self.data_dir)
        self.evals = await asyncio.to_thread(EvalHistory.load, self.data_dir, self.settings.eval_history)
        lexicon = self._lexicon_path
        self._lexicon = await asyncio.to_thread(Lexicon.default) if lexicon is None else \
            await asyncio.to_thread(load_lexicon, lexicon)
        self._ctx = ctx
        if ctx is not None:
            self._register(ctx)
        self._started = True
        self.cluster = self._cluster_jobs(ctx)
        if self.settings.cluster_jobs:
            self.cluster.start_watcher()
        pending = await self.durable.reload()
        if pending and self.settings.resume_jobs:
            coro = self.durable.resume_all(pending, lambda: read_flags(self._client()))
            self._resume_task = (ctx.spawn(coro, "resume-jobs") if ctx is not None
                                 else asyncio.get_running_loop().create_task(coro))
        elif pending:
            log.warning("%d unfinished training job(s) not resumed (compute.resume-jobs = false): %s",
                        len(pending), " ".join(j.job_id for j in pending))

    async def stop(self, graceful: bool) -> None:
        if self.cluster is not None:
            await self.cluster.stop()
            await asyncio.to_thread(self.state.save, self.data_dir)
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
        return {"storage": self.storage is not None, "device": self.device, "jobs_running": len(self.jobs.running()),
                "vocab_columns": self.state.vocab.num_columns, "vocab_features": self.state.vocab.num_features,
                "rows_written": self.state.rows_written, "row_cache": self.cache.stats(),
                "cluster_jobs_followed": len(self.cluster.followed) if self.cluster is not None else 0}

    def lease_settings(self) -> LeaseSettings:
        """The lease protocol's settings from config (``compute.lease-*``; parallel windows =
        ``compute.train-workers``)."""
        c = self.settings
        return LeaseSettings(lease_s=c.lease_s, renew_s=c.lease_renew_s or c.lease_s / 3,
                             probe_interval_s=c.lease_probe_interval_s, lease_windows=c.lease_windows,
                             parallel=c.train_workers, retry_s=c.lease_probe_interval_s / 4,
                             idle_probe_s=c.lease_idle_probe_s)

    def _cluster_jobs(self, ctx: ServiceContext | None) -> ClusterJobs:
        node = ctx.node_name if ctx is not None else (self._node_name or "compute")
        spawn = (lambda coro, name: ctx.spawn(coro, name)) if ctx is not None else None

        def lexicon() -> Lexicon:
            assert self._lexicon is not None  # loaded by start, before this object exists
            return self._lexicon

        return ClusterJobs(node, self._client, lexicon, self.lease_settings(), self.train_settings(),
                           shards=self.settings.lease_shards, spawn=spawn, sink=self._sink,
                           on_trained=self._cluster_trained, on_flags=self._cluster_flags,
                           tag_processes=self.settings.tag_processes, open_corpus=self._open_adopted)

    def _cluster_trained(self, vocab: Vocabulary, batch: RowBatch) -> None:
        self.state.vocab.merge(vocab)
        self.cache.invalidate_batch(batch)

    def _cluster_flags(self, probabilistic: set[int], deterministic: dict[int, bool]) -> None:
        for fid, flag in deterministic.items():
            self.state.deterministic.setdefault(fid, flag)
        self.state.probabilistic |= probabilistic

    def _register(self, ctx: ServiceContext) -> None:
        self._routes.register(ctx.admin)
        m = ctx.metrics
        self._sink = _PromSink({figure: m.counter(name, doc) for figure, (name, doc) in TRAIN_COUNTERS.items()})
        counters: dict[str, tuple[str, Callable[[], float]]] = {
            "giaannd_compute_row_cache_hits_total": (
                "Row cache lookups answered from the cache (inference).", lambda: self.cache.hits),
            "giaannd_compute_row_cache_misses_total": (
                "Row cache lookups that had to read storage (inference).", lambda: self.cache.misses),
            "giaannd_compute_row_cache_in_flight_joins_total": (
                "Row lookups served by a read made for another lookup (joined in flight or held; inference).",
                lambda: self.cache.in_flight_joins),
            "giaannd_compute_row_cache_evictions_total": (
                "Rows evicted from the row cache to stay under compute.row-cache-bytes.",
                lambda: self.cache.evictions),
            "giaannd_compute_row_cache_invalidations_total": (
                "Cached rows dropped as possibly stale (training here rewrote them, or an evaluation began).",
                lambda: self.cache.invalidations),
            "giaannd_compute_infer_steps_total": (
                "Inference session steps run (one row fetched each) by evaluation and generation.",
                lambda: self._inference.steps if self._inference else 0),
        }
        for metric, (doc, fn) in counters.items():
            m.counter_function(metric, doc, fn)
        gauges: dict[str, tuple[str, Callable[[], float]]] = {
            "giaannd_compute_row_cache_bytes": ("Bytes of rows the row cache holds now.", lambda: self.cache.bytes),
            "giaannd_compute_jobs_running": ("Training jobs running now on this node.",
                                             lambda: len(self.jobs.running())),
        }
        for metric, (doc, fn) in gauges.items():
            m.gauge(metric, doc).set_function(fn)

    def storage_client(self) -> StorageClient:
        """The storage client (503 ``AdminHTTPError`` while there is none)."""
        return self._client()

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
            self._fetcher = RowFetcher(inference_reader(client, fewest=self.settings.infer_read_fewest_nodes),
                                       self.cache)
            self._inference = Inference(self._fetcher, max_sessions=self.settings.max_sessions,
                                        prefetch_depth=self._prefetch_depth,
                                        readahead_prompts=self.settings.infer_readahead_prompts, device=self.device,
                                        remember_bytes=self.settings.infer_remember_bytes)
        return self._inference

    # -- training (journaled jobs: durable_jobs.py) -------------------------------------------
    def train_settings(self, workers: int | None = None, coalesce: int | None = None) -> TrainSettings:
        return TrainSettings(workers=workers or self.settings.train_workers,
                             coalesce_sentences=coalesce or self.settings.coalesce_k, device=self.device)

    async def train(self, sentences: Sequence[TaggedSentence], settings: TrainSettings,
                    progress: TrainProgress | None = None, journal: JournalWriter | None = None) -> TrainResult:
        """Run one training job to its end and fold its vocabulary and keys into the node state
        (with a journal: under the journal's writer id, resuming where it says)."""
        base = self._client()
        client = job_client(base, journal.journal.doc.writer_id if journal is not None else None)
        job = TrainingJob(sentences, client, settings, progress, lexicon=self._lexicon,
                          on_written=self.cache.invalidate_batch, journal=journal,
                          profile=self.settings.model_profile)
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
        self.state.rows_written += int(result.row_column.shape[0])

    def _summary(self, result: TrainResult) -> dict[str, Any]:
        """A succeeded training job's result document."""
        return {"rows_written": int(result.row_column.shape[0]),
                "vocab_columns": self.state.vocab.num_columns, "vocab_features": self.state.vocab.num_features,
                "probabilistic_flags": len(result.probabilistic_flags)}

    def _launch(self, run: Callable[[Job], Coroutine[Any, Any, dict[str, Any]]], *,
                job_id: str | None = None, resumes: int = 0) -> Job:
        """Register a training job and start ``run(job)`` (in the daemon's task group if any)."""
        spawn = (lambda c: self._ctx.spawn(c, "train-job")) if self._ctx is not None else None  # type: ignore[union-attr]
        return self.jobs.start("train", TrainProgress(sink=self._sink), run, spawn, job_id=job_id, resumes=resumes)

    def submit(self, sentences: Sequence[TaggedSentence] | Callable[[], Sequence[TaggedSentence]],
               settings: TrainSettings) -> Job:
        """Start a training job in the background; returns its registry entry."""
        self._client()

        async def run(job: Job) -> dict[str, Any]:
            data = await asyncio.to_thread(sentences) if callable(sentences) else sentences
            return self._summary(await self.train(data, settings, job.progress))

        return self._launch(run)

    async def submit_corpus(self, corpus: str | Path, *, workers: int | None = None, coalesce: int | None = None,
                            epochs: int = 1, limit: int | None = None) -> Job:
        """Start a durable training job on a corpus file (module docstring, "Durable jobs"): its
        journal is on disk before this returns, so a crash from here on resumes it on restart."""
        self._client()
        return await self.durable.submit(corpus, self.train_settings(workers, coalesce), epochs, limit)

    def submit_cluster(self, corpus: str | Path, *, coalesce: int | None = None, limit: int | None = None) -> str:
        """Start a cluster training job on a corpus file (cluster_jobs/cluster_train.py): the file
        is streamed into the storage cluster and every compute node with ``compute.cluster-jobs``
        trains its windows. Returns the job id at once."""
        self._client()
        assert self.cluster is not None, "start() first"
        if self.settings.model_profile != "word":
            # the window runner and the flag pass encode with the word profile's assigner; a v2
            # node would train word-level rows into a v2 cluster
            raise ProfileMismatchError(
                f"cluster jobs train the word profile only; this node's compute.model-profile is "
                f"{self.settings.model_profile!r} (run the job on one node: \"cluster\": false)")
        path = Path(corpus)
        if not path.is_file():
            raise FileNotFoundError(f"corpus {path} does not exist or is not a file")
        text = not path.name.endswith(CONLLU_SUFFIXES)
        return self.cluster.create(self._corpus_stream(path, limit, text), path.name,
                                   coalesce or self.settings.coalesce_k, text=text, path=str(path.resolve()),
                                   limit=limit)

    @staticmethod
    def _corpus_stream(path: Path, limit: int | None,
                       text: bool) -> Callable[[], Iterator[TaggedSentence] | Iterator[str]]:
        def sentences() -> Iterator[TaggedSentence] | Iterator[str]:
            # both read as streams; text is cut into sentence texts here (the sentencizer, no
            # model) and tagged by the flag pass on every node (cluster_jobs/tagging.py)
            if text:
                return itertools.islice(stream_sentence_texts(path), limit)
            return itertools.islice(stream_conllu(path), limit)
        return sentences

    def _open_adopted(self, path: str, limit: int | None,
                      text: bool) -> Callable[[], Iterator[TaggedSentence] | Iterator[str]]:
        """The corpus of an upload this node adopts (cluster_jobs/uploads.py): the same path,
        which must lie inside this node's ``compute.corpus-dir`` (as any corpus a request names)."""
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(self.corpus_dir.resolve()):
            raise PermissionError(f"{resolved} is outside this node's compute.corpus-dir {self.corpus_dir}")
        if not resolved.is_file():
            raise FileNotFoundError(f"{resolved} does not exist here or is not a file")
        return self._corpus_stream(resolved, limit, text)

    async def resume(self, job_id: str) -> Job:
        """Resume a journaled job that failed (e.g. storage was down past its retries), under its
        writer id and from its cursor, as a restart would.

        Raises:
            KeyError: no journal for ``job_id``.
            ValueError: the job is running, or its journal is corrupt.
        """
        return await self.durable.resume(job_id)

    # -- inference --------------------------------------------------------------------------------
    async def prompt_assigner(self) -> ColumnAssigner:
        """A column assigner for prompts: this node's deterministic flags and the probabilistic
        flags as storage holds them now (the replicated set). Its vocabulary is its own, not the
        node's: encoding registers every word it meets, and a prompt's words must not grow what
        the node keeps and persists (ids are content-addressed, so the encoding is the same; a word
        never trained has no row, as in the core)."""
        flags = await read_flags(self._client())
        assigner = make_assigner(self.settings.model_profile, self._lexicon, flags | self.state.probabilistic)
        assigner.add_deterministic_flags(self.state.deterministic)
        return assigner

    def _vocab(self) -> Vocabulary:
        """Names of ids: the node's (and storage's) tables, or giaann-v2's fixed ones."""
        return SubwordVocabulary() if self.settings.model_profile == "giaann-v2" else self.state.vocab

    @property
    def node_name(self) -> str:
        """This node's name (the daemon's; in-process: the constructor's)."""
        return self._ctx.node_name if self._ctx is not None else (self._node_name or "compute")

    async def evaluate(self, prompts: Sequence[TaggedSentence], constants: str = "train",
                       mode: str = "teacher", *, spread: bool | None = None,
                       source: str = "bundled corpus") -> dict[str, Any]:
        """Top-1 over tagged prompts (encoded here, with flags unchanged); figures as a dict,
        recorded in the evaluation history with ``source`` (what was evaluated; ``record_eval``).

        ``spread`` (default ``compute.eval-spread``): the encoded prompts are shared out over the
        live compute nodes ``eval_peers`` names and the figures merged exactly (eval_spread.py);
        without peers, or False, every prompt runs here. ``by_node`` says what each node did,
        ``redone`` which shares failed on their node and were run here instead.
        """
        k = constants_named(constants)
        self._infer()
        assigner = await self.prompt_assigner()
        encoded = [e for p in prompts if (e := assigner.encode(p, update_flags=False)) is not None]
        self.cache.clear()  # other nodes may have written since: start from storage's state
        run_mode = "free" if mode == "free" else "teacher"
        use_spread = self.settings.eval_spread if spread is None else spread
        peers = dict(self.eval_peers()) if use_spread and self.eval_peers is not None else {}
        peers.pop(self.node_name, None)

        async def run_local(part: Sequence[EncodedSentence]) -> ShareFigures:
            return await self._run_share(part, assigner, k, run_mode)

        t0 = time.perf_counter()
        result = await spread_evaluate(encoded, self.node_name, run_local, peers,
                                       lambda part: make_share(part, assigner, constants, run_mode),
                                       self.settings.eval_share_timeout_s)
        elapsed = time.perf_counter() - t0
        r = result.total
        top1 = r.matches / r.prediction_tokens if r.prediction_tokens else 0.0
        out = {"constants": constants, "mode": mode, "prompts": r.prompts, "skipped": len(prompts) - r.prompts,
               "prediction_tokens": r.prediction_tokens, "matches": r.matches, "top1": round(top1, 6),
               "no_prediction": r.no_prediction, "steps": r.steps, "elapsed_s": round(elapsed, 3),
               "steps_per_s": round(r.steps / elapsed, 1) if elapsed else 0.0,
               "row_cache": self.cache.stats(), "by_node": result.by_node_doc()}
        if result.redone:
            out["redone"] = result.redone
        await self.record_eval(out, source)
        return out

    async def record_eval(self, figures: Mapping[str, Any], source: str) -> EvalRecord:
        """Add an evaluation's figures to the history and save it. ``trained`` is the sentences
        trained by the jobs this node knows now: its own (running or finished, up to
        ``jobs.MAX_FINISHED_JOBS``) and the cluster jobs ``train list`` shows; cluster jobs are
        left out when storage cannot be read (the eval itself already succeeded). A history
        that cannot be written is logged, not raised."""
        record = EvalRecord(at=round(time.time(), 3), top1=figures["top1"], matches=figures["matches"],
                            prediction_tokens=figures["prediction_tokens"], prompts=figures["prompts"],
                            constants=figures["constants"], mode=figures["mode"],
                            trained=await self._trained_now(), source=source)
        async with self._evals_lock:
            self.evals.add(record)
            data = self.evals.encode()
            try:
                await asyncio.to_thread(self.evals.save, self.data_dir, data)
            except OSError as exc:
                log.warning("evaluation history not saved dir=%s: %s", self.data_dir, exc)
        return record

    async def _trained_now(self) -> int:
        trained = sum(j.progress.trained for j in self.jobs.all())
        if self.cluster is None or self.storage is None:
            return trained
        try:
            for job_id in await self.cluster.list_ids():
                doc = await self.cluster.document(job_id)
                trained += int(doc.get("trained", 0)) if doc is not None else 0
        except STORAGE_ERRORS as exc:
            log.warning("evaluation history: cluster jobs not counted in trained: %s", exc)
        return trained

    async def _run_share(self, prompts: Sequence[EncodedSentence], flags: DelimiterFlags, k: LifConstants,
                         mode: str) -> ShareFigures:
        report = await self._infer().evaluate(prompts, flags, k, "free" if mode == "free" else "teacher")
        r = report.result
        return ShareFigures(r.prompts, r.skipped_short, r.prediction_tokens, r.matches, r.no_prediction, r.steps,
                            report.elapsed_s)

    async def eval_share(self, share: EvalShare) -> ShareFigures:
        """Run another node's share of a spread evaluation (eval_spread.py): its prompts come
        encoded, with the flags their sessions read, so nothing of this node's state is used.

        Raises:
            ValueError: a malformed share. STORAGE_ERRORS / AdminHTTPError(503): storage failing.
        """
        prompts, flags = share_prompts(share)
        self.cache.clear()  # as evaluate: rows written by other nodes since must be read again
        return await self._run_share(prompts, flags, constants_named(share.constants), share.mode)

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
        # as evaluate: rows other nodes wrote since (their jobs invalidate only their own caches) must
        # be read again, else a row cached before their training (absent: empty) is served for good
        self.cache.clear()
        nodes = await inference.generate(list(zip(enc.column.tolist(), enc.feature.tolist())), assigner, k,
                                         max_tokens)
        try:
            await self.resolve_vocab([c for c, _ in nodes], [f for _, f in nodes])
        except STORAGE_ERRORS as exc:  # words still print, as hex, for what could not be fetched
            log.warning("vocabulary lookup failed: %s", exc)
        vocab = self._vocab()  # names: the node's (just resolved from storage), else the prompt's own
        words = [word_of(vocab if _named(vocab, c, f) else assigner.vocab, c, f) for c, f in nodes]
        return {"prompt": list(enc.words), "tokens": words, "text": " ".join(words)}

    # -- vocabulary and export (cluster_export.py) --------------------------------------------
    async def resolve_vocab(self, columns: Any, features: Any) -> int:
        """Fetch the strings of ids this node's vocabulary lacks from storage (where training jobs of
        any compute node put them) into the node's vocabulary, which is the local cache. Entries
        are re-checked against their ids. Returns the number of entries added.

        Raises:
            ReadFailed: every owner of some ids failed.
        """
        return await resolve_vocab(self._vocab(), lambda keys: self._client().get_vocab(keys),
                                   columns, features)

    async def scan_cluster(self) -> RowBatch:
        """Every model row of the cluster (each exactly once; the flag row left out), by scanning
        storage (``StorageClient.scan_all``); restarted if the placement changes under it."""
        return await scan_cluster(self._client())

    async def column_rows(self, column: int, limit: int) -> dict[str, Any] | None:
        """``column rows``: the column's rows from one replica (``StorageClient.read_column``, pages
        of ``compute.export-page-bytes``), cut at ``limit`` entries, as words resolved through this
        node's vocabulary and then storage's (cluster_export.py ``column_contents``). None: no rows.

        Raises:
            ReadFailed: no owner of the column (or of some vocabulary ids) answered.
        """
        read = await self._client().read_column(column, limit, page_bytes=self.settings.export_page_bytes)
        return await column_contents(read, self._vocab(), lambda keys: self._client().get_vocab(keys))

    async def export(self, path: str | Path) -> dict[str, Any]:
        """JSONL export of every row of the cluster, whichever compute node trained it: a storage
        scan, words resolved through this node's vocabulary and then storage's, written as the
        scan goes in bounded memory (cluster_export.py ``export_cluster``).

        Raises:
            VocabularyMissing: some id has no string anywhere (rows written by a node that did not
                replicate its vocabulary); nothing is written.
            ExportWriteError: ``path`` cannot be written; nothing is.
        """
        return await export_cluster(self._client(), self._vocab(),
                                    lambda keys: self._client().get_vocab(keys), path,
                                    page_bytes=self.settings.export_page_bytes,
                                    chunk_entries=self.settings.export_chunk_entries)


def _named(vocab: Vocabulary, column: int, feature: int) -> bool:
    """Whether ``vocab`` has the word of the node (column, feature)."""
    try:
        vocab.word_of(column, feature)
    except KeyError:
        return False
    return True


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
    return ComputeService.from_config(config)
