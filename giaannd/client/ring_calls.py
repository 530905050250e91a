"""Client side of the runtime requests: read, push and override a node's ring over the data plane.

Every node with a data plane (storage or compute) answers ``RingGet``, ``RingPush``,
``SetOverride`` and ``OperationGet`` in its runtime (giaannd/runtime/node.py,
giaannd/protocol.py). These helpers are what ring sync (giaannd/services/ring_sync.py), an
override's lease check (giaannd/services/override_lease.py) and a topology operation's
coordinator call: one connection per call, closed after it (these are rare control requests, not the data path).

``transports`` is the caller's scheme -> ``Transport`` map; a scheme it lacks is created from
``identity`` and added to it (so repeated calls reuse it), as ``StorageClient`` does.

Errors: a typed refusal from the node raises ``RingRequestError`` (its ``reply`` says which);
a transport failure raises what the transport raised (``PeersError`` / ``OSError``: unreachable,
deadline); a reply that is not the expected message raises ``ProtocolViolation``.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Final

from giaannd import protocol as p
from giaannd.cluster.ring import Ring
from giaannd.cluster.view import StorageNode
from giaannd.errors import RemoteFault
from peers.transport import Identity, Transport, connect, make_transport, scheme_of

__all__ = ["DEFAULT_TIMEOUT_S", "RingRequestError", "get_operation_state", "get_ring", "push_ring", "set_override"]

#: Bound on connecting plus one ring request (a ring is a few KiB; the node answers from RAM or
#: after one small fsync).
DEFAULT_TIMEOUT_S: Final = 5.0
#: Added to a flushing SetOverride's own bound, for the connection and the reply.
_FLUSH_MARGIN_S: Final = 5.0


class RingRequestError(RemoteFault):
    """The node refused the request (``reply``: its BadRequest / Unavailable / ... answer)."""

    reason = "ring_request_refused"

    def __init__(self, address: str, reply: p.Reply) -> None:
        super().__init__(f"{address}: {type(reply).__name__}: {getattr(reply, 'message', reply)}")
        self.address = address
        self.reply = reply


async def _call(transports: MutableMapping[str, Transport], identity: Identity | None, address: str,
                msg: p.RuntimeRequest, timeout_s: float) -> p.Reply:
    scheme = scheme_of(address)
    transport = transports.get(scheme)
    if transport is None:
        if identity is None:
            raise KeyError(f"no {scheme}:// transport (and no identity to make one) for {address}")
        transport = transports[scheme] = make_transport(scheme, identity)
    conn = await connect(transport, address, timeout_s=timeout_s)
    try:
        result = await conn.request(p.encode(msg), timeout_s=timeout_s)
    finally:
        await conn.close("ring request done")
    reply = p.decode_reply(result.payload)
    if isinstance(reply, (p.StoreFull, p.NotOwner, p.BadRequest, p.Unavailable, p.VocabConflict)):
        raise RingRequestError(address, reply)
    return reply


def _ring_of(address: str, reply: p.Reply) -> Ring:
    if not isinstance(reply, p.RingState):
        raise p.ProtocolViolation(f"{address} answered {type(reply).__name__} to a ring request")
    try:
        return Ring.from_wire(reply.entries)
    except ValueError as exc:
        raise p.ProtocolViolation(f"{address} sent a bad ring: {exc}") from None


async def get_ring(transports: MutableMapping[str, Transport], identity: Identity | None, address: str,
                   *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Ring:
    """The ring the node at data-plane ``address`` holds (module docstring for errors)."""
    return _ring_of(address, await _call(transports, identity, address, p.RingGet(), timeout_s))


async def push_ring(transports: MutableMapping[str, Transport], identity: Identity | None, address: str,
                    ring: Ring, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Ring:
    """Merge ``ring`` into the node's ring (it persists the result before answering); returns the
    merged ring the node now holds."""
    reply = await _call(transports, identity, address, p.RingPush(ring.to_wire()), timeout_s)
    return _ring_of(address, reply)


async def set_override(transports: MutableMapping[str, Transport], identity: Identity | None,
                       address: str, members: Sequence[StorageNode] | None, flush: bool,
                       timeout_s: float = 30.0, lease: p.OverrideLease | None = None) -> str:
    """Set (``members``) or clear (None) the node's placement override.

    Args:
        flush: the reply waits until the node's storage clients finished the writes they had in
            flight (writes computed under the previous placement are done), at most ``timeout_s``.
        timeout_s: the node's flush bound; the request itself gets a few seconds more.
        lease: the operation the override belongs to (the node drops the override once that
            operation is known to have ended without clearing it: services/override_lease.py).

    Returns:
        the placement epoch now in force on that node.

    Raises:
        RingRequestError: refused (e.g. ``Unavailable``: the flush did not finish in time; the
            override is set nevertheless).
    """
    wire = None if members is None else [(m.name, m.address, float(m.weight)) for m in members]
    msg = p.SetOverride(wire, flush, min(timeout_s, p.MAX_FLUSH_TIMEOUT_S), lease)
    reply = await _call(transports, identity, address, msg, timeout_s + _FLUSH_MARGIN_S)
    if not isinstance(reply, p.OverrideSet):
        raise p.ProtocolViolation(f"{address} answered {type(reply).__name__} to SetOverride")
    return reply.epoch


async def get_operation_state(transports: MutableMapping[str, Transport], identity: Identity | None,
                              address: str, op_id: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """The state of topology operation ``op_id`` on the node at ``address`` that coordinates it;
    "" when that node runs no operation of that id (module docstring for errors; a node that
    predates ``OperationGet`` answers ``BadRequest``: ``RingRequestError``)."""
    reply = await _call(transports, identity, address, p.OperationGet(op_id), timeout_s)
    if not isinstance(reply, p.OperationState):
        raise p.ProtocolViolation(f"{address} answered {type(reply).__name__} to OperationGet")
    return reply.state
