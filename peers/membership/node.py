"""asyncio glue for the membership core: clock, timers, UDP and TCP, keyring.

This module owns no protocol rules (STYLE.md item 2): it feeds stimuli into
``Membership.handle`` and carries out the returned actions. UDP carries probes
and gossip; TCP carries push-pull, join and the fallback probe, one sealed
length-prefixed frame each way per connection. Peer garbage is dropped, counted
(``rejected_<reason>``) and logged at most once per reason every 10 s, with the number held back
(``peers.log_limiter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import socket
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable

import msgspec

from peers.acceptor import Acceptor
from peers.keyring import Keyring
from peers.log_limiter import LogLimiter
from peers.membership.codec import PacketCodec, PacketRejected
from peers.membership.config import MembershipConfig
from peers.membership.events import (
    Action,
    Emit,
    Join,
    JoinFinished,
    Leave,
    MemberEvent,
    NameConflict,
    OpenStream,
    Received,
    ReplyStream,
    ReportUnreachable,
    Send,
    SetTimer,
    Start,
    Stimulus,
    StreamReply,
    StreamRequest,
    TimerFired,
    UpdateMeta,
)
from peers.membership.messages import Addr, MemberStatus, PushPull, StreamMessage
from peers.membership.state import Membership
from peers.retry import RetryPolicy, attempts

__all__ = ["JoinError", "MemberInfo", "MembershipNode", "NameConflictError"]

log = logging.getLogger(__name__)

#: Log each kind of rejected packet at most this often.
REJECT_LOG_INTERVAL_S = 10.0
#: Member events buffered per subscriber before the oldest are dropped.
SUBSCRIBER_QUEUE = 4096
#: Ceiling of the wait between join rounds (``join_backoff_s`` doubles up to it): with the default
#: profiles the rounds end well below it; a config with many rounds still retries twice a minute.
JOIN_BACKOFF_CAP_S = 30.0


class JoinError(ConnectionError):
    """No seed answered a join after every attempt."""


class _Subscription:
    """The member events of one ``subscribe()`` caller, read by iterating it.

    The node holds it weakly: a subscriber that stops iterating and drops it (breaks out of its
    loop, is cancelled) stops receiving events at once, instead of buffering every later event, up
    to ``SUBSCRIBER_QUEUE``, for the node's whole life. (An async generator's ``finally`` would not
    do: one dropped before its first step never runs it.)
    """

    __slots__ = ("_queue", "__weakref__")

    def __init__(self, size: int) -> None:
        self._queue: asyncio.Queue[MemberEvent | None] = asyncio.Queue(size)

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> MemberEvent:
        event = await self._queue.get()
        if event is None:
            self._queue.put_nowait(None)  # ended: stays ended for a later call
            raise StopAsyncIteration
        return event

    def put(self, event: MemberEvent) -> bool:
        """Queue ``event``; a full queue loses its oldest first. Returns whether one was lost."""
        lost = self._queue.full()
        if lost:
            self._queue.get_nowait()
        self._queue.put_nowait(event)
        return lost

    def end(self) -> None:
        """No more events: iteration stops once the queued ones were read (a full queue loses its
        oldest, not the end)."""
        if self._queue.full():
            self._queue.get_nowait()
        self._queue.put_nowait(None)


class NameConflictError(RuntimeError):
    """Another live node (a different node id) already uses this node's name."""


