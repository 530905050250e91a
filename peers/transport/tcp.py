"""``tcp://host:port`` — asyncio TCP with a ``BufferedProtocol`` receiving straight into place.

Why BufferedProtocol: ``readexactly`` is 7–12× slower for large messages and uvloop's
``sock_recv_into`` pays a future per call (transport-baseline.md §2); with ``get_buffer`` returning
the destination slice, the kernel copies socket bytes directly into the pooled buffer or the
caller's tensor. Writes hand the caller's buffers to the transport without joining them, and the
write-buffer high-water mark is 0 so ``drain()`` returns only once everything reached the kernel
(the caller may then reuse its buffers). uvloop is used when the running loop is uvloop; nothing
here requires it.

Corking (``Link.cork``): while corked, frames up to ``_HOLD_FRAME_BYTES`` are held (their bulk
copied, header and body are immutable bytes already) and leave in one ``writev`` at ``uncork``: a
burst of replies costs one syscall and one wake-up of the peer instead of one per frame. A
larger frame, or one that would hold more than ``_HOLD_MAX_BYTES``, first writes what is held, so
the stream keeps write order.

Admission (``TransportLimits``): an accepted socket is closed at once when the listener already has
``max_pending_handshakes`` connections in their handshake or ``max_connections_per_host`` open
connections from the same IP address; both are counted in ``Metrics.connections_refused``. A link
leaves ``TcpTransport.links`` when its socket is lost, so churn leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final
from urllib.parse import urlsplit

from peers.acceptor import Acceptor
from peers.errors import DeadlineExceeded, LocalProtocolError, TransportClosed
from peers.transport.base import Handler, Identity, Link, Listener, Transport
from peers.transport.connection import Connection, Metrics
from peers.transport.limits import TransportLimits
from peers.transport.pool import BufferPool
from peers.transport.session import Session

__all__ = ["TcpTransport", "parse_host_port"]

log = logging.getLogger(__name__)

#: Frames up to this size are handed to the socket as one write (see ``TcpLink.write``).
_COALESCE_BYTES = 256 * 2**10
#: While corked, frames up to this size are held (bulk copied: ~3 µs for 64 KiB here, well under
#: a syscall and a peer wake-up of their own); larger ones are written at once.
_HOLD_FRAME_BYTES: Final = 64 * 2**10
#: At most this much is held at a time: a burst is written in pieces of this size rather than
#: growing memory with the burst.
_HOLD_MAX_BYTES: Final = 1 * 2**20
#: A refused connection is logged at most once per reason in this many seconds (counted always):
#: a connection flood must not become a log flood.
_REFUSAL_LOG_INTERVAL_S: Final = 10.0


def _frame_bytes(parts: Sequence[bytes | memoryview]) -> int:
    total = 0
    for part in parts:
        total += len(part) if isinstance(part, bytes) else part.nbytes
    return total


def parse_host_port(address: str, scheme: str) -> tuple[str, int]:
    """``scheme://host:port`` → (host, port). Raises ``ValueError`` naming the address."""
    parts = urlsplit(address)
    if parts.scheme != scheme or parts.hostname is None or parts.port is None:
        raise ValueError(f"expected {scheme}://host:port, got {address!r}")
    return parts.hostname, parts.port


def _retrieve(future: asyncio.Future[Connection]) -> None:
    """Mark a future's outcome as read (its waiter went away)."""
    if not future.cancelled():
        future.exception()


