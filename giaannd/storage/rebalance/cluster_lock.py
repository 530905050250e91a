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
  whose release never reached a quorum). A token whose write is still in flight is this
  process's too: another ``acquire`` of this node that reads it (a second verb at the same
  moment, the auto-join), or the release at start, leaves it alone;
- otherwise refuses with ``OperationLockBusy`` (the admin API's 409), naming the holder.

A CAS refused because the register changed meanwhile decides again on the value the refusal
answers (a settled one). ``release`` empties the register by CAS, naming the version its
acquisition wrote; a node also releases, at start, a lock that names it (stale by construction).

An owner that *sealed* the register (an operation's handoff moves it to new owners; or a dead
coordinator's seal left behind) refuses it: ``acquire`` then raises ``OperationLockSealed``, a
kind of busy. When a majority of the key's owners cannot be reached otherwise (down), it raises
``OperationLockUnavailable``. The daemon then runs the operation without the lock and says so (in
its log and progress): removing dead members is what a degraded cluster needs, and refusing would
leave no way back. The guarantee holds whenever the register is reachable. A write that failed so
may have taken effect all the same (registers.py: a round whose answers were lost): the exception
carries its ``token``, and the operation releases that when it ends, as a lock it took
(``release`` reads the register and empties it if it names the token), so no lock outlives it. A
write refused by a seal is in doubt too: ``OperationLockSealed`` carries its token, released at once
(the operation does not run).

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

__all__ = ["LOCK_KEY", "ClusterLock", "LockHolder", "OperationLockBusy", "OperationLockSealed",
           "OperationLockUnavailable", "retry_release"]

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
    """Another topology operation holds the cluster's lock (the admin API's 409). ``holder``: who
    (None for ``OperationLockSealed``)."""

    def __init__(self, holder: LockHolder | None, message: str = "") -> None:
        if holder is not None and not message:
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(holder.since))
            message = (f"another topology operation runs in the cluster: {holder.kind} ({holder.op}) "
                       f"coordinated by {holder.coordinator} since {since}; wait for it to end "
                       f"(`giaannctl node topology status` on {holder.coordinator}) or cancel it there")
        super().__init__(message)
        self.holder = holder


class OperationLockSealed(OperationLockBusy):
    """An owner of the lock's register sealed it: a topology operation is handing it to new owners
    (its cutover), or one whose coordinator died left the seal (``giaannctl node registers
    unseal`` on that node). Busy, not unavailable: running without the lock is for owners that
    are down, and a seal says an operation is (or was) under way; whether the read or the write
    met it. ``token``: as ``OperationLockUnavailable``'s (a write that met it is in doubt:
    ``release`` it, though no operation runs)."""

    def __init__(self, detail: str, token: int | None = None) -> None:
        super().__init__(None, "the cluster's topology lock is sealed: a topology operation is handing its "
                               "register to new owners (its cutover), or one whose coordinator died left the "
                               f"seal (`giaannctl node registers unseal` on that node): {detail}")
        self.token = token


class OperationLockUnavailable(Refused):
    """The lock's register could not be read or written (no majority of its owners answered).
    ``token``: a write of that token whose outcome is unknown (``release`` it once the operation
    ended), or None where no write was sent."""

    def __init__(self, message: str, token: int | None = None) -> None:
        super().__init__(message)
        self.token = token


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
    #: tokens whose write is in flight (an acquire not returned yet)
    _inflight: set[int] = field(default_factory=set)
    #: tokens whose write failed with its outcome unknown, not released yet (only ``release``
    #: reads these: such a lock is stale to this node, as one of an earlier life)
    _doubt: set[int] = field(default_factory=set)

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
            return not self._mine(holder.token)
        return not self.is_member_live(holder.coordinator)

    def _mine(self, token: int) -> bool:
        """Whether ``token``'s lock is this process's: held, or its write in flight."""
        return token in self._held or token in self._inflight

    async def acquire(self, op: str, kind: str) -> int:
        """Take the lock for operation ``op``; returns its token (for ``release``).

        Raises:
            OperationLockBusy: a live holder has it (``OperationLockSealed``: an owner sealed it).
            OperationLockUnavailable: the register could not be read or written.
        """
        token = secrets.randbits(63)
        self._inflight.add(token)  # this process's while its write is in flight (stale())
        try:
            return await self._acquire(op, kind, token)
        except (OperationLockUnavailable, OperationLockSealed) as exc:
            if exc.token is not None:  # it may be in the register: ``release`` looks for it
                self._doubt.add(exc.token)
            raise
        finally:
            self._inflight.discard(token)

    async def _acquire(self, op: str, kind: str, token: int) -> int:
        value = msgspec.msgpack.encode(LockHolder(op=op, kind=kind, coordinator=self.me, token=token,
                                                  since=time.time()))
        written = False  # a write of ours was sent (its outcome is unknown when it raises)
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
                written = True
                out = await self.registers.cas(LOCK_KEY, out.version, value, timeout_s=self.timeout_s)
                if out.ok:
                    self._held[token] = out.version
                    log.info("topology lock taken op=%s kind=%s token=%#x", op, kind, token)
                    return token
        except RegisterUnavailable as exc:
            if exc.sealed:  # (the write too: the owners a read meets a moment later refuse it)
                raise OperationLockSealed(str(exc), token if written else None) from None
            raise OperationLockUnavailable(f"the cluster's topology lock (register {LOCK_KEY!r}) cannot be "
                                           f"reached: {exc}", token if written else None) from None
        except LookupError as exc:  # no storage members known
            raise OperationLockUnavailable(f"the cluster's topology lock has no owners: {exc}",
                                           token if written else None) from None
        # (our last CAS lost, but a lost round may still take effect: its token, for ``release``)
        raise OperationLockUnavailable(f"the cluster's topology lock (register {LOCK_KEY!r}) kept changing "
                                       f"under {_MAX_DECISIONS} attempts to take it", token if written else None)

    async def release(self, token: int) -> bool:
        """Empty the lock if it still holds ``token``. True when it no longer does (released now,
        or taken over meanwhile); False when the register could not be written (try again).
        Raises nothing."""
        version = self._held.get(token)
        if version is None and token not in self._doubt:
            return True
        try:
            if version is None:  # a write in doubt (module docstring): look where the register is
                seen = await self.registers.cas(LOCK_KEY, None, timeout_s=self.timeout_s)  # a settled read
                out = CasOutcome(False, seen.version, seen.value)
            else:
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
        self._held.pop(token, None)
        self._doubt.discard(token)
        log.info("topology lock released token=%#x", token)
        return True

    async def release_own_stale(self) -> bool:
        """At start: empty the lock if it names this node with a token of an earlier life (its
        operation cannot be running: this process started none; a token of this process, an
        acquire in flight included, is left alone). True when the lock names no earlier life of
        this node any more. Raises nothing."""
        try:
            # a plain read first: a read settled by CAS (a prepare) leaves a promise on the owners,
            # a state every node's start would then add for the handoffs to move
            seen = await self.registers.read(LOCK_KEY, timeout_s=self.timeout_s)
            holder = self.decode(seen.value)
            if holder is None or holder.coordinator != self.me or self._mine(holder.token):
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
