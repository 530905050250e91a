"""The whole trained model, read back from the storage cluster: scan, vocabulary, JSONL export.

Theory of operation
-------------------
No compute node holds the model: every row lives on its owners in storage, and every id → string
entry a training job learned was put into storage's replicated vocabulary (remote_vocab.py). So a
node can export, or print the words of, rows that *any* compute node trained:

1. **Scan** (``scan_cluster``): ``StorageClient.scan_all`` yields every row of the cluster exactly
   once; the reserved flag row (flags.py) is left out. A placement change during the scan
   (``ScanInterrupted``) restarts it, at most ``EXPORT_SCAN_ATTEMPTS`` times, with a short full-jitter backoff.
2. **Vocabulary** (``resolve_vocab``): the node's own vocabulary (state.py) is the local cache.
   Ids it lacks (``missing_vocab``) are fetched from storage; each entry is re-checked by hashing
   its text (the vocabulary is content-addressed), so a foreign or damaged entry cannot attach a
   wrong word to an id. Storage is not asked at all when nothing is missing.
3. **Write** (``write_export``): the rows as one ``RowStore``, written as JSONL by
   ``giaannd.model.export`` (atomically). An id with no string anywhere raises
   ``VocabularyMissing`` and nothing is written (rows trained before vocabulary replication); a
   file that cannot be written raises ``ExportWriteError`` naming it (the caller's input, not
   storage's fault);
   ``word_of`` prints such an id as ``<column:feature>`` in hex instead, for generation output.

**The export as a stream** (``export_cluster``, issue 14 item 7; what ``POST /v1/export`` runs):
steps 1-3 a page at a time. The scan yields the cluster's rows in global key order (every node's
pages merged k-way, client/scan.py), so each page is, in turn: the flag row dropped, the
vocabulary it lacks fetched, its lines made and appended to the export's temporary file
(``JsonlWriter``, ``chunk_entries`` entries at a time, in a thread: the event loop keeps
serving), and released. The process holds about two scan pages per storage node plus one chunk
of text, whatever the model size (``compute.export-page-bytes``, ``export-chunk-entries``). The
file appears only when complete (fsync, rename); a restarted scan (``ScanInterrupted``), a missing
string (``VocabularyMissing``) or a write error drops the partial file, so nothing half-written is
ever seen at ``path``. A crash leaves that file (``.<name>.<8 characters>.tmp``): the next export
to ``path`` deletes it before it writes, unless a live export holds it (atomic_file.py,
"Leftovers"; ``compute.export-dir`` may be shared by nodes, so no wider sweep). The lines are
byte for byte those of the one-piece path (``write_export``, kept for ``scan_cluster``'s callers
and as the benchmark's baseline).

**One column** (``column_contents``, issue 21; what ``GET /v1/columns/{column}/rows`` runs): the
column's rows read from one replica (``StorageClient.read_column``: client/column_rows.py), the flag
row left out, the vocabulary resolved as above, and the export's words (``word_of``: a prime
neuron's word is its column's lemma) laid out as columns of arrays: ``features`` one element per
row (the source neurons), ``entries`` one per synapse, rows in key order, entries in row order, the
same synapses and order as the export's lines of that column. Words are looked up once per distinct
id and spread by index (``np.unique`` inverses), so the per-entry work is C loops, run in a thread
(about 0.4 s per million entries: the event loop keeps serving).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd.atomic_file import remove_stale_temporaries
from giaannd.client.column_rows import ColumnRead
from giaannd.client.storage_client import ScanInterrupted, StorageClient
from giaannd.compute.flags import without_flag_row
from giaannd.errors import InputError, Refused
from giaannd.model.export import JsonlWriter, write_jsonl
from giaannd.model.ids import PRIME_FEATURE
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.model.vocab import IdCollisionError, Vocabulary
from giaannd.unique import unique
from peers.retry import RetryPolicy, retry

__all__ = [
    "EXPORT_READ_ROWS",
    "EXPORT_SCAN_ATTEMPTS",
    "ExportWriteError",
    "column_contents",
    "VocabularyMissing",
    "entry_window",
    "export_cluster",
    "missing_vocab",
    "resolve_vocab",
    "scan_cluster",
    "word_of",
    "write_export",
]

# Logged under the compute service's name, as before these functions left service.py.
log = logging.getLogger("giaannd.compute.service")

#: Rows per read while gathering an export (kept for importers; the scan pages by its own size).
EXPORT_READ_ROWS: Final = 32_768
#: Whole-scan attempts of an export when the placement changes under it (ScanInterrupted).
EXPORT_SCAN_ATTEMPTS: Final = 3
#: Their waits: full jitter under 0.2 s, then 0.4 s (peers/retry.py); a placement change settles fast.
EXPORT_SCAN_RETRY: Final = RetryPolicy(0.2, 1.0, EXPORT_SCAN_ATTEMPTS)

class ExportWriteError(InputError):
    """The export's file cannot be written (a directory, a read-only place, a full disk)."""


