"""What one compute node does with a window it leased in a cluster training job (the
``run_window`` of lease_driver.py): stage 0 finds the window's flags, stage 1 trains it.

Stage 0 (flag_pass.py): read the window's chunk (corpus_chunks.py), compute its findings with a
fresh assigner, store them at ``job/<id>/f/<w>`` (create-if-absent: a redo finds the same bytes).
A text corpus's window is tagged first (tagging.py) and stored tagged (``job/<id>/t/<w>``), unless
an earlier run of the window stored it already: a window is tagged once in the cluster. A tagging
half-stored by a node that died is tagged again and completed; a run whose store loses to another
node's (different) tagging takes the stored one, which stage 1 trains on, for its findings. An
uploaded window holding fewer sentences than the job row says is a damaged chunk: the window fails
(``ChunkMissing``), never trained in part.

Reads: a window's uploaded chunk (its group's: corpus_chunks.py; the windows of a group, run one
after another or at once, share one read) and its findings are *write-once* registers (every write of one
proposes the same bytes: the corpus file's window, a function of that window; the chunk is emptied
once the job ended), so they are read from one owner (StorageClient.read_write_once_register), not
R: a quorum read of each was most of the register requests a window cost, and the findings reads
of the training stage, (B - 1) / B of the windows on each of the B nodes, grew with B (issue 15).
The initial findings slot and a text window's tagged chunk (two nodes may tag a window, and a
tagger need not give the same bytes) are read from a quorum.

Stage 1: read the chunk; extend the node's :class:`FlagFold` to window ``w`` (findings read once
each, in order, under a lock: windows run concurrently; those this node computed in stage 0 are
kept, up to ``FOUND_MEMO_BYTES``, and not read back: at B = 1 that is every window, one register
read each on the training's critical path); encode with a fresh assigner holding the
fold of the windows ``< w``, ``train_batch``; write the window's vocabulary (``put_vocab``,
idempotent) and then its batch under ``(writer_id, w + 1)`` (``batch_seq``), both retried
("Storage failures" below). The write goes through the node's own storage client, whose writer id
is not the job's: for a foreign id the client sends writer floor 0 (giaannd/client/writes.py), so
no node ever tells storage that the job's seqs below some window are settled while another node
may still send one of them (the "writer floor" point of docs/compute.md).

A window redone after a take-over recomputes the same batch (flag_pass.py) under the same id, and
storage applies it once. The figures of the windows this node ran go to ``progress`` (its
Prometheus counters and its part of the job document).

**Storage failures** (every storage call of a window: chunk reads and stores, findings, vocabulary,
batch) are retried with train.py's backoff until the call has failed for ``patience_s`` (the
compute service gives two lease times; None: train.py's 6 attempts, as in the unit tests). A
window that gives up fails the whole job (lease_driver.py: what reaches the driver is final), so
it must not give up while its lease may yet pass to another node: a node cut off from storage
stops renewing its leases at the same moment, and its own deadline (at most one lease time after
its last renewal) drops the window first; another node takes it over and the job goes on. With
train.py's attempts (a few seconds, under the default 10 s lease) the cut-off node's window failed
first, and its job-row write ``failed`` landed once it was back: one node's network fault failed
the job (tests/integration/test_cluster_job_faults_cut_node.py). Still final: a failure that
leaves the node's renewals working for two lease times (storage refusing the data, not the node
cut off), a full store, a vocabulary collision.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec

from giaannd.client.registers import ABSENT, CasOutcome, RegisterRead, Version
from giaannd.client.storage_client import QuorumNotReached, RemoteVocabConflict, StorageClient, StorageRequestError
from giaannd.compute.cluster_jobs.corpus_chunks import (
    TAGGED,
    UPLOADED,
    ChunkMissing,
    read_texts,
    read_window,
    store_window,
)
from giaannd.compute.cluster_jobs.flag_pass import (
    FlagFold,
    decode_findings,
    encode_findings,
    findings_key,
    window_findings,
)
from giaannd.compute.cluster_jobs.lease_events import RunWindow, batch_seq
from giaannd.compute.cluster_jobs.tagging import WindowTagger
from giaannd.compute.flags import with_flags
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.train import TrainSettings, pair_increments
from giaannd.model.columns import ColumnAssigner
from giaannd.model.gpu.device import Device
from giaannd.model.lexicon import Lexicon
from giaannd.model.rows import RowBatch
from giaannd.model.tokens import TaggedSentence
from giaannd.model.train import backend_for, train_batch
from giaannd.model.vocab import Vocabulary
from giaannd.protocol import BatchId
from peers.errors import PeersError
from peers.retry import retry

__all__ = [
    "FLAG_STAGE",
    "FOUND_MEMO_BYTES",
    "RETRYABLE",
    "STAGES",
    "TRAIN_STAGE",
    "ClusterSpec",
    "WindowRunner",
    "decode_spec",
    "encode_spec",
]

_T = TypeVar("_T")

#: The stages of a cluster training job (flag_pass.py).
FLAG_STAGE: Final = 0
TRAIN_STAGE: Final = 1
STAGES: Final = 2
#: Storage failures worth another attempt (train.py's set: a replica failing over, no quorum yet).
RETRYABLE: Final = (StorageRequestError, PeersError, OSError, LookupError, TimeoutError)


class ClusterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The job row's ``spec``: what every node needs to run the job's windows."""

    k: int
    sentences: int
    corpus: str = ""
    #: the windows hold sentence texts, tagged by the flag pass (tagging.py)
    text: bool = False
    #: wall-clock unix seconds when the job was created (the timeline's first point; 0: a job
    #: created by a node before timelines)
    created_at: float = 0.0
    #: uploaded windows per chunk (corpus_chunks.py ``GROUP_WINDOWS``; 1: a job created by a node
    #: before groups, one window per chunk)
    group: int = 1


