"""The transport interface: ``Transport`` (listen/connect), ``Listener``, and the types a request
handler sees. The request/response machinery shared by every backend is ``connection.Connection``.

A backend only has to move *frames* (``peers.framing``) both ways over a ``Link``; requests, ids,
deadlines, cancellation, bulk placement, handshake and error mapping are written once, so the
conformance suite tests the same logic over every backend.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np

from peers import wire

if TYPE_CHECKING:
    from peers.transport.connection import Connection

__all__ = [
    "Identity",
    "Incoming",
    "Reply",
    "Result",
    "Handler",
    "Link",
    "Listener",
    "Transport",
    "BulkChannel",
]


@dataclass(frozen=True)
class Identity:
    """Who we are on the data plane; the same for every connection of a node.

    ``keyring``: cluster keys, the first is primary (used to prove), all are accepted (rotation).
    """

    node_id: str
    cluster: str
    keyring: Sequence[bytes]
    versions: tuple[int, int] = (wire.PROTOCOL_MIN, wire.PROTOCOL_MAX)


@dataclass(slots=True)
class Incoming:
    """A request as the server's handler sees it.

    ``bulk`` arrays are views of pooled receive buffers, valid until the handler's reply has been
    sent: copy what must outlive it. ``deadline`` is in ``loop.time()`` seconds (or None).
    """

    payload: memoryview
    bulk: list[np.ndarray]
    deadline: float | None
    peer: str

    def decode(self, type_: type[Any]) -> Any:
        """Decode the payload as the application's msgspec type."""
        return msgspec.msgpack.decode(self.payload, type=type_)


@dataclass(slots=True)
class Reply:
    """What a handler returns: an application message (a msgspec Struct, or pre-encoded bytes) and
    bulk buffers (numpy arrays / torch CPU tensors, contiguous; kept alive until sent)."""

    payload: Any = None
    bulk: Sequence[Any] = field(default_factory=list)


@dataclass(slots=True)
class Result:
    """What ``Connection.request`` returns. ``bulk`` are the caller's ``recv_into`` buffers (typed
    views of them) or freshly allocated arrays when none were given."""

    payload: memoryview
    bulk: list[np.ndarray]

    def decode(self, type_: type[Any]) -> Any:
        return msgspec.msgpack.decode(self.payload, type=type_)


Handler = Callable[[Incoming], Awaitable[Reply]]


class Link(abc.ABC):
    """A reliable, ordered frame pipe (the control stream). Backends implement this."""

    @abc.abstractmethod
    def write(self, parts: Sequence[bytes | memoryview]) -> None:
        """Queue the parts of one frame, in order, without copying them if possible."""

    @abc.abstractmethod
    async def drain(self) -> None:
        """Wait until everything written has left our buffers (the caller may reuse them)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close at once; the connection's ``on_lost`` will be called."""

    def close(self) -> None:
        """Close after what was written has been sent (a Reject must reach the peer)."""
        self.abort()

    def cork(self) -> None:
        """Hold small frames written from now on until the matching ``uncork``, which writes them
        together (one syscall for a burst). A frame is held whole and its bytes are the link's own
        (copied if they were the caller's), so ``write`` still returns with the caller's buffers
        free; frames stay in write order. Nested calls nest. Default: nothing is held."""
        return None  # a backend without a syscall to save (mem) keeps writing at once

    def uncork(self) -> None:
        """End one ``cork``; the outermost writes what was held."""
        return None

    def flush_held(self) -> None:
        """Write what a cork holds now, whatever the cork depth: an orderly close says
        ``Goodbye`` and then aborts, and an abort drops what is held."""
        return None

    @property
    @abc.abstractmethod
    def resources(self) -> int:
        """Number of OS/UCX resources held (sockets, endpoints) — for leak checks in tests."""


class BulkChannel(abc.ABC):
    """An out-of-band path for bulk bytes (UCX). Messages are matched by a 64-bit tag."""

    #: Frames whose bulk totals fewer bytes travel inline on the control stream instead: one
    #: stream write beats a second transport's round trip for small buffers (measured, ucx.py).
    min_bytes: int = 0

    @abc.abstractmethod
    async def send(self, tag: int, view: memoryview) -> None: ...

    @abc.abstractmethod
    async def recv(self, tag: int, dest: memoryview) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    def pending_receives(self) -> int:
        """Receives posted and not completed (their buffers may still be written into)."""
        return 0


class Listener(abc.ABC):
    """A bound server. ``address`` is the real one (port 0 resolved)."""

    address: str

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting and close every accepted connection."""

    @property
    @abc.abstractmethod
    def connections(self) -> list[Connection]:
        """Open, handshaken connections accepted by this listener."""


class Transport(abc.ABC):
    """One backend, chosen by URL scheme (``tcp://``, ``ucx://``, ``mem://``)."""

    scheme: ClassVar[str]

    def __init__(self, identity: Identity) -> None:
        self.identity = identity

    @abc.abstractmethod
    async def listen(self, address: str, handler: Handler) -> Listener:
        """Bind ``address`` and serve ``handler`` on every accepted connection."""

    @abc.abstractmethod
    async def connect_once(self, address: str, *, timeout_s: float) -> Connection:
        """One connection attempt including the handshake (``connect.connect`` adds retries).

        Raises:
            TransportClosed: the peer is unreachable or hung up.
            HandshakeRejected: the peer is not one of us (not retried).
            DeadlineExceeded: the attempt took longer than ``timeout_s``.
        """