class TcpLink(Link, asyncio.BufferedProtocol):
    """One TCP connection as a frame link; its ``session`` decodes what arrives."""

    #: Everything written reached the kernel or is held by a cork as the link's own bytes, so the
    #: writer may reuse its buffers (the write-buffer high-water mark is 0: any byte left in our
    #: buffer pauses writing). ``Connection`` then skips ``drain``. An attribute, not a property:
    #: it is read twice per frame.
    flushed: bool = True

    def __init__(self, make_session: Callable[[TcpLink], Session], *,
                 admit: Callable[[TcpLink], bool] | None = None,
                 on_lost: Callable[[TcpLink], None] | None = None) -> None:
        """``admit(link)`` decides on ``connection_made`` whether the socket may stay (False: it is
        aborted before the handshake starts); ``on_lost(link)`` runs when the socket is gone."""
        self.session = make_session(self)
        # uvloop looks up ``get_buffer``/``buffer_updated`` once, when the transport is made:
        # binding the decoder's and the session's own methods saves a Python call per socket read
        self.get_buffer = self.session.decoder.get_buffer  # type: ignore[method-assign]
        self.buffer_updated = self.session.buffer_updated  # type: ignore[method-assign]
        self._admit, self._on_lost = admit, on_lost
        self.host = ""  # the remote IP address, once connected
        self.admitted = False  # counted by the listener's caps (``TcpTransport._admit``)
        self._transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._lost: BaseException | None = None
        self._closed = False
        self._vectored = False  # the transport's writelines is a copy-free writev (uvloop)
        #: aborted before ``connection_made`` gave it a transport: that transport is aborted on arrival
        self._abort_on_made = False
        self._corks = 0  # cork depth
        self._held: list[bytes | memoryview] = []  # frames written while corked, in order
        self._held_bytes = 0

    # ---- asyncio protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they implement its interface
        self._transport = transport  # type: ignore[assignment]
        if self._abort_on_made:
            self.abort()  # connection_lost follows, which fails the session's ``ready``
            return
        transport.set_write_buffer_limits(high=0)  # type: ignore[attr-defined]
        self._vectored = type(transport).__module__.startswith("uvloop")
        peername = transport.get_extra_info("peername")
        self.host = str(peername[0]) if peername else ""
        if self._admit is not None and not self._admit(self):
            self.abort()  # connection_lost follows, which fails the session's ``ready``
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.session.start()

    def get_buffer(self, sizehint: int) -> memoryview:  # replaced per instance (__init__)
        return self.session.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:  # replaced per instance (__init__)
        self.session.buffer_updated(nbytes)

    def eof_received(self) -> bool:
        return False  # half-open connections are not used: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.flushed = False
        self._held, self._held_bytes = [], 0  # the peer will not read them: pending requests fail
        self._lost = exc or TransportClosed("EOF")
        self._can_write.set()
        self.session.lost(exc)
        if self._on_lost is not None:
            self._on_lost(self)

    def pause_writing(self) -> None:
        self.flushed = False
        self._can_write.clear()

    def resume_writing(self) -> None:
        self.flushed = not self._closed
        self._can_write.set()

    # ---- Link ---------------------------------------------------------------------------------

    def write(self, parts: Sequence[bytes | memoryview]) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise TransportClosed("socket is closed")
        count = len(parts)
        if count == 1:
            size = len(parts[0])
        elif count == 2 and type(parts[0]) is bytes and type(parts[1]) is memoryview:  # one bulk buffer
            size = len(parts[0]) + parts[1].nbytes
        else:
            size = _frame_bytes(parts)
        if self._corks and size <= _HOLD_FRAME_BYTES and self._held_bytes + size <= _HOLD_MAX_BYTES:
            held = self._held
            for part in parts:  # header + body are immutable bytes; bulk views are the caller's
                held.append(part if type(part) is bytes else bytes(part))
            self._held_bytes += size
            return
        if self._held:  # what is held goes first: frames keep their order
            if size <= _COALESCE_BYTES:
                self._held.extend(parts)  # one writev for all of it
                self._write_held(transport)
                return
            self._write_held(transport)
        if count == 1:
            transport.write(parts[0])
        elif size > _COALESCE_BYTES:
            # large frames: part by part, without copying the caller's buffers; the header goes
            # out alone, so the receiver can place the bulk before it arrives (no staging copy)
            for part in parts:
                transport.write(part)
        elif self._vectored:
            # uvloop: one writev(2) of all parts: the frame leaves in one syscall, the receiver
            # wakes once, and nothing is copied
            transport.writelines(parts)
        else:
            # asyncio's own transports (3.11) join in writelines anyway: joined here, ≤ 256 KiB
            # copied (~10 µs) is cheaper than a second wake-up of the receiver (20–30 µs here)
            transport.write(b"".join(parts))

    def _write_held(self, transport: asyncio.Transport) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        if self._vectored:
            transport.writelines(held)  # one writev(2), no copy
        else:
            transport.write(b"".join(held))  # asyncio's writelines joins anyway (3.11)

    def cork(self) -> None:
        self._corks += 1

    def uncork(self) -> None:
        if not self._corks:
            return
        self._corks -= 1
        if self._corks or not self._held:
            return
        transport = self._transport
        if transport is None or transport.is_closing():
            self._held, self._held_bytes = [], 0  # going away: what is pending fails there
            return
        try:
            self._write_held(transport)
        except (OSError, RuntimeError) as exc:  # pragma: no cover - transports report via connection_lost
            log.warning("write of held frames failed, closing: %r", exc)
            self.abort()

    def flush_held(self) -> None:
        transport = self._transport
        if self._held and transport is not None and not transport.is_closing():
            self._write_held(transport)  # the corks stay: later frames are held again

    async def drain(self) -> None:
        await self._can_write.wait()
        if self._closed:
            raise TransportClosed(f"socket closed: {self._lost}")

    def abort(self) -> None:
        self._held, self._held_bytes = [], 0
        if self._transport is not None:
            self._transport.abort()
        else:  # accepted, protocol made, ``connection_made`` still a loop tick away
            self._abort_on_made = True

    def close(self) -> None:
        transport = self._transport
        if transport is not None:
            if self._held and not transport.is_closing():
                self._write_held(transport)  # a Reject held by a cork must still reach the peer
            transport.close()

    @property
    def resources(self) -> int:
        return 0 if self._closed or self._transport is None else 1


