"""Distributed training: corpus → B workers → coalesced delta batches → storage owners (ARCHITECTURE §9).

Theory of operation
-------------------
The corpus is cut, in order, into *windows* of K sentences (``coalesce_sentences``): window ``i`` is
``sentences[i*K:(i+1)*K]``. B workers (asyncio tasks; ``workers``) split them statically: worker
``i mod B`` takes window ``i``, in order. For each window a worker:

1. **refresh flags**: read the reserved flag row (flags.py) and merge flags other workers (or other
   compute nodes) found into this worker's :class:`ColumnAssigner`;
2. **encode** the window in order with the worker's assigner (``update_flags=True``), exactly as the
   single-process engine does — the assigner is per worker, like a separate compute node;
3. **train**: ``train_batch`` (the core's code) over the window's encoded sentences. Because
   training is a pure sum of increments (giaann-algorithm.md §3.3), one ``train_batch`` over K
   sentences *is* the coalesced delta: equal (row, entry) keys of all K sentences are summed once.
   Flags found in this window are added as the flag row of the same batch (one batch id: the flags
   land together with the deltas of the sentences that found them);
4. **send** the batch through :class:`~giaannd.client.storage_client.StorageClient`, which splits it by
   owner and writes to R replicas with a quorum. The batch id is ``(writer, i + 1)``: a
   deterministic function of the window. Ids are taken from the job's fresh client in window order
   (``next_batch_id``), so an id counts as unsettled from the moment a worker takes its window and
   the client's writer floor never passes a window not yet written. A failed write is retried with
   the *same* id (storage ignores ids it applied, so a retry never double-counts); a write that
   exhausts its attempts is not abandoned, so the floor never passes it and the job can resume.
   Sends run in the background while the worker encodes its next window, bounded by
   ``max_inflight_bytes`` (a slow storage node fills the budget and the workers wait: backpressure).

**Resuming** (job_journal.py has the full argument): with a journal, each window is recorded as
started, with the flags its worker learned from storage, durably before it is encoded; a window
acknowledged by W replicas (and its vocabulary) moves the journal's cursor. A restarted job (same
writer id) replays the windows before ``journal.restart_window`` without sending them — rebuilding
each worker's assigner exactly — and sends from there on: recorded windows with their recorded
flags (byte-identical batches under the same ids, so storage drops what it already applied),
unrecorded windows as a fresh run would.

**Vocabulary**: each window also carries the id → string entries its worker's assigner learned since
its previous window (``_Window.vocab``). They are written to storage (``StorageClient.put_vocab``,
owned like columns by id) *before* the window's deltas, and a worker's vocabulary writes are chained
in window order, so a row acknowledged by storage never names an id whose string is not durable
there (docs/replication.md, "Vocabulary"). A client without ``put_vocab`` (a test stand-in) skips it.

With one worker the result equals the sequential core exactly (same encodings, same sums; only the
float32 rounding of different batch boundaries can differ). With B workers the only difference is
a flag found by one worker and not yet seen by another (flags.py).

The coalescing ratio reported is *pair increments* (every (source token, target token, segment)
increment the sentences produce before any summing, what a naive per-increment sender would ship)
over entries actually sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np
from numpy.typing import NDArray

from giaannd.client.storage_client import (
    ByteBudget,
    QuorumNotReached,
    RemoteVocabConflict,
    StorageClient,
    StorageRequestError,
)
from giaannd.compute.flags import FLAG_ROW, FlagTracker, flag_ids, with_flags
from giaannd.compute.job_journal import JournalWriter, acked_windows, outlast, sentences_digest
from giaannd.compute.jobs import TrainProgress
from giaannd.model.columns import ColumnAssigner
from giaannd.model.gpu.device import Device
from giaannd.model.lexicon import Lexicon
from giaannd.model.rows import RowBatch
from giaannd.model.sentence import EncodedSentence
from giaannd.model.subwords import (
    PROFILES,
    Profile,
    ProfileMismatchError,
    group_sentences,
    make_assigner,
    profile_marker,
)
from giaannd.model.tokens import TaggedSentence, read_conllu, tag_file_cached
from giaannd.model.train import COLUMN_SEGMENTS, FEATURE_REACH, backend_for, train_batch
from giaannd.model.vocab import Vocabulary
from giaannd.protocol import BatchId
from peers.errors import PeersError
from peers.retry import RetryPolicy, retry

__all__ = [
    "CONLLU_SUFFIXES",
    "DEFAULT_COALESCE_SENTENCES",
    "TrainResult",
    "TrainSettings",
    "TrainingJob",
    "job_client",
    "load_corpus",
    "load_prompts",
    "pair_increments",
    "read_flags",
]

log = logging.getLogger(__name__)

#: K: sentences per coalesced batch. 256 = the single-process engine's batch (a few MB per batch).
DEFAULT_COALESCE_SENTENCES: Final = 256
#: Bytes of delta batches in flight per job (sends not yet acknowledged by a quorum).
DEFAULT_MAX_INFLIGHT_BYTES: Final = 64 * 2**20
#: Attempts per batch before the job fails (the same batch id every time).
DEFAULT_MAX_ATTEMPTS: Final = 6
#: Ceiling of the first retry wait; doubles per attempt (0.1, 0.2, 0.4, ... s), and each wait is
#: drawn uniformly below it (full jitter, peers/retry.py). The mean wait is half the ceiling, so this
#: is twice the fixed 0.05 s first wait it replaced: about 1.5 s over six attempts on average, as before.
DEFAULT_RETRY_BACKOFF_S: Final = 0.1
#: No retry of a batch waits longer than this (a long job with many attempts).
RETRY_CAP_S: Final = 5.0
#: File names read as CoNLL-U (anything else is text, tagged by spaCy).
CONLLU_SUFFIXES: Final = (".conllu", ".conllu.gz", ".conll", ".conll.gz")
_RETRYABLE: Final = (StorageRequestError, PeersError, OSError, LookupError)


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """Knobs of one training job (config: ``compute.train-workers``, ``compute.coalesce-k``).

    Attributes:
        workers: B concurrent workers, each with its own column assigner (as separate nodes would).
        coalesce_sentences: K, sentences summed into one delta batch.
        max_inflight_bytes: backpressure bound on unacknowledged batch bytes.
        max_attempts / retry_backoff_s: retry policy for a failed batch (same batch id): attempts in
            all, and the ceiling of the first full-jitter wait (``retry_policy``).
        offload: run encode + train of a window in a worker thread (``asyncio.to_thread``) so the
            event loop keeps serving sends and admin requests meanwhile.
        device: where ``train_batch`` computes (``compute.device``, resolved): ``cpu`` is the numpy
            backend (the fastest on a CPU), ``cuda`` the torch backend on the device.
    """

    workers: int = 1
    coalesce_sentences: int = DEFAULT_COALESCE_SENTENCES
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S
    offload: bool = False
    device: Device = "cpu"

    def __post_init__(self) -> None:
        if self.workers < 1 or self.coalesce_sentences < 1 or self.max_attempts < 1:
            raise ValueError("workers, coalesce_sentences and max_attempts must be >= 1")
        if self.max_inflight_bytes < 1 or self.retry_backoff_s < 0:
            raise ValueError("max_inflight_bytes must be >= 1 and retry_backoff_s >= 0")

    @property
    def retry_policy(self) -> RetryPolicy:
        """How a failed write, vocabulary put or flag read is retried (always with the same id)."""
        return RetryPolicy(self.retry_backoff_s, max(RETRY_CAP_S, self.retry_backoff_s), self.max_attempts)


@dataclass
class TrainResult:
    """What a finished job leaves behind on the compute node."""

    vocab: Vocabulary
    deterministic_flags: dict[int, bool]
    probabilistic_flags: set[int]
    #: every row key this job wrote (flag row excluded), sorted: (row_column, row_feature)
    row_column: NDArray[np.uint64] = field(default_factory=lambda: np.empty(0, np.uint64))
    row_feature: NDArray[np.uint64] = field(default_factory=lambda: np.empty(0, np.uint64))


def load_corpus(path: str | Path, cache_dir: str | Path | None = None, limit: int | None = None
                ) -> list[TaggedSentence]:
    """Sentences of a corpus file: CoNLL-U (plain or gzip) as is, anything else as UTF-8 text
    tagged by spaCy once and cached (``tag_file_cached``) under ``cache_dir``.

    Raises:
        FileNotFoundError: no such file.
        CorpusFormatError: malformed CoNLL-U (names the line).
        TaggerUnavailableError: a text corpus and no spaCy model.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"corpus {p} does not exist or is not a file")
    if not p.name.endswith(CONLLU_SUFFIXES):
        if cache_dir is None:
            raise ValueError("a text corpus needs a tag cache directory")
        p = tag_file_cached(p, cache_dir)
    out: list[TaggedSentence] = []
    for sentence in read_conllu(p):
        if limit is not None and len(out) >= limit:
            break
        out.append(sentence)
    return out


