"""One topology operation at a time in the whole cluster: a lock held in a replicated register.

Why
---
Each node's ``OperationRegistry`` runs one operation at a time, and a source refuses a second
placement change while it still streams the first; but two operations coordinated by two nodes
could both pass those checks (the second planned just after the first's streams ended, before its
cutover) and both commit. Each had planned against the ring as it was, and the ring (a CRDT) merges
both commits: after two removals planned apart, each having streamed a removed member's columns
to the owners *its* placement named, a column's owners under the merged placement may include a
node that neither operation gave it (a replica short, for good). So every join, decommission,
removenode and replace holds the cluster's operation lock from before its plan until it ended
(done, or failed / cancelled and cleaned up). Repair changes no placement and takes no lock.

How
---
The lock is the register ``LOCK_KEY`` (client/registers.py: CASPaxos over the key's owners): empty
when free, else a ``LockHolder`` naming the operation, its coordinator and a random token of this
acquisition. ``acquire`` reads it (a read settled by CAS) and

- takes it by CAS when it is empty;
- takes it over when its holder is **stale**: its coordinator is not a live member, or is this
  node while the token is none of this process's (an earlier life of this node, or an operation
  whose release never reached a quorum);
- otherwise refuses with ``OperationLockBusy`` (the admin API's 409), naming the holder.

A CAS refused because the register changed meanwhile decides again on the value the refusal
answers (a settled one). ``release`` empties the register by CAS, naming the version its
acquisition wrote; a node also releases, at start, a lock that names it (stale by construction).

When a majority of the key's owners cannot be reached, ``acquire`` raises
``OperationLockUnavailable``. The daemon then runs the operation without the lock and says so (in
its log and progress): removing dead members is what a degraded cluster needs, and refusing would
leave no way back. The guarantee holds whenever the register is reachable.

The register's owners may change with the very operation that holds it: the cutover's register
handoff (register_handoff.py) moves it as it moves every register, so the release after the
cutover finds it on its new owners. Where the handoff cannot move it (fewer than a majority of its
old owners reachable: a removal of dead members), the operation goes on (the lock carries no data)
and the release writes the register empty on its new owners, over whatever they hold.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

import msgspec

from giaannd.client.errors import RegisterUnavailable
from giaannd.client.registers import CasOutcome, RegisterRead, Version
from giaannd.errors import Refused

__all__ = ["LOCK_KEY", "ClusterLock", "LockHolder", "OperationLockBusy", "OperationLockUnavailable", "retry_release"]

log = logging.getLogger(__name__)

#: The register holding the lock (a name no cluster job's keys use: those start with ``jobs``).
LOCK_KEY: Final = "topology/operation"
#: Decisions one ``acquire`` makes before giving up on a register that keeps changing under it.
_MAX_DECISIONS: Final = 8


class LockHolder(msgspec.Struct, frozen=True, kw_only=True):
    """The register's value while the lock is held."""

    #: the operation's id (``Rebalance.op_id``) and kind, for whoever is refused
    op: str
    kind: str
    #: the node coordinating it (where ``giaannctl node topology status`` shows it)
    coordinator: str
    #: random per acquisition: which holder of that name this is
    token: int
    #: wall-clock seconds when it was taken (for people: staleness never reads clocks)
    since: float


class OperationLockBusy(Refused):
    """Another topology operation holds the cluster's lock (the admin API's 409)."""

    def __init__(self, holder: LockHolder) -> None:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(holder.since))
        super().__init__(f"another topology operation runs in the cluster: {holder.kind} ({holder.op}) "
                         f"coordinated by {holder.coordinator} since {since}; wait for it to end "
                         f"(`giaannctl node topology status` on {holder.coordinator}) or cancel it there")
        self.holder = holder


class OperationLockUnavailable(Refused):
    """The lock's register could not be read or written (no majority of its owners answered)."""


class Registers(Protocol):
    """The register calls the lock needs (``RegisterClient``'s)."""

    async def cas(self, key: str, expect: Version | None, value: bytes = b"",
                  timeout_s: float | None = None) -> CasOutcome: ...

    async def read(self, key: str, timeout_s: float | None = None) -> RegisterRead: ...


