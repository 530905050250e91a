"""Resumable, checksummed row streams between storage nodes (join, decommission, removenode).

Theory of operation
-------------------
A *stream* moves the rows of a set of columns from one source node to one target node while the
source keeps serving and applying writes. It is an ordered sequence of *items*, numbered 0, 1, 2...:

- ``CHUNK``: the rows of the next slice of the source's row keys (sorted), read in one synchronous
  call, so a chunk is a consistent cut of those rows;
- ``DELTA``: a batch the source applied *after* the stream opened, restricted to the rows the
  stream has already read (``StreamSender.offer_delta``). Rows not read yet are left out: the chunk
  that reads them later includes the batch. Rows created after the stream opened are always
  forwarded (no chunk will read them).

The receiver applies item ``n`` to its store as the batch ``BatchId(stream_writer, n + 1)`` — strictly
in order, so the store's applied-set *floor* for ``stream_writer`` is exactly the number of items
applied. That floor is the durable resume point: it is in the receiver's update log (and snapshots)
like every batch id, so a receiver killed mid-stream restarts, recovers, and answers the next
``StreamHello`` with ``next_index = floor``; the sender rewinds to it. At most the items in flight
when the receiver died (the sender's *window*) are sent twice, and those that had been applied are
ignored (idempotent batch id).

**Pipelining.** The sender keeps up to ``window`` items on the wire (``storage.stream-window``).
The receiver applies them in order as they arrive (``StreamReceiver.accepted``: the *apply
point*, ahead of the resume point) and acknowledges each once it is durable
(``StreamReceiver.applied``): items applied close together share one fsync of the update log
(its group commit), and since the log is fsynced in order, an acknowledged position is always
a durable prefix. Acknowledgements are cumulative (``StreamPosition.next_index``), so a lost or
reordered reply costs nothing. A receiver killed with items applied but not yet durable recovers
to whatever prefix of them reached the log: the floor, never a gap.

**Room on the receiver.** A hello carries the bytes the sender still has to send
(``StreamHello.expected_bytes``, its estimate); the receiver reserves room for what all its open
streams still bring in its store's base (``ColumnStore.reserve``, capped by its free capacity), so
the chunks, all new rows, land by slice copies into that room instead of regrowing the base as it
fills (rebalance/endpoint.py). A hint only: nothing depends on it being right. An item's rows the
receiver does not hold go straight into that base (``ColumnStore.append_writers``: no delta run,
no fold); rows it holds (dual writes) merge as any batch's.

Why this gives the receiver *exactly* the source's rows: a chunk lands on rows the receiver does not
have (checked when the stream opens), so it is a copy; every later change of those rows at the
source is one applied batch, forwarded as a DELTA in the order the source applied it, and the
receiver applies the same float additions in the same order: bit-identical strengths. No row is
merged by "max" (rows are sums), and no original batch id is reused on the receiver (its applied set
is per node, and one original batch's rows reach it from several sources; see docs/topology.md).

**A row larger than a chunk** is read whole, in the same synchronous call (a consistent cut: one
copy of it on the source while its parts are unacknowledged), and cut by entries into *parts*:
consecutive CHUNK items of that one row, each a canonical row of consecutive entries, made
together so no delta can come between them. The receiver applies them in order like any chunk:
the first creates the row, each next one lies wholly after the entries before it, which the store
applies as an append (row_merge.py: slice copies, no merge). A part holds as many entries as the
parts before it together (at least a chunk), up to ``MAX_PART_BYTES``: the receiver's regrowths
then copy the row about twice in all instead of once per chunk, and the part count stays near
log2(row / chunk) + row / MAX_PART_BYTES. Parts count toward ``pending_bytes`` but not toward the
``max_pending_bytes`` abort (they are one copy of a row the source holds anyway; only deltas, which
a slow receiver lets pile up, do).

Every item carries an xxh3-64 checksum over (stream id, index, kind, the seven buffers); the receiver
verifies it before anything is applied and refuses a bad item (the sender re-sends it).

States of the sender: OPEN (chunks left) → DRAINING (all chunks read; deltas may still arrive while
the source owns the columns) → CLOSED (``close()``: no more deltas; done once everything is acked).
Everything that decides what is sent or applied lives in this file; the glue (rebalance/operations.py) does
the reading, sending and applying.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Final

import msgspec
import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.errors import RemoteFault
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.storage.streaming.column_sets import member, with_columns
from giaannd.unique import unique

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_PART_BYTES",
    "MAX_PENDING_BYTES",
    "ItemKind",
    "StreamData",
    "StreamHello",
    "StreamItem",
    "StreamPosition",
    "StreamReceiver",
    "StreamRefused",
    "StreamSender",
    "StreamTooSlow",
    "StreamVerify",
    "VerifyReply",
    "cut_row",
    "item_checksum",
    "stream_writer",
]

#: Target bytes per chunk: large enough that per-request overhead (one round trip, one fsync shared
#: by the group commit) is amortised, small enough that a re-sent chunk after a receiver crash is
#: cheap and a chunk fits the protocol's batch limits many times over.
DEFAULT_CHUNK_BYTES: Final = 4 * 2**20
#: Unacknowledged items (chunks + forwarded deltas) a sender may hold. Deltas are produced by the
#: source's own writes, which cannot be slowed down by a slow receiver, so past this the stream is
#: aborted (``StreamTooSlow``) and restarted later rather than growing without bound.
MAX_PENDING_BYTES: Final = 256 * 2**20
#: Largest part of a row cut into parts (module docstring): far under the update log's 1 GiB record
#: and the framing's 2 GiB buffer limits, and the most the receiver holds of a part besides the row.
MAX_PART_BYTES: Final = 256 * 2**20
_ENTRY_BYTES: Final = 21  # one entry on the wire: u64 + u64 + f32 + u8
#: the most origins one chunk names (StreamData.origins): ids in flight, far below this
MAX_CHUNK_ORIGINS: Final = 2**20
_U64 = Annotated[int, msgspec.Meta(ge=0)]
_U64_MASK: Final = 0xFFFFFFFFFFFFFFFF


class ItemKind(IntEnum):
    CHUNK = 1
    DELTA = 2


class StreamTooSlow(RemoteFault):
    """The receiver acknowledges more slowly than the source's writes produce deltas."""

    reason = "stream_too_slow"


