"""Asyncio glue for the sending side of row streams (streaming/stream.py) and the local store access
both sides share. The receiving side is rebalance/endpoint.py.

Glue only: what is sent is decided by ``StreamSender``. This module owns the sockets, the clock
(throttle, retries, progress rates) and the local store access:

- ``observe_applies(service)`` wraps the source service's store so every applied batch is offered
  to the open streams (the DELTA items) synchronously, right after the apply, on the event loop;
- ``apply_local`` applies on a node's own store through its group commit, without the ownership
  check (stream items, repair shares);
- ``StreamRunner`` drives one stream: hello/resume, chunk reads (smaller chunks when throttled),
  up to ``storage.stream-window`` items on the wire at once, their replies handled oldest first
  (cumulative positions; a refusal or a lost connection drops the rest and rewinds to the
  receiver's durable position; streaming/stream.py "Pipelining"), send with a runtime throttle
  (a token bucket, ``peers.token_bucket``), reconnect with full-jitter backoff (``peers.retry``),
  verification (one digest over the rows' bytes per slice of keys on both ends,
  ``ColumnStore.rows_digest``, in the newest digest version both ends know; on this end, a chunk
  whose rows are unchanged since it was read is verified with the digest of the page it sent,
  ``PageDigest``; per-row digests only to count the rows that differ), close.

Listing a stream's rows is vectorised (``ColumnStore.rows_of_columns``): no Python key tuple per
stored row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.errors import RemoteFault
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import ApplyResult, DurableStore
from giaannd.storage.engine.regions import ENTRY_BYTES
from giaannd.storage.engine.row_digest import ROWS_DIGEST_VERSIONS, rows_digest_v2_pieces
from giaannd.storage.engine.sorted_keys import difference
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.column_sets import missing, with_columns
from giaannd.storage.streaming.pages import PagePool
from giaannd.storage.streaming.stream import (
    ItemKind,
    StreamData,
    StreamHello,
    StreamItem,
    StreamPosition,
    StreamRefused,
    StreamReply,
    StreamSender,
    StreamVerify,
    VerifyReply,
)
from giaannd.unique import unique
from peers.errors import PeersError
from peers.retry import Backoff
from peers.token_bucket import TokenBucket
from peers.transport import Connection, Transport, connect

__all__ = [
    "AppliedTee",
    "StreamFailed",
    "StreamRunner",
    "Throttle",
    "apply_local",
    "apply_local_nowait",
    "born_columns",
    "observe_applies",
    "row_keys_of",
    "wait_durable",
]

log = logging.getLogger(__name__)

#: Keys per StreamVerify request (the same bound as protocol.MAX_DIGEST_ROWS).
MAX_VERIFY_ROWS: Final = 65_536
#: StreamVerify requests on the wire at once: verification sends one per chunk (``PageDigest``),
#: a round trip each would add up over thousands of chunks; this many overlap the round trips
#: while the keys queued in the transport stay a few MB (at most this × MAX_VERIFY_ROWS × 16 B).
VERIFY_IN_FLIGHT: Final = 8
STREAM_REQUEST_TIMEOUT_S: Final = 30.0
#: A throttled stream's chunks carry about this many seconds of its rate (``_chunk_limit``) ...
THROTTLED_CHUNK_S: Final = 0.5
#: ... but at least this many bytes.
MIN_THROTTLED_CHUNK_BYTES: Final = 64 * 2**10
#: Reconnect backoff of a sender whose receiver went away (it may be restarting): the ceiling of
#: the first full-jitter wait, and the largest.
RECONNECT_BACKOFF_S: Final = (0.05, 1.0)
_REPLY_DECODER: Final = msgspec.msgpack.Decoder(StreamReply)
_ENC: Final = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class PageDigest:
    """A chunk this source read whole (every row present): keys ``[start, stop)`` of the stream's
    key list, the version 2 rows digest of the page as sent (row_digest.py), and the rows' version
    then (an xxh3 of their ``ColumnStore.row_touches``, 8 bytes a chunk, and ``drops``). While the
    version is unchanged the rows are what the page held (every change of a row bumps its touches),
    so verification uses ``digest`` instead of reading them again (the gather of short rows
    scattered over the base was most of a source's verification cost). Kept until verified."""

    start: int
    stop: int
    digest: int
    touches: int
    drops: int


class StreamFailed(RemoteFault):
    """A stream cannot continue (receiver refused fatally, verification failed, state lost)."""

    reason = "stream_failed"


Observer = Callable[[BatchId, RowBatch, str], None]


class AppliedTee:
    """Stands in for a service's ``DurableStore`` in its request core: applies through, then tells
    the observers about every batch that was applied (not duplicates), with the placement epoch
    the writer computed its shares under (``ApplyBatch.placement_epoch``; "" when unknown, e.g. a
    stream item). Everything else delegates to the store."""

    def __init__(self, inner: DurableStore) -> None:
        self._inner = inner
        self.observers: list[Observer] = []
        self.epoch = ""  # of the ApplyBatch being served (set around each apply, synchronously)
        # batches logged during a fold are applied when it ends: told then, with their own epoch
        # (storage/engine/deferred_applies.py)
        inner.deferred.on_applied = self._tell

    def apply(self, batch_id: BatchId, batch: RowBatch, validate: bool = True, track: bool = False) -> ApplyResult:
        result = self._inner.apply(batch_id, batch, validate, track)
        if result.applied:
            # only what was applied: another share of a batch id carries columns applied (and
            # forwarded) before, which the target must not get twice
            self._tell(batch_id, batch if result.part is None else result.part, self.epoch)
        return result

    def _tell(self, batch_id: BatchId, part: RowBatch, epoch: str) -> None:
        for observer in list(self.observers):
            observer(batch_id, part, epoch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def observe_applies(service: StorageService) -> AppliedTee:
    """The tee on ``service``'s apply path (installed once). The service must be open.

    TODO(lead): a first-class ``on_applied(batch_id, batch, epoch)`` hook in
    ``StorageRequests.apply`` would replace these two wrappers; the behaviour is the same.
    """
    core = service.core
    if core is None:
        raise RuntimeError("storage service is not open")
    if isinstance(core.store, AppliedTee):
        return core.store
    tee = AppliedTee(core.store)
    core.store = tee  # type: ignore[assignment]
    serve_apply = core.apply

    def apply_with_epoch(msg: Any, bulk: Any) -> Any:
        tee.epoch = msg.placement_epoch or ""
        try:
            return serve_apply(msg, bulk)
        finally:
            tee.epoch = ""

    core.apply = apply_with_epoch  # type: ignore[method-assign]
    return tee


async def apply_local(service: StorageService, batch_id: BatchId, batch: RowBatch, validate: bool = True) -> bool:
    """Apply on this node's store, bypassing the ownership check, and wait until it is durable
    (shares the service's group commit; holds off while a snapshot reads the store).
    ``validate=False`` only for a batch the caller already checked (``RowBatch.validate``)."""
    result = await apply_local_nowait(service, batch_id, batch, validate)
    await wait_durable(service, result.seq)
    return result.applied


async def apply_local_nowait(service: StorageService, batch_id: BatchId, batch: RowBatch,
                             validate: bool = True) -> ApplyResult:
    """``apply_local`` without the wait: applied in memory and appended to the update log; durable
    once ``wait_durable(service, result.seq)`` returns. Lets a receiver apply the next stream item
    while the fsync of the previous ones runs (streaming/stream.py, "Pipelining")."""
    store = service.store
    if store is None:
        raise RuntimeError("storage service is not open")
    core = service.core
    applier = core.store if core is not None else store  # the tee, if this node also sends streams
    async with service._snapshot_lock:  # noqa: SLF001 (see module docstring)
        return applier.apply(batch_id, batch, validate)


async def wait_durable(service: StorageService, seq: int) -> None:
    """Wait until the update log is durable up to ``seq`` (the service's group commit)."""
    commit = service._commit  # noqa: SLF001 (see module docstring)
    if commit is None:
        raise RuntimeError("storage service is not open")
    await commit.wait_durable(seq)


def _digests(store: DurableStore, cols: NDArray[np.uint64], feats: NDArray[np.uint64]
             ) -> tuple[NDArray[np.uint8], NDArray[np.uint64], NDArray[np.uint64]]:
    """Per-row digests (``ColumnStore.digest``): present, keys, strength. The per-row form of
    verification (a receiver that does not know ``StreamVerify.combined``), and what a failed
    combined check falls back to, to count the rows that differ."""
    digest = store.store.digest
    ds = [digest(key) for key in zip(cols.tolist(), feats.tolist())]
    n = len(ds)
    present = np.fromiter((d is not None for d in ds), np.uint8, n)
    keys = np.fromiter((0 if d is None else d.keys for d in ds), np.uint64, n)
    strength = np.fromiter((0 if d is None else d.strength for d in ds), np.uint64, n)
    return present, keys, strength


def _combined_digest(store: DurableStore, cols: NDArray[np.uint64], feats: NDArray[np.uint64],
                     version: int = 1) -> tuple[NDArray[np.uint8], NDArray[np.uint64]]:
    """Presence per row and one digest over all the present rows' bytes (``ColumnStore.rows_digest``
    in digest ``version``)."""
    present, digest = store.store.rows_digest(cols, feats, version)
    return present, np.array([digest], np.uint64)


def digest_version_for(asked: int) -> int:
    """The ``rows_digest`` version a receiver hashes when asked for ``asked``: that one if it knows
    it, else the newest it knows below it (``VerifyReply.digest_version`` tells the sender)."""
    known = [v for v in ROWS_DIGEST_VERSIONS if v <= asked]
    return known[-1] if known else ROWS_DIGEST_VERSIONS[0]


def _data_message(stream_id: int, item: StreamItem) -> StreamData:
    """The request that carries ``item`` (its rows go in bulk)."""
    return StreamData(stream_id, item.index, int(item.kind), item.checksum,
                      item.origin.writer if item.origin else 0, item.origin.seq if item.origin else 0,
                      tuple((b.writer, b.seq) for b in item.origins))


def born_columns(store: DurableStore, columns: NDArray[np.uint64],
                 claims: Callable[[NDArray[np.uint64]], NDArray[np.bool_]]) -> NDArray[np.uint64]:
    """The columns ``store`` holds now, not among ``columns`` (sorted, unique), that a stream
    carries by its rule (``claims``): those first written after the plan listed the sources'
    columns (it awaits remote listings and other nodes' answers) and before the stream opened.
    Listed with the rest when the stream opens, their rows go in chunks; a later write's delta
    alone (``StreamSender``'s claim) brought only the rows it touched, and the rest were lost
    (before Dec 1, a fourth session). Sorted, unique."""
    extra = missing(columns, store.store.held_columns())
    return extra[claims(extra)] if extra.shape[0] else extra


def row_keys_of(store: DurableStore, columns: NDArray[np.uint64]
                ) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.int64]]:
    """Sorted row keys of ``columns`` in ``store`` and each row's byte size (vectorised:
    ``ColumnStore.rows_of_columns``, no key tuple per stored row)."""
    return store.store.rows_of_columns(np.asarray(columns, np.uint64))


