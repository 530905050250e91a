"""SWIM + Lifeguard membership core, without I/O: ``handle(now, stimulus) -> actions``.

Theory of operation (everything that affects transitions lives in this file):

States of a member, as this node believes them: ALIVE, SUSPECT, DEAD, LEFT.
Transitions, each triggered by a message or a timer, each gossiped onward:

    ALIVE   --Suspect(inc >= known)-->            SUSPECT   (suspicion timer starts)
    SUSPECT --Suspect from a new accuser-->       SUSPECT   (timer shortened, Lifeguard)
    SUSPECT --suspicion timer fires-->            DEAD      (we gossip Dead)
    any     --Alive(inc > known)-->               ALIVE     (refutation / rejoin / update)
    ALIVE/SUSPECT --Dead(inc >= known, src!=name)--> DEAD
    ALIVE/SUSPECT --Dead(inc >= known, src==name)--> LEFT   (graceful leave, never SUSPECT)
    DEAD/LEFT --reap_after_s elapsed-->           forgotten

Precedence (memberlist `aliveNode/suspectNode/deadNode`): an Alive needs a strictly
higher incarnation, or an equal one with changed metadata sent by the member itself;
Suspect and Dead need an incarnation >= the known one. Messages about the local
node that accuse it are refuted by jumping the local incarnation past the accuser's.

Failure detection: one probe per (health-scaled) probe interval, targets in
shuffled round-robin order. A missed direct ack leads to k IndirectPing relays
(which Nack when the target stays silent) and a TCP fallback ping; a probe with no
ack by the end of the interval suspects the target. Lifeguard adds the local
health score (awareness.py), the decaying suspicion timeout with confirmations
(suspicion.py) and the buddy system (a Suspect rides on pings to the suspect).

Forged gossip (issue 16; a key holder can seal anything, so these are plausibility rules):

- Incarnations are clamped, not trusted: a received Suspect/Dead counts as at most
  ``max_incarnation_step`` above the incarnation we know of its member (0 if unknown), an
  Alive as one more (the refutation of such an accusation), and nothing reaches
  ``MAX_INCARNATION``. What we gossip on is the clamped message. So one forged message moves
  a member by a bounded step, its refutation always fits the wire, and a restarted member
  (fresh state) can still outrank what the cluster holds.
- A live member's address changes only once the new address answers a Ping (UDP and TCP)
  naming that member: the claim waits in ``_claims``, the old address stays in use, and the
  claim is forwarded to the member at its old address, which refutes it if it is forged.
  The claim expires after ``address_confirm_timeout_s``. Dead or left members' new
  addresses (a restart on a new port) are taken at once.

Invariants: the local member is always in the table and never SUSPECT/DEAD in it;
at most one probe is outstanding; ``_live`` counts members that are ALIVE or SUSPECT;
at most one address claim per member; no incarnation above ``MAX_INCARNATION``; a leaving
node queues no Alive of its own (it would replace and undo the leave); no compound packet holds
more than ``MAX_MESSAGES_PER_PACKET`` messages; the clock (``_now``) never goes back.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import msgspec

from peers.membership.awareness import Awareness
from peers.membership.broadcast import BroadcastQueue, retransmit_limit
from peers.membership.config import MembershipConfig
from peers.membership.events import (
    Action,
    Emit,
    Join,
    JoinFinished,
    Leave,
    MemberFailed,
    MemberJoined,
    MemberLeft,
    MemberReaped,
    MemberSuspected,
    MemberUpdated,
    NameConflict,
    OpenStream,
    Received,
    ReplyStream,
    ReportUnreachable,
    Send,
    SetTimer,
    Start,
    Stimulus,
    StreamReply,
    StreamRequest,
    TimerFired,
    UpdateMeta,
)
from peers.membership.messages import (
    MAX_INCARNATION,
    MAX_MESSAGES_PER_PACKET,
    MAX_META_BYTES,
    Ack,
    Addr,
    Alive,
    Dead,
    IndirectPing,
    MemberState,
    MemberStatus,
    Message,
    Nack,
    Ping,
    PushPull,
    Suspect,
    message_size,
)
from peers.membership.suspicion import Suspicion, push_pull_scale, suspicion_timeout_s

__all__ = ["DEFAULT_PACKET_OVERHEAD", "Member", "Membership"]

#: Bytes the glue adds around a compound payload (sealing header, nonce, GCM tag).
DEFAULT_PACKET_OVERHEAD = 64
#: Bounded transition log per core ("story", STYLE.md item 5).
STORY_LENGTH = 512
#: A relay nacks after this fraction of the probe timeout (Lifeguard paper, §IV-A).
NACK_FRACTION = 0.8
#: How often dead/left members are checked for reaping, at most.
REAP_CHECK_S = 10.0

_GONE = (MemberStatus.DEAD, MemberStatus.LEFT)


@dataclass(slots=True)
class Member:
    """This node's record of one member."""

    name: str
    node_id: str
    addr: Addr
    incarnation: int
    status: MemberStatus
    meta: bytes
    vsn: tuple[int, int, int]
    state_change: float

    def state(self) -> MemberState:
        """The push-pull row for this member."""
        return MemberState(self.name, self.node_id, self.addr, self.incarnation,
                           self.status, self.meta, self.vsn)


