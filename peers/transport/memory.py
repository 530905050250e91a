"""``mem://name`` — an in-process backend with fault hooks, for tests and the simulator.

It moves real frames through the same ``FrameDecoder``/``Connection`` code as TCP, so the
conformance suite tests the shared logic, and adds faults a test can switch on per network:

- ``drop_next(n)``: the next ``n`` frames written by any link vanish (a request then hits its
  deadline; a lost bulk frame desynchronises nothing because whole frames are dropped);
- ``delay_s``: every frame is delivered this much later (order is kept);
- ``sever(name)``: every link to/from listener ``name`` is cut at once, both ends see a reset.

Frames are copied once at write time (``drain()`` returning means the caller may reuse its
buffers, as on TCP).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from peers.errors import DeadlineExceeded, TransportClosed
from peers.transport.base import Handler, Identity, Link, Listener, Transport
from peers.transport.connection import Connection, Metrics
from peers.transport.limits import TransportLimits
from peers.transport.pool import BufferPool
from peers.transport.session import Session

__all__ = ["MemoryNetwork", "MemoryTransport", "DEFAULT_NETWORK"]


@dataclass
class MemoryNetwork:
    """A namespace of ``mem://`` listeners plus the faults applied to it."""

    listeners: dict[str, _MemListener] = field(default_factory=dict)
    links: set[MemLink] = field(default_factory=set)
    delay_s: float = 0.0
    _drop: int = 0
    #: fault: the next frame of at least this many bytes is cut in half, then the link is severed
    #: (a peer crashing mid-transfer)
    sever_mid_frame_bytes: int | None = None

    def drop_next(self, n: int) -> None:
        self._drop += n

    def _should_drop(self) -> bool:
        if self._drop > 0:
            self._drop -= 1
            return True
        return False

    def sever(self, name: str) -> None:
        for link in list(self.links):
            if link.listener_name == name:
                link.abort()


DEFAULT_NETWORK = MemoryNetwork()


