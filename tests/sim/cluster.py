"""Deterministic cluster simulator for the membership core.

N sans-IO ``Membership`` cores exchange packets over a seeded network model on
virtual time (trio's "terrible network" idea): loss, duplication, delay with
jitter, partitions, TCP streams that are refused by dead hosts and time out
across partitions, and nodes whose event loop is frozen (their input queues up
and is handled, late, when they thaw — what a GC pause or a blocked loop does).

Everything random comes from seeds, so a failing scenario replays exactly.
With ``sealed=True`` every packet and frame goes through each node's real
``PacketCodec`` (AES-GCM, keyring), which the key-rotation scenario needs.
"""

from __future__ import annotations

import heapq
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from peers.keyring import Keyring
from peers.membership.codec import PacketCodec, PacketRejected
from peers.membership.config import MembershipConfig
from peers.membership.events import (
    Emit,
    Join,
    JoinFinished,
    Leave,
    MemberEvent,
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
from peers.membership.messages import Ack, Addr, MemberStatus, Message, Ping
from peers.membership.state import DEFAULT_PACKET_OVERHEAD, Membership

__all__ = ["NetModel", "SimCluster", "SimNode"]


@dataclass
class NetModel:
    """The seeded network: per-packet loss and duplication, one-way delay + jitter."""

    loss: float = 0.0
    duplicate: float = 0.0
    delay_s: float = 0.0005
    jitter_s: float = 0.0005
    refused_s: float = 0.001  # a dead host on a live network answers TCP with RST


@dataclass
class SimNode:
    """One simulated process: its core, its liveness and its loop's freezes."""

    name: str
    node_id: str
    addr: Addr
    core: Membership
    codec: PacketCodec | None
    epoch: int = 0
    up: bool = True
    frozen_until: float = 0.0
    joins: list[JoinFinished] = field(default_factory=list)
    bytes_sent: int = 0
    packets_sent: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class SimCluster:
    """Virtual-time cluster. Drive it with ``run_for`` / ``run_until``."""

    def __init__(self, config: MembershipConfig, *, seed: int, net: NetModel | None = None,
                 sealed: bool = False, cluster_name: str = "sim",
                 keyring: Keyring | None = None) -> None:
        self.config = config
        self.seed = seed
        self.net = net or NetModel()
        self.sealed = sealed
        self.cluster_name = cluster_name
        self._keys = keyring.keys if keyring is not None else (bytes(range(32)),)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.nodes: dict[str, SimNode] = {}
        self._by_addr: dict[Addr, SimNode] = {}
        self._heap: list[tuple[float, int, Addr, int, Stimulus]] = []
        self._seq = 0
        self._streams: dict[int, tuple[Addr, int, int]] = {}
        self._groups: dict[Addr, int] = {}
        self.events: list[tuple[float, str, MemberEvent]] = []
        self.on_event: Callable[[float, str, MemberEvent], None] | None = None
        self.stream_bytes = 0
        self._impostors: dict[Addr, str] = {}

    # ---- building --------------------------------------------------------------------

    def _make_core(self, name: str, node_id: str, addr: Addr, meta: bytes,
                   incarnation: int, codec: PacketCodec | None) -> Membership:
        overhead = codec.overhead if codec is not None else DEFAULT_PACKET_OVERHEAD
        return Membership(self.config, name=name, node_id=node_id, addr=addr,
                          rng=random.Random(f"{self.seed}/{name}/{self._seq}"), meta=meta, incarnation=incarnation,
                          packet_overhead=overhead)

    def add_node(self, name: str, *, node_id: str | None = None, meta: bytes = b"",
                 addr: Addr | None = None, start: bool = True) -> SimNode:
        """Create a node (not yet joined). Names map to addresses 10.x.y.z:7946."""
        index = len(self.nodes) + 1
        addr = addr or (f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}", 7946)
        node_id = node_id or str(uuid.UUID(int=self.rng.getrandbits(128)))
        codec = (PacketCodec(self.cluster_name, Keyring(list(self._keys)))
                 if self.sealed else None)
        core = self._make_core(name, node_id, addr, meta, 0, codec)
        node = SimNode(name, node_id, addr, core, codec)
        self.nodes[name] = node
        self._by_addr[addr] = node
        if start:
            self._stimulate(node, Start())
        return node

    def bootstrap(self, n: int, prefix: str = "n") -> list[SimNode]:
        """n nodes that already know each other (as if they met long ago)."""
        nodes = [self.add_node(f"{prefix}{i}", start=False) for i in range(n)]
        states = [node.core.local.state() for node in nodes]
        for node in nodes:
            node.core.restore(states)
            self._stimulate(node, Start())
        return nodes

    def join(self, name: str, seeds: list[str]) -> None:
        """Ask ``name`` to join through the named seeds."""
        node = self.nodes[name]
        self._stimulate(node, Join(tuple(self.nodes[s].addr for s in seeds)))

    def join_all(self, names: list[str], seed: str) -> None:
        for name in names:
            if name != seed:
                self.join(name, [seed])

    # ---- faults ----------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """kill -9: the process stops; packets to it vanish, TCP is refused."""
        self.nodes[name].up = False

    def restart(self, name: str, seeds: list[str], *, node_id: str | None = None) -> SimNode:
        """A fresh process with the same name (and node id unless given), incarnation 0."""
        old = self.nodes[name]
        codec = old.codec
        core = self._make_core(name, node_id or old.node_id, old.addr, old.core.local.meta,
                               0, codec)
        old.core, old.up, old.epoch = core, True, old.epoch + 1
        old.node_id = core.node_id
        old.frozen_until = 0.0
        self._stimulate(old, Start())
        self.join(name, seeds)
        return old

    def leave(self, name: str) -> None:
        """Graceful leave: announce, keep answering for leave_propagate_s, then stop."""
        node = self.nodes[name]
        self._stimulate(node, Leave())
        self._push(self.now + self.config.leave_propagate_s, node, _Stop())

    def freeze(self, name: str, duration_s: float) -> None:
        """The node's loop is blocked: nothing it receives is handled until it thaws."""
        node = self.nodes[name]
        node.frozen_until = max(node.frozen_until, self.now + duration_s)

    def partition(self, *groups: list[str]) -> None:
        """Cut the network between the groups (nodes in no group reach everyone)."""
        self._groups = {self.nodes[n].addr: i for i, g in enumerate(groups) for n in g}

    def heal(self) -> None:
        self._groups = {}

    def update_meta(self, name: str, meta: bytes) -> None:
        self._stimulate(self.nodes[name], UpdateMeta(meta))

    def report_unreachable(self, observer: str, subject: str) -> None:
        self._stimulate(self.nodes[observer], ReportUnreachable(subject))

    def impersonate(self, addr: Addr, name: str) -> None:
        """A key holder listening at ``addr`` that acks every UDP Ping naming ``name``."""
        self._impostors[addr] = name

    def forge(self, to: list[str], messages: list[Message], *,
              from_addr: Addr = ("10.66.6.6", 7946)) -> None:
        """A key holder's packet (sealed with the cluster's keys when ``sealed``), delivered to each
        node of ``to`` from ``from_addr`` — an attacker, not a member."""
        codec = PacketCodec(self.cluster_name, Keyring(list(self._keys))) if self.sealed else None
        for name in to:
            dst = self.nodes[name]
            opened = messages
            if codec is not None and dst.codec is not None:
                opened = dst.codec.open_packet(codec.seal_packet(messages))
            self._push(self.now + self._delay(), dst, Received(from_addr, opened))

    # ---- observing -------------------------------------------------------------------

    def status(self, observer: str, subject: str) -> MemberStatus | None:
        m = self.nodes[observer].core.member(subject)
        return None if m is None else m.status

    def up_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.up]

    def all_see(self, subject: str, status: MemberStatus, *,
                incarnation_above: int = -1) -> bool:
        """Every up node other than ``subject`` sees it in ``status``."""
        for node in self.up_nodes():
            if node.name == subject:
                continue
            m = node.core.member(subject)
            if m is None or m.status != status or m.incarnation <= incarnation_above:
                return False
        return True

    def converged(self) -> bool:
        """Every up node sees every up node alive."""
        names = [n.name for n in self.up_nodes()]
        return all(self.status(o, s) == MemberStatus.ALIVE for o in names for s in names)

    def events_of(self, kind: type, subject: str | None = None) -> list[tuple[float, str, MemberEvent]]:
        return [e for e in self.events if isinstance(e[2], kind)
                and (subject is None or getattr(e[2], "name", None) == subject)]

    # ---- running ---------------------------------------------------------------------

    def run_for(self, duration_s: float) -> None:
        self.run_until(self.now + duration_s)

    def run_until(self, t: float, cond: Callable[[], bool] | None = None,
                  check_every_s: float = 0.05) -> bool:
        """Process events up to time t; stop early (True) once ``cond`` holds."""
        next_check = self.now
        heap = self._heap
        while heap and heap[0][0] <= t:
            at, _, addr, epoch, stim = heapq.heappop(heap)
            self.now = max(self.now, at)
            if cond is not None and self.now >= next_check:
                if cond():
                    return True
                next_check = self.now + check_every_s
            node = self._by_addr.get(addr)
            if node is None or not node.up or node.epoch != epoch:
                continue
            if node.frozen_until > self.now:
                self._push(node.frozen_until, node, stim)
                continue
            if isinstance(stim, _Stop):
                node.up = False
                continue
            self._stimulate(node, stim)
        self.now = max(self.now, t)
        return cond() if cond is not None else False

    # ---- internals -------------------------------------------------------------------

    def _push(self, at: float, node: SimNode, stim: Stimulus | _Stop) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, node.addr, node.epoch, stim))  # type: ignore[misc]

    def _blocked(self, a: Addr, b: Addr) -> bool:
        ga, gb = self._groups.get(a), self._groups.get(b)
        return ga is not None and gb is not None and ga != gb

    def _delay(self) -> float:
        return self.net.delay_s + self.rng.random() * self.net.jitter_s

    def _stimulate(self, node: SimNode, stim: Stimulus) -> None:
        for action in node.core.handle(self.now, stim):
            if isinstance(action, SetTimer):
                self._push(action.at, node, TimerFired(action.key))
            elif isinstance(action, Send):
                self._send(node, action)
            elif isinstance(action, Emit):
                self.events.append((self.now, node.name, action.event))
                if self.on_event is not None:
                    self.on_event(self.now, node.name, action.event)
            elif isinstance(action, OpenStream):
                self._open_stream(node, action)
            elif isinstance(action, ReplyStream):
                self._reply_stream(node, action)
            elif isinstance(action, JoinFinished):
                node.joins.append(action)

    def _send(self, src: SimNode, action: Send) -> None:
        overhead = src.codec.overhead if src.codec else DEFAULT_PACKET_OVERHEAD
        src.bytes_sent += action.size + overhead
        src.packets_sent += 1
        dst = self._by_addr.get(action.addr)
        if dst is None and action.addr in self._impostors:
            target = self._impostors[action.addr]
            acks: list[Message] = [Ack(m.seq) for m in action.messages if isinstance(m, Ping) and m.target == target]
            if acks:
                self._push(self.now + 2 * self._delay(), src, Received(action.addr, acks))
            return
        if dst is None or self._blocked(src.addr, action.addr):
            return
        copies = 0 if self.rng.random() < self.net.loss else 1
        if copies and self.rng.random() < self.net.duplicate:
            copies = 2
        for _ in range(copies):
            messages = action.messages
            if src.codec is not None and dst.codec is not None:
                try:
                    messages = dst.codec.open_packet(src.codec.seal_packet(messages))
                except PacketRejected as exc:
                    dst.rejected[exc.reason] = dst.rejected.get(exc.reason, 0) + 1
                    continue
            self._push(self.now + self._delay(), dst, Received(src.addr, messages))

    def _open_stream(self, src: SimNode, action: OpenStream) -> None:
        self._push(self.now + self.config.tcp_timeout_s, src, StreamReply(action.token, None))
        dst = self._by_addr.get(action.addr)
        if dst is None or self._blocked(src.addr, action.addr):
            return  # no route: the origin's timeout answers
        if not dst.up:
            self._push(self.now + self.net.refused_s, src, StreamReply(action.token, None))
            return
        message = action.message
        self.stream_bytes += len(msgspec.msgpack.encode(message))
        if src.codec is not None and dst.codec is not None:
            frame = src.codec.seal_frame(message)
            try:
                message = dst.codec.open_frame(frame[4:])
            except PacketRejected as exc:
                dst.rejected[exc.reason] = dst.rejected.get(exc.reason, 0) + 1
                self._push(self.now + self.net.refused_s, src, StreamReply(action.token, None))
                return
        self._seq += 1
        self._streams[self._seq] = (src.addr, src.epoch, action.token)
        self._push(self.now + self._delay(), dst, StreamRequest(src.addr, self._seq, message))

    def _reply_stream(self, dst: SimNode, action: ReplyStream) -> None:
        origin = self._streams.pop(action.token, None)
        if origin is None:
            return
        addr, epoch, token = origin
        src = self._by_addr[addr]
        if src.epoch != epoch or self._blocked(addr, dst.addr):
            return
        message = action.message
        if message is not None:
            self.stream_bytes += len(msgspec.msgpack.encode(message))
            if src.codec is not None and dst.codec is not None:
                try:
                    message = src.codec.open_frame(dst.codec.seal_frame(message)[4:])
                except PacketRejected as exc:
                    src.rejected[exc.reason] = src.rejected.get(exc.reason, 0) + 1
                    message = None
        self._push(self.now + self._delay(), src, StreamReply(token, message))


@dataclass(frozen=True)
class _Stop:
    """Internal: a leaving node's process exits."""