# -- messages on the stream endpoint (own tag space; append only) -------------------------------
class StreamHello(msgspec.Struct, frozen=True, tag=1):
    """Open or resume a stream. ``columns`` in bulk (u64). Reply: ``StreamPosition``."""

    stream_id: _U64
    source: str
    fresh: bool = True  # index 0: the receiver must hold no rows of these columns
    closing: bool = False  # the sender finished: no more items (streaming/dedupe.py)
    #: this sender never connected before: it cannot continue a sequence the receiver already
    #: started (another sender's, e.g. before the source restarted: its chunks were other cuts)
    first: bool = False
    #: bytes of rows the sender still has to send (its estimate; 0: unknown): the receiver makes
    #: room for them in its store's base up front (``ColumnStore.reserve``, capped by its free
    #: capacity) instead of regrowing the base as the chunks land
    expected_bytes: _U64 = 0
    #: the source node's name (``source`` is a label): the receiver records it with the stream's
    #: scope, so that a removenode or replace of that node, dead, discards the stream
    #: (``DiscardStreamsFrom``, rebalance/stream_discard.py). "": a sender older than the field (unknown)
    source_node: str = ""


class StreamData(msgspec.Struct, frozen=True, tag=2):
    """Item ``index`` (7 RowBatch buffers in bulk). Reply: ``StreamPosition`` or ``StreamRefused``."""

    stream_id: _U64
    index: _U64
    kind: int
    checksum: _U64
    origin_writer: _U64 = 0
    origin_seq: _U64 = 0
    #: a CHUNK's origins: (writer, seq) of batches a share may still come for at the receiver, whose
    #: rows in the stream's columns the stream brings, each named once (streaming/dedupe.py,
    #: "Chunks"). Appended: a
    #: receiver without the field ignores it (and may then count such a share twice, as before)
    origins: Annotated[tuple[tuple[_U64, _U64], ...], msgspec.Meta(max_length=MAX_CHUNK_ORIGINS)] = ()


