"""What a compute node keeps between restarts: vocabulary, delimiter flags, keys it wrote.

The id → string tables are replicated in storage (storage/engine/vocab_store.py, docs/replication.md);
the compute node keeps:

* the :class:`~giaannd.model.vocab.Vocabulary`: what its jobs learned plus what it fetched from
  storage (the local cache of the replicated table),
* the deterministic flags (fixed at first sighting; prompts are encoded with them),
* the probabilistic flags it last saw (storage's flag row is the source of truth; this is a cache),
* how many rows its jobs wrote (informational: each job's distinct rows, summed over jobs; the
  keys themselves are not kept: at the mission's size they would be the model's row index, rewritten
  with every job; export scans storage, ``StorageClient.scan_all``),
* the evaluation history (:class:`EvalHistory`, ``GET /v1/evals``), in its own small JSON file.

It is one msgpack file written atomically (temp file, fsync, rename, fsync of the directory), so a
crash leaves the previous version or the new one, never a torn file. Since version 3 the document is
framed by the shared record codec (``giaannd.records``, ``STATE_RECORD``: magic, length, xxh3-64 of
the document and of the header), so damage on disk is an error naming the file: the vocabulary is
checked against its hashes, but nothing else checks the flags or the count, and a flipped bit there
loaded as a silently different state. Versions 1 and 2 (the bare document) are still read. A second
compute node does not need it: it resolves words through storage.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Final

import msgspec

from giaannd.atomic_file import atomic_write_bytes
from giaannd.errors import CorruptDataError
from giaannd.model.vocab import Vocabulary
from giaannd.records import RecordError, RecordFormat

__all__ = ["EVAL_HISTORY_FILE", "STATE_FILE", "STATE_RECORD", "ComputeState", "EvalHistory", "EvalRecord",
           "StateFileError"]

log = logging.getLogger(__name__)

STATE_FILE: Final = "compute-state.msgpack"
#: 2: ``rows_written`` (a count) instead of every key written (version 1, still read: its keys
#: are counted and dropped). 3: the version 2 document in a checksummed frame (``STATE_RECORD``).
_VERSION: Final = 3
#: The versions read as a bare msgpack document (no frame, no checksum).
_BARE_VERSIONS: Final = (1, 2)
#: The frame of a version 3 file (module docstring): header (32 B) + the msgpack document.
STATE_RECORD: Final = RecordFormat(
    "compute state", b"GICS", [("version", "H"), ("reserved", "H"), ("length", "Q"), ("payload_xxh3", "Q")],
    versions=(_VERSION, _VERSION), max_payload_bytes=None)
#: The evaluation history (``EvalHistory``), next to the state file.
EVAL_HISTORY_FILE: Final = "eval-history.json"


class StateFileError(CorruptDataError, ValueError):
    """The state file is corrupt or of another version (the message names the file)."""

    reason = "corrupt_compute_state"


class _Doc(msgspec.Struct, frozen=True):
    version: int
    columns: list[tuple[int, str]]
    features: list[tuple[int, str]]
    deterministic: list[tuple[int, bool]]
    probabilistic: list[int]
    #: version 1 only: every row key written (read to count them)
    row_column: list[int] = []
    row_feature: list[int] = []
    #: version 2: rows written, each job's distinct rows summed over jobs
    rows_written: int = 0


class ComputeState:
    """The node's vocabulary, flags and a count of the rows it wrote (module docstring)."""

    def __init__(self) -> None:
        self.vocab = Vocabulary()
        self.deterministic: dict[int, bool] = {}
        self.probabilistic: set[int] = set()
        #: rows written: each job's distinct rows, summed over jobs
        self.rows_written = 0

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write atomically to ``directory/STATE_FILE``; returns the path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        doc = _Doc(_VERSION, list(self.vocab.columns()), list(self.vocab.features()),
                   sorted(self.deterministic.items()), sorted(self.probabilistic),
                   rows_written=self.rows_written)
        path = d / STATE_FILE
        atomic_write_bytes(path, STATE_RECORD.encode(msgspec.msgpack.encode(doc)))
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ComputeState:
        """Read ``directory/STATE_FILE``; a missing file gives an empty state.

        Raises:
            StateFileError: unreadable, corrupt or another version.
        """
        path = Path(directory) / STATE_FILE
        state = cls()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return state
        framed = raw.startswith(STATE_RECORD.magic)
        try:
            doc = msgspec.msgpack.decode(STATE_RECORD.decode_file(raw).payload if framed else raw, type=_Doc)
        except RecordError as exc:
            raise StateFileError(f"{path}: corrupt compute state at byte offset {exc.offset} ({exc.detail})") from None
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise StateFileError(f"{path}: corrupt compute state ({exc})") from None
        versions = (_VERSION,) if framed else _BARE_VERSIONS
        if doc.version not in versions:
            raise StateFileError(f"{path}: compute state version {doc.version}"
                                 f"{'' if framed else ' without its checksummed frame'}, expected one of {versions}")
        if len(doc.row_column) != len(doc.row_feature):
            raise StateFileError(f"{path}: written-key arrays differ in length")
        if doc.rows_written < 0:
            raise StateFileError(f"{path}: rows_written {doc.rows_written} < 0")
        vocab = Vocabulary()
        try:
            for cid, lemma in doc.columns:
                if vocab.add_column(lemma) != cid:
                    raise StateFileError(f"{path}: column {lemma!r} does not hash to {cid:#x}")
            for fid, word in doc.features:
                if vocab.add_feature(word) != fid:
                    raise StateFileError(f"{path}: feature {word!r} does not hash to {fid:#x}")
        except OverflowError:
            raise StateFileError(f"{path}: id out of range") from None
        state.vocab = vocab
        state.deterministic = dict(doc.deterministic)
        state.probabilistic = set(doc.probabilistic)
        # version 1 listed the distinct keys written: their count (the next save drops the list)
        state.rows_written = doc.rows_written if doc.version >= 2 else len(doc.row_column)
        return state


class EvalRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One successful ``POST /v1/eval`` (``GET /v1/evals``): when (unix seconds), its figures, the
    sentences trained by the jobs this node knew then (``trained``) and what was evaluated
    (``source``: ``bundled corpus, first N`` (the default set), ``inline prompts``, or the
    corpus or prompt file's name)."""

    at: float
    top1: float
    matches: int
    prediction_tokens: int
    prompts: int
    constants: str
    mode: str
    trained: int
    source: str


class _HistoryDoc(msgspec.Struct, frozen=True):
    version: int
    evals: list[EvalRecord]


class EvalHistory:
    """The node's evaluation history, oldest first, at most ``max_entries`` (config
    ``compute.eval-history``; 0 keeps none and writes no file).

    Persisted as one JSON file written atomically after each evaluation (1,000 entries are ~185
    KiB: rewriting it is small next to an evaluation). A file that does not decode is moved aside
    to ``*.corrupt`` with a warning and the history starts empty: a lost history must never stop
    the node from starting.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.entries: list[EvalRecord] = []

    def add(self, record: EvalRecord) -> None:
        """Append ``record``, forgetting the oldest beyond the bound."""
        if self.max_entries <= 0:
            return
        self.entries.append(record)
        del self.entries[: max(0, len(self.entries) - self.max_entries)]

    def as_dict(self) -> dict[str, Any]:
        """``GET /v1/evals``."""
        return {"evals": msgspec.to_builtins(self.entries)}

    def encode(self) -> bytes:
        """The file's bytes (taken on the event loop, so a later ``save`` never writes an older copy)."""
        return msgspec.json.encode(_HistoryDoc(_VERSION, self.entries))

    def save(self, directory: str | os.PathLike[str], data: bytes | None = None) -> Path | None:
        """Write ``data`` (default: ``encode()``) atomically to ``directory/EVAL_HISTORY_FILE``
        (nothing when the history is disabled); returns the path."""
        if self.max_entries <= 0:
            return None
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / EVAL_HISTORY_FILE
        atomic_write_bytes(path, self.encode() if data is None else data)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str], max_entries: int) -> EvalHistory:
        """Read ``directory/EVAL_HISTORY_FILE`` (missing: empty), keeping the newest
        ``max_entries``; a corrupt file is moved aside (class docstring). Never raises for the
        file's content; an unreadable file (permissions) raises OSError."""
        history = cls(max_entries)
        path = Path(directory) / EVAL_HISTORY_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return history
        try:
            doc = msgspec.json.decode(raw, type=_HistoryDoc)
            if doc.version != _VERSION:
                raise ValueError(f"version {doc.version}, expected {_VERSION}")
        except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
            aside = path.with_name(path.name + ".corrupt")
            log.warning("evaluation history unreadable, starting empty; kept aside path=%s: %s", aside, exc)
            os.replace(path, aside)
            return history
        history.entries = doc.evals[-max_entries:] if max_entries > 0 else []
        return history
