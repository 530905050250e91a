"""Transport-level control messages: one msgspec Struct per message, one tagged union.

Every frame on a peer connection carries exactly one of these messages as its msgpack body (see
``peers/framing.py`` for the frame layout). Bulk buffers are *not* in here: a request or response
lists their descriptors (``BufferSpec``) and the raw bytes follow the body, straight into the
receiver's preallocated buffers.

Application messages (storage reads, delta batches...) are not defined here. They travel as the
``payload`` of a ``Request``/``Response``: a ``msgspec.Raw`` holding the msgpack encoding of the
application's own Struct, decoded by the application with its own typed ``Decoder``. The transport
never decodes it, so ``giaannd/protocol.py`` evolves without touching this file.

WARNING (memberlist's rule): tag values and field order are part of the protocol. Only append new
messages with new tags, and only append new fields *with defaults* at the end of a Struct. Never
renumber, reorder or remove. Structs deliberately do not set ``forbid_unknown_fields``, so a newer
peer may add trailing fields that an older one ignores.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

__all__ = [
    "PROTOCOL_MIN",
    "PROTOCOL_MAX",
    "MAX_NDIM",
    "MAX_NODE_ID_CHARS",
    "NONCE_BYTES",
    "DTYPES",
    "BufferSpec",
    "Hello",
    "Welcome",
    "Auth",
    "Ready",
    "Reject",
    "Request",
    "Response",
    "ErrorReply",
    "Cancel",
    "Goodbye",
    "Message",
    "BULK_INLINE",
    "BULK_UCX",
    "DECODE_ERRORS",
    "encode",
    "decoder",
]

#: Protocol versions this build speaks. A peer's range must overlap; the highest common one wins.
PROTOCOL_MIN: Final = 1
PROTOCOL_MAX: Final = 1

#: Arrays with more dimensions than this are refused (row buffers are 1-D or 2-D).
MAX_NDIM: Final = 8
#: Node ids and cluster names are short identifiers; bound them so a Hello stays tiny.
MAX_NODE_ID_CHARS: Final = 128
#: Nonce length for the HMAC challenge-response (128 bits of randomness each way).
NONCE_BYTES: Final = 16

#: Bulk buffer element types accepted on the wire (numpy ``dtype.str`` spellings, little endian).
#: ``bf16`` has no numpy dtype: send it as ``<u2`` (a torch ``view(torch.uint16)``) and re-view.
DTYPES: Final = frozenset(
    {"|u1", "|i1", "|b1", "<u2", "<i2", "<f2", "<u4", "<i4", "<f4", "<u8", "<i8", "<f8"}
)

#: Where the bytes of a frame's bulk buffers travel.
BULK_INLINE: Final = 0  # right after the body, on the same byte stream
BULK_UCX: Final = 1  # on the UCX endpoint, one tagged message per buffer (see transport/ucx.py)

_Short = Annotated[str, msgspec.Meta(max_length=MAX_NODE_ID_CHARS)]
_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
_Proof = Annotated[bytes, msgspec.Meta(max_length=64)]
_Version = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class BufferSpec(msgspec.Struct, frozen=True, array_like=True):
    """Descriptor of one bulk buffer: enough to preallocate the destination and check it.

    ``nbytes`` is redundant with dtype × shape on purpose: the receiver checks they agree before it
    allocates anything. ``checksum`` is the xxh3-64 of the bytes, or None when the sender chose not
    to compute one (TCP and UCX already detect corruption on the link; the checksum guards our own
    buffer bookkeeping and is cheap: see docs/transport.md).
    """

    dtype: str
    shape: tuple[int, ...]
    nbytes: _U64
    checksum: Annotated[int, msgspec.Meta(ge=0)] | None = None


# ---- handshake (tags 1..9) -------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, tag=1, array_like=True):
    """Client → server, first frame of every connection."""

    proto_min: _Version
    proto_max: _Version
    node_id: _Short
    cluster: _Short
    nonce: _Nonce
    transports: list[_Short] = []
    ucx_address: bytes | None = None
    bulk_salt: _U64 = 0  # the tag salt this side receives out-of-band bulk with (transport/ucx.py)


class Welcome(msgspec.Struct, frozen=True, tag=2, array_like=True):
    """Server → client: chosen version, server nonce, and the server's proof of the cluster key."""

    proto: _Version
    node_id: _Short
    nonce: _Nonce
    proof: _Proof
    transports: list[_Short] = []
    ucx_address: bytes | None = None
    bulk_salt: _U64 = 0


class Auth(msgspec.Struct, frozen=True, tag=3, array_like=True):
    """Client → server: the client's proof of the cluster key."""

    proof: _Proof


class Ready(msgspec.Struct, frozen=True, tag=4, array_like=True):
    """Server → client: handshake complete, requests may flow."""

    bulk_path: _Short = "inline"


class Reject(msgspec.Struct, frozen=True, tag=5, array_like=True):
    """Either side: handshake refused. ``reason``: bad_key, wrong_cluster, version, protocol."""

    reason: _Short
    message: Annotated[str, msgspec.Meta(max_length=1024)] = ""


# ---- requests (tags 10..) ----------------------------------------------------------------------


class Request(msgspec.Struct, frozen=True, tag=10, array_like=True):
    """A request. ``id`` is unique per connection and direction; ``budget_ms`` is the time the
    caller is still willing to wait (relative, because clocks of two hosts are not comparable),
    or None for no deadline. ``payload`` is the application's msgpack-encoded message."""

    id: _U64
    payload: msgspec.Raw
    bulk: list[BufferSpec] = []
    budget_ms: float | None = None
    bulk_via: int = BULK_INLINE


class Response(msgspec.Struct, frozen=True, tag=11, array_like=True):
    """The successful reply to ``Request`` ``id``."""

    id: _U64
    payload: msgspec.Raw
    bulk: list[BufferSpec] = []
    bulk_via: int = BULK_INLINE


class ErrorReply(msgspec.Struct, frozen=True, tag=12, array_like=True):
    """The handler of request ``id`` failed. ``kind`` is the exception class name (or one of
    ``deadline``, ``cancelled``, ``bad_request``)."""

    id: _U64
    kind: _Short
    message: Annotated[str, msgspec.Meta(max_length=4096)] = ""


class Cancel(msgspec.Struct, frozen=True, tag=13, array_like=True):
    """The caller gave up on request ``id``; the server cancels the handler if it still runs."""

    id: _U64


class Goodbye(msgspec.Struct, frozen=True, tag=14, array_like=True):
    """Orderly close: the sender will send nothing more."""

    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""


Message = Hello | Welcome | Auth | Ready | Reject | Request | Response | ErrorReply | Cancel | Goodbye

#: Everything decoding peer bytes may raise. msgspec raises a bare ``UnicodeDecodeError`` (not a
#: ``DecodeError``) for invalid UTF-8 in a string field — found by tests/fuzz/test_wire_fuzz.py —
#: and a ``RecursionError`` for arrays nested deeper than the interpreter's recursion limit (a
#: ``Raw`` payload is skipped recursively: a body of ~1,000 ``0x91`` bytes does it, even a stranger's).
DECODE_ERRORS: Final = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)

_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    """Encode one control message to msgpack bytes."""
    return _encoder.encode(message)


def decoder() -> msgspec.msgpack.Decoder[Message]:
    """A typed decoder for the union (one per connection: decoders are cheap but not free)."""
    return msgspec.msgpack.Decoder(Message)