class MemberInfo(msgspec.Struct, frozen=True):
    """A snapshot row of the member table."""

    name: str
    node_id: str
    addr: Addr
    status: str
    incarnation: int
    meta: bytes


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, node: MembershipNode) -> None:
        self.node = node

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.node._on_datagram(data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:
        self.node._count("udp_errors")


async def _advertisable(loop: asyncio.AbstractEventLoop, host: str, port: int) -> str:
    """The address other members are told to reach ``host`` at: ``host`` itself when it is an IP
    address, else what it resolves to now. Members send datagrams to the address gossip carries,
    and uvloop's ``sendto`` refuses a host name outright ("a DNS lookup is required"): a node
    advertised by name (``membership.advertise-address node1.example``, or a bind address given as
    a name) got no probe from a uvloop peer, the daemon's loop, and was declared dead.

    Raises:
        OSError: the name does not resolve (``socket.gaierror``), naming it.
    """
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as exc:
        raise OSError(f"the advertised host {host!r} does not resolve: {exc}") from None
    return str(infos[0][4][0])


class MembershipNode:
    """One node's membership, running on the current asyncio loop.

    Args:
        name: unique member name.
        bind: (host, port) for both UDP and TCP; port 0 picks a free port.
        cluster: cluster name, bound into every packet as associated data.
        keyring: AES-GCM keys; rotate with install_key/use_key/remove_key.
        config: timings; defaults to the LAN profile.
        node_id: stable UUID (kept by the daemon in its data directory).
        meta: initial metadata (see NodeMeta), at most 512 bytes.
        incarnation: starting incarnation (a restart may start above its last one).
        keyring_path: when given, key rotation calls save the keyring there.
    """

    def __init__(self, *, name: str, bind: Addr, cluster: str, keyring: Keyring,
                 config: MembershipConfig | None = None, node_id: str | None = None,
                 meta: bytes = b"", incarnation: int = 0, advertise_host: str | None = None,
                 keyring_path: str | None = None, rng: random.Random | None = None) -> None:
        self.name = name
        self.node_id = node_id or str(uuid.uuid4())
        self.config = config or MembershipConfig.lan()
        self.codec = PacketCodec(cluster, keyring)
        self._bind = bind
        self._advertise_host = advertise_host
        self._meta = meta
        self._incarnation = incarnation
        self._keyring_path = keyring_path
        self._rng = rng or random.Random()
        self._core: Membership | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._server: Acceptor | None = None
        #: inbound push-pull handlers, cancelled by stop (a closed listener leaves them running)
        self._serving: set[asyncio.Task[None]] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        #: the latest time given to the core: it never goes back (``_run``)
        self._clock = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._replies: dict[int, asyncio.Future[StreamMessage | None]] = {}
        self._join_waiter: asyncio.Future[JoinFinished] | None = None
        #: held weakly: a subscription its reader dropped is let go (``_Subscription``)
        self._subscribers: weakref.WeakSet[_Subscription] = weakref.WeakSet()
        self._callbacks: list[Callable[[MemberEvent], None]] = []
        self._counters: dict[str, int] = {}
        self._reject_log = LogLimiter(REJECT_LOG_INTERVAL_S)
        self._inbound = 0
        self._token = 0
        self.addr: Addr = bind

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Bind UDP and TCP and start probing (alone until join())."""
        loop = asyncio.get_running_loop()
        host, port = self._bind
        # Not asyncio.start_server: its Server leaks a socket accepted just before close (3.11);
        # Acceptor closes every socket it accepted that no protocol has yet.
        self._server = await Acceptor.bind(host, port, lambda: asyncio.StreamReaderProtocol(
            asyncio.StreamReader(), self._serve_stream))
        port = self._server.address[1]
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Udp(self), local_addr=(host, port))
        self._udp = transport
        self.addr = (await _advertisable(loop, self._advertise_host or host, port), port)
        try:
            self._core = Membership(self.config, name=self.name, node_id=self.node_id,
                                    addr=self.addr, rng=self._rng, meta=self._meta,
                                    incarnation=self._incarnation,
                                    packet_overhead=self.codec.overhead)
        except ValueError:  # (metadata that no packet can carry): nothing stays bound
            await self.stop()
            raise
        self._run(Start())

    async def join(self, seeds: list[Addr]) -> int:
        """Join through seed addresses, retrying with full-jitter backoff.

        Returns:
            The number of seeds that answered in the successful round; 0 when every seed is this
            node itself (under any spelling: its own answer is not a cluster).
        Raises:
            NameConflictError: a different live node already has our name.
            JoinError: no seed answered in ``config.join_attempts`` rounds.
        """
        rounds = RetryPolicy(self.config.join_backoff_s, JOIN_BACKOFF_CAP_S, self.config.join_attempts)
        async for attempt in attempts(rounds, rng=self._rng):  # full jitter, from the node's own rng
            self._join_waiter = asyncio.get_running_loop().create_future()
            self._run(Join(tuple(seeds)))
            finished = await self._join_waiter
            if finished.conflict is not None:
                raise NameConflictError(
                    f"name {self.name!r} is taken by live node {finished.conflict.known_node_id}"
                    f" (we are {self.node_id})" if not finished.conflict.local else
                    f"name {self.name!r} is already used by node "
                    f"{finished.conflict.claimed_node_id} at {finished.conflict.claimed_addr}")
            if finished.contacted > 0:
                return finished.contacted
            if seeds and finished.selves == len(seeds):  # every seed is this node under another
                return 0  # spelling: the first node of a cluster, alone as if it listed no seed
            log.info("join attempt failed attempt=%d seeds=%s", attempt + 1, seeds)
        raise JoinError(f"could not join: none of the seeds {seeds} answered after "
                        f"{self.config.join_attempts} attempts")

    async def leave(self, timeout: float | None = None) -> None:
        """Announce a graceful leave and keep answering while it spreads."""
        self._run(Leave())
        wait = self.config.leave_propagate_s if timeout is None else min(
            timeout, self.config.leave_propagate_s)
        await asyncio.sleep(wait)

    async def stop(self) -> None:
        """Close sockets, timers and streams; end subscriptions. Idempotent."""
        if self._join_waiter is not None and not self._join_waiter.done():
            self._join_waiter.cancel()
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._server is not None:
            await self._server.close()
            self._server = None
        tasks = self._tasks | self._serving
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for subscription in list(self._subscribers):
            subscription.end()
        self._subscribers.clear()

    # ---- queries and commands --------------------------------------------------------

    @property
    def core(self) -> Membership:
        if self._core is None:
            raise RuntimeError("MembershipNode.start() has not been called")
        return self._core

    def members(self) -> list[MemberInfo]:
        """Snapshot of the member table, this node included."""
        return [MemberInfo(m.name, m.node_id, m.addr, m.status.name.lower(), m.incarnation,
                           m.meta) for m in self.core.members()]

    def alive_members(self) -> list[MemberInfo]:
        return [m for m in self.members() if m.status == "alive"]

    def local_health(self) -> int:
        """Lifeguard health score: 0 is healthy, up to awareness_max_multiplier."""
        return self.core.awareness.score

    def counters(self) -> dict[str, int]:
        """Counters for metrics: the core's and the glue's (rejections, I/O errors)."""
        out = dict(self.core.counters)
        out.update(self._counters)
        out["members_live"] = self.core.num_live()
        return out

    def update_meta(self, meta: bytes) -> None:
        """Gossip new metadata (bumps our incarnation). Raises ValueError if too large."""
        self._run(UpdateMeta(meta))

    def report_unreachable(self, name: str) -> None:
        """The data plane failed to reach ``name``: start suspicion (not death)."""
        self._run(ReportUnreachable(name))

    def subscribe(self) -> AsyncIterator[MemberEvent]:
        """Member events from now on, until stop(). Slow readers lose the oldest; a reader that
        drops the iterator unsubscribes."""
        subscription = _Subscription(SUBSCRIBER_QUEUE)
        self._subscribers.add(subscription)
        return subscription

    def on_event(self, callback: Callable[[MemberEvent], None]) -> None:
        """Call ``callback(event)`` for every member event (on the loop, must not block)."""
        self._callbacks.append(callback)

    def install_key(self, key: bytes) -> None:
        self.codec.keyring.install(key)
        self._save_keys()

    def use_key(self, key: bytes) -> None:
        self.codec.keyring.use(key)
        self._save_keys()

    def remove_key(self, key: bytes) -> None:
        self.codec.keyring.remove(key)
        self._save_keys()

    def _save_keys(self) -> None:
        if self._keyring_path is not None:
            self.codec.keyring.save(self._keyring_path)

    # ---- running the core ------------------------------------------------------------

    def _count(self, key: str) -> None:
        self._counters[key] = self._counters.get(key, 0) + 1

    def _run(self, stimulus: Stimulus, due: float = 0.0) -> None:
        """Feed ``stimulus`` to the core at the loop's time, or at ``due`` if that is later.

        A timer can fire before its deadline by the loop's clock: uvloop rounds a delay to whole
        milliseconds, so about half its timers run up to 1 ms early. The core drops a timer that
        fires before its deadline as stale (re-armed since), and would stop that timer's
        chain for good (probes, gossip, push-pull). So a timer is fed at its deadline at the
        earliest, and the core's clock never goes back.
        """
        loop = asyncio.get_running_loop()
        self._clock = max(self._clock, loop.time(), due)
        for action in self.core.handle(self._clock, stimulus):
            self._do(loop, action)

    def _do(self, loop: asyncio.AbstractEventLoop, action: Action) -> None:
        if isinstance(action, Send):
            if self._udp is not None:
                self._send(self.codec.seal_packet(action.messages), action.addr)
        elif isinstance(action, SetTimer):
            old = self._timers.pop(action.key, None)
            if old is not None:
                old.cancel()
            self._timers[action.key] = loop.call_at(action.at, self._fire, action.key, action.at)
        elif isinstance(action, Emit):
            self._publish(action.event)
        elif isinstance(action, OpenStream):
            self._spawn(self._stream_out(action.addr, action.token, action.message))
        elif isinstance(action, ReplyStream):
            future = self._replies.pop(action.token, None)
            if future is not None and not future.done():
                future.set_result(action.message)
        elif isinstance(action, JoinFinished):
            if self._join_waiter is not None and not self._join_waiter.done():
                self._join_waiter.set_result(action)

    def _send(self, data: bytes, addr: Addr) -> None:
        """One datagram; an address the socket layer refuses fails that send only.

        A member's host is any string gossip carried. asyncio's datagram transport closes itself
        on the TypeError its socket raises for a host with NUL or one IDNA cannot encode (the node
        would go deaf), so those are not handed to it; uvloop raises ValueError for any name it
        would have to resolve, which must not abort the rest of the stimulus's actions.
        """
        assert self._udp is not None
        host = addr[0]
        try:
            if "\x00" in host:
                raise ValueError("a host name holds no NUL character")
            if not host.isascii():
                host.encode("idna")  # UnicodeError where the socket module would fail
            self._udp.sendto(data, addr)
        except ValueError as exc:  # UnicodeError included
            self._count("udp_errors")
            log.debug("send failed peer=%r error=%r", addr, exc)

    def _fire(self, key: Hashable, due: float) -> None:
        self._timers.pop(key, None)
        self._run(TimerFired(key), due)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _publish(self, event: MemberEvent) -> None:
        if isinstance(event, NameConflict):
            log.warning("name conflict name=%s known=%s claimed=%s addr=%s", event.name,
                        event.known_node_id, event.claimed_node_id, event.claimed_addr)
        else:
            log.info("member %s name=%s incarnation=%d cause=%s", type(event).__name__,
                     event.name, event.incarnation, event.cause)
        for callback in self._callbacks:
            callback(event)
        for subscription in list(self._subscribers):
            if subscription.put(event):
                self._count("subscriber_events_dropped")

    def _reject(self, reason: str, peer: Addr, detail: str) -> None:
        self._count(f"rejected_{reason}")
        held = self._reject_log.admit(reason, time.monotonic())
        if held is not None:
            log.warning("dropped membership packet reason=%s peer=%s:%s total=%d suppressed=%d detail=%s",
                        reason, peer[0], peer[1], self._counters[f"rejected_{reason}"], held, detail)

    def _on_datagram(self, data: bytes, addr: Addr) -> None:
        try:
            messages = self.codec.open_packet(data)
        except PacketRejected as exc:
            self._reject(exc.reason, addr, str(exc))
            return
        self._run(Received(addr, messages))

    # ---- TCP streams -----------------------------------------------------------------

    async def _read_frame(self, reader: asyncio.StreamReader) -> StreamMessage:
        length = PacketCodec.frame_length(await reader.readexactly(4))
        return self.codec.open_frame(await reader.readexactly(length))

    async def _stream_out(self, addr: Addr, token: int, message: StreamMessage | PushPull) -> None:
        reply: StreamMessage | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.config.tcp_timeout_s):
                reader, writer = await asyncio.open_connection(addr[0], addr[1])
                writer.write(self.codec.seal_frame(message))
                await writer.drain()
                reply = await self._read_frame(reader)
        except PacketRejected as exc:
            self._reject(exc.reason, addr, str(exc))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            # ValueError (UnicodeError included): a host the resolver cannot encode, from gossip
            self._count("stream_errors")
            log.debug("stream failed peer=%s:%s error=%r", addr[0], addr[1], exc)
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        if self._core is not None and self._udp is not None:
            self._run(StreamReply(token, reply))

    async def _serve_stream(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        peer_info = writer.get_extra_info("peername") or ("?", 0)
        peer: Addr = (str(peer_info[0]), int(peer_info[1]))
        if self._server is None:  # stopped between the accept and this handler's start
            writer.close()
            return
        if self._inbound >= self.config.max_concurrent_push_pulls:
            self._count("streams_refused_busy")
            writer.close()
            return
        self._inbound += 1
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        try:
            async with asyncio.timeout(self.config.tcp_timeout_s):
                message = await self._read_frame(reader)
                self._token += 1
                token = self._token
                future: asyncio.Future[StreamMessage | None] = (
                    asyncio.get_running_loop().create_future())
                self._replies[token] = future
                self._run(StreamRequest(peer, token, message))
                reply = await future
                if reply is not None:
                    writer.write(self.codec.seal_frame(reply))
                    await writer.drain()
        except PacketRejected as exc:
            self._reject(exc.reason, peer, str(exc))
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            self._count("stream_errors")
        finally:
            self._inbound -= 1
            if task is not None:
                self._serving.discard(task)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def member_status(info: MemberInfo) -> MemberStatus:
    """The status of a snapshot row as the enum."""
    return MemberStatus[info.status.upper()]
