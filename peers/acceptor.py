"""A listening TCP socket that owns every socket it accepts until a protocol has it.

Why not ``loop.create_server``: on Python 3.11 a socket accepted just before ``Server.close()``
is handed to its protocol a loop tick later, after the close; ``Server._attach`` then fails an
assertion and the accepted socket is left to the garbage collector (an fd held until then and a
``ResourceWarning`` in whichever code runs the collection). There is no hook to find such sockets.
Here each accepted socket stays in ``_handing`` until ``connect_accepted_socket`` has made its
transport, and ``close`` closes the ones still there; what was handed over belongs to the caller's
protocol (the listener aborts those links).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Final

__all__ = ["Acceptor"]

log = logging.getLogger(__name__)

#: listen(2) backlog, and the most sockets accepted per readiness callback (asyncio's default).
_BACKLOG: Final = 100
#: Out of descriptors or buffers: accepting more now would only fail again; stop for this long
#: (asyncio's own pause) and let connections close.
_ACCEPT_PAUSE_S: Final = 1.0
_RESOURCE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Acceptor:
    """Accept on ``sock`` and hand each socket to ``loop.connect_accepted_socket(factory, ...)``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self._loop, self._sock, self._factory = loop, sock, factory
        #: accepted sockets whose transport is not made yet, by the task handing them over
        self._handing: dict[asyncio.Task[None], socket.socket] = {}
        self._closed = False
        self._resume: asyncio.TimerHandle | None = None
        loop.add_reader(sock.fileno(), self._on_readable)

    @classmethod
    async def bind(cls, host: str, port: int, factory: Callable[[], asyncio.BaseProtocol]) -> Acceptor:
        """Listen on (host, port); port 0 picks a free one (``address`` says which).

        Raises:
            OSError: the address cannot be resolved or bound.
        """
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        if not infos:
            raise OSError(f"cannot resolve {host!r}")
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return cls(loop, sock, factory)

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        name = self._sock.getsockname()
        return str(name[0]), int(name[1])

    def _on_readable(self) -> None:
        for _ in range(_BACKLOG):
            try:
                conn, _peer = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRNOS:
                    log.warning("accept failed: %r", exc)
                    return
                log.warning("accept failed, pausing %.1fs: %r", _ACCEPT_PAUSE_S, exc)
                self._loop.remove_reader(self._sock.fileno())
                self._resume = self._loop.call_later(_ACCEPT_PAUSE_S, self._resume_accepting)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._hand_over(conn))
            self._handing[task] = conn
            task.add_done_callback(self._handed)

    def _resume_accepting(self) -> None:
        self._resume = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._on_readable)

    async def _hand_over(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except (OSError, RuntimeError) as exc:  # the peer went away before connection_made
            log.debug("accepted socket lost before its protocol started: %r", exc)
            conn.close()

    def _handed(self, task: asyncio.Task[None]) -> None:
        conn = self._handing.pop(task, None)
        if conn is not None and (task.cancelled() or task.exception() is not None):
            conn.close()  # a cancelled hand-over may never have started: nothing else closes it

    async def close(self) -> None:
        """Stop accepting and close every accepted socket not yet handed to a protocol."""
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        pending = list(self._handing)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
