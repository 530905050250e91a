"""Requests, responses and bulk placement over one handshaken ``Link`` — shared by every backend.

Theory of operation:

- Either side may send ``Request``s; ids are per direction, so both sides number from 1. Many
  requests are in flight at once; frames are written whole, one at a time (a write lock), and
  responses may come back in any order.
- Caller side: ``request()`` registers a pending entry (future, optional ``recv_into`` buffers,
  deadline), sends the frame, and waits. When the response's header arrives the decoder asks
  ``allocate`` where its bulk goes: into the caller's buffers if they match the specs exactly,
  otherwise into scratch and the request fails with ``LocalProtocolError`` (the bytes must still be
  consumed to keep the stream in sync). On deadline or task cancellation the entry is removed and a
  ``Cancel`` is sent; a late response then lands in scratch and is dropped. A request whose bulk was
  already handed to the link or to UCX is given up only once those buffers are no longer read
  (``_sent_elsewhere``).
- Server side: incoming request bulk lands in pooled, pre-touched buffers; the handler starts at
  once, inside the read callback (``eager.py``: a handler that does not wait replies from there,
  with no Task at all); one that waits continues in a Task under the request's remaining budget;
  its ``Reply`` (or ``ErrorReply``) is sent; the pooled buffers are released after the reply was
  written — except one small buffer, kept for the next request's bulk (``_keep_spare``: a
  sequence of requests costs no lease and release each). ``Cancel`` cancels the handler's task.
- Small messages: the decoder hands a whole request or response straight to ``on_message``
  (``FrameDecoder.whole``); bulk-free requests and replies, and those with one host buffer, are
  framed here without ``encode_frame`` (the same header and limits).
- Writes: a frame is written whole by one ``link.write`` (one ``writev``). Frames written while
  the link is *corked* are held and leave together in one write when it is uncorked: the session
  corks while it dispatches the frames of one read (the replies of pipelined requests), and
  handlers that waited and reply while others are still being served cork until the next loop
  iteration (replies of writes that one group commit woke together). Requests are never held:
  holding a window's requests for an iteration put both ends in lockstep (4 KiB, 16 in flight:
  0.42–0.52× the raw socket with it, 0.88–1.04× without; tools/bench/transport.py).
- Failure: when the link is lost, a protocol error is seen, or ``fail(exc)`` is called (membership
  declared the peer dead), every pending request fails with that typed error at once and every
  handler task is cancelled. A closed connection never reopens; the pool makes a new one.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import numpy as np

from peers import framing, wire
from peers.errors import (
    DeadlineExceeded,
    LocalProtocolError,
    PeersError,
    RemoteError,
    RemoteProtocolError,
    RequestCancelled,
    TransportClosed,
)
from peers.transport.base import BulkChannel, Handler, Incoming, Link, Reply, Result
from peers.transport.eager import TaskStandIn, continue_in_task
from peers.transport.pool import BufferPool, Lease

__all__ = ["Connection", "Metrics", "bulk_tag"]

log = logging.getLogger(__name__)
_RAW_NONE = msgspec.Raw(msgspec.msgpack.encode(None))
_NO_SPECS: list[wire.BufferSpec] = []  # shared by every bulk-free message (never mutated)


def _current_task_lookup() -> Callable[[asyncio.AbstractEventLoop], Any]:
    """``asyncio.current_task(loop)``, as cheap as this Python allows. Up to 3.13 C ``_asyncio``
    keeps the running task of each loop in a dict, and that dict's ``get`` is one C call (on 3.11
    ``current_task`` is Python code around it); 3.14 keeps the running task in the thread state
    and no longer fills the dict, so there the public function is used. A private attribute:
    tests/unit/transport/test_fast_path.py checks that the two agree on the running Python."""
    table = getattr(asyncio.tasks, "_current_tasks", None)
    if sys.version_info < (3, 14) and isinstance(table, dict):
        return table.get
    return asyncio.current_task


_current_task_of = _current_task_lookup()
#: entered with a ``TaskStandIn`` (eager.py), not a Task: typed loosely
_enter_task: Callable[[Any, Any], None] = asyncio.tasks._enter_task
_leave_task: Callable[[Any, Any], None] = asyncio.tasks._leave_task
_RESPONSE_BIT = 1 << 63
#: ``Connection._write_now`` outcomes.
_NOT_WRITTEN, _QUEUED, _FLUSHED = 0, 1, 2


def bulk_tag(salt: int, request_id: int, index: int, *, response: bool) -> int:
    """64-bit tag of one out-of-band buffer: direction bit, 23-bit connection salt, 28-bit request
    id (wraps; at most 2**28 requests in flight is far above any real load), 12-bit buffer index."""
    return (_RESPONSE_BIT if response else 0) | (salt & 0x7FFFFF) << 40 | (request_id & 0xFFFFFFF) << 12 | index


@dataclass
class Metrics:
    """Counters of one transport (exported by the daemon's /metrics)."""

    requests_sent: int = 0
    requests_served: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    protocol_errors: dict[str, int] = field(default_factory=dict)
    handshake_rejections: dict[str, int] = field(default_factory=dict)
    deadlines: int = 0
    cancels: int = 0
    connections_opened: int = 0
    connections_closed: int = 0
    fallbacks: int = 0
    #: accepted sockets closed before the handshake by an admission cap, by reason
    #: (``pending_handshakes``, ``per_host``; see ``TransportLimits``)
    connections_refused: dict[str, int] = field(default_factory=dict)

    def count_protocol_error(self, reason: str) -> None:
        self.protocol_errors[reason] = self.protocol_errors.get(reason, 0) + 1

    def count_rejection(self, reason: str) -> None:
        self.handshake_rejections[reason] = self.handshake_rejections.get(reason, 0) + 1

    def count_refusal(self, reason: str) -> None:
        self.connections_refused[reason] = self.connections_refused.get(reason, 0) + 1


@dataclass(eq=False, slots=True)
class _Pending:
    future: asyncio.Future[Result]
    recv_into: Sequence[Any] | None
    views: list[Any] | None = None
    arrays: list[Any] | None = None


#: One msgpack encoder for payloads and wire messages (``wire.encode`` is the same encoding, one
#: Python call deeper).
_msgpack = msgspec.msgpack.Encoder().encode
_pack_header = framing.HEADER.pack


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A done-callback marking an abandoned future's exception as seen (nobody awaits it)."""
    if not future.cancelled():
        future.exception()


def _payload(obj: Any) -> msgspec.Raw:
    if obj is None:
        return _RAW_NONE
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return msgspec.Raw(obj)
    return msgspec.Raw(_msgpack(obj))


class _DeviceDest:
    """A device destination as the decoder sees it: only ``nbytes`` is used there (device frames
    are always out of band); the bulk channel receives into ``obj``."""

    __slots__ = ("obj", "nbytes")

    def __init__(self, obj: Any, nbytes: int) -> None:
        self.obj, self.nbytes = obj, nbytes


#: numpy dtype of every wire dtype string, looked up once per received buffer.
_DTYPES: dict[str, np.dtype[Any]] = {name: np.dtype(name) for name in wire.DTYPES}


_frombuffer = np.frombuffer


def _typed(view: memoryview, spec: wire.BufferSpec) -> np.ndarray:
    dtype = _DTYPES[spec.dtype]  # validated by the decoder (framing.validate_spec)
    if not spec.nbytes:
        return np.empty(spec.shape, dtype)
    array = np.frombuffer(view, dtype=dtype)
    return array if len(spec.shape) == 1 else array.reshape(spec.shape)


#: A served request's receive buffer up to this size is kept for the next request (``_keep_spare``).
_SPARE_MAX_BYTES: Final = 256 * 2**10

#: The deadline heap is rebuilt without stale entries once it holds this many more than live ones.
_DEADLINE_SLACK = 64


class _Deadlines:
    """Request deadlines: one heap and at most one armed loop timer per connection and side
    (the caller's deadlines, the server's handler budgets).

    Why not ``asyncio.timeout`` per request: it costs a context manager, a ``call_at`` timer and a
    cancel per request (≈ 10 µs on these VMs, a fifth of a small request's Python cost). Here a
    request costs one ``heappush``; entries of answered requests stay in the heap (lazy deletion)
    and are skipped when they reach the top; the heap is compacted when stale entries dominate,
    so memory stays O(in flight). The timer is re-armed only when a new deadline is earlier than
    the armed one, which in steady traffic with one timeout value is never.
    """

    __slots__ = ("_loop", "_expire", "_pending", "_heap", "_handle", "_armed_at", "_seq")

    def __init__(self, loop: asyncio.AbstractEventLoop, pending: dict[int, Any],
                 expire: Callable[[int], None]) -> None:
        """``pending``: the live requests by id. An entry added with a ``token`` is live while
        ``pending[id] is token`` (the server's ids come from the peer, which may reuse one later:
        it must not inherit an old deadline); with ``token=None`` (the caller's own ids, never
        reused) while the id is in ``pending`` — so a stale entry pins no response buffers.
        ``expire(req_id)``: called once per deadline that passes while its entry is live."""
        self._loop, self._pending, self._expire = loop, pending, expire
        self._heap: list[tuple[float, int, int, Any]] = []  # (when, seq, req_id, token)
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = float("inf")
        self._seq = 0

    def _live(self, entry: tuple[float, int, int, Any]) -> bool:
        token = entry[3]
        return entry[2] in self._pending if token is None else self._pending.get(entry[2]) is token

    def add(self, when: float, req_id: int, token: Any) -> None:
        heap = self._heap
        self._seq += 1
        heapq.heappush(heap, (when, self._seq, req_id, token))
        if len(heap) > 2 * len(self._pending) + _DEADLINE_SLACK:
            self._compact()
        if when < self._armed_at:
            self._arm(when)

    def _compact(self) -> None:
        pending = self._pending
        # ``_live`` inlined: this runs over the whole heap once every ~_DEADLINE_SLACK requests
        live = [entry for entry in self._heap
                if (entry[2] in pending if entry[3] is None else pending.get(entry[2]) is entry[3])]
        heapq.heapify(live)
        self._heap = live

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle, self._armed_at = None, float("inf")
        now, heap = self._loop.time(), self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._live(entry):
                self._expire(entry[2])
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self._heap, self._armed_at = None, [], float("inf")


class Connection:
    """One handshaken peer connection (both client and server side use this class)."""

    def __init__(
        self,
        link: Link,
        *,
        peer: str,
        handler: Handler | None,
        pool: BufferPool,
        metrics: Metrics,
        bulk: BulkChannel | None = None,
        bulk_salt: tuple[int, int] = (0, 0),
        checksum: bool = False,
        on_close: Callable[[Connection], None] | None = None,
    ) -> None:
        self.link, self.peer, self._handler, self._pool = link, peer, handler, pool
        self.metrics, self._bulk, self._checksum = metrics, bulk, checksum
        self._send_salt, self._recv_salt = bulk_salt  # salts the peer / we receive with
        self._on_close = on_close
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._serving: dict[int, asyncio.Task[None]] = {}
        self._leases: dict[int, list[Lease]] = {}
        #: the request whose handler runs its first step in the read callback (``_start_handler``):
        #: not in ``_serving`` yet, but its leases are the handler's until it ends
        self._stepping: int | None = None
        # a served request's receive buffer, kept for the next one (``_keep_spare``): the lease,
        # a view of its whole buffer and that buffer's size; ``_spare_lease`` remembers the last
        # one kept (the view is remade only when the buffer changes)
        self._spare: Lease | None = None
        self._spare_lease: Lease | None = None
        self._spare_view = memoryview(b"")
        self._spare_bytes = 0
        self._write_lock = asyncio.Lock()
        self._slow_writers = 0  # writers waiting for, or holding, the write lock
        # links that can tell whether everything written already reached the kernel (tcp) get a
        # lock-free, await-free write path; others (mem: its drain yields to the receiver) do not
        self._fast_write = hasattr(type(link), "flushed")
        self._loop = asyncio.get_running_loop()
        self._deadlines = _Deadlines(self._loop, self._pending, self._expire)
        self._budgets = _Deadlines(self._loop, self._serving, self._budget_expired)
        self._expired: set[int] = set()  # served requests whose budget ran out
        self._still_sending: set[int] = set()  # served requests whose reply's UCX sends outlived the wait
        self._replying: set[int] = set()  # served requests past their handler (budget no longer applies)
        #: requests waiting for the write lock: never seen by the peer, so given up without a Cancel
        #: (a peer that stops reading would otherwise gather one Cancel task per timed-out request)
        self._unwritten: set[int] = set()
        self._closed_exc: BaseException | None = None
        self._corked = False  # the link is corked until the next loop iteration (_uncork)
        self.closed = asyncio.Event()
        #: the receive side's ``FrameDecoder.divert_response`` (set by the session that feeds this
        #: connection): a request given up on stops its response's bulk landing in its buffers
        self.divert_response: Callable[[int], bool] | None = None
        #: responses whose out-of-band bulk is being received into their callers' buffers
        self._receiving: dict[int, asyncio.Task[None]] = {}

    # ---- caller API -------------------------------------------------------------------------------

    @property
    def is_closed(self) -> bool:
        return self._closed_exc is not None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def request(
        self,
        payload: Any = None,
        bulk: Sequence[Any] = (),
        *,
        recv_into: Sequence[Any] | None = None,
        timeout_s: float | None = None,
    ) -> Result:
        """Send a request and wait for its response.

        Args:
            payload: an application msgspec Struct (or any msgpack-able value, or pre-encoded bytes).
            bulk: numpy arrays / torch CPU tensors sent as raw bytes (not copied; keep them unchanged
                until this returns).
            recv_into: destinations for the response's bulk buffers, in order; each must have exactly
                the byte size the responder sends. Without it, fresh arrays are allocated.
            timeout_s: deadline relative to now; the peer learns the remaining budget.

        Raises:
            DeadlineExceeded, RequestCancelled, RemoteError (the handler raised), TransportClosed /
            PeerDead (connection lost), LocalProtocolError (bad buffers, response did not fit).
        """
        if self._closed_exc is not None:
            raise self._closed_error()
        req_id = next(self._ids)
        pending = _Pending(self._loop.create_future(), recv_into)
        self._pending[req_id] = pending
        deadline = None if timeout_s is None else self._loop.time() + timeout_s
        try:
            if bulk:
                sending = self._send_message(req_id, payload, bulk, response=False, budget_s=timeout_s)
            else:  # the common small request, framed here (``_send_message``'s first branch)
                raw = _RAW_NONE if payload is None else (
                    msgspec.Raw(payload) if type(payload) is bytes else _payload(payload))
                sending = self._send_small(_msgpack(wire.Request(
                    req_id, raw, _NO_SPECS, None if timeout_s is None else timeout_s * 1000.0, wire.BULK_INLINE)),
                    req_id, response=False)
            if sending is not None:  # the write must wait (contention, a full socket, UCX bulk)
                async with asyncio.timeout_at(deadline):
                    await sending
            self.metrics.requests_sent += 1
            if deadline is not None:
                self._deadlines.add(deadline, req_id, None)
            return await pending.future
        except TimeoutError:
            self.metrics.deadlines += 1
            self._abandon(req_id)
            await self._received_elsewhere(req_id)
            raise DeadlineExceeded(f"request {req_id} to {self.peer} exceeded {timeout_s}s") from None
        except asyncio.CancelledError:
            self._abandon(req_id)
            await self._received_elsewhere(req_id)
            raise
        finally:
            self._pending.pop(req_id, None)
            if self._unwritten:
                self._unwritten.discard(req_id)
            if pending.future.done() and not pending.future.cancelled():
                pending.future.exception()  # retrieved: the send may have failed first

    def fail(self, exc: PeersError) -> None:
        """Fail every pending operation with ``exc`` and close (membership's ``fail_peer`` hook)."""
        self._shutdown(exc)
        self.link.abort()

    async def close(self, reason: str = "") -> None:
        """Orderly close: say Goodbye, fail what is pending, close the link (also when cancelled
        while the Goodbye waits: nobody would close it later, and its socket would stay open)."""
        try:
            if self._closed_exc is None:
                try:
                    async with asyncio.timeout(1.0):
                        await self._write([*framing.encode_frame(wire.Goodbye(reason))])
                        # a cork (the replies of this read or loop iteration) may hold the Goodbye
                        # and replies before it: the abort below drops what is held, and the peer
                        # would see its connection lost instead
                        self.link.flush_held()
                        await self.link.drain()
                except (OSError, TimeoutError, PeersError):
                    pass
        finally:
            self._shutdown(TransportClosed(f"connection to {self.peer} closed locally"))
            self.link.abort()

    # ---- link callbacks ---------------------------------------------------------------------------

    def allocate(self, message: wire.Message, specs: Sequence[wire.BufferSpec]) -> list[memoryview]:
        """The framing decoder's allocator: where this frame's bulk bytes go."""
        if type(message) is wire.Request:  # incoming bulk lands in pooled, pre-touched buffers
            if message.id in self._leases:  # (one lookup: else the first's leases were overwritten, never returned)
                raise RemoteProtocolError(f"request id {message.id} reused while its handler runs",
                                          reason="bad_message")
            if len(specs) == 1:  # the usual case, without two list comprehensions
                nbytes = specs[0].nbytes
                if self._spare is not None and nbytes <= self._spare_bytes:  # the last request's
                    lease, self._spare = self._spare, None
                    self._leases[message.id] = [lease]
                    return [self._spare_view[:nbytes]]
                lease = self._pool.lease(nbytes)
                self._leases[message.id] = [lease]
                return [lease.view]
            take = self._pool.lease
            leases = [take(s.nbytes) for s in specs]
            self._leases[message.id] = leases
            return [lease.view for lease in leases]
        if isinstance(message, wire.Response):
            pending = self._pending.get(message.id)
            if pending is not None:
                try:
                    pending.views, pending.arrays = self._caller_buffers(pending.recv_into, specs)
                    if any(isinstance(v, _DeviceDest) for v in pending.views) and message.bulk_via == wire.BULK_INLINE:
                        raise LocalProtocolError("device recv_into but the response came inline")
                    return pending.views
                except LocalProtocolError as exc:
                    self._settle(message.id, exc)
            return [np.empty(s.nbytes, np.uint8).data for s in specs]  # late/mismatched: drop
        raise RemoteProtocolError(f"{type(message).__name__} may not carry bulk", reason="bad_message")

    def on_message(self, msg: wire.Message, buffers: list[memoryview]) -> None:
        """Dispatch one decoded inline ``Request`` or ``Response`` (the decoder's ``deliver``: the
        hot path, without a ``Frame``); other messages go to ``on_frame``."""
        if self._closed_exc is not None:
            return  # closed by an earlier frame of the same read (Goodbye, a handler's fail())
        if buffers:
            for buf in buffers:
                self.metrics.bytes_received += buf.nbytes
        if type(msg) is wire.Request:
            self._start_handler(msg, buffers)
        elif type(msg) is wire.Response:
            pending = self._pending.get(msg.id)
            if pending is None or pending.future.done():
                return
            # the body is an immutable ``bytes`` (framing), so the payload is viewed, not copied
            arrays = pending.arrays
            pending.future.set_result(Result(memoryview(msg.payload), arrays if arrays is not None else []))
        else:
            self.on_frame(framing.Frame(msg, buffers, False))

    def on_frame(self, frame: framing.Frame) -> None:
        """Dispatch one decoded frame."""
        if self._closed_exc is not None:
            return  # closed by an earlier frame of the same read (Goodbye, a handler's fail())
        msg = frame.message
        if frame.out_of_band:
            if self._bulk is None:  # the handshake agreed on inline bulk: nothing would ever fill
                # these buffers (no request handled, no response delivered, leases held until close)
                raise RemoteProtocolError("out-of-band bulk on a connection without a bulk channel",
                                          reason="bad_message")
            for buf in frame.buffers:
                self.metrics.bytes_received += buf.nbytes
            receiving = self._loop.create_task(self._receive_out_of_band(frame))
            if type(msg) is wire.Response:  # into its caller's buffers: ``_received_elsewhere``
                self._receiving[msg.id] = receiving
            return
        msg_type = type(msg)
        if msg_type is wire.Request or msg_type is wire.Response:
            self.on_message(msg, frame.buffers)
        elif isinstance(msg, wire.ErrorReply):
            self._settle(msg.id, self._remote_exception(msg))
        elif isinstance(msg, wire.Cancel):
            task = self._serving.get(msg.id)
            if task is not None:
                self.metrics.cancels += 1
                task.cancel()
        elif isinstance(msg, wire.Goodbye):
            self._shutdown(TransportClosed(f"peer {self.peer} said goodbye: {msg.reason}"))
            self.link.abort()
        else:
            raise RemoteProtocolError(f"unexpected {type(msg).__name__} after handshake", reason="bad_message")

    def on_lost(self, exc: BaseException | None) -> None:
        """The link is gone (EOF, reset, abort)."""
        self._shutdown(TransportClosed(f"connection to {self.peer} lost: {exc or 'EOF'}"))

    # ---- internals --------------------------------------------------------------------------------

    def _caller_buffers(
        self, recv_into: Sequence[Any] | None, specs: Sequence[wire.BufferSpec]
    ) -> tuple[list[Any], list[Any]]:
        if recv_into is None:
            fresh = [np.empty(s.shape, np.dtype(s.dtype)) for s in specs]
            return [a.reshape(-1).view(np.uint8).data for a in fresh], list(fresh)
        if len(recv_into) != len(specs):
            raise LocalProtocolError(f"response has {len(specs)} buffers, recv_into {len(recv_into)}")
        views: list[Any] = []
        arrays: list[Any] = []
        for dest, spec in zip(recv_into, specs):
            if framing.is_device_buffer(dest):  # GPU memory: only UCX can write into it
                if self._bulk is None:
                    raise LocalProtocolError("CUDA recv_into needs the ucx bulk path (this connection is inline)")
                if framing.device_spec(dest).nbytes != spec.nbytes:
                    raise LocalProtocolError(f"recv_into device buffer does not fit a {spec.nbytes}-byte buffer")
                views.append(_DeviceDest(dest, spec.nbytes))
                arrays.append(dest)
                continue
            view = framing.as_bytes_view(dest)
            if view.nbytes != spec.nbytes or view.readonly:
                raise LocalProtocolError(f"recv_into buffer of {view.nbytes} bytes does not fit a "
                                         f"{spec.nbytes}-byte response buffer (or is read-only)")
            views.append(view)
            arrays.append(_typed(view, spec))
        return views, arrays

    def _on_response(self, msg: wire.Response) -> None:
        pending = self._pending.get(msg.id)
        if pending is None or pending.future.done():
            return
        arrays = pending.arrays if pending.arrays is not None else []
        # the body is an immutable ``bytes`` (framing), so the payload is viewed, not copied
        pending.future.set_result(Result(memoryview(msg.payload), arrays))

    def _expire(self, req_id: int) -> None:
        """A request's deadline passed (``_Deadlines``): ``request`` turns this into
        ``DeadlineExceeded`` and sends ``Cancel``, exactly as for a timeout during the send."""
        pending = self._pending.get(req_id)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(TimeoutError())

    def _settle(self, req_id: int, exc: BaseException) -> None:
        pending = self._pending.get(req_id)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(exc)

    async def _received_elsewhere(self, req_id: int) -> None:
        """Before a caller that gave up is told: wait for an out-of-band receive of its response's
        bulk into its buffers, if one is under way (a posted UCX receive cannot be taken back, and
        the caller may use its buffers again at once). It ends with its bytes in, or when the
        connection closes (its peer gone: a receive from a dead sender never completes, and its
        bytes never come); a second cancellation of the caller stops the wait."""
        receiving = self._receiving.get(req_id)
        if receiving is not None:
            await self._done_or_closed(receiving)

    async def _done_or_closed(self, future: asyncio.Future[Any]) -> None:
        """Wait until ``future`` is done or this connection closes (``future`` is not cancelled)."""
        if self._closed_exc is None and not future.done():
            closing = self._loop.create_task(self.closed.wait())
            try:
                await asyncio.wait([future, closing], return_when=asyncio.FIRST_COMPLETED)
            finally:
                closing.cancel()

    def _abandon(self, req_id: int) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None and pending.views and self.divert_response is not None:
            # its response's bulk may be arriving into the caller's buffers right now: the rest
            # goes elsewhere, the caller may use them again as soon as it is told
            self.divert_response(req_id)
        if self._closed_exc is None and req_id not in self._unwritten:
            self.metrics.cancels += 1
            self._loop.create_task(self._send_cancel(req_id))

    async def _send_cancel(self, req_id: int) -> None:
        try:
            await self._write(framing.encode_frame(wire.Cancel(req_id)))
        except (OSError, PeersError):
            pass

    @staticmethod
    def _remote_exception(msg: wire.ErrorReply) -> PeersError:
        if msg.kind == "deadline":
            return DeadlineExceeded(f"peer gave up on request {msg.id}: {msg.message}")
        if msg.kind == "cancelled":
            return RequestCancelled(f"peer cancelled request {msg.id}")
        return RemoteError(msg.message, remote_type=msg.kind)

    def _start_handler(self, msg: wire.Request, buffers: list[memoryview]) -> None:
        req_id = msg.id
        if req_id in self._serving:
            raise RemoteProtocolError(f"request id {req_id} reused while in flight", reason="bad_message")
        loop = self._loop
        arrived = loop.time()
        coro = self._serve(msg, buffers, arrived)
        task: asyncio.Task[None]
        if _current_task_of(loop) is not None:  # frames delivered from a task (mem, UCX bulk)
            task = loop.create_task(coro)
        else:
            # one per request, never reused: a handler may keep current_task() and cancel it later
            stand_in = TaskStandIn()
            context = contextvars.copy_context()
            self._stepping = req_id
            _enter_task(loop, stand_in)  # eager.step, inlined: one Python call fewer per request
            try:
                waiting = context.run(coro.send, None)
            except StopIteration:  # replied from inside the read callback: no Task was needed
                _leave_task(loop, stand_in)
                self._stepping = None
                if buffers:
                    self._served(req_id)
                return
            except BaseException:
                _leave_task(loop, stand_in)
                self._stepping = None
                self._served(req_id)
                raise
            _leave_task(loop, stand_in)
            self._stepping = None
            task = continue_in_task(loop, coro, waiting, stand_in, context)
        self._serving[req_id] = task
        # a done-callback (not ``finally``) because a task cancelled before it first runs never
        # executes its body, and its pooled buffers must still go back
        task.add_done_callback(lambda _t: self._served(req_id))
        if self._closed_exc is not None:  # the handler closed us in its first step: cancelled as
            task.cancel()  # ``_shutdown`` cancels every other handler of a closed connection
            return
        if msg.budget_ms is not None:  # a heap entry, not an asyncio.timeout context per request
            self._budgets.add(arrived + max(msg.budget_ms / 1000.0, 0.0), req_id, task)

    def _budget_expired(self, req_id: int) -> None:
        task = self._serving.get(req_id)
        if task is not None and not task.done() and req_id not in self._replying:
            self._expired.add(req_id)
            task.cancel()

    def _served(self, req_id: int) -> None:
        self._serving.pop(req_id, None)
        if self._expired:
            self._expired.discard(req_id)
        if self._replying:
            self._replying.discard(req_id)
        leases = self._leases.pop(req_id, None)
        if self._still_sending and req_id in self._still_sending:  # rare: see ``_finish_send``
            self._still_sending.discard(req_id)
            for lease in leases or ():
                lease.forget()
            return
        if leases is not None:
            if len(leases) == 1 and self._closed_exc is None:
                lease = leases[0]
                if lease is self._spare_lease:  # the kept buffer is back (lent only while none is kept)
                    self._spare = lease
                    return
                if self._keep_spare(lease):
                    return
            for lease in leases:
                lease.release()

    def _keep_spare(self, lease: Lease) -> bool:
        """Keep a served request's receive buffer for the next request's bulk (``allocate``), so
        that a sequence of requests costs no lease and release each: when none is kept, or when
        it is larger than the one kept (which goes back to the pool), up to ``_SPARE_MAX_BYTES``.
        Returns False when the caller should release it."""
        capacity = lease.capacity
        if capacity > _SPARE_MAX_BYTES or (self._spare is not None and capacity <= self._spare_bytes):
            return False
        if self._spare is not None:
            self._spare.release()
        self._spare, self._spare_lease = lease, lease
        self._spare_view, self._spare_bytes = lease.whole(), capacity
        return True

    async def _serve(self, msg: wire.Request, buffers: list[memoryview], arrived: float) -> None:
        """Run the handler under the request's budget (``_budget_expired`` cancels it) and send
        its reply or a typed error."""
        handled = False
        try:
            if self._handler is None:
                raise LocalProtocolError("this side serves no requests")
            deadline = None if msg.budget_ms is None else arrived + max(msg.budget_ms / 1000.0, 0.0)
            # the body is an immutable ``bytes`` (framing), so the payload is viewed, not copied
            if not buffers:
                arrays = []
            elif len(buffers) == 1:
                spec = msg.bulk[0]
                if spec.nbytes and len(spec.shape) == 1:  # ``_typed``'s common case, inlined
                    arrays = [_frombuffer(buffers[0], _DTYPES[spec.dtype])]
                else:
                    arrays = [_typed(buffers[0], spec)]
            else:
                arrays = [_typed(v, s) for v, s in zip(buffers, msg.bulk)]
            incoming = Incoming(memoryview(msg.payload), arrays, deadline, self.peer)
            reply = await self._handler(incoming)
            handled = True
            if not isinstance(reply, Reply):
                raise LocalProtocolError(f"handler returned {type(reply).__name__}, not Reply")
            self.metrics.requests_served += 1
            if msg.id in self._serving:  # the handler waited: it runs in a Task
                if deadline is not None:
                    self._replying.add(msg.id)  # the budget bounds the handler only, not the reply
                if len(self._serving) > 1:
                    # a group commit wakes many at once: the replies of this iteration leave in
                    # one write
                    self._cork_until_next_iteration()
            if reply.bulk:
                sending = self._send_message(msg.id, reply.payload, reply.bulk, response=True, budget_s=None)
            else:  # the common reply: no bulk, framed here (``_send_message``'s first branch)
                payload = reply.payload
                body = _msgpack(wire.Response(msg.id, _RAW_NONE if payload is None else _payload(payload),
                                                  _NO_SPECS, wire.BULK_INLINE))
                sending = self._send_small(body, msg.id, response=True)
            if sending is not None:
                await sending
        except asyncio.CancelledError:
            if not handled and msg.id in self._expired and self._closed_exc is None:
                await self._send_error(msg.id, "deadline", "handler exceeded the request's budget")
            elif self._closed_exc is None:
                await self._send_error(msg.id, "cancelled", "")
        except Exception as exc:  # noqa: BLE001 - a handler's failure goes to the caller, typed
            if isinstance(exc, OSError) and (handled or self._closed_exc is not None):
                return  # the connection going away (TransportClosed is one): the caller fails there
            # (a handler's own OSError, a full disk, on a live connection is answered too: it was
            # taken for the connection's end, and the caller waited for its deadline)
            log.debug("handler failed peer=%s request=%d", self.peer, msg.id, exc_info=True)
            await self._send_error(msg.id, type(exc).__name__, str(exc)[:4000])

    async def _send_error(self, req_id: int, kind: str, message: str) -> None:
        try:
            await self._write(framing.encode_frame(wire.ErrorReply(req_id, kind[:128], message)))
        except (OSError, PeersError):
            pass

    def _send_message(
        self, req_id: int, payload: Any, bulk: Sequence[Any], *, response: bool, budget_s: float | None
    ) -> Awaitable[None] | None:
        """Encode and send one request or response. Returns None when it is completely sent
        (the common case: no await at all), else an awaitable that finishes the send.

        Raises:
            LocalProtocolError: bad bulk buffers or a limit exceeded (nothing was written).
        """
        raw = _RAW_NONE if payload is None else _payload(payload)
        message: wire.Message
        if not bulk:  # the common small message: no specs, no views, inline
            if response:
                message = wire.Response(req_id, raw, _NO_SPECS, wire.BULK_INLINE)
            else:
                message = wire.Request(req_id, raw, _NO_SPECS, None if budget_s is None else budget_s * 1000.0,
                                       wire.BULK_INLINE)
            return self._send_small(_msgpack(message), req_id, response=response)
        if len(bulk) == 1 and self._bulk is None:  # one host buffer, inline: ``encode_frame`` inlined
            spec, view = framing.spec_for(bulk[0], with_checksum=self._checksum)
            nbytes = spec.nbytes
            if response:
                message = wire.Response(req_id, raw, [spec], wire.BULK_INLINE)
            else:
                message = wire.Request(req_id, raw, [spec], None if budget_s is None else budget_s * 1000.0,
                                       wire.BULK_INLINE)
            body = _msgpack(message)
            if len(body) > framing.MAX_BODY_BYTES:
                raise LocalProtocolError(f"control body of {len(body)} bytes exceeds MAX_BODY_BYTES")
            head = _pack_header(framing.MAGIC, framing.FRAME_VERSION, 0, len(body), 1, 0, nbytes) + body
            parts: list[bytes | memoryview] = [head, view] if nbytes else [head]
            state = self._write_now(parts)
            if state == _FLUSHED:
                self.metrics.bytes_sent += nbytes
                return None
            return self._finish_send(parts, state, [view], wire.BULK_INLINE, req_id, response, nbytes)
        specs: list[wire.BufferSpec] = []
        views: list[Any] = []  # memoryviews of host memory, or device arrays (ucx path only)
        nbytes = 0
        for buf in bulk:
            if self._bulk is not None and framing.is_device_buffer(buf):
                spec, view = framing.device_spec(buf), buf
            else:
                spec, view = framing.spec_for(buf, with_checksum=self._checksum)
            specs.append(spec)
            views.append(view)
            nbytes += spec.nbytes
        out_of_band = self._bulk is not None and (
            nbytes >= self._bulk.min_bytes
            or any(not isinstance(v, memoryview) for v in views))  # device buffers need UCX
        via = wire.BULK_UCX if out_of_band else wire.BULK_INLINE
        if response:
            message = wire.Response(req_id, raw, specs, via)
        else:
            budget_ms = None if budget_s is None else budget_s * 1000.0
            message = wire.Request(req_id, raw, specs, budget_ms, via)
        parts = framing.encode_frame(message, views, out_of_band=via != wire.BULK_INLINE)
        state = self._write_now(parts)
        if state == _FLUSHED and via == wire.BULK_INLINE:
            self.metrics.bytes_sent += nbytes
            return None
        return self._finish_send(parts, state, views, via, req_id, response, nbytes)

    def _send_small(self, body: bytes, req_id: int, *, response: bool) -> Awaitable[None] | None:
        """Frame and send an encoded bulk-free body (``encode_frame``'s first case, inlined)."""
        if len(body) > framing.MAX_BODY_BYTES:
            raise LocalProtocolError(f"control body of {len(body)} bytes exceeds MAX_BODY_BYTES")
        parts: list[bytes | memoryview] = [_pack_header(framing.MAGIC, framing.FRAME_VERSION, 0, len(body), 0, 0, 0)
                                           + body]
        link: Any = self.link
        if not self._fast_write or self._slow_writers or self._closed_exc is not None or not link.flushed:
            return self._finish_send(parts, _NOT_WRITTEN, [], wire.BULK_INLINE, req_id, response, 0)
        try:  # ``_write_now``, inlined
            link.write(parts)
        except OSError:
            if self._closed_exc is not None:
                raise self._closed_error() from None
            raise
        if link.flushed:
            return None
        return self._finish_send(parts, _QUEUED, [], wire.BULK_INLINE, req_id, response, 0)

    async def _finish_send(self, parts: list[bytes | memoryview], state: int, views: list[Any], via: int,
                           req_id: int, response: bool, nbytes: int) -> None:
        """The rest of a send that could not finish at once. A cancellation (the caller's
        deadline, a ``Cancel`` of the handler) that comes once the sender's buffers were handed
        over waits until they are no longer read (``_sent_elsewhere``) before it goes on."""
        if state != _FLUSHED:
            # inline bulk: the link may still read the sender's buffers until it drained (uvloop
            # keeps views of them, it copies nothing)
            lent = via == wire.BULK_INLINE and any(v.nbytes for v in views)
            if state == _NOT_WRITTEN:
                if not response:
                    self._unwritten.add(req_id)  # until ``_write_locked`` writes it
                await self._write_locked(parts, lent=lent, request_id=None if response else req_id)
            else:
                try:
                    await self._write_locked(None)
                except asyncio.CancelledError:
                    if lent:  # written already, whether the lock was taken or not
                        await self._sent_elsewhere(self.link.drain())
                    raise
        if via != wire.BULK_INLINE:
            assert self._bulk is not None
            sends = asyncio.gather(*(self._bulk.send(bulk_tag(self._send_salt, req_id, i, response=response), v)
                                     for i, v in enumerate(views) if v.nbytes))
            try:
                await asyncio.shield(sends)
            except asyncio.CancelledError:
                # a posted UCX send cannot be taken back, and ``ep.abort`` does not end it either:
                # one still posted when the wait ends (the connection closed, a second
                # cancellation) may be read by its receiver later, and a reply's buffers may be its
                # request's pooled ones (a handler that echoes): those are never lent again then
                if response:
                    self._still_sending.add(req_id)  # until it ended (``_served``)
                if await self._sent_elsewhere(sends):
                    self._still_sending.discard(req_id)
                raise
        self.metrics.bytes_sent += nbytes

    async def _sent_elsewhere(self, sending: Awaitable[Any]) -> bool:
        """A sender gave up (see ``_finish_send``) while its buffers may still be read: wait for
        ``sending`` (a drain, posted UCX sends) to end before it is told, so that it may use its
        buffers again at once (``_received_elsewhere`` is the receive side's twin). It ends when
        they are out or when the connection closes (its peer gone: nothing more is read then —
        except by a UCX send still posted, see ``_finish_send``); a second cancellation stops the
        wait. Returns whether ``sending`` ended."""
        future = asyncio.ensure_future(sending)
        try:
            await self._done_or_closed(future)
            return future.done()
        finally:
            if not future.done():
                future.cancel()
                # a cancelled gather (UCX sends) ends with its CancelledError set, not cancelled:
                # retrieved when it ends, or asyncio logs it as never retrieved, at ERROR
                future.add_done_callback(_retrieved)
            elif not future.cancelled():
                future.exception()  # retrieved: the caller is told of its cancellation instead

    async def _receive_out_of_band(self, frame: framing.Frame) -> None:
        msg = frame.message
        assert isinstance(msg, (wire.Request, wire.Response)) and self._bulk is not None
        response = isinstance(msg, wire.Response)
        try:
            await asyncio.gather(*(self._bulk.recv(bulk_tag(self._recv_salt, msg.id, i, response=response), v)
                                   for i, v in enumerate(frame.buffers) if v.nbytes))
            framing.verify_checksums(msg.bulk, frame.buffers)
        except RemoteProtocolError as exc:
            self.metrics.count_protocol_error(exc.reason)
            self.fail(exc)
            return
        except (OSError, PeersError) as exc:
            self._shutdown(exc)
            self.link.abort()
            return
        finally:
            if response:
                self._receiving.pop(msg.id, None)
        if response:
            self._on_response(msg)  # type: ignore[arg-type]
        elif self._closed_exc is None:
            self._start_handler(msg, frame.buffers)  # type: ignore[arg-type]

    def _closed_error(self) -> TransportClosed:
        """A fresh error of the kind that closed us (``PeerDead`` stays ``PeerDead``)."""
        exc = self._closed_exc
        kind = type(exc) if isinstance(exc, TransportClosed) else TransportClosed
        error = kind(f"connection to {self.peer} is closed: {exc}")
        error.__cause__ = exc
        return error

    async def _write(self, parts: Sequence[bytes | memoryview]) -> None:
        if self._closed_exc is not None:
            raise self._closed_error()
        state = self._write_now(parts)
        if state != _FLUSHED:
            await self._write_locked(parts if state == _NOT_WRITTEN else None)

    def _cork_until_next_iteration(self) -> None:
        """Hold the frames written in this loop iteration and write them together at the start of
        the next one (``Link.cork``): a burst then costs one ``writev``, not one per frame."""
        if not self._corked:
            self._corked = True
            self.link.cork()
            self._loop.call_soon(self._uncork)

    def _uncork(self) -> None:
        self._corked = False
        self.link.uncork()

    def _write_now(self, parts: Sequence[bytes | memoryview]) -> int:
        """The fast path: when no writer waits and the link's buffer is empty, write at once.

        Returns ``_FLUSHED`` (everything reached the kernel: the caller may reuse its buffers, no
        await needed), ``_QUEUED`` (written, but ``drain`` must still be awaited) or
        ``_NOT_WRITTEN`` (take the lock: ``_write_locked(parts)``). Frames are written whole by one
        synchronous ``link.write``, so they never interleave whichever path wrote them.
        """
        if not self._fast_write or self._slow_writers or self._closed_exc is not None:
            return _NOT_WRITTEN
        link: Any = self.link
        if not link.flushed:
            return _NOT_WRITTEN
        try:
            link.write(parts)
        except OSError:
            if self._closed_exc is not None:
                raise self._closed_error() from None
            raise
        return _FLUSHED if link.flushed else _QUEUED

    async def _write_locked(self, parts: Sequence[bytes | memoryview] | None, *, lent: bool = False,
                            request_id: int | None = None) -> None:
        """Write ``parts`` (None: already written) under the write lock and wait for ``drain``.
        ``lent``: the parts hold the sender's bulk buffers; a cancellation once they were written
        waits for the drain (``_sent_elsewhere``) before it goes on. ``request_id``: the parts are
        that request's frame, no longer ``_unwritten`` once written."""
        self._slow_writers += 1
        try:
            async with self._write_lock:
                if self._closed_exc is not None:
                    raise self._closed_error()
                try:
                    if parts is not None:
                        self.link.write(parts)
                        if request_id is not None:
                            self._unwritten.discard(request_id)
                    try:
                        await self.link.drain()
                    except asyncio.CancelledError:
                        if lent:  # a drain waits for everything written so far: wait anew
                            await self._sent_elsewhere(self.link.drain())
                        raise
                except OSError:
                    if self._closed_exc is not None:
                        raise self._closed_error() from None
                    raise
        finally:
            self._slow_writers -= 1

    def _shutdown(self, exc: BaseException) -> None:
        if self._closed_exc is not None:
            return
        self._closed_exc = exc
        self.metrics.connections_closed += 1
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(exc)
        for task in self._serving.values():
            task.cancel()
        self._deadlines.close()
        self._budgets.close()
        # bulk cut off mid-frame: give the buffers back — unless a UCX receive into them is still
        # posted (it cannot be cancelled), then they are forgotten, never lent again
        stuck = self._bulk is not None and self._bulk.pending_receives > 0
        if self._spare is not None:
            self._spare.release()
        self._spare = self._spare_lease = None
        self._spare_view = memoryview(b"")
        # a handler's leases go back when it ends (``_served``), also one that closed us in its
        # first step (``_stepping``): it still reads their views
        for req_id in [r for r in self._leases if r not in self._serving and r != self._stepping]:
            for lease in self._leases.pop(req_id):
                lease.forget() if stuck else lease.release()
        if self._bulk is not None:
            self._bulk.close()
        self.closed.set()
        if self._on_close is not None:
            self._on_close(self)
