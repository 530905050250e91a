"""Typed member metadata: the documented keys the daemon gossips.

Membership treats metadata as opaque bytes (bounded by MAX_META_BYTES). The
daemon and placement agree on this one schema so every node can read roles,
data-plane addresses, capacity, weight and the digest of its storage ring from any
other member's entry. Fields are append-only with defaults (``omit_defaults``), so
older nodes ignore newer keys.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from peers.membership.messages import MAX_META_BYTES

__all__ = ["MetaTooLargeError", "NodeMeta"]


class MetaTooLargeError(ValueError):
    """Encoded metadata exceeds MAX_META_BYTES."""


class NodeMeta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Metadata one node advertises. Unknown keys from newer nodes are ignored.

    Attributes:
        roles: e.g. ``("storage", "compute")``.
        transports: data-plane address per transport scheme, e.g.
            ``{"tcp": "tcp://10.0.0.1:7400", "ucx": "ucx://10.0.0.1:7401"}``.
        capacity_bytes: RAM offered for column storage (0: not a storage node).
        weight: placement weight (rendezvous hashing), 1.0 = average.
        proto_min / proto_max: data-plane protocol versions spoken.
        full: the storage node refuses writes (over capacity).
        ring: digest of the storage ring this node holds (giaannd/cluster/ring.py; 0: none yet). A peer
            whose digest differs pulls the ring from it (giaannd/services/ring_sync.py).
    """

    roles: tuple[str, ...] = ()
    transports: dict[str, str] = {}
    capacity_bytes: Annotated[int, Meta(ge=0)] = 0
    weight: Annotated[float, Meta(ge=0)] = 1.0
    proto_min: int = 1
    proto_max: int = 1
    full: bool = False
    ring: Annotated[int, Meta(ge=0)] = 0

    def encode(self) -> bytes:
        """Encode to metadata bytes.

        Raises:
            MetaTooLargeError: the encoding is over MAX_META_BYTES.
        """
        data = msgspec.msgpack.encode(self)
        if len(data) > MAX_META_BYTES:
            raise MetaTooLargeError(
                f"node metadata is {len(data)} bytes; the limit is {MAX_META_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> NodeMeta:
        """Decode metadata bytes; empty bytes give the defaults.

        Raises:
            ValueError: the bytes are not a NodeMeta encoding.
        """
        if not data:
            return cls()
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"bad node metadata: {exc}") from exc
