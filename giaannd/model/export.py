"""Export of a row store: readable JSONL, and a compact, checksummed binary snapshot.

JSONL (one synapse per line, rows in ascending id order, entries in row order)::

    {"source_lemma": "cat", "source_word": "the", "source_prime": false, "segment": 8,
     "target_lemma": "cat", "target_word": "cat", "target_prime": true, "strength": 5.0}

``*_lemma`` is the column's noun lemma, ``*_word`` the neuron's word — for a prime concept neuron
(feature 0) the word is the column lemma (giaann-algorithm.md §1.4). ``*_prime`` tells the prime
neuron (column, 0) from a feature neuron whose word happens to equal the lemma (the noun "fire"
and the verb "fire" in column ``fire``): without it the two export the same key. Strengths are
float32 values printed with Python's shortest round-trip repr. :func:`read_jsonl` reads these
lines, and those of older exports, which have no ``*_prime`` fields (module docstring there).
``is_jsonl_export`` recognises a file of this format, or of the older one, by its first line (the
fields above, in that order) so that an export only ever replaces a previous export unless told
otherwise (giaannd/compute/paths.py).

Streaming (issue 14 item 7): the cluster export writes the lines as the scan delivers rows in key
order, a bounded chunk at a time (:class:`JsonlWriter`: a temporary file, fsynced and renamed by
``commit``; ``abort`` removes it), so the format needs no header and no pass over the whole model.
``jsonl_bytes`` makes the lines of one chunk with per-entry work done by C loops (the fragments of
each distinct source row and target neuron are made once per chunk, the strengths by ``repr``, the
lines by one ``str.format`` map), byte for byte the lines ``iter_jsonl`` makes with ``json.dumps``
(tests compare them). A row cut into pieces by the scan is two chunks: its lines, concatenated,
are the row's.

Page cache: an export is as large as ~9× the model's row bytes (~16 GB for a node of 8.6·10^7
entries), written once and read, if ever, by another program. Through the page cache it would
evict what a colocated storage node needs cached (its snapshot: a restart then reads it from
disk, docs/storage.md "Recovery in small pages"), so the writer makes every ``DROP_EVERY_BYTES``
durable (``fdatasync``) and drops those pages (``posix_fadvise(POSIX_FADV_DONTNEED)``), and drops
the rest at ``commit``, as the storage update log does with what it syncs.

Binary snapshot (little-endian), version 1::

    offset size  field
    0      8     magic b"GIAROWS\\0"
    8      4     format version (uint32) = 1
    12     4     reserved (0)
    16     8     number of rows R (uint64)
    24     8     number of entries N (uint64)
    32     8     xxh3_64 of the payload
    40     8     xxh3_64 of bytes 0..39 (the header)
    48     ...   payload: the seven RowBatch buffers in wire order, raw
                 (row_column u64[R], row_feature u64[R], offsets i64[R+1],
                  segment u8[N], target_column u64[N], target_feature u64[N], strength f32[N])

Loading checks the header checksum, the sizes against the file length (before allocating), the
payload checksum and the batch invariants; any failure raises :class:`SnapshotError` naming the file
and the byte offset. The header and those checks are the shared record codec's (``giaannd.records``,
``EXPORT_RECORD``: a format without a length field, its payload size derived from R and N).
Writing goes to a temporary file that is fsynced and renamed, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd import page_cache
from giaannd.atomic_file import atomic_writer, fsync_dir, make_temporary
from giaannd.errors import CorruptDataError
from giaannd.model.ids import PRIME_FEATURE
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.vocab import Vocabulary
from giaannd.records import RecordError, RecordFormat

__all__ = ["EXPORT_RECORD", "JSONL_FIELDS", "JSONL_FIELDS_V1", "SNAPSHOT_MAGIC", "SNAPSHOT_VERSION", "ExportEntry",
           "JsonlWriter", "SnapshotError", "is_jsonl_export", "iter_jsonl", "jsonl_bytes", "load_snapshot",
           "read_jsonl", "save_snapshot", "write_jsonl"]

#: The keys of every JSONL line, in order.
JSONL_FIELDS = ("source_lemma", "source_word", "source_prime", "segment", "target_lemma", "target_word",
                "target_prime", "strength")
#: The keys of a line of an export written before the ``*_prime`` fields.
JSONL_FIELDS_V1 = ("source_lemma", "source_word", "segment", "target_lemma", "target_word", "strength")
#: ``is_jsonl_export`` reads at most this much of a first line (lemmas and words are short).
_MAX_JSONL_LINE_BYTES = 64 * 1024

SNAPSHOT_MAGIC = b"GIAROWS\x00"
SNAPSHOT_VERSION = 1
#: Bytes per row and per entry in the payload (see the table above).
_ROW_BYTES = 8 + 8 + 8
_ENTRY_BYTES = 1 + 8 + 8 + 4
_DTYPES = (np.uint64, np.uint64, np.int64, np.uint8, np.uint64, np.uint64, np.float32)


def _payload_bytes(fields: Mapping[str, int]) -> int:
    """The payload size the header's counts give (the extra 8: offsets has R + 1 entries)."""
    return fields["rows"] * _ROW_BYTES + 8 + fields["entries"] * _ENTRY_BYTES


