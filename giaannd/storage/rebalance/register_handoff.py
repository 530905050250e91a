"""Registers across a placement change: the CASPaxos acceptor states handed to the new owners.

Theory of operation
-------------------
A register's acceptors are the R owners of ``register_key_id(key)`` under the placement in force
(engine/register_store.py; the proposer, client/registers.py, asks a majority Q = R // 2 + 1 of
them). A topology change (join, decommission, removenode, replace) moves keys: old owners O, new
owners N, stayers S = O ∩ N, leavers L = O − N, joiners J = N − O. Rows are moved by streams;
registers are not rows (they are decided by quorums, not summed), so they get their own step,
run by the operation (rebalance/operations.py) after the streams caught up and **before any node
switches** to the new placement:

1. **Seal and export** (``RegisterExport``, every live old member): the node seals every key it
   holds that it loses (it is in L): from now on it answers nothing for it (register_store.py,
   "Seals"; ``NotOwner``), so its state is final; then it answers the states of its keys whose
   owner set changes, sorted by key, a page at a time.
2. **Merge**: per moving key, the states from every old owner that answered (an owner that holds
   no state for a key answered ``EMPTY`` for it), folded with ``register_store.merge``: the
   highest accepted ballot with its value, the highest promise. A key for which fewer than Q of
   its old owners answered, or one of whose joiners is down, is *lost* for this change: the
   operation refuses (like a column with no live copy) unless ``allow_loss``.
3. **Import** (``RegisterImport``) of the merged state into every joiner (the node merges it into
   whatever it holds, durably: the log is synced before it answers). No ownership check: a
   joiner owns nothing until cutover, like a stream's receiver.
4. After cutover (every node switched) or when the operation fails, ``RegisterUnseal`` goes to
   every node (seals are also scoped to the epoch they were made under).

Why this is safe (Rystsov, "CASPaxos: Replicated State Machines without logs", 2018, §2.3
"Cluster membership change"). The paper changes membership one acceptor at a time and keeps every
quorum of the old configuration intersecting every quorum of the new one (it grows the quorum
sizes first, then adds the acceptor, then optionally re-reads every key so the newcomer catches
up); an acceptor that starts empty is safe there only because the larger quorums cover for it.
Here a key's owner set changes in one step, so quorum intersection must come from the states
themselves:

- *What was chosen under O is in a majority of N.* A value chosen at ballot b was accepted by a
  majority of O; any majority of O that answered step 2 contains one of them, whose accepted
  ballot is >= b and whose value is b's or one built from it (CASPaxos: every proposal above b is
  computed from the value it read, so from b's). The merge keeps the highest accepted ballot, so
  each joiner holds b's value or a successor. S members hold their own states. If a majority of N
  is in S, a value chosen under O after the seal needs every answering member of O, i.e. all of
  S (the leavers refuse), so it reaches every majority of N through S; if it is not (two or more
  owners of the key change at once), nothing can be chosen under O after the seal at all (fewer
  than Q answer), and the joiners' copies, taken after the seal, have everything.
- *Old and new proposers never decide apart.* Between the seal and the last node's switch some
  proposers use O and some N. With L sealed, an O-quorum is Q members of S; an N-quorum has at
  least Q - |J| members of S. They meet when Q + Q - |J| > |S| = R - |J|, i.e. 2Q > R: always.
  (When |S| < Q there is no O-quorum at all.) Values chosen under O after the seal are therefore
  seen by every N-quorum, and the reverse.
- *An acceptor never goes backwards.* Merging keeps each acceptor's promise and accepted ballot
  at least what they were, so every promise it gave still binds it and a proposer that read it
  before still sees what it saw or newer. A copied accepted state is an accept message delivered
  late, which Paxos allows; a joiner answered no proposer for the key before (not an owner), so
  taking an accepted ballot below its own promise (left from an earlier ownership) cannot
  invalidate a phase 1 that counted it under the current placement.

Seals are durable (register_store.py, "Seals"): a leaver that restarts between the seal and the
switch still refuses its lost keys under the old epoch (before, it forgot them and could serve an
old-placement proposer alongside one stayer). The export answers only once its seals are on disk,
so a coordinator never counts a member sealed that a crash could unseal.

A coordinator that died leaves its seals until the next operation's handoff or the operator's
``giaannctl node registers unseal`` drops them: unseal.py, "After a coordinator died".

Repair (``repair.registers``) restores a member that lost its register log the same way: the merged
states of the other owners.

Messages share the stream endpoint's tag space (source_control.py): requests 26-28, replies
100-101. Append only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal

import msgspec
import numpy as np

from giaannd import protocol as p
from giaannd.storage.engine.register_store import EMPTY, RegisterState, RegisterStore, RegisterStoreFull, merge
from giaannd.storage.replication.service import StorageService
from peers.placement import Member, Placement

__all__ = [
    "HANDOFF_PAGE_BYTES",
    "HandoffPlan",
    "RegisterCount",
    "RegisterExport",
    "RegisterImport",
    "RegisterStates",
    "RegisterUnseal",
    "from_wire",
    "moving",
    "plan_handoff",
    "serve",
    "to_wire",
]

#: Bytes of register values (plus keys) in one export page or import request: a few pages cover
#: every job's registers (64 MiB per node at most), and one page stays far below the transport's
#: 16 MiB control-body limit while holding at least one value (protocol.MAX_REGISTER_VALUE_BYTES).
HANDOFF_PAGE_BYTES: Final = 4 * 2**20

_U64 = Annotated[int, msgspec.Meta(ge=0)]
#: [key, promised round, promised proposer, accepted round, accepted proposer, counter, origin
#: round, origin proposer, value]: the register log's record payload (register_store.py)
StateWire = tuple[str, _U64, _U64, _U64, _U64, _U64, _U64, _U64, bytes]
Strategy = Literal["hash", "weighted", "pinned"]


class RegisterExport(msgspec.Struct, frozen=True, tag=26):
    """Seal the keys this node loses, then answer its states of keys whose owners change (module
    docstring, step 1), keys after ``after`` in order, up to ``max_bytes``. Reply: ``RegisterStates``."""

    old_members: list[tuple[str, float]]
    new_members: list[tuple[str, float]]
    replicas: int
    strategy: Strategy = "hash"
    after: str = ""
    max_bytes: int = HANDOFF_PAGE_BYTES


class RegisterImport(msgspec.Struct, frozen=True, tag=27):
    """Merge these states (step 3), durably. Reply: ``RegisterCount`` (states that changed)."""

    states: list[StateWire]


class RegisterUnseal(msgspec.Struct, frozen=True, tag=28):
    """Drop every seal (step 4). Reply: ``RegisterCount`` (seals dropped)."""


class RegisterStates(msgspec.Struct, frozen=True, tag=100):
    states: list[StateWire]
    next_after: str
    done: bool


class RegisterCount(msgspec.Struct, frozen=True, tag=101):
    count: int


HandoffRequest = RegisterExport | RegisterImport | RegisterUnseal


def to_wire(key: str, s: RegisterState) -> StateWire:
    return (key, *s.promised, *s.accepted, *s.version, s.value)


def from_wire(w: StateWire) -> tuple[str, RegisterState]:
    key, pr, pp, ar, ap, vc, vr, vp, value = w
    return key, RegisterState((pr, pp), (ar, ap), (vc, vr, vp), value)


def _placement(members: Sequence[tuple[str, float]], replicas: int, strategy: Strategy) -> Placement:
    return Placement(tuple(Member(n, w) for n, w in members), replicas, strategy)


def _owners(placement: Placement, keys: Sequence[str]) -> list[tuple[str, ...]]:
    if not keys:
        return []
    ids = np.fromiter((p.register_key_id(k) for k in keys), np.uint64, len(keys))
    names = placement.names
    return [tuple(names[i] for i in row) for row in placement.owner_indices(ids).tolist()]


def moving(old: Placement, new: Placement, keys: Sequence[str]) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per key: (old owners, new owners)."""
    return list(zip(_owners(old, keys), _owners(new, keys), strict=True))


