"""Export of a row store: readable JSONL, and a compact, checksummed binary snapshot.

JSONL (one synapse per line, rows in ascending id order, entries in row order)::

    {"source_lemma": "cat", "source_word": "the", "segment": 8,
     "target_lemma": "cat", "target_word": "cat", "strength": 5.0}

``*_lemma`` is the column's noun lemma, ``*_word`` the neuron's word — for a prime concept neuron
(feature 0) the word is the column lemma (giaann-algorithm.md §1.4). Strengths are float32 values
printed with Python's shortest round-trip repr. ``is_jsonl_export`` recognises a file of this
format by its first line (the fields above, in that order) so that an export only ever replaces a
previous export unless told otherwise (giaannd/compute/paths.py).

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
payload checksum and the batch invariants; any failure raises :class:`SnapshotError` naming the file.
Writing goes to a temporary file that is fsynced and renamed, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import numpy as np
import xxhash

from giaannd.atomic_file import atomic_writer
from giaannd.errors import CorruptDataError
from giaannd.model.ids import PRIME_FEATURE
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.vocab import Vocabulary

__all__ = ["JSONL_FIELDS", "SNAPSHOT_MAGIC", "SNAPSHOT_VERSION", "SnapshotError", "is_jsonl_export",
           "iter_jsonl", "load_snapshot", "save_snapshot", "write_jsonl"]

#: The keys of every JSONL line, in order.
JSONL_FIELDS = ("source_lemma", "source_word", "segment", "target_lemma", "target_word", "strength")
#: ``is_jsonl_export`` reads at most this much of a first line (lemmas and words are short).
_MAX_JSONL_LINE_BYTES = 64 * 1024

SNAPSHOT_MAGIC = b"GIAROWS\x00"
SNAPSHOT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ")
_HEADER_BYTES = _HEADER.size + 8
#: Bytes per row and per entry in the payload (see the table above).
_ROW_BYTES = 8 + 8 + 8
_ENTRY_BYTES = 1 + 8 + 8 + 4
_DTYPES = (np.uint64, np.uint64, np.int64, np.uint8, np.uint64, np.uint64, np.float32)


class SnapshotError(CorruptDataError, ValueError):
    """A snapshot file is corrupt, truncated, of another format or version."""

    reason = "corrupt_row_snapshot"


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
                "source_lemma": src_lemma, "source_word": src_word, "segment": s,
                "target_lemma": tgt_lemma, "target_word": _word(vocab, tc, tf),
                "strength": float(np.float32(v)),
            }, ensure_ascii=False)


def is_jsonl_export(path: str | os.PathLike[str]) -> bool:
    """True if the regular file ``path`` is empty (the export of an empty model) or its first line
    is a JSONL export line: a JSON object with exactly ``JSONL_FIELDS``, in order.

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
    return isinstance(doc, dict) and tuple(doc) == JSONL_FIELDS


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
    digest = xxhash.xxh3_64()
    for b in buffers:
        digest.update(b.data.cast("B"))
    head = _HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, 0, batch.num_rows, batch.num_entries,
                        digest.intdigest())
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))

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
        head = fh.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES:
            raise SnapshotError(f"{name}: truncated header ({len(head)} of {_HEADER_BYTES} bytes)")
        magic, version, _reserved, rows, entries, payload_sum = _HEADER.unpack_from(head)
        if magic != SNAPSHOT_MAGIC:
            raise SnapshotError(f"{name}: not a giaannd row snapshot (magic {magic!r})")
        (head_sum,) = struct.unpack_from("<Q", head, _HEADER.size)
        if head_sum != xxhash.xxh3_64_intdigest(head[: _HEADER.size]):
            raise SnapshotError(f"{name}: header checksum mismatch")
        if version != SNAPSHOT_VERSION:
            raise SnapshotError(f"{name}: snapshot version {version}, this build reads {SNAPSHOT_VERSION}")
        expected = _HEADER_BYTES + rows * _ROW_BYTES + 8 + entries * _ENTRY_BYTES
        if expected != size:
            raise SnapshotError(f"{name}: size {size} bytes, header says {expected}")
        counts = (rows, rows, rows + 1, entries, entries, entries, entries)
        digest = xxhash.xxh3_64()
        buffers = []
        for count, dt in zip(counts, _DTYPES):
            want = count * np.dtype(dt).itemsize
            raw = fh.read(want)
            if len(raw) != want:
                raise SnapshotError(f"{name}: truncated payload")
            digest.update(raw)
            buffers.append(np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<")).astype(dt))
    if digest.intdigest() != payload_sum:
        raise SnapshotError(f"{name}: payload checksum mismatch")
    try:
        batch = RowBatch.from_buffers(buffers, validate=True)
    except ValueError as exc:
        raise SnapshotError(f"{name}: {exc}") from exc
    return RowStore.from_batch(batch)
