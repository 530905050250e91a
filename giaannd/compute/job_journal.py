"""The durable job journal: what lets a training job resume after a crash without counting twice.

Theory of operation
-------------------
Storage ignores a batch id it already applied (applied sets: per-writer floor + exceptions,
docs/storage.md). A training job that restarts with the **same writer id** and sends every window
again under the **same seq** with the **same content** therefore cannot double-count: a window that
reached a replica before the crash is a duplicate there, one that did not is applied once. The
journal records exactly what makes that possible, one file per job
(``<data-dir>/compute/jobs/<job_id>.journal``):

* the **spec**: corpus path, its SHA-256 (a changed file fails the resume instead of training
  different sentences under old seqs), limit, epochs, workers B and window size K (the windows are
  ``sentences[i*K:(i+1)*K]``, window ``i`` is processed by worker ``i mod B`` and sent as seq ``i+1``);
* the **writer id** (random once per job, kept across restarts);
* the **inputs that are not a function of the corpus**: the flag set storage held when the job
  began (``initial_flags``) and, per window a worker *started*, the flags it learned from storage
  just before encoding it (``learned``, only non-empty sets are stored) plus each worker's count of
  started windows (``started``). A window is recorded as started, durably, **before** any byte of
  it is sent. Replaying a worker's windows with the recorded inputs rebuilds its column assigner
  exactly, so every window that may have reached storage is recomputed byte for byte;
* the **cursor**: windows ``[0, cursor)`` are acknowledged by W replicas (and their vocabulary
  written), and ``settled``: windows ``[0, settled)`` reached *every* owner (the client's writer
  floor when the cursor was saved). A resumed job replays windows ``< min(settled, cursor)`` without
  sending them and sends again from there (re-sends up to ``cursor`` are duplicates storage ignores;
  they let the client's floor advance again — sending a floor above an unsettled seq could make a
  replica drop a hint still in flight for it);
* ``acked``: windows past the cursor already acknowledged (a gap below them: a window still in
  flight, or one that failed). A resumed run sends them again like any window past the cursor, but
  counts them, with ``[0, cursor)``, as sentences the earlier run acknowledged
  (``acknowledged_sentences``): a job's ``done`` never drops at a resume and no window is counted
  twice in the node's counters;
* ``figures``: the job document's other counters (trained, tokens, batches, bytes sent, retries...,
  :class:`JobFigures`) summed over the windows acknowledged so far, booked together with each
  window's acknowledgement (``acknowledge``), so the file always holds the figures of exactly the
  windows its ``cursor`` and ``acked`` count. A resumed run starts its counters from them, as
  ``done`` from the acknowledged sentences (retries: as of the last write).

States: ``running`` (resumed on daemon start) → ``succeeded`` (the file is removed) | ``failed``
(kept for the operator; listed, not resumed). A job cancelled by a shutdown stays ``running``.

File format: ``MAGIC (4) | version u16 | payload length u32 | xxh3-64 of payload u64 | payload``
(msgpack of :class:`JournalDoc`; the shared record codec's ``JOURNAL_RECORD``, ``giaannd.records``,
without a header checksum: the whole file is one record), replaced atomically (``atomic_file``:
temp file, fsync, rename, directory fsync). A file that fails any check raises
:class:`JournalCorrupt` naming the file (and the byte offset); it is never deleted or overwritten
by the loader.

Everything that affects the cursor and the replay plan lives in this file; ``train.py`` calls
``start_window`` / ``acknowledge`` and :class:`JournalWriter` puts the state on disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import xxhash

from giaannd.atomic_file import atomic_write_bytes
from giaannd.errors import CorruptFileError
from giaannd.model.tokens import Token
from giaannd.records import RecordError, RecordFormat

__all__ = [
    "JOURNAL_DIR",
    "JOURNAL_RECORD",
    "JobFigures",
    "JobJournal",
    "JobSpec",
    "JournalCorrupt",
    "JournalDoc",
    "JournalWriter",
    "acked_windows",
    "corpus_sha256",
    "journal_path",
    "load_journals",
    "outlast",
    "sentences_digest",
]

#: Directory (under the compute data directory) holding one journal file per job.
JOURNAL_DIR: Final = "jobs"
_SUFFIX: Final = ".journal"
#: A journal is small (a few ints per window that learned flags); anything bigger is not ours.
MAX_JOURNAL_BYTES: Final = 256 * 2**20
#: The file's header (module docstring): 18 bytes, no header checksum (the file size bounds the
#: length, and the payload checksum covers the rest).
JOURNAL_RECORD: Final = RecordFormat(
    "journal", b"GJNL", [("version", "H"), ("length", "I"), ("payload_xxh3", "Q")],
    versions=(1, 1), max_payload_bytes=MAX_JOURNAL_BYTES, header_checksum=False)

JournalState = Literal["running", "succeeded", "failed"]


class JournalCorrupt(CorruptFileError):
    """A journal file failed validation (left in place; the message names the file, and the byte
    offset when the failure is in its bytes)."""

    reason = "corrupt_journal"


class JobSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the job trains on and how it is cut into windows."""

    corpus: str
    corpus_sha256: str
    limit: int | None
    epochs: int
    workers: int
    coalesce: int


