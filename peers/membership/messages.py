"""Membership wire messages: msgspec Structs in one tagged union, msgpack-encoded.

WARNING (as memberlist says of its message types): tag values and field order are
part of the protocol. Only append new message types with new tags, and only append
new fields at the end with a default. Decoding tolerates unknown trailing fields,
so an older node can read a newer node's messages.

A UDP payload is a msgpack array of messages (a compound packet). TCP streams
carry exactly one message per sealed frame.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = [
    "MAX_INCARNATION", "MAX_MEMBERS_PER_PUSH_PULL", "MAX_MESSAGES_PER_PACKET", "MAX_META_BYTES",
    "MAX_NAME_BYTES", "PROTOCOL_MAX", "PROTOCOL_MIN", "Ack", "Addr", "Alive", "Dead", "IndirectPing", "MemberState",
    "MemberStatus", "Message", "Nack", "Ping", "PushPull", "StreamMessage", "Suspect",
    "compound_size", "decode_compound", "decode_stream", "encode_compound",
    "encode_stream", "message_size",
]

PROTOCOL_MIN = 1
PROTOCOL_MAX = 1

#: Metadata is gossiped on every alive message, so it must stay well inside one
#: datagram (memberlist MetaMaxSize = 512).
MAX_META_BYTES = 512
#: Member names are printed and used as keys; memberlist does not bound them, we do.
MAX_NAME_BYTES = 128
#: A push-pull larger than this is refused before it is merged (memberlist caps
#: the count of concurrent exchanges; we also cap one exchange's size).
MAX_MEMBERS_PER_PUSH_PULL = 20_000
#: A UDP compound packet never holds more messages than this.
MAX_MESSAGES_PER_PACKET = 255
#: Largest incarnation on the wire (msgpack's signed 64-bit range; memberlist uses uint32). A
#: decoder drops a whole packet carrying a larger one, so the core never computes one: every
#: incarnation it makes (refutation, metadata update) is clamped to this (state.py).
MAX_INCARNATION = 2**63 - 1

Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_BYTES)]
NodeId = Annotated[str, Meta(max_length=64)]
Host = Annotated[str, Meta(max_length=255)]
Port = Annotated[int, Meta(ge=0, le=65535)]
Incarnation = Annotated[int, Meta(ge=0, le=MAX_INCARNATION)]
Seq = Annotated[int, Meta(ge=0, le=2**63 - 1)]
MetaBytes = Annotated[bytes, Meta(max_length=MAX_META_BYTES)]
Addr = tuple[Host, Port]
Vsn = tuple[int, int, int]


class MemberStatus(enum.IntEnum):
    """A member's state as this node believes it."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


class Ping(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """Direct probe; ``target`` lets a reused address be told apart (memberlist)."""

    seq: Seq
    target: Name
    source: Name


class IndirectPing(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """Ask the receiver to probe ``target`` on the sender's behalf."""

    seq: Seq
    target: Name
    target_addr: Addr
    nack: bool


class Ack(msgspec.Struct, frozen=True, array_like=True, tag=3):
    """Answer to a Ping (or a relayed answer to an IndirectPing)."""

    seq: Seq


class Nack(msgspec.Struct, frozen=True, array_like=True, tag=4):
    """Lifeguard: the relay is alive but the target did not answer it in time."""

    seq: Seq


class Alive(msgspec.Struct, frozen=True, array_like=True, tag=5):
    """A member is alive at an incarnation, with its address and metadata."""

    incarnation: Incarnation
    name: Name
    node_id: NodeId
    addr: Addr
    meta: MetaBytes = b""
    vsn: Vsn = (PROTOCOL_MIN, PROTOCOL_MAX, PROTOCOL_MAX)


class Suspect(msgspec.Struct, frozen=True, array_like=True, tag=6):
    """``source`` suspects ``name`` at ``incarnation``."""

    incarnation: Incarnation
    name: Name
    source: Name


class Dead(msgspec.Struct, frozen=True, array_like=True, tag=7):
    """``source`` declares ``name`` dead; ``source == name`` means a graceful leave."""

    incarnation: Incarnation
    name: Name
    source: Name


class MemberState(msgspec.Struct, frozen=True, array_like=True):
    """One row of a push-pull full-state exchange."""

    name: Name
    node_id: NodeId
    addr: Addr
    incarnation: Incarnation
    status: MemberStatus
    meta: MetaBytes = b""
    vsn: Vsn = (PROTOCOL_MIN, PROTOCOL_MAX, PROTOCOL_MAX)


class PushPull(msgspec.Struct, frozen=True, array_like=True, tag=8):
    """Full-state exchange over TCP; ``join`` marks the first one of a joining node."""

    join: bool
    source: Name
    members: Annotated[list[MemberState], Meta(max_length=MAX_MEMBERS_PER_PUSH_PULL)]


Message = Ping | IndirectPing | Ack | Nack | Alive | Suspect | Dead
StreamMessage = Ping | Ack | PushPull

_encoder = msgspec.msgpack.Encoder()
_compound_decoder = msgspec.msgpack.Decoder(
    Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES_PER_PACKET)])
_stream_decoder = msgspec.msgpack.Decoder(StreamMessage)


def message_size(message: Message) -> int:
    """Encoded size of one message inside a compound packet."""
    return len(_encoder.encode(message))


def compound_size(sizes_sum: int, count: int) -> int:
    """Size of a compound packet whose messages encode to ``sizes_sum`` bytes."""
    return sizes_sum + (1 if count < 16 else 3)


def encode_compound(messages: list[Message]) -> bytes:
    """Encode a compound packet (a msgpack array of messages)."""
    return _encoder.encode(messages)


def decode_compound(data: bytes) -> list[Message]:
    """Decode a compound packet. Raises msgspec.DecodeError / ValidationError."""
    result: list[Message] = _compound_decoder.decode(data)
    return result


def encode_stream(message: PushPull | Ping | Ack) -> bytes:
    """Encode one stream message."""
    return _encoder.encode(message)


def decode_stream(data: bytes) -> PushPull | Ping | Ack:
    """Decode one stream message. Raises msgspec.DecodeError / ValidationError."""
    result: PushPull | Ping | Ack = _stream_decoder.decode(data)
    return result