#: Fetches ``(kind, id)`` keys from storage's vocabulary (``StorageClient.get_vocab``).
GetVocab = Callable[[Sequence[tuple[int, int]]], Awaitable[dict[tuple[int, int], str]]]


class VocabularyMissing(Refused, ValueError):
    """An exported row names an id whose string neither this node nor storage holds."""

    reason = "vocabulary_missing"


def word_of(vocab: Vocabulary, column: int, feature: int) -> str:
    """The word of a node, or ``<column:feature>`` in hex when ``vocab`` lacks it."""
    try:
        return vocab.word_of(column, feature)
    except KeyError:
        return f"<{column:x}:{feature:x}>"


def missing_vocab(vocab: Vocabulary, columns: Any, features: Any) -> list[tuple[int, int]]:
    """(kind, id) keys of the given column and feature ids ``vocab`` lacks."""
    out: list[tuple[int, int]] = []
    for cid in unique(np.asarray(columns, np.uint64)).tolist():
        try:
            vocab.column_lemma(cid)
        except KeyError:
            out.append((0, cid))
    for fid in unique(np.asarray(features, np.uint64)).tolist():
        if fid == PRIME_FEATURE:
            continue
        try:
            vocab.feature_word(fid)
        except KeyError:
            out.append((1, fid))
    return out


async def resolve_vocab(vocab: Vocabulary, get_vocab: GetVocab, columns: Any, features: Any) -> int:
    """Add to ``vocab`` the strings of the ids it lacks, fetched with ``get_vocab`` (module
    docstring, step 2). Returns the number of entries added.

    Raises:
        ReadFailed: every owner of some ids failed.
    """
    missing = missing_vocab(vocab, columns, features)
    if not missing:
        return 0
    found = await get_vocab(missing)
    added = 0
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


async def scan_cluster(client: StorageClient) -> RowBatch:
    """Every model row of the cluster (each exactly once; the flag row left out), restarted if
    the placement changes under the scan (module docstring, step 1)."""
    async def scan() -> list[RowBatch]:
        return [page async for page in client.scan_all()]

    parts = await retry(scan, EXPORT_SCAN_RETRY, retry_on=ScanInterrupted,
                        on_retry=lambda failures, exc, wait_s: log.info(
                            "export scan restarted (attempt %d): %s", failures, exc))
    return without_flag_row(RowBatch.concat(parts)) if parts else RowBatch.empty()


async def write_export(batch: RowBatch, vocab: Vocabulary, path: str | Path) -> dict[str, Any]:
    """Write ``batch`` as JSONL at ``path`` with the words of ``vocab`` (module docstring, step 3).

    Raises:
        VocabularyMissing: some id has no string in ``vocab``.
        ExportWriteError: ``path`` cannot be written (nothing is).
    """
    store = RowStore.from_batch(batch)
    try:
        await asyncio.to_thread(_reclaim_stale_export, Path(path))
        lines = await asyncio.to_thread(write_jsonl, store, vocab, path)
    except KeyError as exc:
        raise VocabularyMissing(str(exc.args[0] if exc.args else exc)) from None
    except OSError as exc:
        raise ExportWriteError(f"cannot write the export to {path}: {exc.strerror or exc}") from None
    return {"path": str(path), "lines": lines, "rows": batch.num_rows, "entries": batch.num_entries,
            "source": "every row of the storage cluster (scan)"}