class JobFigures(msgspec.Struct, forbid_unknown_fields=True):
    """Counters of the job document (jobs.py ``TrainProgress``, same names) that earlier runs of
    the job counted: those of the acknowledged windows, and the retries (module docstring)."""

    trained: int = 0
    skipped: int = 0
    tokens: int = 0
    batches: int = 0
    retries: int = 0
    bytes_sent: int = 0
    entries_before: int = 0
    entries_after: int = 0
    flags_sent: int = 0


class JournalDoc(msgspec.Struct, forbid_unknown_fields=True):
    """The persisted document (module docstring)."""

    job_id: str
    writer_id: int
    spec: JobSpec
    state: JournalState = "running"
    error: str = ""
    total_sentences: int = 0
    #: digest of the sentences as loaded (tagged), set with ``initial_flags`` (``sentences_digest``)
    sentences_digest: str = ""
    initial_flags: list[int] | None = None
    cursor: int = 0
    settled: int = 0
    #: windows > cursor acknowledged (module docstring), ascending; UNSET (not written) when
    #: there are none, so such a journal's bytes are the format's before the field existed and an
    #: older daemon still reads it (``acked_windows`` reads both)
    acked: list[int] | msgspec.UnsetType = msgspec.UNSET
    started: list[int] = msgspec.field(default_factory=list)
    learned: dict[int, list[int]] = msgspec.field(default_factory=dict)
    resumes: int = 0
    #: the earlier runs' counters (module docstring); UNSET (not written) while nothing was
    #: counted, so such a journal's bytes are the format's before the field existed
    figures: JobFigures | msgspec.UnsetType = msgspec.UNSET


def acked_windows(doc: JournalDoc) -> list[int]:
    """``doc.acked``, empty when not written."""
    return [] if isinstance(doc.acked, msgspec.UnsetType) else doc.acked


def corpus_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a corpus file's bytes (the spec's content check)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sentences_digest(sentences: Iterable[Sequence[Token]]) -> str:
    """Hex xxh3-128 of tagged sentences (every token's fields), so a resume trains the very
    sentences the first run did even when the file is re-tagged (another spaCy, a lost cache)."""
    h = xxhash.xxh3_128()
    for sentence in sentences:
        for token in sentence:
            h.update("\x1f".join((token.form, token.lemma, token.upos, token.xpos)).encode("utf-8"))
            h.update(b"\x1e")
        h.update(b"\x1d")
    return h.hexdigest()