class Throttle:
    """Bytes per second for the streams that share it (None or <= 0: unthrottled).

    A token bucket without burst (``peers.token_bucket``): a stream books an item's bytes just
    before sending it and first waits until they are paid for, so the time a send takes counts
    towards the rate. ``set`` changes the rate at any time; the budget restarts then (no burst, no
    debt from the old rate), as it does after a time unthrottled.
    """

    def __init__(self, rate_bytes_s: float | None = None) -> None:
        self.rate_bytes_s = rate_bytes_s
        self._bucket: TokenBucket | None = None

    def set(self, rate_bytes_s: float | None) -> None:
        """Change the rate; the budget restarts at the next send."""
        self.rate_bytes_s, self._bucket = rate_bytes_s, None

    async def spend(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent (call it before sending them)."""
        rate = self.rate_bytes_s
        if not rate or rate <= 0:
            self._bucket = None
            return
        now = time.monotonic()
        if self._bucket is None or self._bucket.rate != rate:
            self._bucket = TokenBucket(rate, now)
        wait = self._bucket.reserve(now, nbytes)
        if wait > 0:
            await asyncio.sleep(wait)


class StreamRunner:
    """Drives one outgoing stream from a local source service to a target's StreamEndpoint.

    States (``state``): ``streaming`` → ``caught-up`` (all chunks applied and verified; deltas keep
    flowing) → ``closing`` (``close()``: the source stopped accepting writes for these columns) →
    ``done``; or ``failed`` / ``paused``.
    """

    def __init__(self, source: StorageService, transport: Transport, target_address: str,
                 columns: NDArray[np.uint64], stream_id: int, *, chunk_bytes: int | None = None,
                 throttle: Throttle | None = None, label: str = "", direct_epoch: str = "",
                 claims: Callable[[NDArray[np.uint64]], NDArray[np.bool_]] | None = None,
                 source_keeps: Callable[[NDArray[np.uint64]], NDArray[np.bool_]] | None = None,
                 window: int | None = None, locate_target: Callable[[], str | None] | None = None) -> None:
        if source.store is None:
            raise RuntimeError("source storage service is not open")
        self.source, self.transport, self.target_address = source, transport, target_address
        #: the target's address now (None: unknown), asked when it is unreachable: a receiver that
        #: restarted listens on a new port unless its stream-bind names one
        self.locate_target = locate_target
        self.store = source.store
        self.label = label or f"stream {stream_id:#x}"
        #: writes computed under this placement epoch reach the target directly: not forwarded for
        #: the columns ``source_keeps`` (the source stays an owner under it)
        self.direct_epoch = direct_epoch
        self.source_keeps = source_keeps
        columns = unique(np.asarray(columns, np.uint64))
        if claims is not None:
            columns = with_columns(columns, born_columns(self.store, columns, claims))
        cols, feats, sizes = row_keys_of(self.store, columns)
        kw = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        #: items on the wire at once (streaming/stream.py, "Pipelining"): this source's config
        self.window = window or source.settings.stream_window
        self.sender = StreamSender(stream_id, columns, cols, feats, sizes, claims=claims, window=self.window,
                                   origins_of=self._origins_of, **kw)
        #: the chunks' buffers, reused once acknowledged: the window plus the chunk read ahead
        self.page_pool = PagePool(self.sender.chunk_bytes // ENTRY_BYTES, self.window + 1)
        self._inflight: deque[asyncio.Future[Any]] = deque()
        self.throttle = throttle or Throttle()
        self.state = "streaming"
        self.error: str | None = None
        self.caught_up = asyncio.Event()
        self.finished = asyncio.Event()
        self._wake = asyncio.Event()
        self._conn: Connection | None = None
        self._broken = False
        self._started = time.monotonic()
        self.reconnects = 0
        self.resent_items = 0
        self._connected_once = False
        #: with a window of one: read the next chunk while the current one is on the wire
        #: (``_send_and_read``). Off by default: in one process (tools/bench/topology.py) it measured
        #: neutral at 50 entries/row and slower at 5000. A window of more than one item overlaps
        #: reads with the wire and the receiver anyway; this flag is then ignored.
        self.prefetch = False
        self._per_row_verify = False  # the receiver does not know StreamVerify.combined
        #: the rows digest version verification asks for: the newest, until the receiver answers
        #: in an older one (it does not know the newest: ``_verify``)
        self._digest_version = ROWS_DIGEST_VERSIONS[-1]
        #: the chunks read whole, in key order (``_read_page``; ``_verify`` uses them)
        self._pages: list[PageDigest] = []
        #: ``close`` was called (the sender closes once no fold holds writes: ``_close_when_applied``)
        self._close_asked = False
        self._tee = observe_applies(source)
        self._tee.observers.append(self._on_applied)

    # -- observer ---------------------------------------------------------------------------------
    def _origins_of(self, columns: NDArray[np.uint64]) -> list[BatchId]:
        """The ids applied here that a share may still come for, among ``columns`` (a chunk's)."""
        return self.store.store.applied.touching(columns)

    def _on_applied(self, batch_id: BatchId, batch: RowBatch, epoch: str) -> None:
        if self.direct_epoch and epoch == self.direct_epoch and self.source_keeps is not None:
            # Written under the new placement: the target got its own share directly, except of
            # columns this source does not own any more (a late write computed under the old
            # placement, whose epoch was read after the switch): forward those rows only.
            keeps = self.source_keeps(batch.row_column)
            if keeps.all():
                return
            batch = batch.select_rows(~keeps)
        try:
            if self.sender.offer_delta(batch_id, batch):
                self._wake.set()
        except Exception as exc:  # noqa: BLE001 - never fail the source's write because of a stream
            self._fail(f"{type(exc).__name__}: {exc}")

    def _fail(self, message: str) -> None:
        if self.state not in ("done", "failed"):
            self.state, self.error = "failed", message
            self._detach()
            self.caught_up.set()
            self.finished.set()
            self._wake.set()
            log.warning("%s failed: %s", self.label, message)

    def _detach(self) -> None:
        with contextlib.suppress(ValueError):
            self._tee.observers.remove(self._on_applied)

    def retarget(self, address: str) -> None:
        """The target is now at ``address`` (it restarted): the next send reconnects there and
        resumes from its durable position."""
        self.target_address = address
        self._broken = True
        self._wake.set()

    def abort(self, reason: str) -> None:
        """Give up this stream (the operation was cancelled)."""
        self._fail(reason)

    def close(self) -> None:
        """The source no longer applies writes for the columns: finish once everything is acked.

        The writers are drained (every write under the old placement acknowledged), but a write
        the source's fold held is acknowledged before it is applied (deferred_applies.py): the
        stream keeps listening until no fold runs (``_close_when_applied``, in ``run``), so those
        writes are forwarded as they reach the rows."""
        self._close_asked = True
        if self.state != "failed":
            self.state = "closing"
        self._wake.set()

    async def _close_when_applied(self) -> None:
        """``close``'s second half, in the stream's loop: once no fold holds writes any more
        (a new fold may start as one ends: wait for it too), stop listening and finish."""
        while await self._fold_ended():
            pass
        self.sender.close()
        self._detach()

    # -- progress ---------------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        s = self.sender
        elapsed = max(1e-9, time.monotonic() - self._started)
        rate = s.bytes_acked / elapsed
        left = max(0, s.total_bytes_estimate - s.bytes_acked)
        return {"stream": self.label, "state": self.state, "bytes_total_estimate": s.total_bytes_estimate,
                "bytes_done": s.bytes_acked, "rate_bytes_s": rate,
                "eta_s": (left / rate) if rate > 0 and s.chunks_left else 0.0,
                "items_acked": s.acked, "deltas": s.deltas, "resent_items": self.resent_items,
                "reconnects": self.reconnects, "error": self.error}

    # -- the loop ---------------------------------------------------------------------------------
    async def _connect(self) -> None:
        """(Re)connect and resume from the receiver's durable position."""
        s = self.sender
        self._drop_inflight()  # sent on the old connection: the receiver's position says what landed
        if self._conn is not None:
            self.reconnects += 1
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None
        self._conn = await connect(self.transport, self.target_address, timeout_s=5.0)
        self._broken = False
        hello = StreamHello(s.stream_id, self.label, fresh=True, first=not self._connected_once,
                            expected_bytes=max(0, s.total_bytes_estimate - s.bytes_acked),
                            source_node=self.source.node_name)
        res = await self._conn.request(_ENC.encode(hello), [s.columns], timeout_s=STREAM_REQUEST_TIMEOUT_S)
        reply = _REPLY_DECODER.decode(res.payload)
        if isinstance(reply, StreamRefused):
            raise StreamFailed(reply.reason)
        if not isinstance(reply, StreamPosition):
            raise StreamFailed(f"unexpected reply {type(reply).__name__} to StreamHello")
        self._connected_once = True
        self.resent_items += max(0, s.sent_upto - reply.next_index)
        self._acked(s.rewind(reply.next_index))

    async def _request(self, msg: msgspec.Struct, bulk: Sequence[Any] = ()) -> tuple[Any, list[np.ndarray]]:
        if self._conn is None or self._conn.is_closed:
            await self._connect()
        assert self._conn is not None
        res = await self._conn.request(_ENC.encode(msg), list(bulk), timeout_s=STREAM_REQUEST_TIMEOUT_S)
        return _REPLY_DECODER.decode(res.payload), res.bulk

    async def run(self) -> None:
        """Run until done or failed (never raises for stream problems: see ``state``/``error``)."""
        # A previous run may have been cancelled (pause) with an item on the wire: resynchronise
        # with the receiver's durable position before sending anything.
        self._broken = self._conn is not None
        try:
            await self._loop_steps()
        finally:
            self._drop_inflight()  # (also when the run is cancelled: a pause)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()

    async def _loop_steps(self) -> None:
        backoff = Backoff(*RECONNECT_BACKOFF_S)
        while self.state not in ("done", "failed"):
            try:
                await self._step()
                backoff.reset()
            except StreamFailed as exc:
                self._fail(str(exc))
            except ValueError as exc:
                self._fail(f"{type(exc).__name__}: {exc}")
            except (TimeoutError, PeersError, OSError) as exc:
                self._broken = True
                wait_s = backoff.next_delay()
                log.info("%s: receiver unreachable (%s); retrying in %.2fs", self.label, exc, wait_s)
                self._relocate_target()
                await asyncio.sleep(wait_s)

    def _relocate_target(self) -> None:
        """Follow a receiver that restarted at another address (it resumes from its durable
        position there); before, the stream dialled the old one until the operation timed out."""
        address = self.locate_target() if self.locate_target is not None else None
        if address and address != self.target_address:
            log.info("%s: receiver moved to %s", self.label, address)
            self.retarget(address)

    async def _step(self) -> None:
        """Fill the window (send items until ``window`` are unacknowledged), then handle the reply
        to the oldest item in flight; with nothing in flight, verify, finish or wait for deltas."""
        s = self.sender
        if self._close_asked and not s.closed:
            await self._close_when_applied()
        if self._conn is None or self._conn.is_closed or self._broken:
            await self._connect()
        if self.window == 1 and self.prefetch and not self._inflight and await self._step_prefetch():
            return
        while True:
            item = s.next_to_send()
            if item is None and s.unsent == 0 and s.chunks_left and s.in_flight < s.window:
                if await self._fold_ended():  # (the store's rows are being moved: look again after)
                    continue
                s.read_chunk(self._read_page, self._chunk_limit())  # synchronous: a consistent cut
                item = s.next_to_send()
            if item is None:
                break
            await self.throttle.spend(item.batch.nbytes)
            if self.state in ("done", "failed"):  # aborted while the throttle held the item back
                return
            conn = self._conn
            if conn is None or conn.is_closed:
                raise ConnectionError("stream connection closed while filling the window")
            msg = _data_message(s.stream_id, item)
            # tasks start in creation order, so the items go on the wire in index order
            self._inflight.append(asyncio.ensure_future(
                conn.request(_ENC.encode(msg), item.batch.buffers(), timeout_s=STREAM_REQUEST_TIMEOUT_S)))
            # let the request start writing the item now: without this the window's items were
            # all read (a synchronous gather each, ~8 ms a 4 MiB chunk of short rows) before the
            # first byte of any went out, and the receiver idled meanwhile
            await asyncio.sleep(0)
        if self._inflight:
            await self._await_oldest()
            return
        if s.done:
            with contextlib.suppress(PeersError, OSError, asyncio.TimeoutError):
                await self._request(StreamHello(s.stream_id, self.label, fresh=False, closing=True))
            self.state = "done"
            self._detach()
            self.finished.set()
            return
        if not s.chunks_left and s.idle and not self.caught_up.is_set():
            if not await self._verify():
                return
            if self.state == "streaming":
                self.state = "caught-up"
            self._pages.clear()  # (verified: never needed again)
            self.caught_up.set()
            return
        self._wake.clear()
        if s.next_to_send() is None and not s.done:
            await self._wake.wait()

    async def _await_oldest(self) -> None:
        """The reply to the oldest item in flight. Acknowledgements are cumulative; a refusal drops
        the items sent after the refused one (the receiver refuses them as a gap) and rewinds."""
        s = self.sender
        try:
            res = await self._inflight[0]
        except BaseException:
            self._drop_inflight()
            raise
        self._inflight.popleft()
        reply = _REPLY_DECODER.decode(res.payload)
        if isinstance(reply, StreamPosition):
            self._acked(s.on_position(reply.next_index))
        elif isinstance(reply, StreamRefused):
            if reply.fatal:
                raise StreamFailed(reply.reason)
            # The receiver's durable position when it refused: the replies to the items before
            # the refused one left it later, once those were durable, and were handled first,
            # so it may be behind what they acknowledged since (not a loss: resend from there).
            position = max(reply.next_index, s.acked)
            self.resent_items += max(1, s.sent_upto - position)
            self._drop_inflight()
            self._acked(s.rewind(position))

    def _acked(self, items: list[StreamItem]) -> None:
        """Items the receiver acknowledged: it holds every byte of them, so the buffers of the
        pages among them go back to the page pool (a part of a cut row shares its row's buffers
        with the parts after it: never)."""
        for item in items:
            if item.kind == ItemKind.CHUNK and not item.part:
                self.page_pool.give_back(item.batch)

    def _drop_inflight(self) -> None:
        """Forget the requests in flight (their replies no longer matter: the sender rewinds)."""
        for task in self._inflight:
            task.cancel()
            task.add_done_callback(_retrieve)
        self._inflight.clear()

    async def _step_prefetch(self) -> bool:
        """One item with a window of one and ``prefetch`` (``_send_and_read``); False: nothing
        to send (the general step verifies, finishes or waits)."""
        s = self.sender
        item = s.next_to_send()
        while item is None and s.in_flight == 0 and s.chunks_left and await self._fold_ended():
            item = s.next_to_send()
        if item is None and s.in_flight == 0 and s.chunks_left:
            s.read_chunk(self._read_page, self._chunk_limit())
            item = s.next_to_send()
        if item is None:
            return False
        msg = _data_message(s.stream_id, item)
        await self.throttle.spend(item.batch.nbytes)
        if self.state in ("done", "failed"):
            return True
        if item.kind == ItemKind.CHUNK and s.chunks_left and s.unsent == 0:
            reply = await self._send_and_read(msg, item)
        else:
            reply, _ = await self._request(msg, item.batch.buffers())
        if isinstance(reply, StreamPosition):
            self._acked(s.on_position(reply.next_index))
        elif isinstance(reply, StreamRefused):
            if reply.fatal:
                raise StreamFailed(reply.reason)
            self.resent_items += 1
            self._acked(s.rewind(reply.next_index))
        return True

    def _folding(self) -> bool:
        """The source store's delta runs are being folded into its base in a worker thread
        (storage/replication/background_fold.py): a read of the rows now would wait for it on the
        engine's lock, with the event loop blocked."""
        folds = self.source.folds
        return folds is not None and folds.running

    async def _fold_ended(self) -> bool:
        """Wait for a fold under way to end (its held writes applied: deferred_applies.py); whether
        there was one (the caller looks at its state again: writes came in meanwhile)."""
        folds = self.source.folds
        if folds is None or not folds.running:
            return False
        await folds.ready()
        return True

    def _read_page(self, cols: NDArray[np.uint64], feats: NDArray[np.uint64]) -> RowBatch:
        """``StreamSender.read_chunk``'s reader: the rows (``ColumnStore.read_rows``), and, when
        every one is present, the page's digest and the rows' version (``PageDigest``): hashing
        the page as it is costs ~0.03 ms/MB (xxh3), reading the rows again to verify ~1."""
        batch = self.store.store.read_rows(cols, feats, self.page_pool.take)
        if batch.num_rows == cols.shape[0] and 0 < batch.num_rows <= MAX_VERIFY_ROWS:
            self._pages.append(self._page_digest(self.sender.cursor, batch))  # (cursor: the page's first key)
        return batch

    def _page_digest(self, start: int, batch: RowBatch) -> PageDigest:
        """The ``PageDigest`` of a page read whole (every key present) from key ``start`` on."""
        store = self.store.store
        _, touches = store.row_touches(batch.row_column, batch.row_feature)
        digest = rows_digest_v2_pieces(np.diff(batch.offsets), [(batch.segment, batch.target_column,
                                                                  batch.target_feature, batch.strength)])
        return PageDigest(start, start + batch.num_rows, digest, _touches_digest(touches), store.drops)

    def _chunk_limit(self) -> int | None:
        """Throttled, chunks carry about THROTTLED_CHUNK_S of the rate (at least
        MIN_THROTTLED_CHUNK_BYTES): the throttle waits before each item, so one big chunk would go
        at full speed after a long wait; smaller ones keep the rate smooth."""
        rate = self.throttle.rate_bytes_s
        if not rate or rate <= 0:
            return None
        return max(MIN_THROTTLED_CHUNK_BYTES, int(rate * THROTTLED_CHUNK_S))

    async def _send_and_read(self, msg: StreamData, item: StreamItem) -> Any:
        """Send chunk ``item`` and, while the receiver applies it, read the next chunk (a
        synchronous cut, as always; it waits in the sender's queue: the window is still one item
        on the wire, so a receiver crash still re-sends at most one item). Only behind a chunk:
        behind a delta the next chunk is read once the queue is empty, as without prefetch (a
        throttled stream under writes then sends the pending deltas first)."""
        task = asyncio.ensure_future(self._request(msg, item.batch.buffers()))
        try:
            await asyncio.sleep(0)  # the request writes the item (what the socket takes at once)
            if self.state not in ("done", "failed") and not task.done() and not self._folding():
                self.sender.read_chunk(self._read_page, self._chunk_limit())
            reply, _ = await task
        except BaseException:
            task.cancel()
            raise
        return reply

    async def _verify(self) -> bool:
        """Source digests now (no await in between: a consistent cut, nothing is in flight), then
        the receiver's; keys and strengths must be equal bit for bit. False: not verified yet,
        verify again once idle (the receiver answered per-row digests: see below; or a fold
        ended meanwhile and its held writes made deltas to send first).

        Per slice of at most MAX_VERIFY_ROWS keys, both ends compute one combined digest over the
        rows' bytes (``ColumnStore.rows_digest``: no per-row hashing); only if that differs are the
        per-row digests asked for, to say how many rows differ. A receiver that does not know
        ``StreamVerify.combined`` answers per-row digests: the source's must then be taken at a new
        consistent cut (writes may have come in meanwhile), so this returns False and the next
        verification is per row throughout. Likewise a receiver that hashed an older digest
        version than the one asked for (row_digest.py; it says which in its reply): the next
        verification asks for that version. Digests of two versions are never compared.

        Raises:
            StreamFailed: the receiver's rows differ, or it answered something unexpected.
        """
        if await self._fold_ended() and not self.sender.idle:
            # The writes the fold held were applied when it ended, and the stream's rows among
            # them are deltas not sent yet: the source's digests would count them and the
            # receiver's not. Send them first (the caller verifies once idle again).
            return False
        # no await from here until the digests are taken (a consistent cut)
        cols, feats, _ = row_keys_of(self.store, self.sender.columns)
        per_row, version = self._per_row_verify, self._digest_version
        parts = ([(cols[sl], feats[sl], None) for sl in _slices(cols.size)] if per_row or version != 2
                 else self._verify_parts(cols, feats))
        mine: list[Sequence[NDArray[Any]]] = [
            _digests(self.store, c, f) if per_row
            else _combined_digest(self.store, c, f, version) if kept is None
            else (np.ones(c.shape[0], np.uint8), np.array([kept], np.uint64))
            for c, f, kept in parts]
        keyss = [[np.ascontiguousarray(c), np.ascontiguousarray(f)] for c, f, _ in parts]
        if self._conn is None or self._conn.is_closed:
            await self._connect()
        return await self._check_verify(keyss, mine, per_row, version)

    def _verify_parts(self, cols: NDArray[np.uint64], feats: NDArray[np.uint64]
                      ) -> list[tuple[NDArray[np.uint64], NDArray[np.uint64], int | None]]:
        """Verification's slices of keys, each with the digest this source already has for it (None:
        hash it now): every chunk read whole (``PageDigest``) whose rows' version is unchanged
        comes with its page's digest; the keys of other chunks, and the rows created since the
        stream opened (``cols``/``feats``: the stream's rows now, sorted), come in MAX_VERIFY_ROWS
        slices, hashed now. Both ends hash the keys a request lists, in its order, so the slices
        need not follow the key order: together they are every key of the stream."""
        opened_c, opened_f = self.sender.keys
        store = self.store.store
        out: list[tuple[NDArray[np.uint64], NDArray[np.uint64], int | None]] = []

        def fresh(c: NDArray[np.uint64], f: NDArray[np.uint64]) -> None:
            out.extend((c[lo:lo + MAX_VERIFY_ROWS], f[lo:lo + MAX_VERIFY_ROWS], None)
                       for lo in range(0, c.shape[0], MAX_VERIFY_ROWS))

        at = 0
        for page in self._pages:
            fresh(opened_c[at:page.start], opened_f[at:page.start])  # rows read without a kept page
            c, f = opened_c[page.start:page.stop], opened_f[page.start:page.stop]
            present, touches = store.row_touches(c, f)
            same = page.drops == store.drops and bool(present.all()) and _touches_digest(touches) == page.touches
            if same:
                out.append((c, f, page.digest))
            else:
                fresh(c, f)
            at = max(at, page.stop)
        fresh(opened_c[at:], opened_f[at:])
        fresh(*difference(cols, feats, opened_c, opened_f))
        return out or [(cols[:0], feats[:0], None)]

    async def _check_verify(self, keyss: list[list[NDArray[np.uint64]]], mine: list[Sequence[NDArray[Any]]],
                            per_row: bool, version: int) -> bool:
        """``_verify``'s requests, up to VERIFY_IN_FLIGHT at once, and its comparisons, reply by
        reply in order (its docstring)."""
        conn = self._conn
        assert conn is not None
        msg = _ENC.encode(StreamVerify(self.sender.stream_id, combined=not per_row, digest_version=version))
        asked: deque[asyncio.Future[Any]] = deque()
        try:
            for i, (keys, digests) in enumerate(zip(keyss, mine)):
                while len(asked) < VERIFY_IN_FLIGHT and i + len(asked) < len(keyss):
                    asked.append(asyncio.ensure_future(
                        conn.request(msg, keyss[i + len(asked)], timeout_s=STREAM_REQUEST_TIMEOUT_S)))
                res = await asked.popleft()
                if not await self._check_reply(res, keys, digests, per_row, version):
                    return False
            return True
        finally:
            for task in asked:
                task.cancel()
                task.add_done_callback(_retrieve)

    async def _check_reply(self, res: Any, keys: list[NDArray[np.uint64]], digests: Sequence[NDArray[Any]],
                           per_row: bool, version: int) -> bool:
        """One verify reply against this source's digests (``_verify``'s docstring); False: verify
        again (the receiver answered per row, or in an older digest version)."""
        reply, bulk = _REPLY_DECODER.decode(res.payload), res.bulk
        if not isinstance(reply, VerifyReply) or len(bulk) not in (2, 3):
            raise StreamFailed(f"verify: unexpected reply {type(reply).__name__}")
        if not per_row and len(bulk) == 3:
            self._per_row_verify = True
            return False
        if not per_row and reply.digest_version != version:
            if reply.digest_version not in ROWS_DIGEST_VERSIONS or reply.digest_version > version:
                raise StreamFailed(f"verify: receiver hashed digest version {reply.digest_version}, "
                                   f"asked for {version}")
            self._digest_version = reply.digest_version
            return False
        if len(bulk) != len(digests):
            raise StreamFailed(f"verify: {len(bulk)} digest arrays in the reply, {len(digests)} expected")
        if all(np.array_equal(a, np.asarray(b)) for a, b in zip(digests, bulk)):
            return True
        if per_row:
            rows: Sequence[NDArray[Any]] = digests
        else:  # they differ: how many rows do (the source's per-row digests are taken now)
            rows = _digests(self.store, keys[0], keys[1])
            reply, bulk = await self._request(StreamVerify(self.sender.stream_id), keys)
            if not isinstance(reply, VerifyReply) or len(bulk) != 3:
                raise StreamFailed(f"verify: unexpected reply {type(reply).__name__}")
        differ = np.zeros(keys[0].size, bool)
        for a, theirs in zip(rows, bulk):
            b = np.asarray(theirs)
            if a.shape != b.shape:
                raise StreamFailed(f"verify: receiver answered {b.size} digests for {a.size} rows")
            differ |= a != b
        bad = max(1, int(np.count_nonzero(differ)))
        raise StreamFailed(f"verify: {bad} of {keys[0].size} rows differ on the receiver")


def _touches_digest(touches: NDArray[np.uint64]) -> int:
    """One xxh3 of the rows' touches (``PageDigest.touches``): equal, up to a 2**-64 collision,
    exactly when every row's touches are."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(touches, np.uint64).data)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a dropped request's outcome retrieved (it is not needed)."""
    if not task.cancelled():
        task.exception()


def _slices(n: int) -> list[slice]:
    """The MAX_VERIFY_ROWS-key slices verification sends (one, empty, when there are no rows)."""
    return [slice(start, start + MAX_VERIFY_ROWS) for start in range(0, max(1, n), MAX_VERIFY_ROWS)]
