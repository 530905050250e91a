"""What goes into the membership core (stimuli) and what comes out (actions, member events).

Stimuli are nouns/past tense, actions imperative, member events past tense
(STYLE.md item 16). All are plain frozen dataclasses: the core never touches I/O.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from peers.membership.messages import Addr, MemberStatus, Message, PushPull, StreamMessage

__all__ = [
    "Action", "Emit", "Join", "JoinFinished", "Leave", "MemberEvent", "MemberFailed",
    "MemberJoined", "MemberLeft", "MemberReaped", "MemberSuspected", "MemberUpdated",
    "NameConflict", "OpenStream", "Received", "ReplyStream", "ReportUnreachable", "Send",
    "SetTimer", "Start", "Stimulus", "StreamReply", "StreamRequest", "TimerFired",
    "UpdateMeta",
]


# ---- stimuli -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Start:
    """The node starts: arm the periodic timers."""


@dataclass(frozen=True, slots=True)
class Received:
    """A decoded UDP compound packet from ``addr``."""

    addr: Addr
    messages: list[Message]


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """A TCP stream from ``addr`` delivered one message; answer with ReplyStream(token)."""

    addr: Addr
    token: int
    message: StreamMessage


@dataclass(frozen=True, slots=True)
class StreamReply:
    """The answer to our OpenStream(token); None when the exchange failed or timed out."""

    token: int
    message: StreamMessage | None


@dataclass(frozen=True, slots=True)
class TimerFired:
    """A timer set with SetTimer(key) fired (possibly stale: the core checks)."""

    key: Hashable


@dataclass(frozen=True, slots=True)
class Join:
    """Join the cluster through these seed addresses (one push-pull each)."""

    seeds: tuple[Addr, ...]


@dataclass(frozen=True, slots=True)
class Leave:
    """Leave gracefully: announce state ``left`` and stop probing."""


@dataclass(frozen=True, slots=True)
class UpdateMeta:
    """Replace the local metadata (bumps the incarnation and gossips it)."""

    meta: bytes


@dataclass(frozen=True, slots=True)
class ReportUnreachable:
    """The data plane could not reach ``name``: start suspicion (never death alone)."""

    name: str


Stimulus = (Start | Received | StreamRequest | StreamReply | TimerFired | Join | Leave
            | UpdateMeta | ReportUnreachable)


# ---- member events ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _MemberEventBase:
    name: str
    node_id: str
    addr: Addr
    incarnation: int
    status: MemberStatus
    meta: bytes
    cause: str


@dataclass(frozen=True, slots=True)
class MemberJoined(_MemberEventBase):
    """A member became alive: new, or back from dead/left."""


@dataclass(frozen=True, slots=True)
class MemberUpdated(_MemberEventBase):
    """A member's metadata or address changed, or it refuted a suspicion."""


@dataclass(frozen=True, slots=True)
class MemberSuspected(_MemberEventBase):
    """A member is suspected of failure (not yet dead)."""


@dataclass(frozen=True, slots=True)
class MemberFailed(_MemberEventBase):
    """A member was declared dead."""


@dataclass(frozen=True, slots=True)
class MemberLeft(_MemberEventBase):
    """A member left gracefully."""


@dataclass(frozen=True, slots=True)
class MemberReaped(_MemberEventBase):
    """A dead or left member was forgotten after reap_after_s."""


@dataclass(frozen=True, slots=True)
class NameConflict:
    """A different node id claims a live member's name; the claim was rejected."""

    name: str
    known_node_id: str
    claimed_node_id: str
    claimed_addr: Addr
    local: bool


MemberEvent = (MemberJoined | MemberUpdated | MemberSuspected | MemberFailed | MemberLeft
               | MemberReaped | NameConflict)


# ---- actions ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Send:
    """Send one UDP compound packet; ``size`` is its encoded size before sealing."""

    addr: Addr
    messages: list[Message]
    size: int


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Open a TCP stream to ``addr``, send ``message``, report the answer as StreamReply."""

    addr: Addr
    token: int
    message: PushPull | StreamMessage


@dataclass(frozen=True, slots=True)
class ReplyStream:
    """Answer the stream ``token`` (None: close it without an answer)."""

    token: int
    message: StreamMessage | None


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Fire TimerFired(key) at ``at`` (replacing any earlier timer with that key)."""

    at: float
    key: Hashable


@dataclass(frozen=True, slots=True)
class Emit:
    """Tell the rest of the daemon about a member event."""

    event: MemberEvent


@dataclass(frozen=True, slots=True)
class JoinFinished:
    """Every seed of a Join answered or failed; ``contacted`` answered.

    ``selves`` seeds turned out to be this node under another spelling (``localhost`` for
    127.0.0.1, a host name for its address): they answered, but not as a cluster, so they are not
    in ``contacted``.
    """

    contacted: int
    conflict: NameConflict | None
    selves: int = 0


Action = Send | OpenStream | ReplyStream | SetTimer | Emit | JoinFinished