def _reclaim_stale_export(path: Path) -> None:
    """Delete the temporaries a crashed export of ``path`` left (atomic_file.py, "Leftovers").
    The export directory is the operator's to choose, and may be shared by several nodes: only
    this destination's temporaries are touched, when its next export starts, and only those no
    live writer holds.

    Raises:
        OSError: one could not be checked or deleted.
    """
    for stale, size in remove_stale_temporaries(path.parent, of=path.name):
        log.info("removed a stale export temporary file=%s bytes=%d", stale, size)


def _open_writer(path: Path) -> JsonlWriter:
    _reclaim_stale_export(path)
    return JsonlWriter(path)


def entry_window(batch: RowBatch, first: int, stop: int) -> RowBatch:
    """Entries ``first .. stop`` of ``batch`` as a batch (views): the rows they fall in, the first
    and last possibly cut (a chunk of lines may end inside a row, module docstring)."""
    offsets = batch.offsets
    r0 = int(np.searchsorted(offsets, first, "right")) - 1
    r1 = int(np.searchsorted(offsets, stop, "left"))
    window = np.clip(offsets[r0 : r1 + 1], first, stop) - first
    return RowBatch(batch.row_column[r0:r1], batch.row_feature[r0:r1], window, batch.segment[first:stop],
                    batch.target_column[first:stop], batch.target_feature[first:stop], batch.strength[first:stop])


async def _write_page(writer: JsonlWriter, page: RowBatch, vocab: Vocabulary, chunk_entries: int) -> None:
    """The lines of ``page``, ``chunk_entries`` at a time, appended in a thread."""
    for first in range(0, page.num_entries, chunk_entries):
        chunk = entry_window(page, first, min(first + chunk_entries, page.num_entries))
        try:
            await asyncio.to_thread(writer.write, chunk, vocab)
        except KeyError as exc:
            raise VocabularyMissing(str(exc.args[0] if exc.args else exc)) from None
        except OSError as exc:
            raise ExportWriteError(f"cannot write the export to {writer.path}: {exc.strerror or exc}") from None


async def export_cluster(client: StorageClient, vocab: Vocabulary, get_vocab: GetVocab, path: str | Path, *,
                         page_bytes: int, chunk_entries: int) -> dict[str, Any]:
    """The JSONL export of every model row of the cluster, written as the scan goes (module
    docstring, "The export as a stream"); restarted if the placement changes under the scan.

    Raises:
        VocabularyMissing: some id has no string in ``vocab`` nor in storage (nothing is written).
        ExportWriteError: ``path`` cannot be written (nothing is).
        ReadFailed: a node failed and no other live owner is left for some of its columns.
        ScanInterrupted: the placement kept changing (``EXPORT_SCAN_ATTEMPTS`` scans).
    """
    async def attempt() -> dict[str, Any]:
        try:
            writer = await asyncio.to_thread(_open_writer, Path(path))
        except OSError as exc:
            raise ExportWriteError(f"cannot write the export to {path}: {exc.strerror or exc}") from None
        rows = entries = 0
        last: tuple[int, int] | None = None
        try:
            async for scanned in client.scan_all(page_bytes=page_bytes):
                page = without_flag_row(scanned)
                if not page.num_rows:
                    continue
                await resolve_vocab(vocab, get_vocab, np.concatenate([page.row_column, page.target_column]),
                                    np.concatenate([page.row_feature, page.target_feature]))
                await _write_page(writer, page, vocab, chunk_entries)
                # a row cut into pieces ends one page and starts the next: count it once
                rows += page.num_rows - int(last == (int(page.row_column[0]), int(page.row_feature[0])))
                entries += page.num_entries
                last = (int(page.row_column[-1]), int(page.row_feature[-1]))
            await asyncio.to_thread(writer.commit)
        except OSError as exc:  # (commit's: the scan's own failures are ReadFailed)
            writer.abort()
            raise ExportWriteError(f"cannot write the export to {path}: {exc.strerror or exc}") from None
        except BaseException:
            writer.abort()
            raise
        return {"path": str(path), "lines": writer.lines, "rows": rows, "entries": entries,
                "source": "every row of the storage cluster (scan, written as it goes)"}

    return await retry(attempt, EXPORT_SCAN_RETRY, retry_on=ScanInterrupted,
                       on_retry=lambda failures, exc, wait_s: log.info(
                           "export scan restarted (attempt %d): %s", failures, exc))


