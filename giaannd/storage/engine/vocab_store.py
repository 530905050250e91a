"""The storage node's share of the vocabulary: a durable, grow-only id → string table.

Theory of operation
-------------------
Column and feature ids are content-addressed (``giaannd.model.ids``): the id *is* a hash of its
string, so the vocabulary is a grow-only map that any node may write and every writer agrees on.
Storage nodes hold it like columns: an entry ``(kind, id)`` is owned by the R owners of ``id`` under
the same placement as rows (docs/replication.md, "Vocabulary").

Why this design (the simplest that is honest):

* **A single append-only log + an in-RAM dict per node.** Entries are tiny (a lemma or a word), a
  whole corpus' vocabulary is a few MB, and an entry is written once and never changed, so the log
  *is* the table: only entries new to this node are appended, the log never needs compaction or
  snapshots, and replay on start is one sequential read.
* **Own record format, not the update log's.** The update log's records carry row batches and are
  numbered, snapshotted and truncated with the column store; mixing strings into it would couple
  vocabulary durability to row snapshots. A record here is::

      header (28 B): magic "GIAV" | version u16 | reserved u16 | payload_len u32
                     | payload_xxh3 u64 | header_xxh3 u64 (over the first 20 bytes)
      payload:       msgpack list of [kind, id, text]

  The header checksums itself, so a damaged length is never trusted (the update log's rule): a bad
  record followed by no valid header is a *torn tail* (the last append was cut by a crash; it was
  never acknowledged because acks wait for ``sync``) and is cut off and reported; a bad record
  followed by a valid one is *corruption* and stops start-up naming the file and offset. Header,
  checksums and that rule are the shared record codec's (``giaannd.records``, ``VOCAB_RECORD``).
* **Checked content.** ``put`` verifies that each text hashes to its id (a foreign or corrupted
  entry is refused as a bad request), so two different strings under one id can only be a real
  64-bit hash collision: the whole put is refused (nothing changed), counted and logged.

**Durability.** ``open`` fdatasyncs the log it replayed (a process killed before its sync left
records in the page cache only, and a retried put of their entries is "known") and fsyncs its
directory (a new log). After a failed fdatasync nothing more is called durable from that file
("fsyncgate": the kernel may have dropped the pages and still report the next fdatasync a success):
the next ``sync`` rewrites the log from the table (new file, fsync, rename, directory fsync), so
offsets move once, and every put made before it is durable after it.

Concurrency: ``put``/``get`` from one thread (the event loop); ``sync`` from worker threads, one at
a time, while puts continue (it syncs the bytes written before it started; a lock guards the
descriptor, size and tables).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from giaannd.atomic_file import fsync_dir
from giaannd.errors import CorruptDataError, Refused
from giaannd.model.ids import column_id, feature_id
from giaannd.protocol import MAX_VOCAB_ENTRIES
from giaannd.records import RecordError, RecordFormat, open_for_append
from giaannd.storage.engine.log_tail import LogTail, write_all

__all__ = [
    "KIND_COLUMN",
    "KIND_FEATURE",
    "MAX_VOCAB_RECORD_BYTES",
    "VOCAB_FILE",
    "VOCAB_RECORD",
    "VocabCollision",
    "VocabLogCorrupt",
    "VocabPut",
    "VocabStore",
]

log = logging.getLogger(__name__)

KIND_COLUMN: Final = 0
KIND_FEATURE: Final = 1
VOCAB_FILE: Final = "vocab.log"
#: ``_rewrite`` writes the new log as ``vocab.log`` + this, then renames it over the log.
_REWRITE_SUFFIX: Final = ".rewrite"
#: Largest payload a record may claim; checked before anything is allocated for it. A PutVocab is at
#: most MAX_VOCAB_ENTRIES entries of MAX_VOCAB_TEXT_CHARS characters (≤ 4 B each in UTF-8).
MAX_VOCAB_RECORD_BYTES: Final = 300 * 2**20
#: The record header (28 bytes; module docstring).
VOCAB_RECORD: Final = RecordFormat(
    "vocab log", b"GIAV", [("version", "H"), ("reserved", "H"), ("length", "I"), ("payload_xxh3", "Q")],
    versions=(1, 1), max_payload_bytes=MAX_VOCAB_RECORD_BYTES)

Entry = tuple[int, int, str]
_ENTRIES_DECODER: Final = msgspec.msgpack.Decoder(list[tuple[int, int, str]])
_ENCODER: Final = msgspec.msgpack.Encoder()


class VocabLogCorrupt(CorruptDataError, ValueError):
    """The vocab log is damaged before its end (names the file and offset): start-up stops."""

    reason = "corrupt_vocab_log"

    def __init__(self, path: str, offset: int, detail: str) -> None:
        super().__init__(f"{path}: record at offset {offset}: {detail}")
        self.file_path, self.offset = path, offset


class VocabCollision(Refused, ValueError):
    """An id is held with a different string than the one offered: a real 64-bit hash collision."""

    reason = "vocab_collision"

    def __init__(self, kind: int, ident: int, held: str, offered: str) -> None:
        what = "column" if kind == KIND_COLUMN else "feature"
        super().__init__(f"{what} id {ident:#018x} is held as {held!r}, offered {offered!r} (hash collision)")
        self.kind, self.id, self.held, self.offered = kind, ident, held, offered


@dataclass(frozen=True, slots=True)
class VocabPut:
    """Outcome of ``put``: entries new here, entries held already, and the file offset to sync."""

    added: int
    known: int
    offset: int


def hash_of(kind: int, text: str) -> int:
    """The id a text must have (the content address of ``giaannd.model.ids``)."""
    if kind == KIND_COLUMN:
        return column_id(text)
    if kind == KIND_FEATURE:
        return feature_id(text)
    raise ValueError(f"vocabulary kind must be 0 (column) or 1 (feature), got {kind}")


def _record(entries: Sequence[Entry]) -> bytes:
    return VOCAB_RECORD.encode(_ENCODER.encode([list(e) for e in entries]))


def _load_entries(path: str, offset: int, payload: memoryview,
                  tables: tuple[dict[int, str], dict[int, str]]) -> None:
    """Add one record's entries to ``tables``, each checked against its id.

    Raises:
        VocabLogCorrupt: undecodable, or an entry that does not hash to its id.
    """
    try:
        entries = _ENTRIES_DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise VocabLogCorrupt(path, offset, f"undecodable record: {exc}") from None
    for kind, ident, text in entries:
        try:
            ok = hash_of(kind, text) == ident
        except ValueError:
            ok = False
        if not ok:
            raise VocabLogCorrupt(path, offset, f"entry {text!r} does not hash to {ident:#x} (kind {kind})")
        tables[kind][ident] = text


def _sync_inherited(fd: int, directory: Path, new_dir: bool) -> None:
    """Make what ``open`` starts from durable: ``durable_offset`` starts at the end of the log, yet a
    process killed between an append and its sync left that record in the page cache only, and a
    retried put of its entries is "known" here, acknowledged with no sync to come (the update log's
    ``_sync_inherited``). The directory too: a log (or directory) just created is not on disk until
    the directory holding its entry is fsynced."""
    os.fdatasync(fd)
    fsync_dir(directory)
    if new_dir:
        fsync_dir(directory.parent)


class VocabStore:
    """One node's vocabulary table (module docstring). Use :meth:`open`."""

    def __init__(self, path: Path, fd: int, columns: dict[int, str], features: dict[int, str],
                 size: int, torn_bytes: int) -> None:
        self.path = path
        self._fd = fd
        self._tables = (columns, features)
        self._size = size
        self._durable = size
        self._lock = threading.Lock()  # the descriptor, size and tables
        self._sync_lock = threading.Lock()  # one sync (or rewrite) at a time
        #: an fdatasync failed: the pages it dropped may be gone though the next one succeeds
        #: ("fsyncgate"), so nothing more is called durable until ``_rewrite`` replaced the log
        self._sync_failed = False
        #: a failed append's bytes past ``_size`` (giaannd/storage/engine/log_tail.py). Under ``_lock``.
        self._tail = LogTail()
        #: bytes cut off the end at open (a torn last record), for the log and tests
        self.torn_bytes = torn_bytes
        #: refused puts that named a held id with another string (real collisions)
        self.collisions = 0

    # -- open / recovery ---------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> VocabStore:
        """Replay ``directory/vocab.log`` (created if missing); a torn tail is cut off and reported.

        Raises:
            VocabLogCorrupt: a bad record before the end, or an entry that does not hash to its id.
        """
        d = Path(directory)
        new_dir = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        path = d / VOCAB_FILE
        data = path.read_bytes() if path.exists() else b""
        columns: dict[int, str] = {}
        features: dict[int, str] = {}
        off = 0
        try:
            for rec in VOCAB_RECORD.scan(data, torn_tail=True):
                _load_entries(str(path), rec.header.offset, rec.payload, (columns, features))
                off = rec.header.end
        except RecordError as exc:
            raise VocabLogCorrupt(str(path), exc.offset, exc.explanation) from None
        torn = len(data) - off
        # a rewrite a crash cut short left its file (the log is whole: the rename is the switch),
        # which only a later rewrite (after another failed fsync) would overwrite
        path.with_name(path.name + _REWRITE_SUFFIX).unlink(missing_ok=True)
        fd = open_for_append(path, off, "vocab log")
        try:
            _sync_inherited(fd, d, new_dir)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, columns, features, off, torn)

    # -- reads -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._tables[0]) + len(self._tables[1])

    def get(self, kind: int, ident: int) -> str | None:
        return self._tables[kind].get(ident) if kind in (KIND_COLUMN, KIND_FEATURE) else None

    def lookup(self, kinds: Sequence[int], ids: Sequence[int]) -> list[Entry]:
        """The entries held among ``(kinds[i], ids[i])`` (absent ones left out)."""
        out: list[Entry] = []
        for kind, ident in zip(kinds, ids):
            text = self.get(kind, ident)
            if text is not None:
                out.append((kind, ident, text))
        return out

    @property
    def durable_offset(self) -> int:
        """Bytes of the log known to be synced."""
        return self._durable

    @property
    def nbytes(self) -> int:
        """Bytes of the log (≈ the table's size)."""
        return self._size

    # -- writes ------------------------------------------------------------------------------------
    def put(self, entries: Iterable[Entry]) -> VocabPut:
        """Append the entries new to this node (one record) and add them to the table; not yet
        durable: ack only after ``sync()`` covered ``VocabPut.offset``.

        Raises:
            ValueError: an entry whose text does not hash to its id, or a bad kind (nothing changed).
            VocabCollision: an id held with a different string (nothing changed; counted).
            OSError: the append failed (nothing added to the table).
        """
        new: dict[tuple[int, int], str] = {}
        known = 0
        for kind, ident, text in entries:
            if hash_of(kind, text) != ident:
                raise ValueError(f"vocabulary entry {text!r} does not hash to {ident:#x} (kind {kind})")
            held = self._tables[kind].get(ident, new.get((kind, ident)))
            if held is None:
                new[(kind, ident)] = text
            elif held != text:
                self.collisions += 1
                log.error("vocabulary hash collision kind=%d id=%#x held=%r offered=%r", kind, ident, held, text)
                raise VocabCollision(kind, ident, held, text)
            else:
                known += 1
        if new:
            record = _record([(k, i, t) for (k, i), t in new.items()])
            with self._lock:
                self._tail.append(self._fd, self._size, record)  # whole or not at all (log_tail.py)
                self._size += len(record)
                for (kind, ident), text in new.items():  # with the bytes: ``_rewrite`` copies both
                    self._tables[kind][ident] = text
        return VocabPut(len(new), known, self._size)

    def sync(self) -> int:
        """fdatasync; returns the offset now durable (every put whose offset is ≤ it). One at a
        time; one that finds its bytes durable already (group commit) returns at once. After a
        failed fdatasync the next sync rewrites the log from the table (``_rewrite``) instead."""
        with self._sync_lock:
            with self._lock:
                target = self._size
                if self._durable >= target:
                    return self._durable
            if self._sync_failed:
                return self._rewrite()
            try:
                os.fdatasync(self._fd)
            except OSError:
                self._sync_failed = True
                raise
            with self._lock:
                self._durable = max(self._durable, target)
                return self._durable

    def _rewrite(self) -> int:
        """Replace the log with one written from the table (an fdatasync failed: ``_sync_failed``):
        the table's entries as they were at ``size``, then the records put since, copied under the
        lock; fsync, rename over the log, directory fsync. Returns the offset now durable."""
        with self._lock:
            size = self._size
            entries = [(kind, i, t) for kind, table in enumerate(self._tables) for i, t in table.items()]
        tmp = self.path.with_name(self.path.name + _REWRITE_SUFFIX)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for start in range(0, len(entries), MAX_VOCAB_ENTRIES):  # each a PutVocab's most: readable
                write_all(fd, _record(entries[start : start + MAX_VOCAB_ENTRIES]))
            offset = os.lseek(fd, 0, os.SEEK_CUR)
            with self._lock:
                write_all(fd, os.pread(self._fd, self._size - size, size))
                os.fsync(fd)
                os.replace(tmp, self.path)
                old, self._fd = self._fd, fd
                self._tail = LogTail()  # (a partial record of the old file was not copied)
                self._size = offset + self._size - size
                target = self._size
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(old)
        fsync_dir(self.path.parent)
        self._sync_failed = False
        with self._lock:
            self._durable = target  # offsets moved: every put so far is in the new file
            return self._durable

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