class _TcpListener(Listener):
    def __init__(self, address: str) -> None:
        self.address = address
        self.acceptor: Acceptor | None = None
        self._conns: set[Connection] = set()
        #: accepted sockets, handshake done or not: closing the server does not close them
        self._links: set[TcpLink] = set()

    @property
    def connections(self) -> list[Connection]:
        return [c for c in self._conns if not c.is_closed]

    def accepted(self, ready: asyncio.Future[Connection]) -> None:
        """A handshake ended (``ready``'s callback, a loop iteration later): keep its connection
        unless it closed meanwhile — the rest of the read that completed the handshake may close it
        (a Goodbye, a protocol error), and its removal (``on_close``) then came first."""
        if ready.exception() is None and not ready.result().is_closed:
            self._conns.add(ready.result())

    async def close(self) -> None:
        if self.acceptor is not None:
            await self.acceptor.close()  # closes the sockets not yet handed to a link
        for conn in list(self._conns):
            await conn.close("listener closing")
        for link in list(self._links):  # still in the handshake (or refused): nothing to say to them
            link.abort()


class TcpTransport(Transport):
    """The TCP backend; bulk bytes travel inline on the same stream as control frames."""

    scheme: ClassVar[str] = "tcp"

    def __init__(self, identity: Identity, *, pool: BufferPool | None = None, checksum: bool = False,
                 limits: TransportLimits | None = None) -> None:
        super().__init__(identity)
        self.pool = pool or BufferPool()
        self.metrics = Metrics()
        self.checksum = checksum
        self.limits = limits or TransportLimits()
        self.links: set[TcpLink] = set()  # open sockets (leak checks; membership's fail_peer)
        self._pending_handshakes = 0  # accepted links whose handshake has not finished
        self._per_host: dict[str, int] = {}  # open accepted links by remote IP address
        self._refusal_logged: dict[str, float] = {}

    def _session(self, link: TcpLink, *, client: bool, handler: Handler | None,
                 on_close: Callable[[Connection], None] | None = None) -> Session:
        def make(agreement: Any) -> Connection:
            return Connection(link, peer=agreement.peer_node_id, handler=handler, pool=self.pool,
                              metrics=self.metrics, checksum=self.checksum, on_close=on_close)

        return Session(link, client=client, identity=self.identity, metrics=self.metrics, make_connection=make,
                       limits=self.limits)

    # ---- admission of accepted sockets (module docstring) -------------------------------------

    def _admit(self, link: TcpLink) -> bool:
        limits = self.limits
        if self._pending_handshakes >= limits.max_pending_handshakes:
            return self._refuse(link, "pending_handshakes", limits.max_pending_handshakes)
        if self._per_host.get(link.host, 0) >= limits.max_connections_per_host:
            return self._refuse(link, "per_host", limits.max_connections_per_host)
        self._pending_handshakes += 1
        self._per_host[link.host] = self._per_host.get(link.host, 0) + 1
        link.admitted = True
        link.session.ready.add_done_callback(self._handshake_over)
        return True

    def _handshake_over(self, _ready: asyncio.Future[Connection]) -> None:
        self._pending_handshakes -= 1

    def _refuse(self, link: TcpLink, reason: str, cap: int) -> bool:
        self.metrics.count_refusal(reason)
        now = asyncio.get_running_loop().time()
        if now - self._refusal_logged.get(reason, -_REFUSAL_LOG_INTERVAL_S) >= _REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged[reason] = now
            log.warning("connection refused reason=%s peer=%s cap=%d refused_total=%d", reason, link.host,
                        cap, self.metrics.connections_refused[reason])
        return False

    def _link_lost(self, link: TcpLink) -> None:
        self.links.discard(link)

    def _accepted_link_lost(self, link: TcpLink) -> None:
        self.links.discard(link)
        if not link.admitted:
            return
        count = self._per_host.get(link.host, 0) - 1
        if count > 0:
            self._per_host[link.host] = count
        else:
            self._per_host.pop(link.host, None)

    async def listen(self, address: str, handler: Handler) -> Listener:
        host, port = parse_host_port(address, self.scheme)
        lst = _TcpListener(address)

        def factory() -> TcpLink:

            def make(link: TcpLink) -> Session:
                session = self._session(link, client=False, handler=handler, on_close=lst._conns.discard)
                session.ready.add_done_callback(lst.accepted)
                return session

            def lost(link: TcpLink) -> None:
                lst._links.discard(link)
                self._accepted_link_lost(link)

            link = TcpLink(make, admit=self._admit, on_lost=lost)
            self.links.add(link)
            lst._links.add(link)
            return link

        lst.acceptor = await Acceptor.bind(host, port, factory)
        bound_host, bound_port = lst.acceptor.address
        lst.address = f"{self.scheme}://{bound_host}:{bound_port}"
        return lst

    async def connect_once(self, address: str, *, timeout_s: float) -> Connection:
        host, port = parse_host_port(address, self.scheme)
        loop = asyncio.get_running_loop()
        link: TcpLink | None = None
        try:
            async with asyncio.timeout(timeout_s):
                def factory() -> TcpLink:
                    nonlocal link
                    link = TcpLink(lambda lk: self._session(lk, client=True, handler=self._client_handler),
                                   on_lost=self._link_lost)
                    self.links.add(link)
                    return link

                await loop.create_connection(factory, host, port)
                assert link is not None
                return await link.session.ready
        except TimeoutError:
            if link is not None:
                link.abort()
            raise DeadlineExceeded(f"connecting to {address} took over {timeout_s}s") from None
        except OSError as exc:
            if link is not None:
                link.abort()
            if isinstance(exc, TransportClosed):
                raise
            raise TransportClosed(f"cannot connect to {address}: {exc}") from exc
        except BaseException:  # cancelled (a caller's deadline, a shutdown) mid-connect or handshake
            if link is not None:
                # nobody will await ``ready`` now: read its end, so a failure is not reported as
                # "never retrieved", and close the socket instead of leaking it
                link.session.ready.add_done_callback(_retrieve)
                link.abort()
            raise

    #: Requests the server side sends back over a client connection (peers may call each other
    #: over one connection); set before connecting.
    _client_handler: Handler | None = None

    def set_client_handler(self, handler: Handler | None) -> None:
        """Serve requests that peers send over connections we opened."""
        if handler is not None and not callable(handler):
            raise LocalProtocolError("handler must be an async callable")
        self._client_handler = handler

    @property
    def open_resources(self) -> int:
        """Sockets still open (leak checks)."""
        return sum(1 for lk in self.links if lk.resources)