class JobJournal:
    """One job's journal in memory: pure state transitions, no I/O (see :class:`JournalWriter`).

    Args:
        doc: the document (new, or as loaded).
    """

    def __init__(self, doc: JournalDoc) -> None:
        if len(doc.started) not in (0, doc.spec.workers):
            raise ValueError("started counts do not match the number of workers")
        if any(w <= doc.cursor for w in acked_windows(doc)):
            raise ValueError("acknowledged windows at or below the cursor")
        self.doc = doc
        if not doc.started:
            doc.started = [0] * doc.spec.workers
        self._acked: set[int] = set(acked_windows(doc))  # windows >= cursor acknowledged, waiting for the gap below

    @classmethod
    def create(cls, spec: JobSpec, job_id: str | None = None, writer_id: int | None = None) -> JobJournal:
        """A new running job with a fresh job id and a random 64-bit writer id."""
        return cls(JournalDoc(job_id or secrets.token_hex(8),
                              secrets.randbits(64) if writer_id is None else writer_id, spec))

    @property
    def job_id(self) -> str:
        return self.doc.job_id

    # -- replay plan ---------------------------------------------------------------------------
    @property
    def restart_window(self) -> int:
        """First window to send again after a restart (earlier ones are replayed only)."""
        return min(self.doc.settled, self.doc.cursor)

    def worker_of(self, window: int) -> int:
        """Worker that processes ``window`` (static: window i → worker i mod B)."""
        return window % self.doc.spec.workers

    def is_started(self, window: int) -> bool:
        """Whether ``window`` was started (possibly sent) by an earlier run of the job."""
        b = self.doc.spec.workers
        return window // b < self.doc.started[window % b]

    def acknowledged_sentences(self, total: int) -> int:
        """Sentences of the acknowledged windows, of ``total`` sentences cut into windows of K."""
        k = self.doc.spec.coalesce
        done = min(self.doc.cursor * k, total)
        return done + sum(max(0, min(k, total - w * k)) for w in self._acked)

    def figures(self) -> dict[str, int]:
        """The counters earlier runs counted (``JobFigures``' fields; all 0 when none)."""
        f = self.doc.figures
        return msgspec.structs.asdict(JobFigures() if isinstance(f, msgspec.UnsetType) else f)

    def learned_before(self, window: int) -> set[int]:
        """Flags the worker merged from storage just before encoding a started window."""
        return set(self.doc.learned.get(window, ()))

    # -- transitions ---------------------------------------------------------------------------
    def begin(self, initial_flags: Iterable[int], total_sentences: int) -> None:
        """Record the flag set storage held when the job began (first run only)."""
        if self.doc.initial_flags is None:
            self.doc.initial_flags = sorted(int(f) for f in initial_flags)
        self.doc.total_sentences = total_sentences

    def check_sentences(self, digest: str, count: int) -> None:
        """Bind the job to the sentences it trains: record them before the first window, refuse a
        resume over different ones (their windows would differ from those already sent).

        Raises:
            ValueError: the sentences differ from the ones an earlier run started on.
        """
        if self.doc.initial_flags is None:  # nothing was started yet: (re)bind
            self.doc.sentences_digest, self.doc.total_sentences = digest, count
            return
        if (digest, count) != (self.doc.sentences_digest, self.doc.total_sentences):
            raise ValueError(f"the corpus now reads as {count} sentences (digest {digest[:12]}), the job "
                             f"started on {self.doc.total_sentences} (digest {self.doc.sentences_digest[:12]}): "
                             "not resumed, its windows would differ from those already sent")

    def start_window(self, window: int, learned: Iterable[int]) -> None:
        """Record that ``window`` is about to be encoded (and sent) after learning ``learned``.

        Raises:
            ValueError: windows of one worker must start in order, each once.
        """
        b = self.doc.spec.workers
        worker, index = window % b, window // b
        if index != self.doc.started[worker]:
            raise ValueError(f"window {window} started out of order (worker {worker} is at {self.doc.started[worker]})")
        self.doc.started[worker] = index + 1
        flags = sorted(int(f) for f in learned)
        if flags:
            self.doc.learned[window] = flags

    def acknowledge(self, window: int, settled_floor: int, figures: Mapping[str, int] | None = None) -> bool:
        """Book ``window`` as acknowledged by W replicas; ``settled_floor`` is the client's writer
        floor now (seqs ≤ it reached every owner). ``figures``: the window's counters (``count``),
        when this run counted it (not a re-send of a window an earlier run acknowledged).
        Returns True if the cursor moved."""
        if window < self.doc.cursor:
            return False
        if figures:  # in the same step as the window: a write holds both or neither
            self.count(**figures)
        self._acked.add(window)
        moved = False
        while self.doc.cursor in self._acked:
            self._acked.discard(self.doc.cursor)
            self.doc.cursor += 1
            moved = True
        self.doc.acked = sorted(self._acked) if self._acked else msgspec.UNSET
        # seq s is window s-1: floor f settles windows [0, f); it never passes an unacked window
        self.doc.settled = max(self.doc.settled, min(settled_floor, self.doc.cursor))
        return moved

    def count(self, **amounts: int) -> None:
        """Add to the journaled counters (``JobFigures`` names); on disk with the next commit."""
        if isinstance(self.doc.figures, msgspec.UnsetType):
            self.doc.figures = JobFigures()
        for name, amount in amounts.items():
            setattr(self.doc.figures, name, getattr(self.doc.figures, name) + amount)

    def finish(self, state: JournalState, error: str = "") -> None:
        self.doc.state = state
        self.doc.error = error

    def reopen(self) -> None:
        """Make a failed job running again (an operator's resume), counting the resume."""
        if self.doc.state == "succeeded":
            raise ValueError(f"job {self.job_id} succeeded: nothing to resume")
        self.doc.state, self.doc.error = "running", ""
        self.doc.resumes += 1

    def encode(self) -> bytes:
        """The file's bytes (header + checksummed msgpack payload)."""
        return JOURNAL_RECORD.encode(msgspec.msgpack.encode(self.doc))

    @classmethod
    def decode(cls, data: bytes, path: str = "<journal>") -> JobJournal:
        """Parse a journal file's bytes.

        Raises:
            JournalCorrupt: bad magic, version, length, checksum or document.
        """
        try:
            record = JOURNAL_RECORD.decode_file(data)
        except RecordError as exc:
            raise JournalCorrupt(path, exc.detail, offset=exc.offset) from None
        try:
            doc = msgspec.msgpack.decode(record.payload, type=JournalDoc)
            return cls(doc)
        except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
            raise JournalCorrupt(path, f"bad document: {exc}", offset=record.header.payload_offset) from None


