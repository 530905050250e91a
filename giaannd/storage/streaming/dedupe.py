"""Dedupe between forwarded stream deltas and a writer's retry under the new placement.

The problem (docs/topology.md, "Known gaps" before this module): a batch ``b`` applied by a source
under the old placement is forwarded to the target as a stream delta (under the stream's writer
id, not ``b``'s). If ``b``'s writer then retries ``b`` under the new placement (same id: the client's
contract), the target gets its share of ``b`` directly — including the rows it already has through
the stream — and would count them twice.

The fix, per target node and per stream ``s``, with two kinds of marker (empty batches under
``BatchId(scoped_writer(b.writer, s, kind), b.seq)``, durable in the update log like any batch id):

- *forwarded* ``F(b, s)``: applied just before a forwarded delta of origin ``b`` (a crash in between
  at worst leaves a marker whose delta the resumed stream then brings);
- *direct* ``D(b, s)``: applied right after a direct batch ``b`` that carried rows in the columns of
  stream ``s`` while ``s`` is open (the ack waits for it to be durable too);
- a direct batch drops its rows in ``s``'s columns when ``F(b, s)`` exists (the retry after the
  forward); a forwarded delta is applied empty when ``D(b, s)`` exists (the delayed original after
  the retry). A direct batch carries rows of ``s``'s columns only if it was computed under the new
  placement (under the old one this node did not own them), so ``D`` never hides an old-placement
  share this node needs.
- the columns each stream carried are kept in ``<data dir>/streams/<stream id>.cols`` (u64, append
  only, fsynced before the first item that uses them); a ``.closed`` file marks a stream whose
  sender finished (no more forwarded deltas: no more ``D`` markers needed), a ``.discarded`` file
  one whose operation was abandoned before its cutover and whose rows this node dropped
  (rebalance/stream_discard.py, ``DiscardStream``): it is never accepted again and has no scope.
  ``<stream id>.source`` names the node that sends the stream (``StreamHello.source_node``,
  written once, atomically, before its first columns): a removenode or replace of that node,
  dead, discards the streams it left open (``DiscardStreamsFrom``).

**Chunks** (Dec 2). A chunk copies rows that already hold batches, and a share of one of them can
still reach the target directly later: a hint the holder re-splits after the cutover (its target
was down during the stream and refuses the rows it no longer owns), or a writer's retry. So chunks
name batches (``StreamData.origins``), each once per stream: the first chunk the source's ids a
share may still come for among the stream's columns when it opened (``AppliedSet.touching``:
tracked writers' ids above their promised floors; one pass over the ids in flight, once per
stream), and each later chunk the batches applied since whose rows in those columns were left for
a chunk (``StreamSender.offer_delta``; a batch forwarded whole is named by its delta's marker
already). The receiver applies their ``F`` markers before the chunk's rows; the direct share then
drops its rows in the stream's columns as for a forwarded delta. Every row of a named batch in the
stream's columns reaches the target through the stream: in a chunk read after the batch was
applied, or as a forwarded delta (rows read before). An item names at most ``MAX_CHUNK_ORIGINS``
(2^20, the receiver's decode limit); more wait for the next chunk, and those still waiting when
the chunks run out are not named (ids in flight past 2^20 times a stream's chunks: a member down
so long that its hints hold every writer's floor; each named id also costs a marker record).

Markers are never collected (a few bytes per forwarded delta, and per direct batch while a stream
is open). A crash between a direct batch and its ``D`` marker (before the ack) leaves no ack: the
writer's retry, a duplicate here, writes the marker then; only a delayed original that reaches the
restarted node before that retry is still counted twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.atomic_file import atomic_write_bytes, fsync_dir
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.log_tail import append_synced
from giaannd.storage.streaming.column_sets import member, missing, with_columns
from giaannd.unique import unique

__all__ = ["StreamScopes", "direct_marker_id", "filter_direct", "marker_id", "scoped_writer"]

SCOPES_DIR: Final = "streams"


def scoped_writer(writer: int, stream_id: int, kind: bytes = b"F") -> int:
    """The writer id of ``writer``'s markers of ``kind`` (F: forwarded, D: direct) in a stream."""
    raw = b"giaannd-scope-" + kind + int(writer).to_bytes(8, "little") + int(stream_id).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(raw)


def marker_id(origin: BatchId, stream_id: int) -> BatchId:
    """``F(b, s)``: origin ``b`` reached this node as a forwarded delta of stream ``s``."""
    return BatchId(scoped_writer(origin.writer, stream_id, b"F"), origin.seq)