class StreamVerify(msgspec.Struct, frozen=True, tag=3):
    """Row digests on the receiver (keys in bulk: u64 columns, u64 features). Reply: VerifyReply."""

    stream_id: _U64
    #: one digest over all the rows (``ColumnStore.rows_digest``) instead of one per row
    combined: bool = False
    #: the ``rows_digest`` version asked for (row_digest.py). A receiver that does not know this
    #: field hashes version 1 and its reply says so (``VerifyReply.digest_version`` absent: 1),
    #: so the sender compares only digests of one version.
    digest_version: int = 1


class StreamPosition(msgspec.Struct, frozen=True, tag=64):
    """The receiver's next expected index (= items durably applied)."""

    stream_id: _U64
    next_index: _U64


class StreamRefused(msgspec.Struct, frozen=True, tag=65):
    """The item was not applied (bad checksum, gap, unknown stream, precondition)."""

    stream_id: _U64
    next_index: _U64
    reason: str
    fatal: bool = False


class VerifyReply(msgspec.Struct, frozen=True, tag=66):
    """Bulk: present u8[K], keys-digest u64[K], strength-digest u64[K]; for a ``combined`` request
    present u8[K] and rows-digest u64[1], hashed in ``digest_version`` (the version asked for if
    the receiver knows it, else the newest it knows below it; 1 from a receiver older than the field)."""

    digest_version: int = 1


StreamRequest = StreamHello | StreamData | StreamVerify
StreamReply = StreamPosition | StreamRefused | VerifyReply


def stream_writer(stream_id: int) -> int:
    """The writer id under which the receiver applies a stream's items. Distinct from every
    training writer with probability 1 - 2**-64 (both are random 64-bit values)."""
    return xxhash.xxh3_64_intdigest(b"giaannd-stream\x00" + int(stream_id).to_bytes(8, "little"))


def item_checksum(stream_id: int, index: int, kind: int, batch: RowBatch) -> int:
    h = xxhash.xxh3_64()
    h.update(np.array([stream_id & _U64_MASK, index, kind], np.uint64).tobytes())
    for buf in batch.buffers():
        h.update(np.ascontiguousarray(buf).data)
    return h.intdigest()


@dataclass(frozen=True, eq=False)
class StreamItem:
    index: int
    kind: ItemKind
    batch: RowBatch
    checksum: int
    origin: BatchId | None = None
    part: bool = False  # one part of a row cut into parts (module docstring)
    #: a chunk's origins (StreamData.origins)
    origins: tuple[BatchId, ...] = ()


