"""NodeCall: the one primitive the StorageClient's parts are written against.

``StorageClient._call`` (client.py) sends one request to one named storage node over a reused
connection, raises typed error replies as exceptions (client/errors.py) and reports unreachable
nodes. The parts that run an operation over many nodes (writes.py, reads.py, scan.py,
remote_vocab.py, column_info.py) take that method as a ``NodeCall`` argument instead of the whole
client, so each one says exactly what it needs and can be driven by a fake in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from giaannd import protocol as p

__all__ = ["NodeCall", "NodeReply"]

#: A success reply and its bulk buffers (received in place).
NodeReply = tuple[p.Reply, list[np.ndarray]]


class NodeCall(Protocol):
    """One request to ``node``; returns the reply and its bulk buffers (received straight into
    ``recv_into`` when given: the reply's buffers must then match them exactly in number and bytes,
    else ``LocalProtocolError``, ``peers.transport.Connection.request``).

    Raises:
        StorageRequestError: a typed error reply (``Remote*``, client/errors.py).
        PeersError / OSError / ProtocolViolation / KeyError: the node could not be used.
    """

    async def __call__(self, node: str, msg: p.Request, bulk: Sequence[Any] = (),
                       timeout_s: float | None = None, *, recv_into: Sequence[Any] | None = None) -> NodeReply: ...