#: The 48-byte header of the table above. No length field and no payload limit: the derived size
#: must equal the file's, checked before anything is allocated.
EXPORT_RECORD = RecordFormat(
    "row snapshot", SNAPSHOT_MAGIC,
    [("version", "I"), ("reserved", "I"), ("rows", "Q"), ("entries", "Q"), ("payload_xxh3", "Q")],
    versions=(SNAPSHOT_VERSION, SNAPSHOT_VERSION), max_payload_bytes=None, payload_bytes=_payload_bytes)


class SnapshotError(CorruptDataError, ValueError):
    """A snapshot file is corrupt, truncated, of another format or version.

    Args:
        message: names the file and what failed.
        offset: the byte offset where validation failed.
    """

    reason = "corrupt_row_snapshot"

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


def _word(vocab: Vocabulary, column: int, feature: int) -> str:
    try:
        return vocab.word_of(column, feature)
    except KeyError:
        kind = "column" if feature == PRIME_FEATURE else "feature"
        missing = column if feature == PRIME_FEATURE else feature
        raise KeyError(f"export: {kind} id {missing:#018x} is not in the vocabulary") from None


def iter_jsonl(store: RowStore, vocab: Vocabulary) -> Iterator[str]:
    """The JSONL lines (without newline) of every entry of ``store``.

    Raises:
        KeyError: an id of the store is missing from ``vocab`` (the message names it).
    """
    lemma_of = vocab.column_lemma
    for (c, f), row in store:
        try:
            src_lemma = lemma_of(c)
        except KeyError:
            raise KeyError(f"export: column id {c:#018x} is not in the vocabulary") from None
        src_word = _word(vocab, c, f)
        for s, tc, tf, v in zip(row.segment.tolist(), row.target_column.tolist(),
                                row.target_feature.tolist(), row.strength.tolist()):
            try:
                tgt_lemma = lemma_of(tc)
            except KeyError:
                raise KeyError(f"export: column id {tc:#018x} is not in the vocabulary") from None
            yield json.dumps({
                "source_lemma": src_lemma, "source_word": src_word, "source_prime": f == PRIME_FEATURE,
                "segment": s, "target_lemma": tgt_lemma, "target_word": _word(vocab, tc, tf),
                "target_prime": tf == PRIME_FEATURE, "strength": float(np.float32(v)),
            }, ensure_ascii=False)


_JSON = json.JSONEncoder(ensure_ascii=False).encode
#: One line from its five parts: the source row's fragment, the segment, the target column's, the
#: target neuron's word (and prime flag), the strength.
_LINE = "{}{}{}{}{}}}\n".format
_SEGMENTS = np.array([str(i) for i in range(256)], dtype=object)
#: ``jsonl_bytes`` formats this many lines per C call at most. ``"".join(map(str.format, ...))``
#: runs in C from its first item to its last without giving the interpreter a chance to switch
#: threads, so a chunk of 65,536 lines held the GIL for ~80 ms at a time: on a compute node the
#: event loop (gossip's acks, inference) waited that long at every chunk of an export, which runs
#: in a worker thread. A slice is ~2-3 ms of work.
JSONL_SLICE_LINES: Final = 2048


def _lemma(vocab: Vocabulary, column: int) -> str:
    try:
        return vocab.column_lemma(column)
    except KeyError:
        raise KeyError(f"export: column id {column:#018x} is not in the vocabulary") from None


