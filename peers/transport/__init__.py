"""The data plane: one ``Transport`` interface, backends by URL scheme (``tcp://``, ``ucx://``,
``mem://``), request/response messages with bulk buffers received in place. See docs/transport.md."""

from peers.transport.base import Handler, Identity, Incoming, Listener, Reply, Result, Transport
from peers.transport.connect import connect
from peers.transport.connection import Connection, Metrics
from peers.transport.connections import ConnectionPool
from peers.transport.limits import TransportLimits
from peers.transport.pool import BufferPool
from peers.transport.registry import make_transport, scheme_of

__all__ = [
    "BufferPool",
    "Connection",
    "ConnectionPool",
    "Handler",
    "Identity",
    "Incoming",
    "Listener",
    "Metrics",
    "Reply",
    "Result",
    "Transport",
    "TransportLimits",
    "connect",
    "make_transport",
    "scheme_of",
]
