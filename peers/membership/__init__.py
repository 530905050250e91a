"""SWIM + Lifeguard gossip membership (GIAANN-agnostic).

``Membership`` is the sans-IO core; ``MembershipNode`` runs it on asyncio over
UDP and TCP with AES-GCM sealing. See docs/membership.md.
"""

from peers.membership.codec import PacketCodec, PacketRejected
from peers.membership.config import MembershipConfig
from peers.membership.events import (
    MemberEvent,
    MemberFailed,
    MemberJoined,
    MemberLeft,
    MemberReaped,
    MemberSuspected,
    MemberUpdated,
    NameConflict,
)
from peers.membership.messages import MAX_META_BYTES, MemberStatus
from peers.membership.meta import MetaTooLargeError, NodeMeta
from peers.membership.node import JoinError, MemberInfo, MembershipNode, NameConflictError
from peers.membership.state import Membership

__all__ = [
    "MAX_META_BYTES", "JoinError", "MemberEvent", "MemberFailed", "MemberInfo", "MemberJoined",
    "MemberLeft", "MemberReaped", "MemberStatus", "MemberSuspected", "MemberUpdated",
    "Membership", "MembershipConfig", "MembershipNode", "MetaTooLargeError", "NameConflict",
    "NameConflictError", "NodeMeta", "PacketCodec", "PacketRejected",
]