class JsonlFragments:
    """The JSON fragments of the ids an export has met, made once each (``jsonl_bytes``): what
    depends on the source row, on the target column, and on the target word."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self._lemmas: dict[int, str] = {}
        self._words: dict[int, str] = {}
        self._columns: dict[int, str] = {}

    def lemma(self, cid: int) -> str:
        """Column ``cid``'s lemma as JSON."""
        got = self._lemmas.get(cid)
        if got is None:
            got = self._lemmas[cid] = _JSON(_lemma(self.vocab, cid))
        return got

    def word(self, fid: int) -> str:
        """Feature ``fid``'s word as JSON."""
        got = self._words.get(fid)
        if got is None:
            try:
                word = self.vocab.feature_word(fid)
            except KeyError:
                raise KeyError(f"export: feature id {fid:#018x} is not in the vocabulary") from None
            got = self._words[fid] = _JSON(word)
        return got

    def column(self, cid: int) -> str:
        """``, "target_lemma": L, "target_word": `` of column ``cid``."""
        got = self._columns.get(cid)
        if got is None:
            got = self._columns[cid] = f', "target_lemma": {self.lemma(cid)}, "target_word": '
        return got

    def prime(self, cid: int) -> str:
        """The rest of a line's target of the prime neuron of ``cid``, up to the strength."""
        return f'{self.lemma(cid)}, "target_prime": true, "strength": '

    def feature(self, fid: int) -> str:
        """The rest of a line's target of feature neuron ``fid``, up to the strength."""
        return f'{self.word(fid)}, "target_prime": false, "strength": '

    def source(self, cid: int, fid: int) -> str:
        """Everything of a line up to the segment, for the row (cid, fid)."""
        prime = fid == PRIME_FEATURE
        return (f'{{"source_lemma": {self.lemma(cid)}, "source_word": {self.lemma(cid) if prime else self.word(fid)}, '
                f'"source_prime": {"true" if prime else "false"}, "segment": ')


def _table(ids: NDArray[np.uint64], make: Callable[[int], str]) -> NDArray[np.object_]:
    out = np.empty(ids.shape[0], dtype=object)
    out[:] = [make(i) for i in ids.tolist()]
    return out


def jsonl_bytes(batch: RowBatch, vocab: Vocabulary, fragments: JsonlFragments | None = None) -> bytes:
    """The JSONL lines of every entry of ``batch`` (rows in its order), UTF-8: the bytes
    ``iter_jsonl`` gives for the same rows (module docstring, "Streaming"). ``fragments``: a cache
    kept across the chunks of one export (a new one when None).

    Raises:
        KeyError: an id of the batch is missing from ``vocab`` (the message names it).
    """
    if batch.num_entries == 0:
        return b""
    frag = fragments if fragments is not None and fragments.vocab is vocab else JsonlFragments(vocab)
    lengths = np.diff(batch.offsets)
    rows = np.flatnonzero(lengths)
    sources = np.empty(rows.shape[0], dtype=object)
    sources[:] = [frag.source(c, f) for c, f in zip(batch.row_column[rows].tolist(), batch.row_feature[rows].tolist())]
    tc, tf = batch.target_column, batch.target_feature
    columns, at_column = np.unique(tc, return_inverse=True)
    features, at_feature = np.unique(tf, return_inverse=True)
    words = _table(features, lambda f: "" if f == PRIME_FEATURE else frag.feature(f))[at_feature.reshape(-1)]
    prime = tf == PRIME_FEATURE
    if prime.any():
        words[prime] = _table(columns, frag.prime)[at_column.reshape(-1)[prime]]
    src = sources[np.repeat(np.arange(rows.shape[0]), lengths[rows])].tolist()
    seg = _SEGMENTS[batch.segment].tolist()
    col = _table(columns, frag.column)[at_column.reshape(-1)].tolist()
    word = words.tolist()
    strength = batch.strength.tolist()
    step = JSONL_SLICE_LINES  # (a Python loop between the C calls: other threads get the GIL)
    text = "".join(["".join(map(_LINE, src[lo:lo + step], seg[lo:lo + step], col[lo:lo + step], word[lo:lo + step],
                                map(float.__repr__, strength[lo:lo + step])))
                    for lo in range(0, len(src), step)])
    return text.encode("utf-8")


#: An export writer makes its file durable and drops it from the page cache every this many bytes
#: (module docstring, "Page cache"): the cache it fills at most, and the data a sync waits for.
DROP_EVERY_BYTES = 64 << 20