@dataclass
class HandoffPlan:
    """What step 3 sends: joiner -> key -> merged state; and the keys too few old owners answered for."""

    imports: dict[str, dict[str, RegisterState]] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    keys: int = 0


def plan_handoff(old: Placement, new: Placement, answers: Mapping[str, Mapping[str, RegisterState]],
                 live: Collection[str]) -> HandoffPlan:
    """Step 2 (module docstring), pure. ``answers``: old member that answered -> its states of
    moving keys (a key it does not list is ``EMPTY`` there). A key is lost when fewer than a
    majority of its old owners answered, or when one of its joiners is not ``live`` (it would
    start empty, and the stayers alone may not be a majority holding the value)."""
    keys = sorted({k for states in answers.values() for k in states})
    plan = HandoffPlan(keys=len(keys))
    quorum = old.effective_replicas // 2 + 1
    for key, (was, now) in zip(keys, moving(old, new, keys), strict=True):
        joiners = [n for n in now if n not in was]
        if not joiners:
            continue
        heard = [answers[o].get(key, EMPTY) for o in was if o in answers]
        if len(heard) < quorum or any(j not in live for j in joiners):
            plan.lost.append(key)
            joiners = [j for j in joiners if j in live]  # with allow_loss: what can be saved is
        if len(heard) < quorum:
            continue
        state = EMPTY
        for s in heard:
            state = merge(state, s)
        for j in joiners:
            plan.imports.setdefault(j, {})[key] = state
    return plan