def direct_marker_id(origin: BatchId, stream_id: int) -> BatchId:
    """``D(b, s)``: ``b`` reached this node directly with rows in stream ``s``'s columns."""
    return BatchId(scoped_writer(origin.writer, stream_id, b"D"), origin.seq)


class StreamScopes:
    """The columns each stream brought to this node, durable (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._columns: dict[int, NDArray[np.uint64]] = {}
        self._closed: set[int] = set()
        self._discarded: set[int] = set()
        self._sources: dict[int, str] = {}  # stream id -> the node that sends it, where known

    @classmethod
    def open(cls, data_dir: Path) -> StreamScopes:
        scopes = cls(data_dir / SCOPES_DIR)
        if scopes.directory.is_dir():
            for path in scopes.directory.glob("*.cols"):
                try:
                    sid = int(path.stem, 16)
                except ValueError:
                    continue
                if path.with_suffix(".discarded").exists():
                    scopes._discarded.add(sid)
                    continue
                raw = path.read_bytes()
                scopes._columns[sid] = unique(np.frombuffer(raw[: len(raw) // 8 * 8], np.uint64))
                if path.with_suffix(".closed").exists():
                    scopes._closed.add(sid)
                if path.with_suffix(".source").exists():
                    scopes._sources[sid] = path.with_suffix(".source").read_text("utf-8", "replace")
        return scopes

    def close(self, stream_id: int) -> None:
        """The stream's sender finished: no more forwarded deltas will come (durable)."""
        if stream_id in self._closed or stream_id not in self._columns:
            return
        with open(self.directory / f"{stream_id:016x}.closed", "wb") as f:
            os.fsync(f.fileno())
        fsync_dir(self.directory)  # the marker is its name: durable once the directory is synced
        self._closed.add(stream_id)

    def discard(self, stream_id: int) -> NDArray[np.uint64]:
        """Mark the stream discarded (durable before the return: a ``.discarded`` file, even for a
        stream that never recorded columns) and forget its scope; returns the columns it had."""
        cols = self._columns.pop(stream_id, np.zeros(0, np.uint64))
        self._closed.discard(stream_id)
        self._sources.pop(stream_id, None)
        if stream_id not in self._discarded:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.directory / f"{stream_id:016x}.discarded", "wb") as f:
                os.fsync(f.fileno())
            if not (self.directory / f"{stream_id:016x}.cols").exists():  # found at the next open
                with open(self.directory / f"{stream_id:016x}.cols", "wb") as f:
                    os.fsync(f.fileno())
            fsync_dir(self.directory)
            self._discarded.add(stream_id)
        return cols

    def is_discarded(self, stream_id: int) -> bool:
        return stream_id in self._discarded

    def open_streams(self) -> list[int]:
        """The streams that brought columns here and are neither closed nor discarded."""
        return [sid for sid in self._columns if sid not in self._closed]

    def set_source(self, stream_id: int, node: str) -> None:
        """Record (durably, once) that ``node`` sends ``stream_id`` ("": unknown, nothing is recorded)."""
        if not node or self._sources.get(stream_id) == node:
            return
        self.directory.mkdir(parents=True, exist_ok=True)  # (its name is synced by add_columns, next)
        atomic_write_bytes(self.directory / f"{stream_id:016x}.source", node.encode())
        self._sources[stream_id] = node

    def source_of(self, stream_id: int) -> str | None:
        """The node that sends ``stream_id``, if its hello named it."""
        return self._sources.get(stream_id)

    def open_streams_from(self, node: str) -> list[int]:
        """The open streams (``open_streams``) that ``node`` sends."""
        return [sid for sid in self.open_streams() if self._sources.get(sid) == node]

    def columns_of_open_streams(self, but: int) -> NDArray[np.uint64]:
        """The columns of every stream still open (not closed, not discarded) other than ``but``."""
        parts = [cols for sid, cols in self._columns.items() if sid != but and sid not in self._closed]
        return unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)

    def open_streams_touching(self, row_column: NDArray[np.uint64]) -> list[int]:
        return [sid for sid, cols in self._columns.items()
                if sid not in self._closed and bool(member(row_column, cols).any())]

    def add_columns(self, stream_id: int, columns: NDArray[np.uint64]) -> None:
        """Record (durably) that ``stream_id`` carries ``columns``."""
        have = self._columns.get(stream_id, np.zeros(0, np.uint64))
        new = missing(have, np.asarray(columns, np.uint64))
        if new.size == 0 and stream_id in self._columns:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{stream_id:016x}.cols"
        # whole or not at all: the file is read 8 bytes at a time, so a record cut short (a full
        # disk) under the retry's whole one would shift every later column id
        append_synced(path, new.tobytes())
        # a new file's (and a new directory's) name is durable only once its directory is synced:
        # else a power loss can drop the whole scope while the F markers it preceded stay logged.
        # Until the first record of the stream succeeded, not "when this call created them": a
        # first attempt whose fsync failed (a full disk, EIO) created them, and its retry must sync
        if stream_id not in self._columns:
            fsync_dir(self.directory.parent)
            fsync_dir(self.directory)
        self._columns[stream_id] = with_columns(have, new)

    def items(self) -> Iterator[tuple[int, NDArray[np.uint64]]]:
        return iter(self._columns.items())

    def __len__(self) -> int:
        return len(self._columns)