class JsonlWriter:
    """A JSONL export written chunk by chunk (module docstring, "Streaming"): into a temporary file
    next to ``path`` until ``commit`` fsyncs it and renames it over ``path``; ``abort`` (or any
    failure of ``commit``) removes it, leaving ``path`` untouched. Synchronous: the asyncio glue
    calls it in a thread.

    Raises:
        OSError: the temporary file cannot be made (``path``'s directory does not exist, ...).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        fd, tmp = make_temporary(self.path)  # locked while it is written: no reclaim takes it
        self._tmp = tmp
        self._fh: IO[bytes] | None = os.fdopen(fd, "wb")
        os.fchmod(fd, 0o644)
        #: lines written so far
        self.lines = 0
        self._fragments: JsonlFragments | None = None
        self._written = 0  # bytes written to the file
        self._synced = 0  # of them, made durable (and dropped from the page cache) so far
        self._cached = page_cache.DroppedPrefix()  # how far the file left the page cache

    def write(self, batch: RowBatch, vocab: Vocabulary) -> None:
        """Append the lines of ``batch`` (the rows after every row written before).

        Raises:
            KeyError: an id is missing from ``vocab`` (nothing of ``batch`` is written).
            OSError: the write failed.
        """
        if self._fh is None:
            raise ValueError("export writer already closed")
        if self._fragments is None or self._fragments.vocab is not vocab:
            self._fragments = JsonlFragments(vocab)
        data = jsonl_bytes(batch, vocab, self._fragments)
        self._fh.write(data)
        self.lines += batch.num_entries
        self._written += len(data)
        if self._written - self._synced >= DROP_EVERY_BYTES:
            self._drop_synced(self._fh)

    def _drop_synced(self, fh: IO[bytes]) -> None:
        """Make what was written durable and drop its whole pages from the page cache (module
        docstring, "Page cache"); a no-op for the cache where there is no ``posix_fadvise``."""
        fh.flush()
        os.fdatasync(fh.fileno())
        self._synced = self._written
        self._cached.drop(fh.fileno(), self._synced)

    def commit(self) -> None:
        """Make the file complete and durable at ``path``.

        Raises:
            OSError: the flush, fsync or rename failed (the temporary file is removed).
        """
        if self._fh is None:
            raise ValueError("export writer already closed")
        fh, self._fh = self._fh, None
        try:
            with fh:
                fh.flush()
                os.fsync(fh.fileno())
                page_cache.drop_rest(fh.fileno(), self._cached.dropped)  # the rest leaves it too
            os.replace(self._tmp, self.path)
        except BaseException:
            self._remove()
            raise
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drop the partial file (idempotent; a no-op after ``commit``)."""
        if self._fh is not None:
            fh, self._fh = self._fh, None
            # closing flushes what is still buffered: on a full disk (the failure that often
            # brought us here) that fails again, yet the file is closed and must still go, and the
            # caller's own error is the one to report
            with contextlib.suppress(OSError):
                fh.close()
            self._remove()

    def _remove(self) -> None:
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