@dataclass
class ClusterLock:
    """The cluster's topology-operation lock as one node sees it (module docstring).

    Args:
        registers: the register client (a storage node's own).
        me: this node's name.
        is_member_live: whether a node of that name is a live member now (membership).
        timeout_s: bound on each register call.
    """

    registers: Registers
    me: str
    is_member_live: Callable[[str], bool]
    timeout_s: float = 30.0
    #: tokens this process acquired and has not released: (token -> version it wrote)
    _held: dict[int, Version] = field(default_factory=dict)

    def decode(self, value: bytes) -> LockHolder | None:
        """The holder a register value names; None when empty or unreadable (a value no version
        of this code wrote: taken over like a stale one, and logged)."""
        if not value:
            return None
        try:
            return msgspec.msgpack.decode(value, type=LockHolder)
        except msgspec.DecodeError as exc:
            log.warning("topology lock: register %s holds a value that is not a lock (%s); it is taken over",
                        LOCK_KEY, exc)
            return None

    def stale(self, holder: LockHolder) -> bool:
        """Whether ``holder`` can be taken over (module docstring)."""
        if holder.coordinator == self.me:
            return holder.token not in self._held
        return not self.is_member_live(holder.coordinator)

    async def acquire(self, op: str, kind: str) -> int:
        """Take the lock for operation ``op``; returns its token (for ``release``).

        Raises:
            OperationLockBusy: a live holder has it.
            OperationLockUnavailable: the register could not be read or written.
        """
        token = secrets.randbits(63)
        value = msgspec.msgpack.encode(LockHolder(op=op, kind=kind, coordinator=self.me, token=token,
                                                  since=time.time()))
        try:
            out = await self.registers.cas(LOCK_KEY, None, timeout_s=self.timeout_s)  # a settled read
            for _ in range(_MAX_DECISIONS):
                holder = self.decode(out.value)
                if holder is not None and holder.token == token:  # ours (a lost round that took effect)
                    self._held[token] = out.version
                    return token
                if holder is not None and not self.stale(holder):
                    raise OperationLockBusy(holder)
                if holder is not None:
                    log.warning("topology lock: taking over from %s's %s (%s): %s", holder.coordinator,
                                holder.kind, holder.op, "an earlier life of this node" if
                                holder.coordinator == self.me else "its coordinator is not a live member")
                out = await self.registers.cas(LOCK_KEY, out.version, value, timeout_s=self.timeout_s)
                if out.ok:
                    self._held[token] = out.version
                    log.info("topology lock taken op=%s kind=%s token=%#x", op, kind, token)
                    return token
        except RegisterUnavailable as exc:
            raise OperationLockUnavailable(f"the cluster's topology lock (register {LOCK_KEY!r}) cannot be "
                                           f"reached: {exc}") from None
        except LookupError as exc:  # no storage members known
            raise OperationLockUnavailable(f"the cluster's topology lock has no owners: {exc}") from None
        raise OperationLockUnavailable(f"the cluster's topology lock (register {LOCK_KEY!r}) kept changing "
                                       f"under {_MAX_DECISIONS} attempts to take it")

    async def release(self, token: int) -> bool:
        """Empty the lock if it still holds ``token``. True when it no longer does (released now,
        or taken over meanwhile); False when the register could not be written (try again).
        Raises nothing."""
        version = self._held.get(token)
        if version is None:
            return True
        try:
            out = await self.registers.cas(LOCK_KEY, version, b"", timeout_s=self.timeout_s)
            if not out.ok:
                # Changed since we wrote it. Another holder's: leave it. Ours under another version,
                # or empty (a handoff that could not move the register left new owners without
                # it, while some may still hold ours): write it empty over that, at a higher
                # ballot, so no remnant of ours is ever read as held again.
                holder = self.decode(out.value)
                if holder is None or holder.token == token:
                    out = await self.registers.cas(LOCK_KEY, out.version, b"", timeout_s=self.timeout_s)
                    if not out.ok:
                        return False
        except (RegisterUnavailable, LookupError) as exc:
            log.warning("topology lock: release of token %#x failed (%s); retried later", token, exc)
            return False
        del self._held[token]
        log.info("topology lock released token=%#x", token)
        return True

    async def release_own_stale(self) -> bool:
        """At start: empty the lock if it names this node with a token of an earlier life (its
        operation cannot be running: this process started none). True when the lock names no
        earlier life of this node any more. Raises nothing."""
        try:
            # a plain read first: a read settled by CAS (a prepare) leaves a promise on the owners,
            # a state every node's start would then add for the handoffs to move
            seen = await self.registers.read(LOCK_KEY, timeout_s=self.timeout_s)
            holder = self.decode(seen.value)
            if holder is None or holder.coordinator != self.me or holder.token in self._held:
                return True
            out = await self.registers.cas(LOCK_KEY, seen.version, b"", timeout_s=self.timeout_s)
            if not out.ok:  # (changed meanwhile, or the read saw a value not yet settled: look again)
                return False
        except (RegisterUnavailable, LookupError) as exc:
            log.info("topology lock: could not check for a lock of an earlier life (%s)", exc)
            return False
        if out.ok:
            log.warning("topology lock: released %s's lock of an earlier life of this node (%s)", holder.kind,
                        holder.op)
        return out.ok


async def retry_release(lock: ClusterLock, token: int, sleep: Callable[[float], Awaitable[object]],
                        *, every_s: float = 5.0, attempts: int = 120) -> bool:
    """``release`` until it succeeds, ``every_s`` apart, at most ``attempts`` times (a release
    that never reaches a quorum leaves the lock to be taken over once this node restarts or
    leaves). True once released."""
    for _ in range(attempts):
        if await lock.release(token):
            return True
        await sleep(every_s)
    log.error("topology lock: gave up releasing token %#x; restart this node or let another take it over "
              "once this node is gone", token)
    return False
