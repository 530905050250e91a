"""The exception tree of the peers layer.

Modelled on h11's split (STYLE.md item 10): an error says *whose fault* it is, because that decides
what the caller does.

- ``RemoteProtocolError``: the peer sent something we cannot accept (garbage, oversize length, wrong
  message in this state). Close that one connection, count it, keep serving everyone else.
- ``LocalProtocolError``: we tried to do something the protocol forbids (a bug on our side, or a caller
  misusing the API, such as sending a buffer larger than the limit). Never the peer's fault.
- ``TransportClosed``: the connection is gone (reset, EOF, closed by us). It subclasses ``OSError``
  so code that already handles socket errors handles it too (dask's ``CommClosedError`` role).
- ``HandshakeRejected``: the peer is not one of us (wrong cluster key, cluster name, or no common
  protocol version). Both sides get one, with the reason, and the connection is closed.
- ``DeadlineExceeded``: an operation did not finish before its deadline. Subclasses ``TimeoutError``
  so ``asyncio.timeout`` style handling applies.
- ``PeerDead``: membership (or the control connection) declared the peer dead; everything pending to
  it fails with this at once.
- ``RemoteError``: the peer's request handler raised; the response carries its type name and message.
- ``RequestCancelled``: the operation was cancelled by the other side (or by a local ``cancel``).

Backend-specific exceptions (ucxx's ``UCXError`` family, which is *not* an OSError) are translated to
these at the transport boundary, so callers never import a backend's exception types.
"""

from __future__ import annotations

__all__ = [
    "PeersError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "TransportClosed",
    "HandshakeRejected",
    "DeadlineExceeded",
    "PeerDead",
    "RemoteError",
    "RequestCancelled",
    "TransportUnavailable",
]


class PeersError(Exception):
    """Base class of every error raised by the peers layer."""


class LocalProtocolError(PeersError):
    """We (the local side) broke the protocol or misused the API; the peer did nothing wrong."""


class RemoteProtocolError(PeersError):
    """The peer broke the protocol: close the connection, count it, keep serving.

    ``reason`` is a short stable token suitable as a metrics label (``bad_magic``, ``oversize`` ...).
    """

    def __init__(self, message: str, *, reason: str = "protocol") -> None:
        super().__init__(message)
        self.reason = reason


class TransportClosed(PeersError, OSError):
    """The connection is closed (by the peer, by us, or by a failure)."""


class HandshakeRejected(PeersError):
    """The handshake failed: wrong cluster key, wrong cluster name, or no common protocol version.

    ``reason`` is one of ``bad_key``, ``wrong_cluster``, ``version``, ``protocol``; ``by_peer`` tells
    whether the peer rejected us (True) or we rejected the peer (False).
    """

    def __init__(self, message: str, *, reason: str, by_peer: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.by_peer = by_peer
        #: the ``peers.wire.Reject`` to send the peer before closing (set by the detecting side)
        self.reply: object | None = None


class DeadlineExceeded(PeersError, TimeoutError):
    """An operation did not complete before its deadline."""


class PeerDead(TransportClosed):
    """The peer was declared dead (by membership or by the control connection)."""


class RemoteError(PeersError):
    """The peer's handler raised; ``remote_type`` is the exception's class name on the peer."""

    def __init__(self, message: str, *, remote_type: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_message = message


class RequestCancelled(PeersError):
    """The request was cancelled (locally, or by the peer)."""


class TransportUnavailable(PeersError):
    """A backend cannot be used here (e.g. ucxx not importable); callers fall back to another."""