def encode_spec(spec: ClusterSpec) -> bytes:
    return msgspec.msgpack.encode(spec)


def decode_spec(data: bytes) -> ClusterSpec:
    return msgspec.msgpack.decode(data, type=ClusterSpec)


@dataclass
class _Trained:
    batch: RowBatch
    vocab: Vocabulary
    handled: int
    trained: int
    tokens: int
    increments: int
    flags: int


def _train(assigner: ColumnAssigner, sentences: Sequence[TaggedSentence], device: Device = "cpu") -> _Trained:
    """Encode (updating flags, as the core does inside its window) and train on ``device``; synchronous."""
    encoded = [e for s in sentences if (e := assigner.encode(s, update_flags=True)) is not None]
    out = train_batch(encoded, backend=backend_for(device), device=device)
    new_flags = set(assigner.learned_probabilistic)
    return _Trained(with_flags(out.rows, new_flags), assigner.vocab, len(sentences), out.sentences, out.tokens,
                    pair_increments(encoded), len(new_flags))


#: Encoded findings of the windows this node computed in stage 0, kept for its fold in stage 1 (a
#: few KB a window: 16 MiB is thousands of windows; past it the rest are read back from registers).
FOUND_MEMO_BYTES: Final = 16 * 2**20


#: Chunk reads a runner keeps (``WindowRunner._read_chunk``): the groups of the windows it runs at
#: once and of the next ones of their leases (a group's part is at most a register, 256 KiB).
CHUNK_MEMO: Final = 8


#: Reads of a window's tagging stored by another node before giving up on its missing parts
#: (a node still storing them; 0.75 s of waits in all).
TAGGED_ATTEMPTS: Final = 5


def _retrieve(read: asyncio.Future[RegisterRead]) -> None:
    """Mark a shared read's failure as seen (no "exception was never retrieved" for a read whose
    every waiter was cancelled; the waiters that remain get it from ``shield``)."""
    if not read.cancelled():
        read.exception()