def load_prompts(path: str | Path, cache_dir: str | Path | None = None, limit: int | None = None
                 ) -> list[TaggedSentence]:
    """Prompts of a prompt file: CoNLL-U as is (one sentence per prompt), anything else as UTF-8
    text with one prompt per non-blank line, each tagged whole as the reference tags a prompt line
    (``tag_file_cached(..., lines=True)``, cached under ``cache_dir``).

    Raises:
        FileNotFoundError: no such file.
        CorpusFormatError: malformed CoNLL-U, or text that is not UTF-8.
        TaggerUnavailableError: a text file and no spaCy model.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {p} does not exist or is not a file")
    if not p.name.endswith(CONLLU_SUFFIXES):
        if cache_dir is None:
            raise ValueError("a text prompt file needs a tag cache directory")
        p = tag_file_cached(p, cache_dir, lines=True)
    return list(itertools.islice(read_conllu(p), limit))


def pair_increments(sentences: Sequence[EncodedSentence]) -> int:
    """Increments the sentences produce before any summing (§3.1 step 6): per source token p, one
    feature entry per target within ``FEATURE_REACH`` tokens, one column entry per later target
    fewer than ``COLUMN_SEGMENTS`` instances away."""
    total = 0
    for s in sentences:
        n = len(s)
        if n < 2:
            continue
        inst = np.asarray(s.instance, np.int64)
        m = int(inst[-1]) + 1
        pos = np.arange(n, dtype=np.int64)
        feature = np.minimum(FEATURE_REACH, n - 1 - pos)
        ends = np.searchsorted(inst, np.arange(m, dtype=np.int64), side="right")
        column = ends[np.minimum(inst + (COLUMN_SEGMENTS - 1), m - 1)] - pos - 1
        total += int(feature.sum() + column.sum())
    return total


def job_client(base: StorageClient, writer_id: int | None = None) -> StorageClient:
    """A client sharing ``base``'s topology, transports and policy, with its own writer id: the
    journal's (a resumed job reuses its ids on purpose: storage drops what it already applied) or a
    fresh random one. Its seqs start at 1 (the job takes one per window, in window order)."""
    return StorageClient(
        base.topology, base.transports, identity=base.identity,
        writer_id=secrets.randbits(64) if writer_id is None else writer_id,
        write_quorum=base.write_quorum, request_timeout_s=base.request_timeout_s,
        connect_timeout_s=base.connect_timeout_s, max_inflight_bytes_per_owner=base.max_inflight,
        on_unreachable=base.on_unreachable,
    )


async def read_flags(client: StorageClient) -> set[int]:
    """The replicated flag set as storage holds it now (empty before any flag was written)."""
    batch = await client.read_rows(np.array([FLAG_ROW[0]], np.uint64), np.array([FLAG_ROW[1]], np.uint64))
    return flag_ids(batch.row(0)) if batch.num_rows else set()


@dataclass
class _Window:
    batch: RowBatch
    handled: int
    trained: int
    tokens: int
    increments: int
    flags: int
    #: (kind, id, text) entries new to the worker since its previous window (kind 0 column, 1 feature)
    vocab: list[tuple[int, int, str]] = field(default_factory=list)


class _Worker:
    """One worker's column assigner and view of the flag set."""

    def __init__(self, lexicon: Lexicon, flags: set[int], profile: Profile = "word", device: Device = "cpu") -> None:
        self.assigner: ColumnAssigner = make_assigner(profile, lexicon, flags)
        self.device: Device = device
        self.tracker = FlagTracker(flags)
        self._vocab_seen = (0, 0)  # columns / features of the assigner's vocabulary already taken
        #: the worker's last vocabulary write (each one waits for the one before: window order)
        self.vocab_task: asyncio.Task[None] | None = None

    def take_new_vocab(self) -> list[tuple[int, int, str]]:
        """Entries added to the assigner's vocabulary since the last call (insertion order)."""
        vocab = self.assigner.vocab
        nc, nf = self._vocab_seen
        out = [(0, cid, lemma) for cid, lemma in itertools.islice(vocab.columns(), nc, None)]
        out += [(1, fid, word) for fid, word in itertools.islice(vocab.features(), nf, None)]
        self._vocab_seen = (vocab.num_columns, vocab.num_features)
        return out

    def learn(self, remote: set[int]) -> set[int]:
        """Merge flags read from storage (or recorded in the journal); returns the new ones."""
        learned = self.tracker.merge_remote(remote)
        if learned:
            self.assigner.add_probabilistic_flags(learned)
        return learned

    def replay(self, window: Sequence[TaggedSentence], learned: set[int]) -> None:
        """Redo a window of an earlier run that storage already holds: the same state changes as
        ``learn`` + ``process`` (flags, deterministic flags, vocabulary taken), without training."""
        self.learn(learned)
        for t in window:
            self.assigner.encode(t, update_flags=True)
        self.tracker.take_unsent(self.assigner.probabilistic_flags)
        self.take_new_vocab()

    def process(self, window: Sequence[TaggedSentence]) -> _Window:
        """Encode (updating flags) and train one window; synchronous (may run in a thread)."""
        encoded = [e for t in window if (e := self.assigner.encode(t, update_flags=True)) is not None]
        out = train_batch(encoded, backend=backend_for(self.device), device=self.device)
        new_flags = self.tracker.take_unsent(self.assigner.probabilistic_flags)
        batch = with_flags(out.rows, new_flags)
        return _Window(batch, len(window), out.sentences, out.tokens, pair_increments(encoded), len(new_flags),
                       self.take_new_vocab())