def _node_words(vocab: Vocabulary, columns: NDArray[np.uint64], features: NDArray[np.uint64]) -> list[str]:
    """``word_of`` of every neuron (columns[i], features[i]), each distinct id looked up once."""
    out = np.empty(columns.shape[0], dtype=object)
    prime = features == np.uint64(PRIME_FEATURE)
    cols, at = np.unique(columns[prime], return_inverse=True)
    out[prime] = np.array([word_of(vocab, c, PRIME_FEATURE) for c in cols.tolist()], object)[at]
    feats, at = np.unique(features[~prime], return_inverse=True)
    found = [_feature_word(vocab, f) for f in feats.tolist()]
    words = np.array(found, object)[at]
    missing = np.flatnonzero(np.array([w is None for w in found], bool)[at])
    if missing.shape[0]:  # no word anywhere: word_of's <column:feature>, which needs each entry's column
        rest = np.flatnonzero(~prime)[missing]
        words[missing] = [word_of(vocab, c, f) for c, f in zip(columns[rest].tolist(), features[rest].tolist())]
    out[~prime] = words
    result: list[str] = out.tolist()
    return result


def _feature_word(vocab: Vocabulary, feature: int) -> str | None:
    try:
        return vocab.feature_word(feature)
    except KeyError:
        return None


async def column_contents(read: ColumnRead, vocab: Vocabulary, get_vocab: GetVocab) -> dict[str, Any] | None:
    """The column's rows as the ``column rows`` answer (module docstring, "One column"); None when
    the replica read holds no row of it (the flag row does not count).

    Raises:
        ReadFailed: every owner of some vocabulary ids failed.
    """
    batch = without_flag_row(read.rows)
    if not batch.num_rows:
        return None
    await resolve_vocab(vocab, get_vocab, np.concatenate([batch.row_column, batch.target_column]),
                        np.concatenate([batch.row_feature, batch.target_feature]))
    # ~400 ns an entry (10 M entries: seconds): in a thread, so the event loop keeps serving; the
    # vocabulary is only read there (lookups, no iteration), which training adding to it allows
    return await asyncio.to_thread(_column_document, read, batch, vocab)


def _column_document(read: ColumnRead, batch: RowBatch, vocab: Vocabulary) -> dict[str, Any]:
    """``column_contents``' answer from the read's rows (the flag row left out), words resolved."""
    lengths = np.diff(batch.offsets)
    source_feature = np.repeat(batch.row_feature, lengths)
    feature_words = _node_words(vocab, batch.row_column, batch.row_feature)
    return {
        "column": read.column, "word": word_of(vocab, read.column, PRIME_FEATURE),
        "total_entries": read.total_entries,
        "truncated": read.truncated,
        "features": {"feature": feature_words, "prime": (batch.row_feature == np.uint64(PRIME_FEATURE)).tolist(),
                     "entries": lengths.tolist()},
        "entries": {
            "source_feature": np.array(feature_words, object)[np.repeat(np.arange(batch.num_rows), lengths)].tolist(),
            "source_prime": (source_feature == np.uint64(PRIME_FEATURE)).tolist(),
            "segment": batch.segment.tolist(),
            "target_column": _node_words(vocab, batch.target_column,
                                         np.zeros(batch.num_entries, np.uint64)),
            "target_feature": _node_words(vocab, batch.target_column, batch.target_feature),
            "target_prime": (batch.target_feature == np.uint64(PRIME_FEATURE)).tolist(),
            "strength": batch.strength.astype(np.float64).tolist(),
        },
    }