def pages(states: Mapping[str, RegisterState], max_bytes: int = HANDOFF_PAGE_BYTES) -> Iterable[list[StateWire]]:
    """``states`` cut into import requests of about ``max_bytes`` each."""
    page: list[StateWire] = []
    size = 0
    for key, s in sorted(states.items()):
        page.append(to_wire(key, s))
        size += len(key) + len(s.value)
        if size >= max_bytes:
            yield page
            page, size = [], 0
    if page:
        yield page


# -- the node's side -------------------------------------------------------------------------------
def _store(service: StorageService) -> RegisterStore:
    if service.registers is None:
        raise RuntimeError("storage service keeps no registers (not open)")
    return service.registers


async def export(service: StorageService, msg: RegisterExport) -> RegisterStates:
    """Step 1 on this node: seal what it loses (first page; durable before anything is answered:
    register_store.py, "Seals"), answer a page of moving keys' states.

    Raises:
        RuntimeError: the seals could not be written (the operation fails and unseals).
    """
    store, me = _store(service), service.node_name
    old = _placement(msg.old_members, msg.replicas, msg.strategy)
    new = _placement(msg.new_members, msg.replicas, msg.strategy)
    keys = store.keys()
    owners = moving(old, new, keys)
    if not msg.after:
        epoch = service.topology.placement.epoch if service.topology is not None else ""
        lost = [k for k, (was, now) in zip(keys, owners, strict=True) if me in was and me not in now]
        try:
            await asyncio.to_thread(store.seal, lost, epoch)  # two fsyncs: off the event loop
        except OSError as exc:
            raise RuntimeError(f"register seals not written: {exc}") from exc
    out: list[StateWire] = []
    size = 0
    for key, (was, now) in zip(keys, owners, strict=True):
        if key <= msg.after or was == now or me not in was:
            continue
        if size >= msg.max_bytes:
            return RegisterStates(out, out[-1][0], False)
        state = store.get(key)  # one value at a time: spilled corpus chunks are read as they go
        out.append(to_wire(key, state))
        size += len(key) + len(state.value)
    return RegisterStates(out, "", True)


async def _unseal(store: RegisterStore) -> int:
    """Drop every seal (step 4; also the operator's unseal, unseal.py); the seals dropped."""
    try:
        return await asyncio.to_thread(store.unseal)  # a directory fsync: off the event loop
    except OSError as exc:
        raise RuntimeError(f"register seals not removed: {exc}") from exc


async def serve(service: StorageService, msg: HandoffRequest) -> RegisterStates | RegisterCount:
    """One handoff request on this node (module docstring)."""
    store = _store(service)
    if isinstance(msg, RegisterExport):
        return await export(service, msg)
    if isinstance(msg, RegisterUnseal):
        return RegisterCount(await _unseal(store))
    changed, seq = 0, 0
    try:
        for w in msg.states:
            key, copied = from_wire(w)
            before = store.get(key)
            state, seq = store.merge(key, copied)
            changed += state != before
        if store.durable_seq < seq:
            await asyncio.to_thread(store.sync)  # answered only once durable, like a promise
    except (RegisterStoreFull, OSError) as exc:  # the states merged so far stay: merging is idempotent
        raise RuntimeError(f"register import failed: {exc}") from exc
    return RegisterCount(changed)