class TrainingJob:
    """One training run over ``sentences`` (module docstring).

    Args:
        sentences: tagged sentences, in corpus order.
        client: the job's storage client, fresh (seqs from 1; :func:`job_client`).
        settings: workers, K, backpressure, retries.
        progress: updated as windows are acknowledged (the job document).
        lexicon: the ever-POS lexicon (default: the shipped one).
        on_written: called with every acknowledged batch (the node's row cache invalidates on it).
        journal: the job's durable journal (job_journal.py): records windows and the cursor, and
            makes this run resume where an earlier run of the same job stopped. Its spec's workers
            and K must be ``settings``'.
        profile: the model profile (config ``compute.model-profile``); ``giaann-v2`` joins the
            sentences three by three into sequences. The job records it in storage's vocabulary
            (``profile_marker``) and refuses a cluster trained under another (``_claim_profile``).
    """

    def __init__(self, sentences: Sequence[TaggedSentence], client: StorageClient, settings: TrainSettings,
                 progress: TrainProgress | None = None, *, lexicon: Lexicon | None = None,
                 on_written: Callable[[RowBatch], None] | None = None,
                 journal: JournalWriter | None = None, profile: Profile = "word") -> None:
        self.profile = profile
        if profile == "giaann-v2":
            sentences = list(group_sentences(sentences))
        self.sentences = sentences
        self.client = client
        self.settings = settings
        self.progress = progress if progress is not None else TrainProgress()
        self.progress.total = len(sentences)
        self.lexicon = lexicon if lexicon is not None else Lexicon.default()
        self.on_written = on_written
        self.journal = journal
        if journal is not None:
            spec = journal.journal.doc.spec
            if (spec.workers, spec.coalesce) != (settings.workers, settings.coalesce_sentences):
                raise ValueError("the journal's workers / coalesce differ from the settings")
        k = settings.coalesce_sentences
        self._num_windows = -(-len(sentences) // k)
        self._budget = ByteBudget(settings.max_inflight_bytes)
        self._sends: set[asyncio.Task[None]] = set()
        self._side_tasks: set[asyncio.Task[None]] = set()  # vocabulary and journal writes
        self._keys: list[tuple[NDArray[np.uint64], NDArray[np.uint64]]] = []
        self._bids: dict[int, BatchId] = {}
        self._allocated = 0
        self._counted = 0  # windows below this were counted in progress by an earlier run
        self._counted_past: frozenset[int] = frozenset()  # and these, past it (job_journal.py ``acked``)
        self._failure: BaseException | None = None
        self._workers: list[_Worker] = []

    def _window(self, index: int) -> Sequence[TaggedSentence]:
        k = self.settings.coalesce_sentences
        return self.sentences[index * k:(index + 1) * k]

    def _batch_id(self, window: int) -> BatchId:
        """The id of ``window`` (seq window + 1), taking ids from the client in window order."""
        while self._allocated <= window:
            bid = self.client.next_batch_id()
            self._allocated += 1
            if bid.seq != self._allocated:
                raise ValueError(f"the job's client is not fresh: seq {bid.seq}, expected {self._allocated}")
            self._bids[self._allocated - 1] = bid
        return self._bids.pop(window)

    async def run(self) -> TrainResult:
        """Train every sentence (or, resumed, what an earlier run left); returns once every batch
        is acknowledged by a quorum.

        Raises:
            QuorumNotReached / StorageRequestError: a batch failed ``max_attempts`` times.
            ValueError: resumed over other sentences than the journal's job started on.
        """
        journal = self.journal.journal if self.journal is not None else None
        if journal is not None:
            # bind the job to the sequences it trains (giaann-v2: sentences joined three by three),
            # refuse a resume over others (job_journal.py ``check_sentences``)
            digest = await asyncio.to_thread(sentences_digest, self.sentences)
            journal.check_sentences(digest, len(self.sentences))
        resuming = journal is not None and journal.doc.initial_flags is not None
        if journal is not None and journal.doc.initial_flags is not None:
            initial = set(journal.doc.initial_flags)
        else:
            await self._claim_profile()
            initial = await self._read_flags()
            if self.journal is not None and journal is not None:
                journal.begin(initial, len(self.sentences))
                await self.journal.commit()
        workers = self._workers = [_Worker(self.lexicon, initial, self.profile, self.settings.device)
                                 for _ in range(self.settings.workers)]
        restart = await self._replay(workers) if resuming else 0
        loop = asyncio.get_running_loop()
        work = [loop.create_task(self._work(w, i, restart)) for i, w in enumerate(workers)]
        try:
            await asyncio.gather(*work)
            while self._sends:
                await asyncio.wait(set(self._sends))
        except BaseException:
            # a failed worker fails the job: the other workers stop too (gather leaves them running)
            tasks = {*work, *self._sends, *self._side_tasks}
            for task in tasks:
                task.cancel()
            # the run ends after its tasks, however often it is cancelled meanwhile: one may be
            # waiting for a journal write in its thread, which must not land after the caller
            # removes the journal (a cancelled job, durable_jobs.py)
            await outlast(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved: the job's own failure is the one raised
            raise
        # every send awaited its window's vocabulary write; any left still has to land
        if self._side_tasks:
            await asyncio.gather(*self._side_tasks, return_exceptions=True)
        if self._failure is not None:
            raise self._failure
        return self._result(workers)

    async def _replay(self, workers: Sequence[_Worker]) -> int:
        """Resume (the journal says an earlier run began): rebuild the workers' state from the windows before the
        journal's restart window
        (their ids settled: taken and given up); returns the first window to send."""
        if self.journal is None:
            return 0
        journal = self.journal.journal
        restart = min(journal.restart_window, self._num_windows)
        self._counted = min(journal.doc.cursor, self._num_windows)
        self._counted_past = frozenset(acked_windows(journal.doc))
        # ``done`` counts from what the earlier run acknowledged, windows past its cursor included,
        # the other figures from what it counted for those windows (job_journal.py ``figures``)
        self.progress.resume_at(journal.acknowledged_sentences(len(self.sentences)), journal.figures())
        for index in range(restart):
            workers[journal.worker_of(index)].replay(self._window(index), journal.learned_before(index))
            self.client.abandon(self._batch_id(index))
            if index % 16 == 15:
                await asyncio.sleep(0)  # keep the node's event loop serving while we replay
        if restart:
            log.info("job resumed job=%s writer=%#x replayed_windows=%d cursor=%d", journal.job_id,
                     journal.doc.writer_id, restart, journal.doc.cursor)
        return restart

    async def _work(self, worker: _Worker, number: int, restart: int) -> None:
        b = self.settings.workers
        first = restart + (number - restart) % b
        for index in range(first, self._num_windows, b):
            if self._failure is not None:
                return
            bid = self._batch_id(index)
            recorded = await self._learn(worker, index)
            window = self._window(index)
            if self.settings.offload:
                done = await asyncio.to_thread(worker.process, window)
            else:
                done = worker.process(window)
            loop = asyncio.get_running_loop()
            if done.vocab:
                vocab_task = loop.create_task(self._put_vocab(done.vocab, worker.vocab_task))
                worker.vocab_task = vocab_task
                self._side_tasks.add(vocab_task)
                vocab_task.add_done_callback(self._side_done)
            if done.batch.num_rows == 0:
                self.client.abandon(bid)  # nothing to send: settled (the id is never used)
                task = loop.create_task(self._finish_empty(index, done, worker.vocab_task, recorded))
            else:
                await self._budget.acquire(done.batch.nbytes)
                task = loop.create_task(self._send(index, bid, done, worker.vocab_task, recorded))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _learn(self, worker: _Worker, index: int) -> asyncio.Task[None] | None:
        """Merge flags before encoding window ``index``: the journal's record for a window an
        earlier run started, else storage's flag row, then recorded as started. Returns the
        journal write of that record (it runs while the window is encoded; the window's send
        awaits it, so the record is durable before any byte of the window leaves)."""
        journal = self.journal.journal if self.journal is not None else None
        commit: asyncio.Task[None] | None = None
        if journal is not None and journal.is_started(index):
            learned = worker.learn(journal.learned_before(index))
        else:
            learned = worker.learn(await self._read_flags())
            if self.journal is not None and journal is not None:
                journal.start_window(index, learned)
                commit = asyncio.get_running_loop().create_task(self.journal.commit())
                self._side_tasks.add(commit)  # cancelled with the job, failures fail it
                commit.add_done_callback(self._side_done)
        if learned:
            self.progress.add(flags_learned=len(learned))
        return commit

    async def _acknowledged(self, index: int, figures: dict[str, int] | None = None) -> None:
        """Window ``index`` is acknowledged (W acks, vocabulary written): move the journal cursor.
        ``figures``: what this run counted for it (``_count``), journaled with it."""
        if self.journal is not None:
            floor = int(getattr(self.client, "writer_floor", 0))
            if self.journal.journal.acknowledge(index, floor, figures):
                await self.journal.commit()

    def _count(self, index: int, window: _Window, **sent: int) -> dict[str, int] | None:
        """Count window ``index`` in the job document, unless an earlier run acknowledged (and
        counted) it; returns the figures counted (for the journal: ``_acknowledged``), or None."""
        if self._counted_before(index):  # a re-send of a window an earlier run acknowledged counts once
            return None
        figures = dict(trained=window.trained, skipped=window.handled - window.trained, tokens=window.tokens, **sent)
        self.progress.add(done=window.handled, **figures)
        return figures

    def _retried(self) -> None:
        """One more retry (of any request of the job), journaled like the windows' figures."""
        self.progress.add(retries=1)
        if self.journal is not None:
            self.journal.journal.count(retries=1)

    async def _finish_empty(self, index: int, window: _Window, vocab: asyncio.Task[None] | None,
                            recorded: asyncio.Task[None] | None) -> None:
        """A window with no rows: acknowledged once its vocabulary and start record are written."""
        try:
            for task in (vocab, recorded):
                if task is not None:
                    await asyncio.shield(task)
            # its sentences may be trained (one token: no pair), as the core counts
            await self._acknowledged(index, self._count(index, window))
        except Exception as exc:  # recorded; run() raises it once the other sends have ended
            if self._failure is None:
                self._failure = exc

    def _counted_before(self, index: int) -> bool:
        """Whether an earlier run of the job acknowledged window ``index`` (and counted it)."""
        return index < self._counted or index in self._counted_past

    def _side_done(self, task: asyncio.Task[None]) -> None:
        self._side_tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None and self._failure is None:
            self._failure = exc

    async def _put_vocab(self, entries: list[tuple[int, int, str]], before: asyncio.Task[None] | None) -> None:
        """Write vocabulary entries after the worker's previous vocabulary write, with retries
        (puts are idempotent); a hash collision is not retried."""
        if before is not None:
            await before

        def note(failures: int, exc: BaseException, wait_s: float) -> None:
            self._retried()
            log.info("vocabulary write retry attempt=%d in %.2fs: %s", failures, wait_s, exc)

        await retry(lambda: self.client.put_vocab(entries), self.settings.retry_policy, retry_on=_RETRYABLE,
                    give_up=lambda exc: isinstance(exc, RemoteVocabConflict), on_retry=note)

    async def _send(self, index: int, bid: BatchId, window: _Window,
                    vocab: asyncio.Task[None] | None = None, recorded: asyncio.Task[None] | None = None) -> None:
        batch = window.batch
        try:
            # the strings of this window's ids are durable before its rows, and so is the
            # journal's record that the window started (a resume must recompute it identically)
            for task in (vocab, recorded):
                if task is not None:
                    await asyncio.shield(task)
            await self._write_with_retries(batch, bid)
        except Exception as exc:  # recorded; run() raises it once the other sends have ended
            if self._failure is None:
                self._failure = exc
            return
        finally:
            await self._budget.release(batch.nbytes)
        keep = ~((batch.row_column == FLAG_ROW[0]) & (batch.row_feature == FLAG_ROW[1]))
        self._keys.append((batch.row_column[keep], batch.row_feature[keep]))
        figures = self._count(index, window, batches=1, bytes_sent=batch.nbytes, entries_before=window.increments,
                              entries_after=batch.num_entries, flags_sent=window.flags)
        if self.on_written is not None:
            self.on_written(batch)
        try:
            await self._acknowledged(index, figures)
        except Exception as exc:
            if self._failure is None:
                self._failure = exc

    async def _write_with_retries(self, batch: RowBatch, bid: BatchId) -> None:
        # A write that runs out of attempts (or meets a full store) is not abandoned: the id stays
        # unsettled, so the writer floor never passes it and a resumed run can still send it
        # (module docstring).
        def note(failures: int, exc: BaseException, wait_s: float) -> None:
            self._retried()
            log.info("batch retry writer=%#x seq=%d attempt=%d in %.2fs: %s", bid.writer, bid.seq, failures,
                     wait_s, exc)

        await retry(lambda: self.client.write(batch, bid), self.settings.retry_policy, retry_on=_RETRYABLE,
                    give_up=lambda exc: isinstance(exc, QuorumNotReached) and exc.store_full, on_retry=note)

    async def _claim_profile(self) -> None:
        """Refuse a cluster that holds another profile's marker, then write this one's (before any
        row, so the rows of a cluster always have a marker). Check then write: two jobs of different
        profiles started at the same moment are not caught (docs/model.md). A client without a
        vocabulary (a test stand-in) skips it.

        Raises:
            ProfileMismatchError: the cluster was trained under another profile.
        """
        get, put = getattr(self.client, "get_vocab", None), getattr(self.client, "put_vocab", None)
        if get is None or put is None:
            return
        markers = {p: profile_marker(p) for p in PROFILES}
        found = await retry(lambda: get([(k, i) for k, i, _ in markers.values()]), self.settings.retry_policy,
                            retry_on=_RETRYABLE)
        others = [p for p, (k, i, text) in markers.items() if p != self.profile and found.get((k, i)) == text]
        if others:
            raise ProfileMismatchError(
                f"this cluster was trained under model profile {others[0]!r}; this node's is "
                f"{self.profile!r} (compute.model-profile): profiles cannot be mixed in one cluster")
        await retry(lambda: put([markers[self.profile]]), self.settings.retry_policy, retry_on=_RETRYABLE,
                    give_up=lambda exc: isinstance(exc, RemoteVocabConflict))

    async def _read_flags(self) -> set[int]:
        """The replicated flag set, retried like a write (a replica may be failing over)."""
        return await retry(lambda: read_flags(self.client), self.settings.retry_policy, retry_on=_RETRYABLE,
                           on_retry=lambda failures, exc, wait_s: self._retried())

    def partial_result(self) -> TrainResult:
        """What a failed or cancelled run got acknowledged so far (vocabulary, flags, keys written),
        so the node can still export and print those rows."""
        return self._result(self._workers)

    def _result(self, workers: Sequence[_Worker]) -> TrainResult:
        vocab = Vocabulary()
        deterministic: dict[int, bool] = {}
        prob: set[int] = set()
        for w in workers:
            vocab.merge(w.assigner.vocab)
            for fid, flag in w.assigner.deterministic_flags.items():
                deterministic.setdefault(fid, flag)
            prob |= w.assigner.probabilistic_flags
        result = TrainResult(vocab, deterministic, prob)
        if self._keys:
            cols = np.concatenate([k[0] for k in self._keys])
            feats = np.concatenate([k[1] for k in self._keys])
            order = np.lexsort((feats, cols))
            cols, feats = cols[order], feats[order]
            new = np.ones(cols.shape[0], bool)
            new[1:] = (cols[1:] != cols[:-1]) | (feats[1:] != feats[:-1])
            result.row_column, result.row_feature = cols[new], feats[new]
        return result