def filter_direct(batch_id: BatchId, batch: RowBatch, applied: AppliedSet, scopes: StreamScopes) -> RowBatch | None:
    """The part of a direct batch this node still needs, or None if it needs all of it."""
    keep: NDArray[np.bool_] | None = None
    for sid, cols in scopes.items():
        if marker_id(batch_id, sid) in applied:
            drop = member(batch.row_column, cols)
            keep = ~drop if keep is None else keep & ~drop
    if keep is None or keep.all():
        return None
    return batch.select_rows(keep)


def install_direct_filter(core: Any, scopes: StreamScopes, applied: Callable[[], AppliedSet]) -> None:
    """Wrap ``core.apply`` (StorageRequests) so direct batches pass ``filter_direct`` first and
    leave ``D`` markers for open streams (module docstring), and ``core.serve_during_fold`` so
    that such a batch is not held by a fold (it waits for the fold, then takes ``apply``).

    TODO(lead): a hook in ``StorageRequests.apply`` would replace this wrapper.
    """
    from giaannd import protocol as p
    from giaannd.storage.replication.requests import WaitDurable

    if getattr(core, "_stream_filter_installed", False):
        return
    serve_apply = core.apply

    def apply_filtered(msg: Any, bulk: Any) -> Any:
        if not (len(scopes) and isinstance(msg, p.ApplyBatch) and msg.hint_for in (None, core.node_name)):
            return serve_apply(msg, bulk)
        try:
            batch = p.check_batch(bulk)
        except p.ProtocolViolation:
            return serve_apply(msg, bulk)  # the core answers BadRequest
        bid = BatchId(msg.writer, msg.seq)
        reduced = filter_direct(bid, batch, applied(), scopes)
        kept = batch if reduced is None else reduced
        step = serve_apply(msg, bulk if reduced is None else reduced.buffers())
        # a duplicate (ack.applied False) too: after a crash, or a torn log tail, between the batch
        # and its D marker the writer retries (the ack waited for the marker), and that retry is
        # what writes the marker the restart lost (b in the applied set with rows in an open
        # stream's columns: only a direct batch of the new placement puts them there)
        if not (isinstance(step, WaitDurable) and bid in applied()):
            return step
        seq = step.seq
        for sid in scopes.open_streams_touching(kept.row_column):
            if direct_marker_id(bid, sid) in applied():
                continue
            try:
                seq = max(seq, core.store.apply(direct_marker_id(bid, sid), RowBatch.empty()).seq)
            except OSError as exc:
                # the batch is applied, its marker is not: refused, so the writer retries, and the
                # retry (a duplicate) writes the marker (an ack here left the delayed original
                # forwarded by the source to count twice)
                return core.error(p.Unavailable(f"stream dedupe marker not written: {exc}"))
            except ValueError:
                break  # the batch is applied; only the delayed-original dedupe is weakened
        return WaitDurable(seq, step.ack) if seq != step.seq else step

    serve_during_fold = core.serve_during_fold

    def during_fold_filtered(msg: Any, bulk: Any) -> Any:
        # A batch held during a fold (requests.py ``_defer``) is applied later without passing
        # ``apply_filtered``: rows already forwarded would count twice and no D marker be written
        # (and a forwarded delta waiting behind the fold has checked D already). So one that the
        # filter would reduce or mark is not held: it waits for the fold and is served live (None).
        if len(scopes) and isinstance(msg, p.ApplyBatch) and msg.hint_for in (None, core.node_name):
            try:
                batch = p.check_batch(bulk)
            except p.ProtocolViolation:
                return serve_during_fold(msg, bulk)  # the core answers BadRequest
            if (filter_direct(BatchId(msg.writer, msg.seq), batch, applied(), scopes) is not None
                    or scopes.open_streams_touching(batch.row_column)):
                return None
        return serve_during_fold(msg, bulk)

    core.apply = apply_filtered
    core.serve_during_fold = during_fold_filtered
    core._stream_filter_installed = True