class MemLink(Link):
    """One end of an in-process link."""

    def __init__(self, network: MemoryNetwork, listener_name: str) -> None:
        self.network, self.listener_name = network, listener_name
        self.peer: MemLink | None = None
        self.session: Session | None = None
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._deliver())
        self._closed = False
        network.links.add(self)

    def write(self, parts: Sequence[bytes | memoryview]) -> None:
        if self._closed or self.peer is None:
            raise TransportClosed("mem link is closed")
        if self.network._should_drop():
            return
        data = b"".join(parts)
        cut = self.network.sever_mid_frame_bytes
        if cut is not None and len(data) >= cut:
            self.network.sever_mid_frame_bytes = None
            self.peer._queue.put_nowait((asyncio.get_running_loop().time(), data[: len(data) // 2]))
            self.peer._queue.put_nowait((0.0, b""))  # the sever marker
            return
        self.peer._queue.put_nowait((asyncio.get_running_loop().time() + self.network.delay_s, data))

    async def drain(self) -> None:
        if self._closed:
            raise TransportClosed("mem link is closed")
        await asyncio.sleep(0)  # let the receiver run, like a socket write would

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while (item := await self._queue.get()) is not None:
            at, data = item
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            if self._closed or self.session is None:
                return
            if not data:  # the sever marker of sever_mid_frame_bytes: visibly mid-frame, then cut
                await asyncio.sleep(0.05)
                self.abort()
                return
            view = memoryview(data)
            while view.nbytes and not self._closed:
                target = self.session.get_buffer()
                n = min(target.nbytes, view.nbytes)
                target[:n] = view[:n]
                view = view[n:]
                self.session.buffer_updated(n)

    def _lose(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        self.network.links.discard(self)
        self._queue.put_nowait(None)
        if self.session is not None:
            self.session.lost(exc)

    def abort(self) -> None:
        peer = self.peer
        self._lose(None)
        if peer is not None:
            peer._lose(ConnectionResetError("mem link severed"))

    def close(self) -> None:
        # deliver what is queued first (a Reject must arrive), then close both ends
        asyncio.get_running_loop().call_later(self.network.delay_s + 0.01, self.abort)

    @property
    def resources(self) -> int:
        return 0 if self._closed else 1


class _MemListener(Listener):
    def __init__(self, transport: MemoryTransport, name: str, handler: Handler) -> None:
        self.transport, self.name, self.handler = transport, name, handler
        self.address = f"mem://{name}"
        self._conns: set[Connection] = set()
        #: accepted links still in the handshake (TCP's listener keeps the same set)
        self._links: set[MemLink] = set()
        self.closed = False

    @property
    def connections(self) -> list[Connection]:
        return [c for c in self._conns if not c.is_closed]

    def _accepted(self, link: MemLink, ready: asyncio.Future[Connection]) -> None:
        """A handshake ended: its connection is this listener's, or, once the listener closed
        meanwhile, severed (nothing may reach a closed listener's handler: the in-process cluster
        restarts a node at the same address, and a connection left to the stopped one answered
        for it)."""
        self._links.discard(link)
        if ready.cancelled() or ready.exception() is not None:
            return
        if self.closed:
            link.abort()
        elif not ready.result().is_closed:  # a frame delivered with the handshake's last may
            self._conns.add(ready.result())  # have closed it: its removal (``on_close``) came first

    async def close(self) -> None:
        self.closed = True
        self.transport.network.listeners.pop(self.name, None)
        for conn in list(self._conns):
            await conn.close("listener closing")
        for link in list(self._links):  # still in the handshake: nothing to say to them
            link.abort()


class MemoryTransport(Transport):
    """In-process backend. All transports sharing a ``MemoryNetwork`` can reach each other."""

    scheme: ClassVar[str] = "mem"

    def __init__(self, identity: Identity, *, network: MemoryNetwork | None = None,
                 pool: BufferPool | None = None, checksum: bool = False,
                 limits: TransportLimits | None = None) -> None:
        super().__init__(identity)
        self.limits = limits or TransportLimits()  # the handshake's; there are no sockets to cap
        self.network = network or DEFAULT_NETWORK
        self.pool = pool or BufferPool()
        self.metrics = Metrics()
        self.checksum = checksum
        self._client_handler: Handler | None = None

    def set_client_handler(self, handler: Handler | None) -> None:
        self._client_handler = handler

    def _session(self, link: MemLink, *, client: bool, handler: Handler | None,
                 on_close: Any = None) -> Session:
        def make(agreement: Any) -> Connection:
            return Connection(link, peer=agreement.peer_node_id, handler=handler, pool=self.pool,
                              metrics=self.metrics, checksum=self.checksum, on_close=on_close)

        return Session(link, client=client, identity=self.identity, metrics=self.metrics, make_connection=make,
                       limits=self.limits)

    async def listen(self, address: str, handler: Handler) -> Listener:
        name = address.removeprefix("mem://")
        if not address.startswith("mem://") or not name:
            raise ValueError(f"expected mem://name, got {address!r}")
        if name in self.network.listeners:
            raise OSError(f"mem://{name} is already bound")
        listener = _MemListener(self, name, handler)
        self.network.listeners[name] = listener
        return listener

    async def connect_once(self, address: str, *, timeout_s: float) -> Connection:
        name = address.removeprefix("mem://")
        listener = self.network.listeners.get(name)
        if listener is None:
            raise TransportClosed(f"nothing listens on {address}")
        client, server = MemLink(self.network, name), MemLink(self.network, name)
        client.peer, server.peer = server, client
        lst = listener
        server.session = lst.transport._session(server, client=False, handler=lst.handler,
                                                on_close=lst._conns.discard)
        lst._links.add(server)
        server.session.ready.add_done_callback(lambda f: lst._accepted(server, f))
        client.session = self._session(client, client=True, handler=self._client_handler)
        server.session.start()
        client.session.start()
        try:
            async with asyncio.timeout(timeout_s):
                return await client.session.ready
        except TimeoutError:
            client.abort()
            raise DeadlineExceeded(f"connecting to {address} took over {timeout_s}s") from None
        except BaseException:  # cancelled mid-handshake (a caller's deadline, fail_peer, a shutdown)
            client.abort()  # as tcp does: the handshake would otherwise finish with nobody holding it
            raise

    @property
    def open_resources(self) -> int:
        return sum(1 for link in self.network.links if link.session is not None
                   and link.session.link is link and link.resources)
