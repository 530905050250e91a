"""What a stream listener admits before and around the handshake: the data plane's resource policy.

Until the handshake has proved that a peer holds the cluster key, anyone who can reach the port is a
stranger, and everything a stranger makes us hold must be small and bounded: the bytes of one
handshake frame, the time to finish the handshake, and the number of such connections at once.
After the handshake the peer is one of us and the framing's own limits (``peers.framing``) apply.

The defaults are safe for a daemon on a shared host; ``giaannd/config.py`` exposes each field under
``[transport]`` (docs/config.md), and docs/transport.md explains the choice of each value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from peers import framing

__all__ = [
    "DEFAULT_HANDSHAKE_MAX_BODY_BYTES",
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS_PER_HOST",
    "DEFAULT_MAX_PENDING_HANDSHAKES",
    "TransportLimits",
]

#: A Hello/Welcome is well under 2 KiB (the largest field is a UCX worker address, a few hundred
#: bytes); 64 KiB, the staging buffer minus its header, leaves a wide margin and means a stranger's
#: frame never needs more than the one buffer every connection has anyway.
DEFAULT_HANDSHAKE_MAX_BODY_BYTES: Final = framing.STAGING_BYTES - framing.HEADER_BYTES
#: A peer that has not finished its handshake after this long is dropped: a handshake is two round
#: trips (sub-millisecond on a LAN), so 10 s only ever cuts off silent or stalled clients.
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 10.0
#: Accepted connections still in their handshake, at once. Each holds one 64 KiB staging buffer, so
#: the cap bounds a stranger's footprint at 8 MiB; real peers finish in milliseconds, so even a
#: whole cluster reconnecting at once (one connection per peer and role) stays far below it.
DEFAULT_MAX_PENDING_HANDSHAKES: Final = 128
#: Open accepted connections from one remote host (IP address). A node keeps one pooled connection
#: per peer plus a few for streams and clients; a loopback test cluster has all of its nodes on one
#: address, hence the generous value. It keeps one host from taking every file descriptor.
DEFAULT_MAX_CONNECTIONS_PER_HOST: Final = 512


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """Admission limits of one transport (see the module docstring and docs/transport.md).

    Attributes:
        max_pending_handshakes: accepted connections still in their handshake, at once; more are
            closed on accept (counted as ``connections_refused["pending_handshakes"]``).
        max_connections_per_host: open accepted connections per remote IP address; more are
            closed on accept (``connections_refused["per_host"]``).
        handshake_timeout_s: an accepted connection that has not finished its handshake by then is
            dropped (``handshake_rejections["timeout"]``).
        handshake_max_body_bytes: largest frame body accepted before the handshake completed; a
            larger one is a protocol error (``oversize``) refused before anything is allocated.
    """

    max_pending_handshakes: int = DEFAULT_MAX_PENDING_HANDSHAKES
    max_connections_per_host: int = DEFAULT_MAX_CONNECTIONS_PER_HOST
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    handshake_max_body_bytes: int = DEFAULT_HANDSHAKE_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.max_pending_handshakes < 1 or self.max_connections_per_host < 1:
            raise ValueError("connection caps must be >= 1")
        if not self.handshake_timeout_s > 0:
            raise ValueError("handshake_timeout_s must be > 0")
        if not 1024 <= self.handshake_max_body_bytes <= framing.MAX_BODY_BYTES:
            raise ValueError(f"handshake_max_body_bytes must be in [1024, {framing.MAX_BODY_BYTES}]")
