"""Sealing and opening of membership packets and stream frames (no I/O).

Layout of a sealed packet (a UDP datagram, or the body of one stream frame)::

    u8 wire version (1) | u8 label length L | label (cluster name, L bytes, UTF-8)
    | 12-byte nonce | AES-GCM ciphertext of the msgpack payload | 16-byte tag

The version byte and label are sent in the clear so that a packet from another
cluster or another protocol version is rejected *by name* (memberlist's label
header), and both are also the GCM associated data, so they cannot be altered.
Keys are tried in keyring order (primary first), so rotation needs no flag day.

Every rejection raises PacketRejected with a short stable ``reason`` that the glue
counts (``rejected_<reason>``) and logs at a rate limit; nothing is mutated.
"""

from __future__ import annotations

import os

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from peers.errors import RemoteProtocolError
from peers.keyring import Keyring
from peers.membership.messages import (
    Message,
    PushPull,
    StreamMessage,
    decode_compound,
    decode_stream,
    encode_compound,
    encode_stream,
)

__all__ = ["MAX_STREAM_FRAME_BYTES", "MAX_UDP_PACKET_BYTES", "WIRE_VERSION", "PacketCodec",
           "PacketRejected"]

WIRE_VERSION = 1
#: Datagrams above this are rejected unread (the largest UDP payload is 65507).
MAX_UDP_PACKET_BYTES = 65507
#: One push-pull frame; 20,000 members of ~300 bytes fit. The length prefix is
#: checked against this before any buffer is allocated.
MAX_STREAM_FRAME_BYTES = 8 * 1024 * 1024
NONCE_BYTES = 12
TAG_BYTES = 16


class PacketRejected(RemoteProtocolError):
    """A packet or frame was dropped; ``reason`` is a stable counter name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason, reason=reason)


class PacketCodec:
    """Seals with the keyring's primary key; opens with any installed key."""

    def __init__(self, cluster: str, keyring: Keyring) -> None:
        label = cluster.encode("utf-8")
        if not 1 <= len(label) <= 255:
            raise ValueError("cluster name must be 1..255 bytes of UTF-8")
        self.keyring = keyring
        self._header = bytes([WIRE_VERSION, len(label)]) + label
        self._ciphers: dict[bytes, AESGCM] = {}

    @property
    def overhead(self) -> int:
        """Bytes sealing adds to a payload."""
        return len(self._header) + NONCE_BYTES + TAG_BYTES

    def _cipher(self, key: bytes) -> AESGCM:
        cipher = self._ciphers.get(key)
        if cipher is None:
            if len(self._ciphers) > 32:
                self._ciphers.clear()  # keys were rotated away; do not grow forever
            cipher = self._ciphers[key] = AESGCM(key)
        return cipher

    def seal(self, payload: bytes) -> bytes:
        """Encrypt and authenticate a payload under the primary key."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._cipher(self.keyring.primary).encrypt(nonce, payload, self._header)
        return self._header + nonce + sealed

    def unseal(self, data: bytes, limit: int = MAX_UDP_PACKET_BYTES) -> bytes:
        """Check the header and decrypt. Raises PacketRejected."""
        if len(data) > limit:
            raise PacketRejected("oversized", f"{len(data)} bytes")
        if len(data) < 2:
            raise PacketRejected("truncated")
        if data[0] != WIRE_VERSION:
            raise PacketRejected("bad_version", f"version {data[0]}")
        header_len = 2 + data[1]
        if len(data) < header_len + NONCE_BYTES + TAG_BYTES:
            raise PacketRejected("truncated")
        if data[:header_len] != self._header:
            raise PacketRejected("wrong_label")
        nonce = data[header_len:header_len + NONCE_BYTES]
        body = data[header_len + NONCE_BYTES:]
        for key in self.keyring.keys:
            try:
                return self._cipher(key).decrypt(nonce, body, self._header)
            except InvalidTag:
                continue
        raise PacketRejected("wrong_key")

    def seal_packet(self, messages: list[Message]) -> bytes:
        """Encode and seal a compound UDP packet."""
        return self.seal(encode_compound(messages))

    def open_packet(self, data: bytes) -> list[Message]:
        """Unseal and decode a UDP packet. Raises PacketRejected, never anything else."""
        payload = self.unseal(data)
        try:
            return decode_compound(payload)
        except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: bad UTF-8
            raise PacketRejected("malformed", str(exc)) from None

    def seal_frame(self, message: PushPull | StreamMessage) -> bytes:
        """Encode, seal and length-prefix one stream message."""
        body = self.seal(encode_stream(message))
        if len(body) > MAX_STREAM_FRAME_BYTES:
            raise ValueError(f"stream frame of {len(body)} bytes exceeds the limit")
        return len(body).to_bytes(4, "big") + body

    @staticmethod
    def frame_length(prefix: bytes) -> int:
        """Body length from a 4-byte prefix, checked before allocating. Raises PacketRejected."""
        length = int.from_bytes(prefix, "big")
        if length > MAX_STREAM_FRAME_BYTES:
            raise PacketRejected("oversized", f"frame of {length} bytes")
        return length

    def open_frame(self, body: bytes) -> StreamMessage:
        """Unseal and decode one stream frame body. Raises PacketRejected."""
        payload = self.unseal(body, MAX_STREAM_FRAME_BYTES)
        try:
            return decode_stream(payload)
        except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: bad UTF-8
            raise PacketRejected("malformed", str(exc)) from None
