"""The receiving side of row streams: ``StreamEndpoint``, asyncio glue over streaming/stream.py's
``StreamReceiver`` (the storage role opens one per node, giaannd/storage/rebalance/daemon.py).

The endpoint listens on its own data-plane address: streams are not storage requests (they apply
under a stream writer id and bypass the ownership check, since the target does not own the rows
until cutover). Accepted items are applied through the service's group commit (``apply_local``);
the durable resume point is the store's applied-set floor of the stream writer. It also keeps the
per-stream dedupe state of streaming/dedupe.py and installs that module's filter on the service's
direct applies.

The same listener serves the *source-control* requests of source_control.py (a remote coordinator
starts, polls, pauses, closes and aborts streams this node sends; lists its columns; counts,
delivers and drops its hints): ``StreamEndpoint.sources`` is this node's ``SourceRegistry``.

Discarding streams (``DiscardStream``, ``DiscardStreamsFrom``, ``discard_idle``): the endpoint's
``discards``, stream_discard.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.errors import StoreFullError
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.rebalance.source_control import (
    ORPHAN_AFTER_S,
    DiscardStream,
    DiscardStreamsFrom,
    SourceRegistry,
    SourceRequest,
)
from giaannd.storage.rebalance.stream_discard import StreamDiscards
from giaannd.storage.repair.remote import RepairServer
from giaannd.storage.repair.wire import is_repair_request
from giaannd.storage.replication.disk_full import is_out_of_space
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.dedupe import StreamScopes, direct_marker_id, install_direct_filter, marker_id
from giaannd.storage.streaming.sender import (
    MAX_VERIFY_ROWS,
    _combined_digest,
    _digests,
    apply_local_nowait,
    digest_version_for,
    wait_durable,
)
from giaannd.storage.streaming.stream import (
    Accept,
    Duplicate,
    ItemKind,
    StreamData,
    StreamHello,
    StreamPosition,
    StreamReceiver,
    StreamRefused,
    StreamRequest,
    StreamVerify,
    VerifyReply,
    stream_writer,
)
from giaannd.storage.streaming.writers import record_stream_writer
from giaannd.unique import unique
from peers.errors import PeersError
from peers.transport import Incoming, Listener, Reply, Transport
from peers.wire import DECODE_ERRORS

__all__ = ["StreamEndpoint"]

log = logging.getLogger(__name__)

#: Stream items and source control share the endpoint (disjoint tags: streaming/stream.py, source_control.py).
_REQ_DECODER: Final = msgspec.msgpack.Decoder(StreamRequest | SourceRequest)
_ENC: Final = msgspec.msgpack.Encoder()

#: An open stream that sent this node nothing for this long is discarded (``discard_idle``): twice the
#: time after which its sources give it up as orphaned, so no live operation's stream is touched
#: (a paused operation's streams are aborted by their sources after ORPHAN_AFTER_S as well).
IDLE_STREAM_DISCARD_S: Final = 2 * ORPHAN_AFTER_S


def _reply(msg: msgspec.Struct, bulk: Sequence[Any] = ()) -> Reply:
    return Reply(_ENC.encode(msg), list(bulk))


class StreamEndpoint:
    """Receives streams for one storage service (module docstring)."""

    def __init__(self, service: StorageService, transport: Transport, address: str) -> None:
        self.service, self.transport, self.listen_address = service, transport, address
        self.listener: Listener | None = None
        self._receivers: dict[int, StreamReceiver] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        #: per stream, the update-log seq of the last item applied (a duplicate waits for it)
        self._applied_seq: dict[int, int] = {}
        #: per open stream, the bytes its sender said are still to come (``StreamHello.expected_bytes``,
        #: less the chunks applied since): what ``_hello`` reserves room for in the store
        self._expected: dict[int, int] = {}
        self.scopes = StreamScopes.open(service.data_dir)
        self.deltas_skipped = 0
        #: discards of this node's streams (stream_discard.py); they share the streams' locks
        self.discards = StreamDiscards(service, self.scopes, self._locks, store=self._store, forget=self._forget)
        #: monotonic time of the last stream or source-control request (release waits for quiet)
        self.last_activity = -1e18
        #: streams this node sends for remote coordinators (source_control.py)
        self.sources = SourceRegistry(service, transport)
        #: peers repairing themselves read this node's log and digests (repair/remote.py)
        self.repair = RepairServer(service)

    @property
    def address(self) -> str:
        assert self.listener is not None
        return self.listener.address

    async def open(self) -> StreamEndpoint:
        if self.service.core is None:
            raise RuntimeError("storage service is not open")
        install_direct_filter(self.service.core, self.scopes, lambda: self._store().store.applied)
        self.listener = await self.transport.listen(self.listen_address, self.handle)
        return self

    async def close(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(Exception):
                await self.listener.close()
            self.listener = None
        await self.sources.close()  # after the listener: a coordinator sees the node go, not an abort

    def _store(self) -> DurableStore:
        if self.service.store is None:
            raise RuntimeError("storage service is not open")
        return self.service.store

    async def handle(self, incoming: Incoming) -> Reply:
        if is_repair_request(incoming.payload):  # its own tag space (>= 200)
            return await self.repair.handle_incoming(incoming)
        self.last_activity = time.monotonic()
        try:
            msg = _REQ_DECODER.decode(incoming.payload)
        except DECODE_ERRORS as exc:
            return _reply(StreamRefused(0, 0, f"undecodable stream request: {exc}"[:400], fatal=True))
        if isinstance(msg, (DiscardStream, DiscardStreamsFrom)):
            return _reply(await self.discards.handle(msg))
        if not isinstance(msg, (StreamHello, StreamData, StreamVerify)):  # source control
            try:
                reply, bulk = await self.sources.handle(msg, incoming.bulk)
            except (ValueError, RuntimeError) as exc:
                return _reply(StreamRefused(0, 0, f"{type(exc).__name__}: {exc}"[:400], fatal=True))
            except OSError as exc:  # (the hint log: DropHints)
                return _reply(self._disk_failed(0, exc))
            return _reply(reply, bulk)
        self.discards.seen[msg.stream_id] = self.last_activity
        if self.scopes.is_discarded(msg.stream_id):
            return _reply(StreamRefused(msg.stream_id, 0, (
                f"stream {msg.stream_id:#x} was discarded here (its operation was abandoned before the "
                "cutover and the rows it brought were dropped): start a new operation"), fatal=True))
        try:
            if isinstance(msg, StreamHello):
                return self._hello(msg, incoming.bulk)
            if isinstance(msg, StreamData):
                return await self._data(msg, incoming.bulk)
            return self._verify(msg, incoming.bulk)
        except (ValueError, RuntimeError) as exc:
            return _reply(StreamRefused(msg.stream_id, 0, f"{type(exc).__name__}: {exc}"[:400], fatal=True))
        except OSError as exc:  # the update log, the stream's scope, the stream-writers file
            return _reply(self._disk_failed(msg.stream_id, exc))

    def _disk_failed(self, stream_id: int, exc: OSError) -> StreamRefused:
        """A write of this node's failed: a fatal refusal that says so. Left to the transport, the
        error got the sender no reply at all (it drops a handler's OSError as its own connection
        going away): the stream took the receiver for unreachable and retried until the stream
        timeout, an hour. Failing the stream fails the operation, whose clean-up drops what its
        streams brought here. ENOSPC puts the node in the disk-full state, as the update log's
        own writes do (replication/disk_full.py).

        Raises:
            OSError: a connection's error (``PeersError``), not this node's disk: as before.
        """
        if isinstance(exc, PeersError):
            raise exc
        self.service.disk.write_failed("stream", exc)
        name = errno.errorcode.get(exc.errno or 0, "OSError")
        if is_out_of_space(exc):
            why = (f"{self.service.node_name} is full: its disk has no space left ({name}: {exc}); free space "
                   "on its data directory's file system, then run the operation again")
        else:
            why = (f"{self.service.node_name}'s disk failed ({name}: {exc}); check the disk of its data "
                   "directory, then run the operation again")
        return StreamRefused(stream_id, 0, why[:400], fatal=True)

    def _receiver(self, stream_id: int) -> StreamReceiver:
        rx = self._receivers.get(stream_id)
        if rx is None:
            floor = self._store().store.applied.floor(stream_writer(stream_id))
            rx = self._receivers[stream_id] = StreamReceiver(stream_id, floor)
        return rx

    def _hello(self, msg: StreamHello, bulk: Sequence[np.ndarray]) -> Reply:
        rx = self._receiver(msg.stream_id)
        if msg.closing:
            if self._expected.pop(msg.stream_id, None) is not None and not self._expected:
                self._store().store.allow_huge_pages()  # the room reserved below is filled
            self.scopes.close(msg.stream_id)
            self._store().store.append_writers.discard(rx.writer)
            return _reply(StreamPosition(msg.stream_id, rx.next_index))
        if len(bulk) != 1 or bulk[0].dtype != np.uint64 or bulk[0].ndim != 1:
            return _reply(StreamRefused(msg.stream_id, rx.next_index,
                                        "hello: expected one 1-d uint64 array of columns", fatal=True))
        if rx.next_index > 0 and msg.first:
            return _reply(StreamRefused(msg.stream_id, rx.next_index, (
                f"stream {msg.stream_id:#x} was started here by another sender ({rx.next_index} items "
                "applied); a new sender's chunks are other cuts of the rows and cannot continue it "
                "(the source restarted?): the operation fails, this node drops what its streams "
                "brought, and it can then be run again"),
                fatal=True))
        if rx.next_apply == 0 and msg.fresh:
            # rows of these columns though no item of this stream was applied here, durable or not
            # (a reconnect before the first items were synced finds the rows they brought: those
            # are this stream's own, and it resumes)
            stale = int(self._store().store.rows_of_columns(bulk[0])[0].size)
            if stale:
                return _reply(StreamRefused(msg.stream_id, 0, self._stale_rows(stale), fatal=True))
        record_stream_writer(self.service, rx.writer)
        # its items bring rows this node does not hold yet (a chunk: all of them, unless dual
        # writes made some): those go straight into the store's base (ColumnStore.append_writers)
        self._store().store.append_writers.add(rx.writer)
        self.scopes.set_source(msg.stream_id, msg.source_node)  # before its columns (DiscardStreamsFrom)
        self.scopes.add_columns(msg.stream_id, bulk[0])
        if msg.expected_bytes:
            # room in the base for what every open stream still brings (several sources stream to a
            # joining node at once): the chunks then land without regrowing the base. A hint: not
            # while a fold moves the base (it would wait for the fold with the event loop blocked;
            # the next stream's open or the chunks' own merges make the room then)
            self._expected[msg.stream_id] = msg.expected_bytes
            folds = self.service.folds
            if folds is None or not folds.running:
                self._store().store.reserve(sum(self._expected.values()))
        return _reply(StreamPosition(msg.stream_id, rx.next_index))

    def _stale_rows(self, stale: int) -> str:
        """Why a fresh stream is refused for ``stale`` rows of its columns held here, with advice
        that fits this node: a standby (joining) node holds nothing else, and may be wiped and
        joined again; an active member holds replicas of other columns, which a wipe would
        destroy (it used to be given the same advice)."""
        why = (f"this node already holds {stale} rows of the streamed columns from an earlier stream that "
               "was abandoned but not discarded (its coordinator did not reach this node, or stopped); "
               "rows are sums and cannot be replaced in place: ")
        topology = self.service.topology
        if topology is None or self.service.node_name not in topology.placement.names:
            return why + "wipe this node's data directory and join it again"
        return why + (
            f"{self.service.node_name} is an active storage member holding replicas, so do not wipe its data "
            f"directory: its idle-stream sweep drops those rows {IDLE_STREAM_DISCARD_S / 3600:g} h after that "
            "stream's last item (and the rows of columns it gave away, storage.release-delay-s after that "
            "ring change); then run the operation again")

    async def discard_idle(self, idle_s: float = IDLE_STREAM_DISCARD_S, now: float | None = None) -> list[int]:
        """Discard every open stream that sent this node nothing for ``idle_s``; returns their ids
        (stream_discard.py, ``StreamDiscards.idle``)."""
        return await self.discards.idle(idle_s, now)

    @property
    def idle_discarded(self) -> int:
        """Streams ``discard_idle`` discarded."""
        return self.discards.idle_discarded

    def _forget(self, stream_id: int) -> None:
        """Drop what this endpoint keeps of a discarded stream (``StreamDiscards``, under its lock)."""
        self._receivers.pop(stream_id, None)
        self._expected.pop(stream_id, None)
        self._applied_seq.pop(stream_id, None)
        self._store().store.append_writers.discard(stream_writer(stream_id))

    async def _data(self, msg: StreamData, bulk: Sequence[np.ndarray]) -> Reply:
        """Apply item ``msg.index`` in order, then acknowledge it once durable (streaming/stream.py,
        "Pipelining"): the lock covers the apply only, so the next item of the window is applied
        while this one waits for the fsync it shares with it."""
        rx = self._receiver(msg.stream_id)
        lock = self._locks.setdefault(msg.stream_id, asyncio.Lock())
        async with lock:  # one item of a stream at a time: items apply strictly in order
            if self.scopes.is_discarded(msg.stream_id):  # discarded while this item waited for the lock
                return _reply(StreamRefused(msg.stream_id, 0, (
                    f"stream {msg.stream_id:#x} was discarded here while this item waited: start a new "
                    "operation"), fatal=True))
            try:
                batch = RowBatch.from_buffers(list(bulk), validate=True)
            except ValueError as exc:
                return _reply(StreamRefused(msg.stream_id, rx.next_index, f"bad rows: {exc}"[:400]))
            if any(origin_seq < 1 for _, origin_seq in msg.origins):  # (seqs count from 1)
                return _reply(StreamRefused(msg.stream_id, rx.next_index, "bad origins: a seq of 0", fatal=True))
            decision = rx.check(msg.index, msg.kind, msg.checksum, batch)
            if isinstance(decision, Duplicate):  # applied; answer once everything applied is durable
                index, seq = rx.next_apply - 1, self._applied_seq.get(msg.stream_id, 0)
            elif not isinstance(decision, Accept):
                return _reply(StreamRefused(msg.stream_id, decision.next_index, decision.reason))
            else:
                try:
                    seq = await self._apply_item(msg, decision, batch)
                except StoreFullError as exc:
                    return _reply(StreamRefused(msg.stream_id, rx.next_index, f"store full: {exc}"[:400],
                                                fatal=True))
                index = decision.index
                rx.accepted(index)
                left = self._expected.pop(msg.stream_id, 0) - batch.nbytes
                if left > 0:  # all that was announced has come: nothing more to reserve for it
                    self._expected[msg.stream_id] = left
                self._applied_seq[msg.stream_id] = seq
        await wait_durable(self.service, seq)
        rx.applied(index)
        return _reply(StreamPosition(msg.stream_id, rx.next_index))

    async def _apply_item(self, msg: StreamData, decision: Accept, batch: RowBatch) -> int:
        """Apply one accepted item (not waiting for durability); the log seq that covers it."""
        seq = 0
        if msg.kind == ItemKind.DELTA and msg.origin_seq:
            # streaming/dedupe.py: the writer's retry may have come first (apply nothing), or
            # may come later (mark the origin first, so the retry drops these rows)
            origin = BatchId(msg.origin_writer, msg.origin_seq)
            if direct_marker_id(origin, msg.stream_id) in self._store().store.applied:
                batch = RowBatch.empty()
                self.deltas_skipped += 1
            else:
                self.scopes.add_columns(msg.stream_id, unique(batch.row_column))
                seq = (await apply_local_nowait(self.service, marker_id(origin, msg.stream_id),
                                                RowBatch.empty())).seq
        elif msg.kind == ItemKind.CHUNK and msg.origins:
            # streaming/dedupe.py, "Chunks": the batches in these rows are marked first, so a
            # share of one coming later (a hint re-split, a retry) drops its rows in the stream's
            # columns; a resumed stream re-sends the chunk and finds them marked
            self.scopes.add_columns(msg.stream_id, unique(batch.row_column))
            applied = self._store().store.applied
            for writer, origin_seq in msg.origins:
                marker = marker_id(BatchId(writer, origin_seq), msg.stream_id)
                if marker not in applied:
                    seq = (await apply_local_nowait(self.service, marker, RowBatch.empty())).seq
        # (validated once, by from_buffers: the store need not check it again)
        result = await apply_local_nowait(self.service, decision.batch_id, batch, validate=False)
        return max(seq, result.seq)

    def _verify(self, msg: StreamVerify, bulk: Sequence[np.ndarray]) -> Reply:
        # 1-d uint64 only, as protocol.check_keys: keys of another dtype were cast (floats to
        # garbage keys, silently) and 2-d ones raised in the per-row digests instead of a refusal
        if (len(bulk) != 2 or any(b.dtype != np.uint64 or b.ndim != 1 for b in bulk)
                or bulk[0].shape != bulk[1].shape or bulk[0].size > MAX_VERIFY_ROWS):
            return _reply(StreamRefused(msg.stream_id, 0, "verify: expected two equal 1-d u64 key arrays"))
        cols, feats = bulk
        if msg.combined:
            version = digest_version_for(msg.digest_version)
            return _reply(VerifyReply(digest_version=version),
                          list(_combined_digest(self._store(), cols, feats, version)))
        return _reply(VerifyReply(), list(_digests(self._store(), cols, feats)))

