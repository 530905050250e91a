"""Stream sources driven remotely: the source-control messages served by every storage node's
``StreamEndpoint``, the node-local ``SourceRegistry`` behind them, and the client calls.

Theory of operation
-------------------
A stream's *sender* must run where its source's rows are: it reads them in synchronous cuts and
tees every batch the source applies (streaming/sender.py). In the daemon each storage node is its own
process and a topology operation is coordinated by one of them (the joining node, a survivor for
removenode), so the coordinator drives each remote source through that source's stream endpoint:

- ``SourceStart`` carries the operation's two member lists (name, weight), R, the strategy, the
  live set and the avoided sources. The source rebuilds both ``Placement``\\ s and the
  ``TransferRule`` and computes the columns it sends to that target itself (rebalance/plan.py: every
  node computes the same plan from the same inputs); the coordinator may add the columns it
  planned in bulk (u64; the union is taken). The source then runs an ordinary ``StreamRunner``
  (same tee, same forwarding rules: ``direct_epoch`` is the new placement's epoch).
- The ``SourceRegistry`` keeps stream id -> runner. A ``SourceStart`` for a known id *resumes*
  that runner (paused -> streaming) instead of starting a second one, so the coordinator may
  re-issue it after every reconnect (idempotent). A ``SourceStart`` with ``resume=True`` (the
  coordinator had an acknowledged start) or a ``SourceStatus`` for an id the registry does not
  know means the source restarted: its queue of forwarded writes was in memory, so the stream
  cannot continue; the reply is a clear ``SourceRefused`` (docs/topology.md).
- ``SourcePause`` stops sending (the runner keeps collecting the source's writes), ``SourceClose``
  ends the deltas at cutover, ``SourceAbort`` gives up, ``SourceRate`` changes that stream's
  throttle. Every reply to them is the stream's ``SourceState`` (state, caught up, finished,
  error, the runner's progress dictionary).
- A stream no coordinator has asked about for ``orphan_after_s`` (default ``ORPHAN_AFTER_S``) is
  aborted: its coordinator is gone, and an orphaned sender would forward the source's writes
  forever (an operation paused longer than that fails on resume, with that reason).
- Cutover steps that touch every node's hint store are requests too: ``HintsHeld(names)``,
  ``DeliverHints()``, ``DropHints(name)``; planning uses ``ListColumns()`` (the u64 column ids the
  node holds, in bulk).

Register handoff (rebalance/register_handoff.py): ``RegisterExport``, ``RegisterImport``,
``RegisterUnseal`` are served here too (``register_call``).

``DiscardStream`` goes to a stream's *receiver* (its endpoint serves it, not the registry): the
operation that opened the stream was abandoned before its cutover (rebalance/operations.py).
``DiscardStreamsFrom`` too: a removenode or replace of a dead member discards, on every receiver,
the open streams that member sent (a decommissioning node killed mid-stream for good left them).

Tags share the stream endpoint's tag space (streaming/stream.py uses 1-3 and 64-66): source requests are
16-25, 29 (``DiscardStream``) and 30 (``DiscardStreamsFrom``), replies 96-99, 102 and 103. Append
only: a node older than a tag answers a ``StreamRefused`` ("undecodable stream request").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec
import numpy as np
from numpy.typing import NDArray

from giaannd.errors import RemoteFault
from giaannd.storage.rebalance import register_handoff as rh
from giaannd.storage.rebalance.plan import TransferRule, owns
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.sender import StreamRunner, Throttle
from giaannd.storage.streaming.stream import StreamRefused
from peers.placement import Member, Placement
from peers.transport import Connection, Transport, connect

__all__ = [
    "ColumnList",
    "DeliverHints",
    "DiscardStream",
    "DiscardStreamsFrom",
    "DropHints",
    "HintCount",
    "HintsHeld",
    "ListColumns",
    "SourceAbort",
    "SourceClient",
    "SourceClose",
    "SourceControlError",
    "SourcePause",
    "SourceRate",
    "SourceRefused",
    "SourceRegistry",
    "SourceRequest",
    "SourceStart",
    "SourceState",
    "SourceStatus",
    "StreamDiscarded",
    "StreamsDiscarded",
    "deliver_hints",
    "discard_stream",
    "discard_streams_from",
    "drop_hints",
    "hints_held",
    "list_columns",
    "register_call",
]

log = logging.getLogger(__name__)

_U64 = Annotated[int, msgspec.Meta(ge=0)]
#: Bound on one source-control request (a DeliverHints waits for the deliveries it pushes).
CONTROL_REQUEST_TIMEOUT_S: Final = 30.0
#: Finished (done / failed) streams a registry keeps answering SourceStatus for; older ones are
#: forgotten (a coordinator polls a stream until it is finished, so it has seen the outcome).
MAX_FINISHED_SOURCES: Final = 256
#: A stream with no control request for this long is aborted as orphaned (module docstring). A
#: running coordinator polls every POLL_S[1] at most; a paused one sends nothing, so this also
#: bounds how long an operation may stay paused.
ORPHAN_AFTER_S: Final = 3600.0


# -- messages (append only; tags share the stream endpoint's space) ------------------------------
class SourceStart(msgspec.Struct, frozen=True, tag=16):
    """Start (or resume) streaming this node's columns for ``target`` to ``target_stream_address``.
    Bulk: optionally the planned columns (u64). Reply: ``SourceState`` or ``SourceRefused``."""

    stream_id: _U64
    target_stream_address: str
    source: str
    target: str
    old_members: list[tuple[str, float]]
    new_members: list[tuple[str, float]]
    replicas: int
    strategy: str = "hash"
    live: list[str] = []
    avoid: list[str] = []
    chunk_bytes: int | None = None
    rate_bytes_s: float | None = None
    label: str = ""
    resume: bool = False  # the coordinator had an acknowledged start: an unknown id is a restart


class SourceStatus(msgspec.Struct, frozen=True, tag=17):
    stream_id: _U64


class SourcePause(msgspec.Struct, frozen=True, tag=18):
    stream_id: _U64


class SourceClose(msgspec.Struct, frozen=True, tag=19):
    stream_id: _U64


class SourceAbort(msgspec.Struct, frozen=True, tag=20):
    stream_id: _U64
    reason: str = "aborted by the coordinator"


class SourceRate(msgspec.Struct, frozen=True, tag=21):
    stream_id: _U64
    rate_bytes_s: float | None = None


class ListColumns(msgspec.Struct, frozen=True, tag=22):
    """Reply: ``ColumnList`` (bulk: the u64 column ids this node holds rows of, sorted)."""


class HintsHeld(msgspec.Struct, frozen=True, tag=23):
    """Reply: ``HintCount`` (hints this node holds for ``names``)."""

    names: list[str]


class DeliverHints(msgspec.Struct, frozen=True, tag=24):
    """Reply: ``HintCount`` (hints delivered by this push)."""


class DropHints(msgspec.Struct, frozen=True, tag=25):
    """Reply: ``HintCount`` (hints forgotten for ``name``, a member that left the placement)."""

    name: str


class DiscardStream(msgspec.Struct, frozen=True, tag=29):
    """To a stream's *receiver*: the operation that opened ``stream_id`` was abandoned before its
    cutover. The receiver drops the rows of the stream's columns that it does not own and that no
    other open stream brings, and never accepts the stream again (rebalance/endpoint.py). Reply:
    ``StreamDiscarded``; ``StreamRefused`` when it cannot tell what it owns (a placement override
    in force: an operation's cutover is under way)."""

    stream_id: _U64


class DiscardStreamsFrom(msgspec.Struct, frozen=True, tag=30):
    """To a *receiver*: ``source`` is a dead member that a removenode or replace removes, so no
    stream it sent will go on; the receiver discards, as ``DiscardStream`` does, every open stream
    whose hello named ``source`` as its node (``StreamHello.source_node``; streams from senders
    older than that field are left to the idle-stream sweep). Reply: ``StreamsDiscarded``;
    ``StreamRefused`` when ``source`` is live in the receiver's view (its streams may be running)
    or a placement override is in force."""

    source: str


class SourceState(msgspec.Struct, frozen=True, tag=96):
    stream_id: _U64
    state: str
    caught_up: bool
    finished: bool
    error: str | None = None
    progress: dict[str, Any] = {}


class SourceRefused(msgspec.Struct, frozen=True, tag=97):
    stream_id: _U64
    reason: str


class ColumnList(msgspec.Struct, frozen=True, tag=98):
    """Bulk: u64 column ids."""


class HintCount(msgspec.Struct, frozen=True, tag=99):
    count: int


class StreamDiscarded(msgspec.Struct, frozen=True, tag=102):
    """The stream is discarded (durable); ``rows`` of ``columns`` columns were dropped (logged and
    synced) by this request: 0 when an earlier one had."""

    stream_id: _U64
    columns: int
    rows: int


class StreamsDiscarded(msgspec.Struct, frozen=True, tag=103):
    """``streams`` open streams from ``source`` are discarded (durable); ``rows`` were dropped."""

    source: str
    streams: int
    rows: int


SourceRequest = (SourceStart | SourceStatus | SourcePause | SourceClose | SourceAbort | SourceRate
                 | ListColumns | HintsHeld | DeliverHints | DropHints | rh.RegisterExport | rh.RegisterImport
                 | rh.RegisterUnseal | DiscardStream | DiscardStreamsFrom)
SourceReply = (SourceState | SourceRefused | ColumnList | HintCount | StreamRefused | rh.RegisterStates
               | rh.RegisterCount | StreamDiscarded | StreamsDiscarded)
_REPLY_DECODER: Final = msgspec.msgpack.Decoder(SourceReply)
_ENC: Final = msgspec.msgpack.Encoder()


class SourceControlError(RemoteFault):
    """The source refused (restarted, wrong node, bad request): the stream cannot continue."""

    reason = "source_refused"


# -- the node-local registry ----------------------------------------------------------------------
@dataclass
class _Source:
    runner: StreamRunner
    throttle: Throttle
    task: asyncio.Task[None] | None = None
    last_seen: float = field(default_factory=time.monotonic)
    #: (old members, new members) of the operation: one operation at a time per source
    change: tuple[Any, ...] = ()


def _change_of(msg: SourceStart) -> tuple[Any, ...]:
    """The placement change a stream belongs to (its operation, as far as a source can tell)."""
    return (tuple(map(tuple, msg.old_members)), tuple(map(tuple, msg.new_members)))


def _restarted(source: str, stream_id: int) -> str:
    return (f"source {source} does not know stream {stream_id:#x}: it restarted since the stream "
            "began and its queue of forwarded writes was lost; the operation fails, its receivers "
            "drop what its streams brought, and the verb can then be run again")


class SourceRegistry:
    """The streams this node sends for remote coordinators (module docstring).

    Args:
        service: this node's storage service (the source).
        transport: dials the targets' stream endpoints.
        orphan_after_s: abort a stream no coordinator asked about for this long.
    """

    def __init__(self, service: StorageService, transport: Transport, orphan_after_s: float = ORPHAN_AFTER_S) -> None:
        self.service, self.transport, self.orphan_after_s = service, transport, orphan_after_s
        self._sources: dict[int, _Source] = {}
        self._watchdog: asyncio.Task[None] | None = None

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._sources

    @property
    def active(self) -> int:
        """Streams this node is sending that have not finished (done or failed)."""
        return sum(1 for e in self._sources.values() if not e.runner.finished.is_set())

    async def handle(self, msg: Any, bulk: Sequence[np.ndarray]) -> tuple[msgspec.Struct, list[Any]]:
        """Serve one source-control request; returns (reply, reply bulk)."""
        if isinstance(msg, (ListColumns, SourceStart)) and (folds := self.service.folds) is not None:
            # the held columns come from the key order, which a drop or a repair's listing changes
            # in a worker thread behind the fold gate: not while one does (no await after this)
            await folds.ready()
        if isinstance(msg, ListColumns):
            return ColumnList(), [self.columns_held()]
        if isinstance(msg, HintsHeld):
            hints = self.service.hints
            return HintCount(0 if hints is None else sum(len(hints.pending(n)) for n in msg.names)), []
        if isinstance(msg, DeliverHints):
            return HintCount(await self.service.deliver_hints()), []
        if isinstance(msg, DropHints):
            return HintCount(self.drop_hints(msg.name)), []
        if isinstance(msg, SourceStart):
            return self.start(msg, bulk), []
        if isinstance(msg, (rh.RegisterExport, rh.RegisterImport, rh.RegisterUnseal)):
            return await rh.serve(self.service, msg), []
        entry = self._sources.get(msg.stream_id)
        if entry is None:
            return SourceRefused(msg.stream_id, _restarted(self.service.node_name, msg.stream_id)), []
        entry.last_seen = time.monotonic()
        if isinstance(msg, SourcePause):
            self._stop_task(entry)
        elif isinstance(msg, SourceClose):
            entry.runner.close()
            self._spawn(entry)  # it must run to send the last deltas and finish
        elif isinstance(msg, SourceAbort):
            self._stop_task(entry)
            entry.runner.abort(msg.reason)
        elif isinstance(msg, SourceRate):
            entry.throttle.set(msg.rate_bytes_s)
        return self._state(msg.stream_id, entry), []

    def columns_held(self) -> NDArray[np.uint64]:
        store = self.service.store
        if store is None:
            raise RuntimeError("storage service is not open")
        return store.store.held_columns()

    def drop_hints(self, name: str) -> int:
        """Forget the hints held for ``name``, removed for good (hints.py ``drop``)."""
        hints = self.service.hints
        return hints.drop(name) if hints is not None else 0

    def start(self, msg: SourceStart, bulk: Sequence[np.ndarray]) -> SourceState | SourceRefused:
        entry = self._sources.get(msg.stream_id)
        if entry is None:
            if msg.resume:
                return SourceRefused(msg.stream_id, _restarted(self.service.node_name, msg.stream_id))
            if msg.source != self.service.node_name:
                return SourceRefused(msg.stream_id, f"this node is {self.service.node_name!r}, not {msg.source!r}")
            change = _change_of(msg)
            busy = [e for e in self._sources.values() if not e.runner.finished.is_set() and e.change != change]
            if busy:
                return SourceRefused(msg.stream_id, (
                    f"another topology operation is streaming from {self.service.node_name} "
                    f"({busy[0].runner.label}): one operation at a time; wait for it or cancel it"))
            try:
                entry = self._new(msg, bulk)
                entry.change = change
            except (ValueError, TypeError, RuntimeError) as exc:
                return SourceRefused(msg.stream_id, f"{type(exc).__name__}: {exc}"[:400])
            self._prune()
            self._sources[msg.stream_id] = entry
            log.info("source stream started stream=%#x label=%s columns=%d", msg.stream_id, msg.label,
                     entry.runner.sender.columns.size)
        else:
            entry.throttle.set(msg.rate_bytes_s)
            entry.last_seen = time.monotonic()
            if msg.target_stream_address != entry.runner.target_address:
                # the target restarted (new port): reconnect there, resuming from its durable point
                log.info("source stream target moved stream=%#x to=%s", msg.stream_id,
                         msg.target_stream_address)
                entry.runner.retarget(msg.target_stream_address)
        self._spawn(entry)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return self._state(msg.stream_id, entry)

    def _new(self, msg: SourceStart, bulk: Sequence[np.ndarray]) -> _Source:
        strategy: Any = msg.strategy
        old = Placement(tuple(Member(n, w) for n, w in msg.old_members), msg.replicas, strategy)
        new = Placement(tuple(Member(n, w) for n, w in msg.new_members), msg.replicas, strategy)
        rule = TransferRule(old, new, frozenset(msg.live), frozenset(msg.avoid))
        # the coordinator's columns for this stream; the runner adds every column held here that
        # the rule gives it (``born_columns``). uint64 only: columns of another dtype were cast
        # (floats and negatives to other columns)
        if len(bulk) == 1 and bulk[0].ndim == 1 and bulk[0].dtype == np.uint64:
            mine = bulk[0]
        elif bulk:
            raise ValueError("SourceStart: expected at most one 1-d uint64 array of columns")
        else:
            mine = np.zeros(0, np.uint64)
        throttle = Throttle(msg.rate_bytes_s)
        runner = StreamRunner(self.service, self.transport, msg.target_stream_address, mine, msg.stream_id,
                              chunk_bytes=msg.chunk_bytes, throttle=throttle, label=msg.label,
                              direct_epoch=new.epoch,
                              claims=functools.partial(rule.claims, msg.source, msg.target),
                              source_keeps=functools.partial(owns, new, msg.source))
        return _Source(runner, throttle)

    def _spawn(self, entry: _Source) -> None:
        if entry.runner.state in ("done", "failed"):
            return
        if entry.task is None or entry.task.done():
            entry.task = asyncio.get_running_loop().create_task(entry.runner.run())

    @staticmethod
    def _stop_task(entry: _Source) -> None:
        if entry.task is not None:
            entry.task.cancel()
            entry.task = None

    async def _watch(self) -> None:
        """Abort orphaned streams (module docstring); ends when nothing is left to watch."""
        while any(not e.runner.finished.is_set() for e in self._sources.values()):
            await asyncio.sleep(min(60.0, self.orphan_after_s / 4))
            now = time.monotonic()
            for sid, entry in list(self._sources.items()):
                if not entry.runner.finished.is_set() and now - entry.last_seen > self.orphan_after_s:
                    log.warning("source stream orphaned stream=%#x label=%s idle_s=%.0f", sid,
                                entry.runner.label, now - entry.last_seen)
                    self._stop_task(entry)
                    entry.runner.abort(f"orphaned: no request from its coordinator for {self.orphan_after_s:.0f}s")

    def _prune(self) -> None:
        finished = [sid for sid, e in self._sources.items() if e.runner.finished.is_set()]
        for sid in finished[: max(0, len(finished) - MAX_FINISHED_SOURCES)]:
            del self._sources[sid]

    @staticmethod
    def _state(stream_id: int, entry: _Source) -> SourceState:
        r = entry.runner
        return SourceState(stream_id, r.state, r.caught_up.is_set(), r.finished.is_set(), r.error, r.progress())

    async def close(self) -> None:
        """The node stops: abort every stream it still sends (their coordinators see the refusal)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        for entry in self._sources.values():
            task = entry.task
            self._stop_task(entry)
            entry.runner.abort("source node stopped")
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._sources.clear()


# -- client side ----------------------------------------------------------------------------------
class SourceClient:
    """One control connection to a node's stream endpoint (reconnects on demand)."""

    def __init__(self, transport: Transport, address: str, *, timeout_s: float = CONTROL_REQUEST_TIMEOUT_S) -> None:
        self.transport, self.address, self.timeout_s = transport, address, timeout_s
        self._conn: Connection | None = None

    @property
    def is_connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed

    async def request(self, msg: msgspec.Struct, bulk: Sequence[Any] = ()) -> tuple[Any, list[np.ndarray]]:
        """Send one request; returns the decoded reply and its bulk.

        Raises:
            SourceControlError: the endpoint refused (``SourceRefused`` or an undecodable request).
            PeersError / OSError / TimeoutError: the node is unreachable (retry later).
        """
        if self._conn is None or self._conn.is_closed:
            self._conn = await connect(self.transport, self.address, timeout_s=min(5.0, self.timeout_s))
        res = await self._conn.request(_ENC.encode(msg), list(bulk), timeout_s=self.timeout_s)
        reply = _REPLY_DECODER.decode(res.payload)
        if isinstance(reply, (SourceRefused, StreamRefused)):
            raise SourceControlError(reply.reason)
        return reply, list(res.bulk)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


async def _once(transport: Transport, address: str, msg: msgspec.Struct) -> tuple[Any, list[np.ndarray]]:
    client = SourceClient(transport, address)
    try:
        return await client.request(msg)
    finally:
        await client.close()


def _count(reply: Any) -> int:
    if not isinstance(reply, HintCount):
        raise SourceControlError(f"unexpected reply {type(reply).__name__}")
    return reply.count


async def list_columns(transport: Transport, address: str) -> NDArray[np.uint64]:
    """The column ids the node at ``address`` (a stream endpoint) holds rows of."""
    reply, bulk = await _once(transport, address, ListColumns())
    if not isinstance(reply, ColumnList) or len(bulk) != 1:
        raise SourceControlError(f"unexpected reply {type(reply).__name__} to ListColumns")
    return np.asarray(bulk[0]).astype(np.uint64, copy=False)


async def discard_stream(transport: Transport, address: str, stream_id: int) -> StreamDiscarded:
    """Make the receiver at ``address`` (its stream endpoint) discard ``stream_id`` (``DiscardStream``).

    Raises:
        SourceControlError: the receiver refused (its placement is overridden: a cutover runs).
        PeersError / OSError / TimeoutError: the node is unreachable.
    """
    reply, _ = await _once(transport, address, DiscardStream(stream_id))
    if not isinstance(reply, StreamDiscarded):
        raise SourceControlError(f"unexpected reply {type(reply).__name__} to DiscardStream")
    return reply


async def discard_streams_from(transport: Transport, address: str, source: str) -> StreamsDiscarded:
    """Make the receiver at ``address`` discard the open streams ``source`` sent (``DiscardStreamsFrom``).

    Raises:
        SourceControlError: the receiver refused (``source`` is live there, a cutover runs, or it is
            older than the message).
        PeersError / OSError / TimeoutError: the node is unreachable.
    """
    reply, _ = await _once(transport, address, DiscardStreamsFrom(source))
    if not isinstance(reply, StreamsDiscarded):
        raise SourceControlError(f"unexpected reply {type(reply).__name__} to DiscardStreamsFrom")
    return reply


async def hints_held(transport: Transport, address: str, names: Sequence[str]) -> int:
    """Hints the node at ``address`` holds for ``names``."""
    return _count((await _once(transport, address, HintsHeld(list(names))))[0])


async def deliver_hints(transport: Transport, address: str) -> int:
    """Make the node at ``address`` push its hints now; returns how many it delivered."""
    return _count((await _once(transport, address, DeliverHints()))[0])


async def drop_hints(transport: Transport, address: str, name: str) -> int:
    """Make the node at ``address`` forget its hints for ``name``; returns how many."""
    return _count((await _once(transport, address, DropHints(name)))[0])


async def register_call(transport: Transport, address: str,
                        msg: rh.HandoffRequest) -> rh.RegisterStates | rh.RegisterCount:
    """One register-handoff request to the node at ``address`` (its stream endpoint)."""
    reply, _ = await _once(transport, address, msg)
    if isinstance(reply, StreamRefused):
        raise SourceControlError(f"register handoff refused: {reply.reason}")
    if not isinstance(reply, (rh.RegisterStates, rh.RegisterCount)):
        raise SourceControlError(f"unexpected reply {type(reply).__name__} to {type(msg).__name__}")
    return reply
