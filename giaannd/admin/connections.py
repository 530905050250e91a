"""Connection limits of the admin HTTP server: a cap on open connections and a request-head deadline.

aiohttp has neither (its keep-alive timer is not reset by a trickle of bytes, and it accepts every
connection), so one client dribbling request heads a byte at a time, or opening sockets and never
writing, would hold descriptors forever (issue 16 item 5).

Theory of operation
-------------------
``GuardedSite`` listens like ``web.TCPSite`` but wraps the protocol aiohttp makes for each
connection (its ``RequestHandler``) in a ``_GuardedProtocol`` that forwards every callback, with
two additions:

- **Admission.** A connection arriving while ``max_connections`` are open is not handed to aiohttp:
  it is answered ``503`` with the admin API's JSON error shape and closed (after a short linger, so
  the answer is not lost to a reset when the client's request is still unread).
- **Head deadline.** A timer runs from the moment the connection opens. The admin dispatcher calls
  ``request_started`` when aiohttp hands it a parsed request (so its head is complete: timer
  stopped) and ``request_finished`` when the handler has returned (timer restarted). When the
  timer fires the connection is closed. Hence every request head must be complete within
  ``header_timeout_s`` of the connection opening or of the previous request's end, and an idle
  keep-alive connection lives that long too.

The body has its own deadline, kept by the dispatcher (giaannd/admin/api.py), which reads it
under ``body_timeout_s`` before calling a handler.

A request aiohttp cannot parse (a control or non-ASCII byte in the path, a request line or header
over its limits, a malformed header) never reaches the dispatcher: aiohttp answers it itself.
``_JsonErrorProtocol`` makes that answer the admin API's JSON error shape too (aiohttp's is
text/plain) and logs the client's garbage in one debug line instead of a traceback at ERROR.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Final, cast

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from peers.acceptor import Acceptor

__all__ = ["REFUSAL_LINGER_S", "ConnectionGuard", "GuardedSite"]

log = logging.getLogger(__name__)

#: A refused connection is half-closed, then fully closed after this long (or at the client's EOF):
#: closing a socket whose request is still unread sends a reset, which can discard our 503 before
#: the client reads it (the reason for "lingering close" in RFC 9112 §9.6).
REFUSAL_LINGER_S: Final = 1.0

_REFUSAL_BODY: Final = msgspec.json.encode(
    {"error": "too many admin connections open; retry later", "code": "too_many_connections"})
_REFUSAL: Final = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
                   + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)


class ConnectionGuard:
    """The open connections of one admin server and their limits (module docstring).

    Args:
        max_connections: connections served at once; more are refused with 503.
        header_timeout_s: the request-head deadline.
        on_close: called with a reason (``"refused"``, ``"header_timeout"``) for each connection
            the guard ends, for metrics.
    """

    def __init__(self, *, max_connections: int, header_timeout_s: float,
                 on_close: Callable[[str], None] = lambda reason: None) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self._on_close = on_close
        #: the aiohttp protocol of each admitted connection -> its proxy
        self._open: dict[object, _GuardedProtocol] = {}
        #: refused connections lingering before their close (aiohttp never saw them, so its
        #: shutdown does not close them: ``close_refused`` does)
        self._refused: set[asyncio.Transport] = set()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def wrap(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        """The protocol to give the event loop for one new connection served by ``inner``."""
        return _GuardedProtocol(self, inner)

    def request_started(self, protocol: object) -> None:
        """aiohttp parsed a request head on the connection of ``protocol`` (``request.protocol``)."""
        proxy = self._open.get(protocol)
        if proxy is not None:
            proxy.disarm()

    def request_finished(self, protocol: object) -> None:
        """The handler of that request returned: the next head's deadline starts now."""
        proxy = self._open.get(protocol)
        if proxy is not None:
            proxy.arm()

    def _admit(self, proxy: _GuardedProtocol) -> bool:
        if len(self._open) >= self.max_connections:
            self._on_close("refused")
            return False
        self._open[proxy.inner] = proxy
        return True

    def close_refused(self) -> None:
        """Close the refused connections still lingering (the server is stopping)."""
        for transport in list(self._refused):
            transport.close()
        self._refused.clear()

    def _linger_then_close(self, transport: asyncio.Transport) -> None:
        self._refused.add(transport)

        def close() -> None:
            self._refused.discard(transport)
            transport.close()

        asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, close)

    def _release(self, proxy: _GuardedProtocol) -> None:
        self._open.pop(proxy.inner, None)

    def _timed_out(self) -> None:
        self._on_close("header_timeout")