def cut_row(row: RowBatch, first_entries: int, max_entries: int) -> list[RowBatch]:
    """The one row of ``row`` as consecutive parts, each a one-row batch of views: ``first_entries``,
    then each part as long as all before it together, at most ``max_entries`` (module docstring)."""
    n = row.num_entries
    bounds = [0]
    while bounds[-1] < n:
        done = bounds[-1]
        bounds.append(min(n, done + min(max_entries, max(first_entries, done))))
    rc, rf = row.row_column[:1], row.row_feature[:1]
    return [RowBatch(rc, rf, np.array([0, b - a], np.int64), row.segment[a:b], row.target_column[a:b],
                     row.target_feature[a:b], row.strength[a:b]) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class Accept:
    """Apply ``batch`` as ``batch_id`` durably, then call ``StreamReceiver.applied(index)``."""

    index: int
    batch_id: BatchId


@dataclass(frozen=True)
class Duplicate:
    """Already applied: answer the current position."""

    next_index: int


@dataclass(frozen=True)
class Refuse:
    reason: str
    next_index: int


class StreamReceiver:
    """Receiver side of one stream (module docstring).

    Args:
        stream_id: the stream.
        next_index: the durable resume point (``applied.floor(stream_writer(stream_id))``).
    """

    def __init__(self, stream_id: int, next_index: int) -> None:
        self.stream_id = stream_id
        self.writer = stream_writer(stream_id)
        self.next_index = next_index  # durable: the resume point, what is acknowledged
        self.next_apply = next_index  # applied (maybe not durable yet): the next item to apply
        self.items_refused = 0

    def check(self, index: int, kind: int, checksum: int, batch: RowBatch) -> Accept | Duplicate | Refuse:
        """Decide what to do with one item; changes nothing until ``accepted``/``applied``.
        A ``Duplicate`` may be applied but not durable yet: answer once it is."""
        if index < self.next_apply:
            return Duplicate(self.next_index)
        if index > self.next_apply:
            self.items_refused += 1
            return Refuse(f"gap: expected item {self.next_apply}, got {index}", self.next_index)
        if kind not in (ItemKind.CHUNK, ItemKind.DELTA):
            self.items_refused += 1
            return Refuse(f"unknown item kind {kind}", self.next_index)
        if item_checksum(self.stream_id, index, kind, batch) != checksum:
            self.items_refused += 1
            return Refuse(f"checksum mismatch on item {index}", self.next_index)
        return Accept(index, BatchId(self.writer, index + 1))

    def accepted(self, index: int) -> None:
        """Item ``index`` is applied to the store, not durable yet: the next one may be applied."""
        if index == self.next_apply:
            self.next_apply += 1

    def applied(self, index: int) -> None:
        """Items up to ``index`` are durably applied (the log is fsynced in order: a prefix)."""
        if index >= self.next_index:
            self.next_index = index + 1
            self.next_apply = max(self.next_apply, self.next_index)


RowReader = Callable[[NDArray[np.uint64], NDArray[np.uint64]], RowBatch]


class StreamSender:
    """Sender side of one stream (module docstring).

    Args:
        stream_id: the stream.
        columns: the columns streamed (any order).
        claims: for a column not in ``columns`` (created after the stream opened), whether this
            stream carries it (rebalance.TransferRule.claims); None: only ``columns``.
        row_columns, row_features: the row keys of those columns at the source when the stream
            opens, sorted by (column, feature).
        chunk_bytes: target chunk size.
        window: items in flight at once (1: a receiver crash re-sends at most one item).
        max_pending_bytes: see MAX_PENDING_BYTES.
    """

    def __init__(self, stream_id: int, columns: NDArray[np.uint64], row_columns: NDArray[np.uint64],
                 row_features: NDArray[np.uint64], row_bytes: NDArray[np.int64] | None = None, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, window: int = 1,
                 max_pending_bytes: int = MAX_PENDING_BYTES,
                 claims: Callable[[NDArray[np.uint64]], NDArray[np.bool_]] | None = None,
                 origins_of: Callable[[NDArray[np.uint64]], list[BatchId]] | None = None) -> None:
        if window < 1 or chunk_bytes < 1:
            raise ValueError("window and chunk_bytes must be >= 1")
        self.stream_id = stream_id
        self.columns = unique(np.asarray(columns, np.uint64))
        self._claims = claims
        #: ids the next chunk names (streaming/dedupe.py, "Chunks"): those a share may still come
        #: for among the stream's columns when it opens (``origins_of``, AppliedSet.touching, asked
        #: once: it is a pass over every id in flight), then each later batch whose rows in them
        #: were left for a chunk (``offer_delta``); none without ``origins_of``
        self._names = origins_of is not None
        self._to_name: list[BatchId] = list(origins_of(self.columns)) if origins_of is not None else []
        self._named: set[BatchId] = set()  # named by an item already
        self._keys_c = np.asarray(row_columns, np.uint64)
        self._keys_f = np.asarray(row_features, np.uint64)
        #: row key -> position in the key list (a compiled hash index over the key arrays, 16-32 B
        #: a row: a Python dict cost ~10x that and a Python loop per delta row); built on the first
        #: delta that needs it (most streams see few)
        self._pos: KeyIndex | None = None
        sizes = (np.asarray(row_bytes, np.int64) if row_bytes is not None
                 else np.full(self._keys_c.size, 64, np.int64))
        #: the bytes of rows [0, i] of the key list: where each chunk ends, by one binary search
        #: (until Dec 1 each chunk summed the sizes of every row left: O(rows) a chunk, 10^7 rows
        #: of 50 entries at 4 MiB a chunk ~2,500 sums of millions of rows)
        self._row_ends = np.cumsum(sizes)
        self.total_bytes_estimate = int(self._row_ends[-1]) if self._row_ends.shape[0] else 0
        self.chunk_bytes, self.window, self.max_pending_bytes = chunk_bytes, window, max_pending_bytes
        self.cursor = 0  # rows [0, cursor) of the key list have been read into chunks
        self.next_index = 0  # next index to assign
        self.acked = 0  # receiver's next expected index
        self._send_from = 0  # lowest index not yet sent (rewinds on resume)
        self._pending: deque[StreamItem] = deque()
        self.pending_bytes = 0
        self._part_bytes = 0  # of pending_bytes: parts of cut rows (module docstring)
        self.parts = 0  # items that were parts of a cut row
        self.closed = False
        self.bytes_acked = 0
        self.deltas = 0

    # -- producing items ----------------------------------------------------------------------------
    @property
    def keys(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """The row keys the stream opened with, sorted (views; do not mutate): chunks are slices of them."""
        return self._keys_c, self._keys_f

    @property
    def chunks_left(self) -> bool:
        return self.cursor < self._keys_c.size

    def _push(self, kind: ItemKind, batch: RowBatch, origin: BatchId | None, part: bool = False,
              origins: tuple[BatchId, ...] = ()) -> None:
        item = StreamItem(self.next_index, kind, batch,
                          item_checksum(self.stream_id, self.next_index, kind, batch), origin, part, origins)
        self.next_index += 1
        self._pending.append(item)
        self.pending_bytes += batch.nbytes
        if part:
            self._part_bytes += batch.nbytes
            self.parts += 1
        if self.pending_bytes - self._part_bytes > self.max_pending_bytes:
            raise StreamTooSlow(f"stream {self.stream_id:#x}: {self.pending_bytes} bytes unacknowledged")

    def read_chunk(self, read: RowReader, max_bytes: int | None = None) -> StreamItem | None:
        """Read the next slice of rows (``read`` must be synchronous: the cut is consistent), of
        about ``chunk_bytes``, or ``max_bytes`` if smaller (a throttled stream's smaller chunks)."""
        if not self.chunks_left:
            return None
        start = self.cursor
        limit = self.chunk_bytes if max_bytes is None else max(1, min(self.chunk_bytes, max_bytes))
        # the rows from ``start`` whose sizes add up to at most ``limit`` (at least one): the rows
        # before it end at or below ``before`` (sizes are not negative), so they count and are taken off
        before = int(self._row_ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(self._row_ends, before + limit, side="right")))
        batch = read(self._keys_c[start:stop], self._keys_f[start:stop])
        origins = self._chunk_origins()
        self.cursor = stop
        first = self.next_index
        if batch.num_rows == 1 and batch.num_entries * _ENTRY_BYTES > limit:
            parts = cut_row(batch, max(1, limit // _ENTRY_BYTES), max(1, MAX_PART_BYTES // _ENTRY_BYTES))
            for i, part in enumerate(parts):  # (the first part names them: the receiver marks them first)
                self._push(ItemKind.CHUNK, part, None, part=True, origins=origins if i == 0 else ())
        else:
            self._push(ItemKind.CHUNK, batch, None, origins=origins)
        return self._pending[-(self.next_index - first)]

    def _chunk_origins(self) -> tuple[BatchId, ...]:
        """The ids the chunk read now names: those waiting (``_to_name``), each once per stream,
        at most ``MAX_CHUNK_ORIGINS`` (the rest wait for the next chunk)."""
        found = [b for b in dict.fromkeys(self._to_name) if b not in self._named]
        found, self._to_name = found[:MAX_CHUNK_ORIGINS], found[MAX_CHUNK_ORIGINS:]
        self._named.update(found)
        return tuple(found)

    def offer_delta(self, batch_id: BatchId, batch: RowBatch) -> bool:
        """The source applied ``batch``: forward the part the receiver must see (module docstring).
        Call synchronously after the source's apply. Returns True if an item was made.

        Raises:
            StreamTooSlow: past ``max_pending_bytes``.
        """
        if self.closed or batch.num_rows == 0:
            return False
        mask = member(batch.row_column, self.columns)
        if self._claims is not None and not mask.all():
            other = unique(batch.row_column[~mask])
            new_cols = other[self._claims(other)]
            if new_cols.size:  # columns born after the stream opened: all their rows are new
                self.columns = with_columns(self.columns, new_cols)
                mask = member(batch.row_column, self.columns)
        if not mask.any():
            return False
        if self.chunks_left:  # (all chunks read: no row is left for a later chunk)
            if self._pos is None:
                self._pos = KeyIndex.from_keys(self._keys_c, self._keys_f)
            rows = np.flatnonzero(mask)
            pos = self._pos.lookup(batch.row_column[rows], batch.row_feature[rows])  # -1: not listed
            later = pos >= self.cursor
            mask[rows[later]] = False  # a later chunk reads these rows, batch included
            if self._names and later.any() and batch_id not in self._named:
                self._to_name.append(batch_id)  # (and names it: streaming/dedupe.py, "Chunks")
            if not mask.any():
                return False
        self._push(ItemKind.DELTA, batch.select_rows(mask), batch_id)
        self.deltas += 1
        return True

    def close(self) -> None:
        """No more deltas (the source no longer accepts writes for these columns)."""
        self.closed = True

    # -- sending ------------------------------------------------------------------------------------
    def next_to_send(self) -> StreamItem | None:
        """The next item to send, if the window allows."""
        if self._send_from - self.acked >= self.window:
            return None
        for item in self._pending:
            if item.index >= self._send_from:
                self._send_from = item.index + 1
                return item
        return None

    def on_position(self, next_index: int) -> list[StreamItem]:
        """The receiver says it applied everything below ``next_index``. Returns the items that
        this acknowledged (dropped here: never sent again; their buffers may be reused).

        Raises:
            ValueError: the receiver claims items that were never made (a different stream).
        """
        if next_index > self.next_index:
            raise ValueError(f"receiver at {next_index}, but only {self.next_index} items exist")
        acked = []
        while self._pending and self._pending[0].index < next_index:
            item = self._pending.popleft()
            self.pending_bytes -= item.batch.nbytes
            if item.part:
                self._part_bytes -= item.batch.nbytes
            self.bytes_acked += item.batch.nbytes
            acked.append(item)
        self.acked = max(self.acked, next_index)
        self._send_from = max(self._send_from, self.acked)
        return acked

    def rewind(self, next_index: int) -> list[StreamItem]:
        """After a reconnect / refusal: resend from the receiver's position. Returns the items
        this acknowledged (``on_position``).

        Raises:
            ValueError: the receiver is behind an index it already acknowledged (it lost durable
                state: the stream cannot be resumed, only restarted).
        """
        if next_index < self.acked:
            raise ValueError(f"receiver went back from {self.acked} to {next_index}: state lost")
        acked = self.on_position(next_index)
        self._send_from = next_index
        return acked

    @property
    def sent_upto(self) -> int:
        """Items below this index have been sent at least once."""
        return self._send_from

    @property
    def in_flight(self) -> int:
        return self._send_from - self.acked

    @property
    def unsent(self) -> int:
        """Items made but not sent yet (waiting for the window)."""
        return self.next_index - self._send_from

    @property
    def idle(self) -> bool:
        """Everything made so far is acknowledged."""
        return not self._pending

    @property
    def done(self) -> bool:
        return self.closed and not self.chunks_left and not self._pending