class WindowRunner:
    """Runs the windows one node leased in one job (module docstring).

    Args:
        client: the node's storage client.
        job_id / spec: the job.
        lexicon: the node's lexicon (every node of a cluster must use the same one).
        settings: retry policy of writes (train.py).
        progress: this node's figures for the job.
        on_trained: called with each window's vocabulary and batch once acknowledged (the node
            merges the vocabulary into its own and invalidates cached rows).
        tagger: tags the windows of a text corpus in the flag pass.
        patience_s: retry a failing storage call until it has failed this long (module docstring,
            "Storage failures"); None: ``settings``' attempts.
    """

    def __init__(self, client: StorageClient, job_id: str, spec: ClusterSpec, lexicon: Lexicon,
                 settings: TrainSettings, progress: TrainProgress,
                 on_trained: Callable[[Vocabulary, RowBatch], None] | None = None,
                 tagger: WindowTagger | None = None, patience_s: float | None = None) -> None:
        self.client, self.job_id, self.spec, self.lexicon = client, job_id, spec, lexicon
        self.tagger = tagger
        self.patience_s = patience_s
        self._policy = settings.retry_policy if patience_s is None else \
            dataclasses.replace(settings.retry_policy, max_attempts=None)
        self.settings, self.progress, self._on_trained = settings, progress, on_trained
        self.fold = FlagFold()
        self._fold_lock = asyncio.Lock()
        #: window -> encoded findings this node stored in stage 0 (FOUND_MEMO_BYTES), until folded
        self._found: dict[int, bytes] = {}
        self._found_bytes = 0
        #: chunk key -> its read, shared by the windows of a group (module docstring, "Reads")
        self._chunks: collections.OrderedDict[str, asyncio.Future[RegisterRead]] = collections.OrderedDict()

    async def __call__(self, action: RunWindow) -> int:
        """Run one window; returns what it counts in the job's tallies: the sentences it trained,
        or in the flag pass of a text job the window's sentences, tagged here or by an earlier run
        (0 for a tagged corpus). A window's flag pass is completed once, and a run that finds it
        tagged follows one that never completed it (a lease taken over, or given back): that
        tagging would otherwise be counted by no node's tally. ``progress`` (the node's counters)
        gets ``tagged`` only for a tagging this node stored."""
        # the uploaded chunks are write-once (module docstring, "Reads"): one owner answers; a text
        # window's tagged chunk is not (two nodes may tag it), so it is read from a quorum
        once, w, spec = self._patient(self._read_chunk), action.window, self.spec
        read = self._patient(self.client.read_register) if spec.text else once
        if action.stage == FLAG_STAGE:
            try:
                sentences = await read_window(read, self.job_id, w, (), TAGGED if spec.text else UPLOADED,
                                              missing_ok=spec.text, group=spec.group, k=spec.k)
                if not spec.text:
                    self._check_whole(w, sentences)
            except ChunkMissing:
                if not spec.text:
                    raise
                sentences = None  # a tagging half-stored by a node that died: store it whole (below)
            if sentences is None:  # a text window not tagged yet: tag it here, store it for stage 1
                assert self.tagger is not None, "a text job needs a tagger"
                texts = self._check_whole(w, await read_texts(once, self.job_id, w, (),
                                                              group=spec.group, k=spec.k))
                mine = await self.tagger.tag(texts)
                try:
                    await store_window(self._patient_cas, self.job_id, w, mine, ())
                except ChunkMissing:
                    # another node stored its tagging first (a tagger need not give the same
                    # bytes): stage 1 trains on the stored one, so the findings must be its
                    sentences = await self._stored_tagging(w)
                else:
                    sentences = mine
                    self.progress.add(tagged=len(mine))
            await self._find(w, sentences)
            return len(sentences) if spec.text else 0
        sentences = await read_window(read, self.job_id, w, (), TAGGED if spec.text else UPLOADED,
                                      group=spec.group, k=spec.k)
        assert sentences is not None
        if not spec.text:
            self._check_whole(w, sentences)
        return await self._train_window(action, sentences)

    def _check_whole(self, window: int, got: list[_T] | None) -> list[_T]:
        """``got``, the uploaded window ``window``, if it holds the sentences the job row says (K,
        fewer in the job's last window only). Raises: ChunkMissing (a damaged chunk: never train
        part of a window silently)."""
        want = min(self.spec.k, self.spec.sentences - window * self.spec.k)
        if got is None or len(got) != want:
            raise ChunkMissing(f"window {window} of job {self.job_id} holds {len(got or ())} sentences in its "
                               f"corpus chunk, not {want}: the chunk is damaged")
        return got

    async def _stored_tagging(self, window: int) -> list[TaggedSentence]:
        """The tagging another node stored for ``window`` (a quorum read), waiting a little for the
        parts of one still being stored. Raises: ChunkMissing (still incomplete, or damaged)."""
        for attempt in range(TAGGED_ATTEMPTS):
            try:
                got = await read_window(self._patient(self.client.read_register), self.job_id, window, (), TAGGED)
                assert got is not None
                return got
            except ChunkMissing:
                if attempt + 1 == TAGGED_ATTEMPTS:
                    raise
                await asyncio.sleep(0.05 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _read_chunk(self, key: str) -> RegisterRead:
        """A write-once read of an uploaded chunk, shared by the windows of its group: the last
        ``CHUNK_MEMO`` keys read are kept (a failed read is not: the caller's retry reads again)."""
        read = self._chunks.get(key)
        if read is None:
            read = asyncio.ensure_future(self.client.read_write_once_register(key))
            read.add_done_callback(_retrieve)
            self._chunks[key] = read
            while len(self._chunks) > CHUNK_MEMO:
                self._chunks.popitem(last=False)
        try:
            return await asyncio.shield(read)  # a window dropped meanwhile does not cancel the others' read
        except BaseException:
            if read.done() and self._chunks.get(key) is read:
                del self._chunks[key]
            raise

    async def _find(self, window: int, sentences: list[TaggedSentence]) -> None:
        findings = await asyncio.to_thread(window_findings, self.lexicon, sentences)
        data = encode_findings(findings)
        key = findings_key(self.job_id, window)
        out = await self._retry(lambda: self.client.cas_register(key, ABSENT, data))
        if not out.ok and out.value != data:  # a redo computes the same bytes (module docstring)
            raise ValueError(f"flag findings of window {window} differ from the stored ones")
        if window >= self.fold.upto and window not in self._found and \
                self._found_bytes + len(data) <= FOUND_MEMO_BYTES:  # what is stored: the same bytes
            self._found[window] = data
            self._found_bytes += len(data)

    async def extend_fold(self, window: int) -> FlagFold:
        """The node's fold, extended to at least window ``window`` (findings read in order)."""
        async with self._fold_lock:
            while self.fold.upto < window:
                data = self._found.pop(self.fold.upto, None)
                if data is not None:
                    self._found_bytes -= len(data)
                else:
                    key = findings_key(self.job_id, self.fold.upto)
                    read = self.client.read_write_once_register if self.fold.upto >= 0 else self.client.read_register
                    got = await self._retry(lambda key=key, read=read: read(key))  # type: ignore[misc]
                    if not got.version[0]:
                        raise ValueError(f"flag findings {key} are absent (stage 0 not done?)")
                    data = got.value
                self.fold.add(self.fold.upto, decode_findings(data))
        return self.fold

    async def _train_window(self, action: RunWindow, sentences: list[TaggedSentence]) -> int:
        fold = await self.extend_fold(action.window)
        assigner = fold.assigner(self.lexicon, action.window)
        done = await asyncio.to_thread(_train, assigner, sentences, self.settings.device)
        vocab = done.vocab
        entries = [(0, cid, lemma) for cid, lemma in vocab.columns()]
        entries += [(1, fid, word) for fid, word in vocab.features()]
        if entries:
            await self._retry(lambda: self.client.put_vocab(entries),
                              give_up=lambda exc: isinstance(exc, RemoteVocabConflict))
        bid = BatchId(action.writer_id, batch_seq(action.window))
        if done.batch.num_rows:
            await self._retry(lambda: self.client.write(done.batch, bid),
                              give_up=lambda exc: isinstance(exc, QuorumNotReached) and exc.store_full)
        self.progress.add(done=done.handled, trained=done.trained, skipped=done.handled - done.trained,
                          tokens=done.tokens, batches=1 if done.batch.num_rows else 0,
                          bytes_sent=done.batch.nbytes, entries_before=done.increments,
                          entries_after=done.batch.num_entries, flags_sent=done.flags)
        if self._on_trained is not None:
            self._on_trained(vocab, done.batch)
        return done.trained

    async def _retry(self, call: Callable[[], Awaitable[_T]],
                     give_up: Callable[[BaseException], bool] | None = None) -> _T:
        """``call`` with train.py's backoff, until ``patience_s`` after its first failure (module
        docstring, "Storage failures"), else train.py's attempts; retried failures are counted in
        ``progress``."""
        loop = asyncio.get_running_loop()
        first_failure: list[float] = []

        def stop(exc: BaseException) -> bool:
            if give_up is not None and give_up(exc):
                return True
            if self.patience_s is None:
                return False
            first_failure[:] = first_failure or [loop.time()]
            return loop.time() - first_failure[0] >= self.patience_s

        return await retry(call, self._policy, retry_on=RETRYABLE, give_up=stop,
                           on_retry=lambda failures, exc, wait_s: self.progress.add(retries=1))

    def _patient(self, read: Callable[[str], Awaitable[RegisterRead]]) -> Callable[[str], Awaitable[RegisterRead]]:
        """``read`` retried by ``_retry`` (corpus_chunks.py is then given no failures to retry)."""
        return lambda key: self._retry(lambda: read(key))

    async def _patient_cas(self, key: str, expect: Version | None, value: bytes) -> CasOutcome:
        return await self._retry(lambda: self.client.cas_register(key, expect, value))