class _GuardedProtocol(asyncio.Protocol):
    """One connection: forwards to aiohttp's protocol unless refused; owns the head timer."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False

    # -- the head timer ---------------------------------------------------------------------
    def arm(self) -> None:
        self.disarm()
        if self._transport is not None and not self._transport.is_closing():
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.guard.header_timeout_s, self._expire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            log.debug("admin connection closed: no complete request head within %.1fs peer=%s",
                      self.guard.header_timeout_s, self._transport.get_extra_info("peername"))
            self.guard._timed_out()
            self._transport.close()

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport, so no isinstance).
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        if not self.guard._admit(self):
            self._refused = True
            log.debug("admin connection refused: %d open peer=%s", self.guard.open_connections,
                      transport.get_extra_info("peername"))
            transport.write(_REFUSAL)
            if transport.can_write_eof():
                transport.write_eof()
            self.guard._linger_then_close(transport)
            return
        self.inner.connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # a refused client's request is read and dropped
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused:
            assert self._transport is not None
            self._transport.close()
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self._refused and self._transport is not None:
            self.guard._refused.discard(self._transport)
        if not self._refused:
            self.guard._release(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self.inner.resume_writing()


#: Longest aiohttp parser message quoted in an answer (it quotes the offending line, which may be
#: as long as the line limit).
_MAX_PARSER_MESSAGE_CHARS: Final = 200


class _JsonErrorProtocol(RequestHandler):
    """aiohttp's protocol for one connection, answering the requests aiohttp itself refuses (module
    docstring) with ``{"error", "code"}``. It adds no state (``__slots__`` is empty), so an aiohttp
    ``RequestHandler`` can become one (``_json_errors``): aiohttp makes them, with no hook for the
    class or the error answer."""

    __slots__ = ()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # our fault (the dispatcher answers its own errors; this is what escaped it)
            self.log_exception("admin request failed peer=%s", request.remote, exc_info=exc)
            doc = {"error": "internal error; see the daemon log", "code": "internal"}
        else:  # the client's: its words, on one line
            text = " ".join(line.strip() for line in (message or "").splitlines() if line.strip())
            log.debug("admin request refused by the HTTP parser status=%d peer=%s: %s", status,
                      request.remote, text)
            reason = HTTPStatus(status).phrase
            doc = {"error": f"malformed HTTP request: {text or reason}"[:_MAX_PARSER_MESSAGE_CHARS],
                   "code": reason.lower().replace(" ", "_").replace("-", "_")}
        if request.writer.output_size > 0:  # as aiohttp: an answer has begun, none can follow
            raise ConnectionError("the response is sent already: no error answer can follow")
        response = web.Response(body=msgspec.json.encode(doc), status=status, content_type="application/json")
        response.force_close()
        return response


def _json_errors(protocol: RequestHandler) -> RequestHandler:
    """``protocol``, answering what aiohttp refuses as ``_JsonErrorProtocol`` does."""
    protocol.__class__ = _JsonErrorProtocol
    return protocol


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with every connection passed through ``guard`` (module docstring).

    It listens through ``peers.acceptor.Acceptor``, not ``loop.create_server``: asyncio's
    ``Server`` (3.11) leaks a socket accepted just before its close (the data plane's race)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._guard = guard
        self._acceptor: Acceptor | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); port 0 at construction picks a free one."""
        if self._acceptor is None:
            raise RuntimeError("the site is not started")
        return self._acceptor.address

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "the runner is set up before its site starts"
        guard = self._guard
        self._acceptor = await Acceptor.bind(self._host, self._port,
                                             lambda: guard.wrap(_json_errors(server())))

    async def stop(self) -> None:
        self._guard.close_refused()  # aiohttp's shutdown closes only the connections it was given
        if self._acceptor is not None:
            await self._acceptor.close()
            self._acceptor = None
        await super().stop()  # no asyncio Server here: it only unregisters the site