async def outlast(aws: Iterable[asyncio.Future[Any]]) -> None:
    """Wait until every one of ``aws`` is done, even if the caller is cancelled meanwhile (any
    number of times); the caller, cancelled, re-raises its own cancellation afterwards. What a
    cancelled job awaits before it may end: a journal write in its thread, or the job's tasks that
    await one (train.py), so nothing of the job lands after ``remove``. Exceptions are not retrieved."""
    pending = set(aws)
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            pending = {f for f in pending if not f.done()}


def journal_path(directory: str | os.PathLike[str], job_id: str) -> Path:
    """Where the journal of ``job_id`` lives under the compute data directory."""
    return Path(directory) / JOURNAL_DIR / f"{job_id}{_SUFFIX}"


def load_journals(directory: str | os.PathLike[str]) -> list[JobJournal | JournalCorrupt]:
    """Every journal under ``directory/jobs`` (sorted by file name); a corrupt one is returned as
    its :class:`JournalCorrupt` error (the caller reports it; the file is left alone)."""
    d = Path(directory) / JOURNAL_DIR
    if not d.is_dir():
        return []
    out: list[JobJournal | JournalCorrupt] = []
    for path in sorted(d.glob(f"*{_SUFFIX}")):
        try:
            if path.stat().st_size > MAX_JOURNAL_BYTES:
                raise JournalCorrupt(str(path), f"larger than {MAX_JOURNAL_BYTES} bytes")
            journal = JobJournal.decode(path.read_bytes(), str(path))
            if path.name != f"{journal.job_id}{_SUFFIX}":
                raise JournalCorrupt(str(path), f"holds job {journal.job_id!r}, not the one its name says")
            out.append(journal)
        except JournalCorrupt as exc:
            out.append(exc)
        except OSError as exc:
            out.append(JournalCorrupt(str(path), f"unreadable: {exc}"))
    return out


class JournalWriter:
    """Puts a :class:`JobJournal` on disk; concurrent ``commit`` calls are serialised and coalesced
    (a commit returns once a write that includes every change made before the call is durable).

    Args:
        directory: the compute data directory.
        journal: the job's journal.
    """

    def __init__(self, directory: str | os.PathLike[str], journal: JobJournal) -> None:
        self.path = journal_path(directory, journal.job_id)
        self.journal = journal
        self._lock = asyncio.Lock()
        self._changes = 0
        self._written = 0

    def save_now(self) -> None:
        """Synchronous durable write (job creation, before the job's task exists)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, self.journal.encode())

    async def commit(self) -> None:
        """Make the journal's current state durable (module docstring: write before send)."""
        self._changes += 1
        wanted = self._changes
        async with self._lock:
            if self._written >= wanted:
                return  # a write that started after our change already covered it
            covered, data = self._changes, self.journal.encode()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write = asyncio.ensure_future(asyncio.to_thread(atomic_write_bytes, self.path, data))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # the thread renames the file into place anyway: a cancelled commit (the job
                # cancelled) ends once it has, however often it is cancelled meanwhile (``train
                # cancel`` then a shutdown), so no removal of the file (``remove``) precedes it
                await outlast({write})
                if not write.cancelled():
                    write.exception()  # retrieved: the cancellation is what the caller gets
                raise
            self._written = covered

    def remove(self) -> None:
        """Delete the file (the job succeeded: nothing left to resume)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