@dataclass(slots=True)
class _Probe:
    seq: int
    target: str
    acked: bool = False
    expected_nacks: int = 0
    nacks: int = 0


@dataclass(slots=True)
class _Relay:
    origin: Addr
    origin_seq: int
    nack: bool


@dataclass(slots=True)
class _Claim:
    """An unconfirmed new address of a live member: ``alive`` waits for the Ack to ``seq``."""

    alive: Alive
    seq: int


@dataclass(slots=True)
class _JoinState:
    pending: int
    contacted: int = 0
    conflict: NameConflict | None = None
    selves: int = 0


class Membership:
    """The sans-IO membership state machine of one node."""

    def __init__(self, config: MembershipConfig, *, name: str, node_id: str, addr: Addr,
                 rng: random.Random, meta: bytes = b"", incarnation: int = 0,
                 packet_overhead: int = DEFAULT_PACKET_OVERHEAD) -> None:
        self.config = config
        self.name = name
        self.node_id = node_id
        self._rng = rng
        self._overhead = packet_overhead
        self._check_meta(meta, addr)
        self._now = 0.0
        self._out: list[Action] = []
        self._members: dict[str, Member] = {}
        self._names: list[str] = []
        self._live = 0
        self._probe_order: list[str] = []
        self._probe_index = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._streams: dict[int, tuple[str, int]] = {}
        self._joins: dict[int, _JoinState] = {}
        self._suspicions: dict[str, Suspicion] = {}
        self._claims: dict[str, _Claim] = {}  # member name -> its unconfirmed new address
        self._claim_seqs: dict[int, str] = {}  # confirming ping's seq -> member name
        self._timers: dict[Hashable, float] = {}
        self._broadcasts: BroadcastQueue[Message] = BroadcastQueue()
        self.awareness = Awareness(config.awareness_max_multiplier)
        self._seq = 0
        self.leaving = False
        self._told: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self.story: deque[tuple[float, str, str, str, str]] = deque(maxlen=STORY_LENGTH)
        self._add(Member(name, node_id, addr, incarnation, MemberStatus.ALIVE, meta,
                         (1, 1, 1), 0.0))

    # ---- public ------------------------------------------------------------------

    def handle(self, now: float, stimulus: Stimulus) -> list[Action]:
        """Feed one stimulus at time ``now``; returns the actions to carry out.

        The core's clock never goes back: a ``now`` earlier than one already seen counts as
        that one (else a suspicion started then would get a deadline already past, and a
        driver firing it by its own clock would declare the member dead with no time to refute).
        """
        self._now = max(self._now, now)
        self._out = []
        match stimulus:
            case Received(addr, messages):
                for message in messages:
                    self._on_message(addr, message)
            case TimerFired(key):
                self._on_timer(key)
            case StreamRequest(addr, token, message):
                self._on_stream_request(token, message)
            case StreamReply(token, message):
                self._on_stream_reply(token, message)
            case Start():
                self._start()
            case Join(seeds):
                self._join(seeds)
            case Leave():
                self._leave()
            case UpdateMeta(meta):
                self._update_meta(meta)
            case ReportUnreachable(target):
                member = self._members.get(target)
                if member is not None and target != self.name:
                    self._count("unreachable_reports")
                    self._on_suspect(Suspect(member.incarnation, target, self.name))
        out, self._out = self._out, []
        return out

    @property
    def local(self) -> Member:
        """The local member's record."""
        return self._members[self.name]

    def members(self) -> list[Member]:
        """Every known member (including this node), by name."""
        return [self._members[n] for n in sorted(self._members)]

    def member(self, name: str) -> Member | None:
        """One member's record, or None."""
        return self._members.get(name)

    def num_live(self) -> int:
        """Members ALIVE or SUSPECT, this node included (the N of the formulas)."""
        return self._live

    def pending_broadcasts(self) -> int:
        """Broadcasts still queued for piggy-backing."""
        return len(self._broadcasts)

    def restore(self, states: list[MemberState]) -> None:
        """Load members without gossiping or emitting events.

        For restoring a snapshot and for building large simulated clusters whose
        members are assumed to have met long ago. States about this node are skipped.
        """
        for s in states:
            if s.name != self.name and s.name not in self._members:
                self._add(Member(s.name, s.node_id, s.addr, s.incarnation, s.status,
                                 s.meta, s.vsn, self._now))

    # ---- plumbing ------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _set_timer(self, key: Hashable, at: float) -> None:
        self._timers[key] = at
        self._out.append(SetTimer(at, key))

    def _add(self, member: Member) -> None:
        self._members[member.name] = member
        self._names.append(member.name)
        if member.status not in _GONE:
            self._live += 1
        self._into_probe_order(member.name)

    def _into_probe_order(self, name: str) -> None:
        """A new or revived member joins the current round at a random later slot."""
        if name != self.name and self._probe_order:
            pos = self._rng.randint(self._probe_index, len(self._probe_order))
            self._probe_order.insert(pos, name)

    def _set_status(self, member: Member, status: MemberStatus, cause: str) -> None:
        old = member.status
        if old == status:
            return
        self._live += int(status not in _GONE) - int(old not in _GONE)
        member.status = status
        member.state_change = self._now
        self.story.append((self._now, member.name, old.name, status.name, cause))

    def _emit(self, kind: type[MemberJoined] | type[MemberUpdated] | type[MemberSuspected]
              | type[MemberFailed] | type[MemberLeft] | type[MemberReaped],
              m: Member, cause: str) -> None:
        self._out.append(Emit(kind(m.name, m.node_id, m.addr, m.incarnation, m.status,
                                   m.meta, cause)))

    def _retransmit_limit(self) -> int:
        return retransmit_limit(self.config.retransmit_mult, self._live)

    def _broadcast(self, name: str, message: Message) -> None:
        self._broadcasts.queue(name, message, message_size(message))

    def _send(self, addr: Addr, messages: list[Message]) -> None:
        """Send messages plus as many piggy-backed broadcasts as fit in one packet."""
        size = sum(message_size(m) for m in messages)
        budget = self.config.max_packet_bytes - self._overhead - size - 3
        packet = list(messages)
        # never more messages than a receiver decodes (it would drop the whole packet)
        for message, message_bytes in self._broadcasts.get(
                0, budget, self._retransmit_limit(), MAX_MESSAGES_PER_PACKET - len(packet)):
            packet.append(message)
            size += message_bytes
        self._count("packets_sent")
        self._out.append(Send(addr, packet, size + (1 if len(packet) < 16 else 3)))

    def _k_random(self, k: int, exclude: str, *, with_dead_s: float = -1.0) -> list[Member]:
        """Up to k distinct random members other than self and ``exclude``.

        Live members qualify; dead ones too while they died less than ``with_dead_s``
        ago (gossip to the dead). Bounded tries, as memberlist's kRandomNodes.
        """
        chosen: dict[str, Member] = {}
        names = self._names
        for _ in range(3 * len(names)):
            if len(chosen) >= k:
                break
            m = self._members[names[self._rng.randrange(len(names))]]
            if m.name in (self.name, exclude) or m.name in chosen:
                continue
            if m.status in _GONE and not (m.status == MemberStatus.DEAD and
                                          self._now - m.state_change < with_dead_s):
                continue
            chosen[m.name] = m
        return list(chosen.values())

    # ---- timers --------------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        self._set_timer("probe", self._now + self._rng.uniform(0, cfg.probe_interval_s))
        self._set_timer("gossip", self._now + self._rng.uniform(0, cfg.gossip_interval_s))
        if cfg.push_pull_interval_s > 0:
            first = self._rng.uniform(0.5, 1.0) * push_pull_scale(cfg.push_pull_interval_s,
                                                                   self._live)
            self._set_timer("push_pull", self._now + first)
        self._set_timer("reap", self._now + min(REAP_CHECK_S, cfg.reap_after_s))
        if cfg.reconnect_interval_s > 0:
            # no draw from the shared rng here: seeded runs keep their sequence (the attempts are
            # spread by the probability in the tick, not by the phase)
            self._set_timer("reconnect", self._now + cfg.reconnect_interval_s)

    def _on_timer(self, key: Hashable) -> None:
        at = self._timers.get(key)
        if at is None or at > self._now + 1e-9:
            return  # stale: re-armed or cancelled since
        del self._timers[key]
        if key == "probe":
            self._probe_tick()
        elif key == "gossip":
            self._gossip_tick()
        elif key == "push_pull":
            self._push_pull_tick()
        elif key == "reap":
            self._reap_tick()
        elif key == "reconnect":
            self._reconnect_tick()
        elif isinstance(key, tuple):
            kind, arg = key
            if kind == "probe_timeout":
                self._probe_timeout(arg)
            elif kind == "relay":
                relay = self._relays.pop(arg, None)
                if relay is not None and relay.nack:
                    self._send(relay.origin, [Nack(relay.origin_seq)])
            elif kind == "suspicion":
                self._suspicion_timeout(arg)
            elif kind == "claim":
                self._end_claim(arg, confirmed=False)

    def _gossip_tick(self) -> None:
        cfg = self.config
        self._set_timer("gossip", self._now + cfg.gossip_interval_s)
        if not len(self._broadcasts):
            return
        limit = self._retransmit_limit()
        budget = cfg.max_packet_bytes - self._overhead - 3
        for m in self._k_random(cfg.gossip_nodes, "", with_dead_s=cfg.gossip_to_dead_s):
            picked = self._broadcasts.get(0, budget, limit, MAX_MESSAGES_PER_PACKET)
            if not picked:
                break
            size = sum(b for _, b in picked) + (1 if len(picked) < 16 else 3)
            self._count("gossip_packets_sent")
            self._out.append(Send(m.addr, [x for x, _ in picked], size))

    def _push_pull_tick(self) -> None:
        cfg = self.config
        self._set_timer("push_pull", self._now + push_pull_scale(cfg.push_pull_interval_s,
                                                                  self._live))
        if self.leaving:
            return
        for m in self._k_random(1, ""):
            self._open_stream(m.addr, ("push_pull", 0),
                              PushPull(False, self.name, self._states()))

    def _reconnect_tick(self) -> None:
        """Push-pull with one failed member now and then (Serf's reconnect; config field docs).

        After a partition longer than the suspicion timeout each side holds the other DEAD, and
        nothing reaches a dead member: probes and push-pull pick live ones, gossip to the dead
        stops after gossip-to-dead-s. The exchange carries our view (it DEAD), which it refutes with
        a higher incarnation in its reply; its view (we DEAD) makes us refute in turn, straight to
        it. Left members are not tried: they meant to go.
        """
        cfg = self.config
        self._set_timer("reconnect", self._now + cfg.reconnect_interval_s)
        if self.leaving:
            return
        failed = [m for m in self._members.values() if m.status == MemberStatus.DEAD]
        # with probability failed/alive (capped at 1), so the cluster as a whole tries about one
        # reconnect per failed member per interval, however many nodes there are
        if not failed or self._rng.random() > len(failed) / max(1, self._live):
            return
        target = failed[self._rng.randrange(len(failed))]
        self._count("reconnect_attempts")
        self._open_stream(target.addr, ("push_pull", 0), PushPull(False, self.name, self._states()))

    def _reap_tick(self) -> None:
        cfg = self.config
        self._set_timer("reap", self._now + min(REAP_CHECK_S, cfg.reap_after_s))
        gone = [m for m in self._members.values()
                if m.status in _GONE and self._now - m.state_change >= cfg.reap_after_s
                and m.name != self.name]
        for m in gone:
            del self._members[m.name]
            self._names.remove(m.name)
            self._emit(MemberReaped, m, "reap")
            self._count("members_reaped")

    # ---- probing -------------------------------------------------------------------

    def _next_probe_target(self) -> Member | None:
        for _ in range(len(self._probe_order) + 2):
            if self._probe_index >= len(self._probe_order):
                self._probe_order = [n for n, m in self._members.items()
                                     if n != self.name and m.status not in _GONE]
                self._rng.shuffle(self._probe_order)
                self._probe_index = 0
                if not self._probe_order:
                    return None
            m = self._members.get(self._probe_order[self._probe_index])
            self._probe_index += 1
            if m is not None and m.status not in _GONE and m.name != self.name:
                return m
        return None

    def _probe_tick(self) -> None:
        cfg = self.config
        self._finish_probe()
        self._set_timer("probe", self._now + self.awareness.scale(cfg.probe_interval_s))
        if self.leaving:
            return
        target = self._next_probe_target()
        if target is None:
            return
        seq = self._next_seq()
        messages: list[Message] = [Ping(seq, target.name, self.name)]
        if target.status == MemberStatus.SUSPECT and cfg.lifeguard:
            # Buddy system: tell the suspect directly so it can refute at once.
            messages.append(Suspect(target.incarnation, target.name, self.name))
        self._probe = _Probe(seq, target.name)
        self._count("probes")
        self._send(target.addr, messages)
        self._set_timer(("probe_timeout", seq),
                        self._now + self.awareness.scale(cfg.probe_timeout_s))

    def _probe_timeout(self, seq: int) -> None:
        probe = self._probe
        if probe is None or probe.seq != seq or probe.acked:
            return
        target = self._members.get(probe.target)
        if target is None:
            return
        cfg = self.config
        relays = self._k_random(cfg.indirect_checks, target.name)
        for relay in relays:
            self._send(relay.addr, [IndirectPing(seq, target.name, target.addr, cfg.lifeguard)])
        probe.expected_nacks = len(relays) if cfg.lifeguard else 0
        self._count("indirect_probes", len(relays))
        if cfg.tcp_fallback_probe:
            self._open_stream(target.addr, ("fallback", seq), Ping(seq, target.name, self.name))

    def _finish_probe(self) -> None:
        probe, self._probe = self._probe, None
        if probe is None or probe.acked:
            return
        self._count("probes_failed")
        if self.config.lifeguard:
            if probe.expected_nacks > 0:
                delta = max(0, probe.expected_nacks - probe.nacks)
            else:
                delta = 1
            self.awareness.apply_delta(delta)
        m = self._members.get(probe.target)
        if m is not None and m.status not in _GONE:
            self._on_suspect(Suspect(m.incarnation, m.name, self.name))

    def _on_ack(self, seq: int) -> None:
        if seq in self._claim_seqs:
            self._end_claim(seq, confirmed=True)
            return
        probe = self._probe
        if probe is not None and probe.seq == seq:
            if not probe.acked:
                probe.acked = True
                if self.config.lifeguard:
                    self.awareness.apply_delta(-1)
            return
        relay = self._relays.pop(seq, None)
        if relay is not None:
            self._send(relay.origin, [Ack(relay.origin_seq)])

    # ---- messages ------------------------------------------------------------------

    def _on_message(self, addr: Addr, message: Message) -> None:
        match message:
            case Ping(seq, target, _):
                if target != self.name:
                    self._count("pings_wrong_target")
                    return
                self._send(addr, [Ack(seq)])
            case Ack(seq):
                self._on_ack(seq)
            case Nack(seq):
                if self._probe is not None and self._probe.seq == seq:
                    self._probe.nacks += 1
            case IndirectPing(seq, target, target_addr, nack):
                own = self._next_seq()
                self._relays[own] = _Relay(addr, seq, nack)
                self._send(target_addr, [Ping(own, target, self.name)])
                # Lifeguard: nack at 80 % of the probe timeout so that the nack reaches
                # the origin before its probe interval (and its nack count) closes.
                self._set_timer(("relay", own),
                                self._now + NACK_FRACTION * self.config.probe_timeout_s)
            case Alive():
                self._on_alive(message, direct=message.addr == addr)
            case Suspect():
                self._on_suspect(message)
            case Dead():
                self._on_dead(message)

    def _bounded(self, name: str, incarnation: int, *, alive: bool) -> int:
        """``incarnation`` clamped to what one message may claim (module docstring; issue 16).

        An accusation at most ``max_incarnation_step`` above the incarnation we know of ``name``
        (0 for a stranger) and below ``MAX_INCARNATION``, so that the accused can refute it; an
        Alive one more, as that refutation is. Pure apart from the counter.
        """
        known = self._members.get(name)
        base = known.incarnation if known is not None else 0
        limit = min(base + self.config.max_incarnation_step, MAX_INCARNATION - 1) + int(alive)
        if incarnation <= limit:
            return incarnation
        self._count("incarnations_clamped")
        return limit

    def _refute(self, accused_incarnation: int) -> None:
        local = self.local
        # never past the wire's limit: receivers would drop every packet carrying it
        local.incarnation = min(max(local.incarnation, accused_incarnation) + 1, MAX_INCARNATION)
        self._count("refutes")
        if self.config.lifeguard:
            self.awareness.apply_delta(1)
        self._broadcast(self.name, self._alive_of(local))

    def _accused(self, incarnation: int, accuser: str) -> None:
        """Someone suspects us or declares us dead: refute, and tell the accuser directly.

        memberlist only gossips the refutation. Under loss an accuser can miss every
        copy and turn its suspicion into a (false) death, so we also send our Alive
        straight to each accuser we hear of, once per accuser and incarnation. Every
        gossiped copy of the accusation is a chance to do so.
        """
        if self.leaving:
            return
        local = self.local
        if incarnation >= local.incarnation:
            self._refute(incarnation)
        target = self._members.get(accuser)
        if (target is None or accuser == self.name or target.status in _GONE
                or self._told.get(accuser) == local.incarnation):
            return
        if len(self._told) > 4 * self._live + 64:
            self._told.clear()  # bounded: forget old accusers
        self._told[accuser] = local.incarnation
        self._count("refutations_sent_to_accuser")
        self._out.append(Send(target.addr, [self._alive_of(local)],
                              message_size(self._alive_of(local)) + 1))

    def _alive_of(self, m: Member) -> Alive:
        return Alive(m.incarnation, m.name, m.node_id, m.addr, m.meta, m.vsn)

    def _conflict(self, known: Member, claim: Alive) -> None:
        self._count("name_conflicts")
        event = NameConflict(claim.name, known.node_id, claim.node_id, claim.addr,
                             local=known.name == self.name)
        for join in self._joins.values():
            if event.local:
                join.conflict = event
        self._out.append(Emit(event))

    def _on_alive(self, a: Alive, *, direct: bool) -> None:
        bounded = self._bounded(a.name, a.incarnation, alive=True)
        if bounded != a.incarnation:
            a = msgspec.structs.replace(a, incarnation=bounded)
        m = self._members.get(a.name)
        if a.name == self.name and m is not None:
            if a.node_id != self.node_id:
                self._conflict(m, a)
            elif self.leaving:
                return  # our Alive would replace the queued leave and, higher, undo it everywhere
            elif a.incarnation > m.incarnation or (
                    a.incarnation == m.incarnation and (a.meta, a.addr) != (m.meta, m.addr)):
                self._refute(a.incarnation)  # a stale or forged view of us: jump past it
            return
        if m is None:
            m = Member(a.name, a.node_id, a.addr, a.incarnation, MemberStatus.ALIVE, a.meta,
                       a.vsn, self._now)
            self._add(m)
            self.story.append((self._now, a.name, "-", "ALIVE", "alive"))
            self._broadcast(a.name, a)
            self._emit(MemberJoined, m, "alive")
            return
        if a.node_id != m.node_id:
            reclaim = self.config.dead_node_reclaim_s
            if m.status not in _GONE or self._now - m.state_change < reclaim:
                self._conflict(m, a)
                return
            m.node_id = a.node_id
        elif a.incarnation < m.incarnation:
            return
        elif a.incarnation == m.incarnation:
            changed = (a.meta, a.addr) != (m.meta, m.addr)
            if not (changed and direct and m.status == MemberStatus.ALIVE):
                return
        if a.addr != m.addr and m.status not in _GONE:
            self._claim_address(m, a)  # confirmed before it is used (module docstring)
            return
        self._apply_alive(m, a)

    def _apply_alive(self, m: Member, a: Alive) -> None:
        """Take an accepted Alive for a known member: state, broadcast, event."""
        claim = self._claims.get(m.name)
        if claim is not None and claim.alive.incarnation <= a.incarnation:
            del self._claims[m.name]  # superseded (e.g. the member refuted a forged claim)
            self._claim_seqs.pop(claim.seq, None)
        old = m.status
        changed = (a.meta, a.addr, a.vsn) != (m.meta, m.addr, m.vsn)
        self._cancel_suspicion(a.name)
        m.incarnation, m.meta, m.addr, m.vsn = a.incarnation, a.meta, a.addr, a.vsn
        self._set_status(m, MemberStatus.ALIVE, "alive")
        self._broadcast(a.name, a)
        if old in _GONE:
            self._into_probe_order(m.name)
            self._emit(MemberJoined, m, "rejoin")
        elif old == MemberStatus.SUSPECT:
            self._emit(MemberUpdated, m, "refuted")
        elif changed:
            self._emit(MemberUpdated, m, "meta")

    def _claim_address(self, m: Member, a: Alive) -> None:
        """A live member is said to be elsewhere: ask the new address, tell the old one.

        Issue 16 item 4: a forged Alive with a wrong address made every receiver probe (and
        gossip to) the wrong port, declare the member dead, and never let it hear why. Now the
        Alive waits until the new address acks a Ping naming the member (sent raw, without
        piggy-backed gossip: the address is not trusted yet) and the member hears the claim at
        its current address, where a forged claim is refuted at once.
        """
        pending = self._claims.get(m.name)
        if pending is not None:
            if pending.alive.incarnation >= a.incarnation:
                return  # already asking
            self._claim_seqs.pop(pending.seq, None)
        seq = self._next_seq()
        self._claims[m.name] = _Claim(a, seq)
        self._claim_seqs[seq] = m.name
        self._count("address_claims")
        self.story.append((self._now, m.name, m.status.name, m.status.name,
                           f"address claim {a.addr[0]}:{a.addr[1]} at {a.incarnation}"))
        ping = Ping(seq, m.name, self.name)
        self._out.append(Send(a.addr, [ping], message_size(ping) + 1))
        self._open_stream(a.addr, ("claim", seq), ping)  # a lost datagram must not lose the claim
        self._out.append(Send(m.addr, [a], message_size(a) + 1))
        self._set_timer(("claim", seq), self._now + self.config.address_confirm_timeout_s)

    def _end_claim(self, seq: int, *, confirmed: bool) -> None:
        """The claimed address acked (adopt it, unless something newer came) or timed out."""
        name = self._claim_seqs.pop(seq, None)
        if name is None:
            return  # superseded, or already settled
        claim = self._claims.pop(name)
        self._timers.pop(("claim", seq), None)
        m = self._members.get(name)
        if not confirmed:
            self._count("address_claims_expired")
        elif m is not None and m.node_id == claim.alive.node_id and self._outranks(claim.alive, m):
            self._count("address_claims_confirmed")
            self._apply_alive(m, claim.alive)

    @staticmethod
    def _outranks(a: Alive, m: Member) -> bool:
        """Whether a held Alive still beats ``m``'s record: alive < suspect < dead/left at one
        incarnation, so a Suspect or Dead (a leave too) at the claim's incarnation, heard while
        the claim waited for its Ack, wins; the member refutes it with a higher one."""
        return a.incarnation > m.incarnation or (a.incarnation == m.incarnation
                                                 and m.status == MemberStatus.ALIVE)

    def _cancel_suspicion(self, name: str) -> None:
        if self._suspicions.pop(name, None) is not None:
            self._timers.pop(("suspicion", name), None)

    def _on_suspect(self, s: Suspect) -> None:
        m = self._members.get(s.name)
        if m is None:
            return
        bounded = self._bounded(s.name, s.incarnation, alive=False)
        if bounded != s.incarnation:
            s = msgspec.structs.replace(s, incarnation=bounded)
        if s.name == self.name:
            self._accused(s.incarnation, s.source)
            return
        if s.incarnation < m.incarnation:
            return
        suspicion = self._suspicions.get(s.name)
        if suspicion is not None:
            if s.incarnation == m.incarnation and suspicion.confirm(s.source):
                self._count("suspicion_confirmations")
                self._set_timer(("suspicion", s.name), suspicion.deadline())
                self._broadcast(s.name, s)
            return
        if m.status != MemberStatus.ALIVE:
            return
        if s.name == self.name:
            self._accused(s.incarnation, s.source)
            return
        cfg = self.config
        n = self._live
        k = cfg.suspicion_mult - 2 if cfg.lifeguard else 0
        if n - 2 < k:
            k = 0
        min_s = suspicion_timeout_s(cfg.suspicion_mult, n, cfg.probe_interval_s)
        max_s = cfg.suspicion_max_timeout_mult * min_s if cfg.lifeguard else min_s
        suspicion = Suspicion(s.source, k, min_s, max_s, self._now)
        self._suspicions[s.name] = suspicion
        m.incarnation = s.incarnation
        self._set_status(m, MemberStatus.SUSPECT, f"suspect from {s.source}")
        self._set_timer(("suspicion", s.name), suspicion.deadline())
        self._broadcast(s.name, s)
        if cfg.lifeguard:
            # Buddy system, extended: probe a new suspect next rather than in turn,
            # so it hears the accusation on our ping (and answers us directly)
            # before the timer runs out; a truly dead one gains a confirmation.
            self._probe_order.insert(self._probe_index, s.name)
        self._count("suspicions")
        self._emit(MemberSuspected, m, f"suspect from {s.source}")

    def _suspicion_timeout(self, name: str) -> None:
        self._suspicions.pop(name, None)
        m = self._members.get(name)
        if m is not None and m.status == MemberStatus.SUSPECT:
            self._on_dead(Dead(m.incarnation, name, self.name))

    def _on_dead(self, d: Dead) -> None:
        m = self._members.get(d.name)
        if m is None:
            return
        bounded = self._bounded(d.name, d.incarnation, alive=False)
        if bounded != d.incarnation:
            d = msgspec.structs.replace(d, incarnation=bounded)
        if d.name == self.name:
            self._accused(d.incarnation, d.source)
            return
        if d.incarnation < m.incarnation or m.status in _GONE:
            return
        self._cancel_suspicion(d.name)
        m.incarnation = d.incarnation
        left = d.source == d.name
        self._set_status(m, MemberStatus.LEFT if left else MemberStatus.DEAD,
                         "leave" if left else f"dead from {d.source}")
        self._broadcast(d.name, d)
        self._count("members_left" if left else "members_failed")
        self._emit(MemberLeft if left else MemberFailed, m,
                   "leave" if left else f"dead from {d.source}")

    # ---- streams, join, leave, metadata ----------------------------------------------

    def _states(self) -> list[MemberState]:
        return [m.state() for m in self._members.values()]

    def _open_stream(self, addr: Addr, purpose: tuple[str, int],
                     message: Ping | PushPull) -> None:
        token = self._next_seq()
        self._streams[token] = purpose
        self._out.append(OpenStream(addr, token, message))

    def _merge(self, remote: PushPull) -> None:
        """Merge a remote full state (memberlist mergeState): remote deaths only suspect."""
        for s in remote.members:
            if s.status == MemberStatus.ALIVE:
                self._on_alive(Alive(s.incarnation, s.name, s.node_id, s.addr, s.meta, s.vsn),
                               direct=s.name == remote.source)
            elif s.status == MemberStatus.LEFT:
                self._on_dead(Dead(s.incarnation, s.name, s.name))
            else:
                self._on_suspect(Suspect(s.incarnation, s.name, remote.source))

    def _on_stream_request(self, token: int, message: Ping | Ack | PushPull) -> None:
        if isinstance(message, Ping):
            self._out.append(ReplyStream(token, Ack(message.seq)
                                         if message.target == self.name else None))
        elif isinstance(message, PushPull):
            self._count("push_pulls_served")
            self._merge(message)
            self._out.append(ReplyStream(token, PushPull(False, self.name, self._states())))
        else:
            self._out.append(ReplyStream(token, None))

    def _on_stream_reply(self, token: int, message: Ping | Ack | PushPull | None) -> None:
        purpose = self._streams.pop(token, None)
        if purpose is None:
            return
        kind, arg = purpose
        if kind == "fallback":
            if isinstance(message, Ack) and message.seq == arg:
                self._count("fallback_probe_acks")
                self._on_ack(arg)
        elif kind == "claim":
            if isinstance(message, Ack) and message.seq == arg:
                self._end_claim(arg, confirmed=True)
        elif kind == "push_pull":
            if isinstance(message, PushPull):
                self._merge(message)
        elif kind == "join":
            join = self._joins.get(arg)
            if join is None:
                return
            if isinstance(message, PushPull):
                if self._is_own(message):
                    join.selves += 1
                else:
                    join.contacted += 1
                self._merge(message)
            join.pending -= 1
            if join.pending <= 0:
                del self._joins[arg]
                self._out.append(JoinFinished(join.contacted, join.conflict, join.selves))

    def _is_own(self, remote: PushPull) -> bool:
        """A push-pull answered by this very node: a seed naming it under another spelling.

        Counting it as a seed that answered made a node whose other seeds were down "join" a
        cluster of one, and a fresh storage node bootstrap its own ring. Another node with our
        name has another node id (a conflict, reported by the merge), so it is not us.
        """
        return remote.source == self.name and any(
            s.name == self.name and s.node_id == self.node_id for s in remote.members)

    def _join(self, seeds: tuple[Addr, ...]) -> None:
        if not seeds:
            self._out.append(JoinFinished(0, None))
            return
        join_id = self._next_seq()
        self._joins[join_id] = _JoinState(pending=len(seeds))
        for seed in seeds:
            self._open_stream(seed, ("join", join_id), PushPull(True, self.name, self._states()))

    def _leave(self) -> None:
        if self.leaving:
            return
        self.leaving = True
        local = self.local
        self._set_status(local, MemberStatus.LEFT, "leave")
        dead = Dead(local.incarnation, self.name, self.name)
        self._broadcast(self.name, dead)
        for m in self._k_random(self.config.gossip_nodes, ""):
            self._send(m.addr, [dead])

    def _check_meta(self, meta: bytes, addr: Addr) -> None:
        """Our metadata rides on our Alive, which must fit one packet with nothing else in it.

        A larger Alive is never picked for gossip (no packet has room) and stayed queued for
        good: with ``max_packet_bytes`` 512, 450 bytes of metadata never spread. Raises
        ValueError (as the metadata limit does).
        """
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"metadata is {len(meta)} bytes; limit {MAX_META_BYTES}")
        alive = Alive(MAX_INCARNATION, self.name, self.node_id, addr, meta)
        room = self.config.max_packet_bytes - self._overhead - 3
        if message_size(alive) > room:
            raise ValueError(f"metadata of {len(meta)} bytes makes our Alive {message_size(alive)} "
                             f"bytes; max-packet-bytes {self.config.max_packet_bytes} leaves {room}")

    def _update_meta(self, meta: bytes) -> None:
        self._check_meta(meta, self.local.addr)
        if self.leaving:
            # our Alive at a higher incarnation would replace the queued leave and bring us back
            # ALIVE everywhere, to be declared dead (a failure, not a leave) once we stop
            self._count("meta_updates_while_leaving")
            return
        local = self.local
        local.meta = meta
        local.incarnation = min(local.incarnation + 1, MAX_INCARNATION)
        self._broadcast(self.name, self._alive_of(local))