def is_jsonl_export(path: str | os.PathLike[str]) -> bool:
    """True if the regular file ``path`` is empty (the export of an empty model) or its first line
    is a JSONL export line: a JSON object with exactly ``JSONL_FIELDS``, in order, or the fields of
    an export written before the ``*_prime`` fields (``JSONL_FIELDS_V1``), so that a re-export
    replaces an export this daemon wrote before an upgrade.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        first = fh.readline(_MAX_JSONL_LINE_BYTES)
    if not first:
        return True
    try:
        doc = json.loads(first)
    except ValueError:  # not JSON, or not UTF-8
        return False
    return isinstance(doc, dict) and tuple(doc) in (JSONL_FIELDS, JSONL_FIELDS_V1)


@dataclass(frozen=True, slots=True)
class ExportEntry:
    """One JSONL line: a synapse from neuron (source_lemma, source_word) onto segment ``segment``
    of neuron (target_lemma, target_word); ``*_prime`` marks a prime concept neuron."""

    source_lemma: str
    source_word: str
    source_prime: bool
    segment: int
    target_lemma: str
    target_word: str
    target_prime: bool
    strength: float


def _entry(d: object) -> ExportEntry:
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    try:
        src_lemma, src_word, tgt_lemma, tgt_word = (d["source_lemma"], d["source_word"], d["target_lemma"],
                                                    d["target_word"])
        segment, strength = d["segment"], d["strength"]
    except KeyError as exc:
        raise ValueError(f"missing field {exc.args[0]!r}") from None
    if not all(isinstance(x, str) for x in (src_lemma, src_word, tgt_lemma, tgt_word)):
        raise ValueError("lemmas and words must be strings")
    if isinstance(segment, bool) or not isinstance(segment, int) or isinstance(strength, bool) \
            or not isinstance(strength, (int, float)):
        raise ValueError("segment must be an integer and strength a number")
    # An export written before the *_prime fields: a word equal to its column's lemma is read as
    # the prime neuron, the only reading the old key allows (the ambiguity the fields remove).
    src_prime = d.get("source_prime", src_word == src_lemma)
    tgt_prime = d.get("target_prime", tgt_word == tgt_lemma)
    if not isinstance(src_prime, bool) or not isinstance(tgt_prime, bool):
        raise ValueError("source_prime and target_prime must be true or false")
    return ExportEntry(src_lemma, src_word, src_prime, segment, tgt_lemma, tgt_word, tgt_prime, float(strength))


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[ExportEntry]:
    """The entries of a JSONL export, this version's or an older one without ``*_prime`` fields
    (then a word equal to its lemma is taken for the prime neuron). Blank lines are skipped.

    Raises:
        ValueError: a line is not an export entry; the message names the file and line.
        OSError: the file cannot be read.
    """
    name = os.fspath(path)
    with open(name, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield _entry(json.loads(line))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{name}:{lineno}: not an export entry: {exc}") from None


def write_jsonl(store: RowStore, vocab: Vocabulary, path: str | os.PathLike[str]) -> int:
    """Write the JSONL export atomically; returns the number of lines."""
    count = 0
    with atomic_writer(path) as fh:
        for line in iter_jsonl(store, vocab):
            fh.write(line.encode("utf-8") + b"\n")
            count += 1
    return count


def save_snapshot(store: RowStore, path: str | os.PathLike[str]) -> int:
    """Write a binary snapshot of every row atomically; returns its size in bytes."""
    batch = store.export()
    buffers = [np.ascontiguousarray(b, dtype=dt).astype(np.dtype(dt).newbyteorder("<"), copy=False)
               for b, dt in zip(batch.buffers(), _DTYPES)]
    head = EXPORT_RECORD.header_for([b.data.cast("B") for b in buffers], rows=batch.num_rows,
                                    entries=batch.num_entries)

    with atomic_writer(path) as fh:
        fh.write(head)
        for b in buffers:
            fh.write(b.data.cast("B"))
    return len(head) + sum(int(b.nbytes) for b in buffers)


def load_snapshot(path: str | os.PathLike[str]) -> RowStore:
    """Load a snapshot written by :func:`save_snapshot`.

    Raises:
        SnapshotError: wrong magic/version, bad checksums, sizes that disagree with the file, or
            rows that break the batch invariants.
        OSError: the file cannot be read.
    """
    name = os.fspath(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        try:
            head = EXPORT_RECORD.read_header(fh.read(EXPORT_RECORD.header_bytes))
            EXPORT_RECORD.check_extent(head, size)
        except RecordError as exc:
            raise SnapshotError(f"{name}: {exc.detail}", exc.offset) from None
        rows, entries = head.fields["rows"], head.fields["entries"]
        counts = (rows, rows, rows + 1, entries, entries, entries, entries)
        digest = xxhash.xxh3_64()
        buffers = []
        for count, dt in zip(counts, _DTYPES):
            at = fh.tell()
            want = count * np.dtype(dt).itemsize
            raw = fh.read(want)
            if len(raw) != want:  # the file shrank under us: its size was checked above
                raise SnapshotError(f"{name}: truncated payload", at)
            digest.update(raw)
            buffers.append(np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<")).astype(dt))
    try:
        EXPORT_RECORD.check_payload(head, digest.intdigest())
        batch = RowBatch.from_buffers(buffers, validate=True)
    except RecordError as exc:
        raise SnapshotError(f"{name}: {exc.detail}", exc.offset) from None
    except ValueError as exc:
        raise SnapshotError(f"{name}: {exc}", head.payload_offset) from exc
    return RowStore.from_batch(batch)
