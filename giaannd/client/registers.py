"""Replicated registers, the client's side: quorum reads and compare-and-set (CASPaxos proposer).

Theory of operation
-------------------
A register is a small named row ``(version, value)`` kept by the R
owners of ``protocol.register_key_id(key)``, each a CASPaxos acceptor
(giaannd/storage/engine/register_store.py has the acceptor rules and their durability). This
module is the proposer.

**Versions** are ``(counter, origin round, origin proposer)``: the counter grows by one per
change, and the origin is the ballot that first proposed the value (a value written back keeps
its version). ``(0, 0, 0)`` is a register never written. Two different values never share a
version, even a value accepted by a minority and then superseded: so a CAS that names a version
it *read* (reads may see a change still in progress) cannot be applied on top of a different
value that happens to carry the same counter. A bare counter would allow exactly that lost update.

A majority is ``Q = R // 2 + 1`` owners (2 of 3), for every phase,
whatever the cluster's write quorum W is set to: Paxos is only safe with majorities (a W of 1
would let two writers both succeed).

**Compare-and-set** ``cas(key, expect, value)`` is one or more *rounds* (:class:`CasRound`,
sans-IO, also driven by the simulator in tests/sim/leases.py), each under a fresh ballot
``(round, proposer)``:

1. *prepare*: every owner promises the ballot and answers its accepted ``(ballot, version, value)``;
   with Q promises the current value is the one under the highest accepted ballot (Paxos: any value
   a majority accepted is seen by every later majority);
2. if its version is ``expect``, *accept* ``value`` under version ``(expect counter + 1, this
   ballot)`` on the owners: Q acceptances and the CAS **succeeded**. Otherwise the CAS is
   **refused** and answers the current value; when the promises did not all agree on it (Q of them
   under the same ballot), the current value is first written back under our ballot, so what a
   refusal answers is settled (*chosen*): the next CAS naming that version cannot be refused
   because a minority still holds something older or newer.

An owner refusing a phase because it saw a higher ballot (``RemoteRegisterConflict``: another
proposer at work) makes the round start again above that ballot after a full-jitter wait; an
owner that fails or is down is simply not counted. Fewer than Q answers, or ``max_rounds`` rounds
lost to contention, raise ``RegisterUnavailable``. A round that lost its accept phase may still
have taken effect: the next round of the same call recognises its own value if it is still the
current one (same counter, value and proposer) and reports success; if another proposer already
built on it, the call reports a refusal with the current value, which then *contains* the change.
A refusal after a lost round is therefore not proof that nothing changed (``CasOutcome.doubtful``);
callers that must know compare the current value with what they asked for (the lease agent does:
it adopts any lease the row names it as holder).

**Read** ``read(key)``: ``RegisterGet`` to the owners (no promise, no disk write), the value under
the highest accepted ballot among the first Q answers, and ``settled`` when Q of them agree on it.

What this guarantees, with R = 3 (Q = 2), as long as at most one owner of the key is lost:

* successful CASes on a key are linearizable: they form one chain ``v -> v + 1 -> ...``, each
  computed from the value the previous one wrote; two CASes naming the same version cannot both
  succeed;
* a refusal answers a value that is chosen, at least as new as every CAS that succeeded before the
  CAS began;
* a read answers a value at least as new as every CAS that succeeded before the read began; it may
  be a CAS still in progress (``settled`` False), which may yet be superseded: use reads to look,
  and CAS (whose version check catches a stale look) to decide.

What it does **not** guarantee:

* liveness under contention: duelling proposers can keep refusing each other (randomised waits
  make it unlikely; ``max_rounds`` bounds it, then ``RegisterUnavailable``);
* anything once two of a key's three owners are lost for good (their promises and values go with
  them): like every row, a register lives on its R owners;
* **placement changes**: the acceptors are the key's owners under the client's placement. When the
  owner set of a key changes (a storage node joins, leaves or is replaced), a majority of the new
  owners may hold nothing; a CAS through them would find version 0. Registers are not handed off by
  rebalancing yet, so a job must not run across a change of its rows' owners (docs/compute.md "One
  job across every compute node" lists this).
* ballots are unique only as long as two clients never draw the same 64-bit proposer id.

**Write-once reads** ``read_one(key)``: one ``RegisterGet`` to the key's first live owner instead
of R, for registers whose every CAS proposes the same bytes ``V`` (create-if-absent of a value that
is a function of the key's name: a cluster job's corpus chunks and flag findings), or empties the
register once it is no longer read. There, any non-empty value one owner accepted *is* ``V``, so one
answer is enough; an owner holding nothing (it missed the write, or a handoff has not reached it)
or failing answers None and the caller reads a quorum. A register that two writers may set to
different bytes must not be read this way (a minority may hold a value that lost).
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from giaannd import protocol as p
from giaannd.client.errors import REQUEST_FAILURES, RegisterUnavailable, RemoteNotOwner, RemoteRegisterConflict
from giaannd.client.node_call import NodeCall, NodeReply
from giaannd.cluster.view import ClusterView

__all__ = ["ABSENT", "Ballot", "CasOutcome", "CasRound", "ReadRound", "RegisterClient", "RegisterRead", "Version",
           "register_owners"]

Ballot = tuple[int, int]
#: (counter, origin round, origin proposer) (module docstring)
Version = tuple[int, int, int]
#: The version of a register never written.
ABSENT: Final[Version] = (0, 0, 0)
#: Rounds one CAS may lose to other proposers before it gives up (``RegisterUnavailable``).
DEFAULT_MAX_ROUNDS: Final = 12
#: Ceiling of the first wait after a lost round; doubles per round (full jitter), capped below.
ROUND_BACKOFF_S: Final = 0.002
ROUND_BACKOFF_CAP_S: Final = 0.1
_Feed = Callable[[str, p.Request, p.Reply | BaseException], list[tuple[str, p.Request]]]
#: Keys whose last round the client remembers (so its next ballot starts above it).
_MAX_REMEMBERED_KEYS: Final = 4096


@dataclass(frozen=True, slots=True)
class CasOutcome:
    """``ok``: the CAS took effect and the register is now ``(version, value)``; else refused and
    the register's current value is ``(version, value)`` (settled). For a read-by-CAS, ``ok``."""

    ok: bool
    version: Version
    value: bytes
    #: a refusal that followed a round of the same call which sent its value to be accepted and
    #: lost: that value may have taken effect (and been built upon) all the same
    doubtful: bool = False


@dataclass(frozen=True, slots=True)
class RegisterRead:
    """A quorum read: the newest value a majority answered, and whether a majority agreed on it."""

    version: Version
    value: bytes
    settled: bool


def register_owners(topology: ClusterView, key: str) -> tuple[str, ...]:
    """The key's R acceptors under the current placement.

    Raises:
        LookupError: no storage members known.
    """
    return topology.placement.owners(p.register_key_id(key))


def _ballot(v: p.RegisterValue) -> Ballot:
    return (v.round, v.proposer)


def _version(v: p.RegisterValue) -> Version:
    return (v.version, v.origin_round, v.origin_proposer)


@dataclass
class _Tally:
    """Answers of one phase from ``owners`` nodes: done when Q agreed or Q can no longer agree."""

    owners: int
    ok: dict[str, p.Reply] = field(default_factory=dict)
    refused: Ballot | None = None
    failed: dict[str, str] = field(default_factory=dict)
    refusals: int = 0
    #: owners that refused because they sealed the key (protocol.REGISTER_SEALED)
    sealed: set[str] = field(default_factory=set)

    @property
    def quorum(self) -> int:
        return self.owners // 2 + 1

    def add(self, node: str, result: p.Reply | BaseException) -> None:
        if isinstance(result, RemoteRegisterConflict):
            self.refusals += 1
            self.refused = max(self.refused or (0, 0), result.ballot)
        elif isinstance(result, BaseException):
            self.failed[node] = str(result) or type(result).__name__
            if isinstance(result, RemoteNotOwner) and result.message == p.REGISTER_SEALED:
                self.sealed.add(node)
        else:
            self.ok[node] = result

    @property
    def won(self) -> bool:
        return len(self.ok) >= self.quorum

    @property
    def lost(self) -> bool:
        return self.owners - self.refusals - len(self.failed) < self.quorum


class CasRound:
    """One CASPaxos round (module docstring), sans-IO: ``start()`` gives the prepares to send;
    feed each answer (a reply, or the exception the call raised) to ``on_prepare`` / ``on_accept``,
    which return the accepts to send, if any. When ``done``: ``outcome`` (success, refusal, or read),
    else ``retry_above`` (a higher ballot was seen: start a new round above it) or ``error`` (no quorum).

    Args:
        key, owners: the register and its R acceptors.
        ballot: this round's ballot, above any this proposer used for the key.
        expect, value: CAS from version ``expect`` to ``value``; ``expect`` None: a read by CAS
            (the current value, settled by a write-back when the quorum does not agree).
    """

    def __init__(self, key: str, owners: Sequence[str], ballot: Ballot, expect: Version | None, value: bytes = b"",
                 epoch: str = "") -> None:
        self.key, self.owners, self.ballot, self.expect, self.value, self.epoch = key, tuple(owners), ballot, \
            expect, value, epoch
        self.phase = "prepare"
        self._tally = _Tally(len(self.owners))
        self._result: CasOutcome | None = None  # what success of the accept phase means
        self.outcome: CasOutcome | None = None
        self.retry_above: Ballot | None = None
        self.error: str | None = None
        #: the new (version, value) this round sends to be accepted, if it got that far: it may
        #: take effect even when the round is lost (a later proposer can build on it)
        self.proposal: tuple[Version, bytes] | None = None

    @property
    def sealed(self) -> bool:
        """Some owner of the phase that ended it refused because it sealed the key."""
        return bool(self._tally.sealed)

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def start(self) -> list[tuple[str, p.Request]]:
        return [(n, p.RegisterPrepare(self.key, *self.ballot, self.epoch)) for n in self.owners]

    def on_prepare(self, node: str, result: p.Reply | BaseException) -> list[tuple[str, p.Request]]:
        if self.phase != "prepare":
            return []
        if not isinstance(result, BaseException) and not isinstance(result, p.RegisterValue):
            result = ValueError(f"unexpected reply {type(result).__name__} to RegisterPrepare")
        self._tally.add(node, result)
        if self._tally.lost:
            self._end_lost()
        elif self._tally.won:
            return self._decide()
        return []

    def on_accept(self, node: str, result: p.Reply | BaseException) -> None:
        if self.phase != "accept":
            return
        if not isinstance(result, BaseException) and not isinstance(result, p.RegisterAccepted):
            result = ValueError(f"unexpected reply {type(result).__name__} to RegisterAccept")
        self._tally.add(node, result)
        if self._tally.won:
            self.outcome, self.phase = self._result, "done"
        elif self._tally.lost:
            self._end_lost()

    def _end_lost(self) -> None:
        tally = self._tally
        if tally.refused is not None:
            self.retry_above = tally.refused
        else:
            detail = "; ".join(f"{n}: {e}" for n, e in sorted(tally.failed.items()))
            self.error = f"{len(tally.ok)} of {len(self.owners)} owners of register {self.key!r} answered " \
                         f"{self.phase} (need {tally.quorum}): {detail}"
        self.phase = "done"

    def _decide(self) -> list[tuple[str, p.Request]]:
        promises = [v for v in self._tally.ok.values() if isinstance(v, p.RegisterValue)]
        best = max(promises, key=_ballot)
        current = _version(best)
        settled = sum(_ballot(v) == _ballot(best) for v in promises) >= self._tally.quorum
        if self.expect is not None and current == self.expect:
            version: Version = (current[0] + 1, *self.ballot)
            self._result, value = CasOutcome(True, version, self.value), self.value
            self.proposal = (version, value)
        else:  # a read, a refusal, or our own earlier round that landed: settle the current value
            mine = (self.expect is not None and current[0] == self.expect[0] + 1 and current[2] == self.ballot[1]
                    and best.value == self.value)
            self._result = CasOutcome(self.expect is None or mine, current, best.value)
            if settled:
                self.outcome, self.phase = self._result, "done"
                return []
            version, value = current, best.value
        self.phase, self._tally = "accept", _Tally(len(self.owners))
        msg = p.RegisterAccept(self.key, *self.ballot, *version, value, self.epoch)
        return [(n, msg) for n in self.owners]


class ReadRound:
    """A quorum read (module docstring), sans-IO: ``start()``, then ``on_reply`` per answer until
    ``done``: ``outcome`` or ``error``."""

    def __init__(self, key: str, owners: Sequence[str], epoch: str = "") -> None:
        self.key, self.owners, self.epoch = key, tuple(owners), epoch
        self._tally = _Tally(len(self.owners))
        self.outcome: RegisterRead | None = None
        self.error: str | None = None

    @property
    def sealed(self) -> bool:
        """Some owner of the phase that ended it refused because it sealed the key."""
        return bool(self._tally.sealed)

    @property
    def done(self) -> bool:
        return self.outcome is not None or self.error is not None

    def start(self) -> list[tuple[str, p.Request]]:
        return [(n, p.RegisterGet(self.key, self.epoch)) for n in self.owners]

    def on_reply(self, node: str, result: p.Reply | BaseException) -> None:
        if self.done:
            return
        if not isinstance(result, BaseException) and not isinstance(result, p.RegisterValue):
            result = ValueError(f"unexpected reply {type(result).__name__} to RegisterGet")
        self._tally.add(node, result)
        if self._tally.won:
            values = [v for v in self._tally.ok.values() if isinstance(v, p.RegisterValue)]
            best = max(values, key=_ballot)
            agree = sum(_ballot(v) == _ballot(best) for v in values)
            self.outcome = RegisterRead(_version(best), best.value, agree >= self._tally.quorum)
        elif self._tally.lost:
            detail = "; ".join(f"{n}: {e}" for n, e in sorted(self._tally.failed.items()))
            self.error = f"{len(self._tally.ok)} of {len(self.owners)} owners of register {self.key!r} " \
                         f"answered (need {self._tally.quorum}): {detail}"


class RegisterClient:
    """The StorageClient's registers: runs rounds over its ``NodeCall`` (module docstring).

    Args:
        topology: owners and liveness (owners believed down are counted as failed, not asked).
        call: one request to one node.
        proposer: this client's 64-bit proposer id (random by default).
        max_rounds: rounds one CAS may lose to contention.
        rng: the waits' randomness.
    """

    def __init__(self, topology: ClusterView, call: NodeCall, *, proposer: int | None = None,
                 max_rounds: int = DEFAULT_MAX_ROUNDS, rng: random.Random | None = None) -> None:
        self.topology, self._call = topology, call
        self.proposer = secrets.randbits(64) if proposer is None else proposer
        self.max_rounds = max_rounds
        self._rng = rng or random.Random()
        self._rounds: dict[str, int] = {}
        #: rounds lost to another proposer, over the client's life (tests, metrics)
        self.conflicts = 0

    async def read(self, key: str, timeout_s: float | None = None) -> RegisterRead:
        """Quorum read. Raises: RegisterUnavailable, LookupError (no storage members)."""
        rnd = ReadRound(key, register_owners(self.topology, key), self.topology.epoch)

        def feed(node: str, msg: p.Request, result: p.Reply | BaseException) -> list[tuple[str, p.Request]]:
            rnd.on_reply(node, result)
            return []

        await self._exchange(rnd.start(), feed, lambda: rnd.done, timeout_s)
        if rnd.outcome is None:
            raise RegisterUnavailable(rnd.error or "no quorum", sealed=rnd.sealed)
        return rnd.outcome

    async def read_one(self, key: str, timeout_s: float | None = None) -> RegisterRead | None:
        """One owner's value of a *write-once* register (module docstring, "Write-once reads"), or
        None where the first live owner holds no value or fails (then read a quorum). ``settled``
        is False: one answer says nothing about the other owners.

        Raises:
            LookupError: no storage members known.
        """
        live = [n for n in register_owners(self.topology, key) if self.topology.is_live(n)]
        if not live:
            return None
        try:
            reply, _ = await self._call(live[0], p.RegisterGet(key, self.topology.epoch), timeout_s=timeout_s)
        except REQUEST_FAILURES:
            return None
        if not isinstance(reply, p.RegisterValue) or not reply.version or not reply.value:
            return None
        return RegisterRead(_version(reply), reply.value, False)

    async def cas(self, key: str, expect: Version | None, value: bytes = b"",
                  timeout_s: float | None = None) -> CasOutcome:
        """Compare-and-set (``expect`` None: a read settled by CAS).

        Raises:
            RegisterUnavailable: no quorum, or contention outlasted ``max_rounds`` (the CAS may
                have taken effect).
            ValueError: ``value`` over ``protocol.MAX_REGISTER_VALUE_BYTES``.
            LookupError: no storage members known.
        """
        if len(value) > p.MAX_REGISTER_VALUE_BYTES:
            raise ValueError(f"register value of {len(value)} bytes, over {p.MAX_REGISTER_VALUE_BYTES}")
        proposed = False
        for attempt in range(self.max_rounds):
            rnd = CasRound(key, register_owners(self.topology, key), self._next_ballot(key), expect, value,
                           self.topology.epoch)

            def feed(node: str, msg: p.Request, result: p.Reply | BaseException,
                     rnd: CasRound = rnd) -> list[tuple[str, p.Request]]:
                if isinstance(msg, p.RegisterPrepare):
                    return rnd.on_prepare(node, result)
                rnd.on_accept(node, result)
                return []

            def finished(rnd: CasRound = rnd) -> bool:
                return rnd.done

            await self._exchange(rnd.start(), feed, finished, timeout_s)
            if rnd.outcome is not None:
                out = rnd.outcome
                return CasOutcome(out.ok, out.version, out.value, True) if proposed and not out.ok else out
            proposed = proposed or rnd.proposal is not None
            if rnd.retry_above is None:
                raise RegisterUnavailable(rnd.error or "no quorum", sealed=rnd.sealed)
            self.conflicts += 1
            self._remember(key, rnd.retry_above[0])
            await asyncio.sleep(self._rng.uniform(0, min(ROUND_BACKOFF_CAP_S, ROUND_BACKOFF_S * 2**attempt)))
        raise RegisterUnavailable(f"register {key!r}: {self.max_rounds} rounds lost to other proposers")

    def _next_ballot(self, key: str) -> Ballot:
        n = self._rounds.get(key, 0) + 1
        self._remember(key, n)
        return (n, self.proposer)

    def _remember(self, key: str, round_: int) -> None:
        if key not in self._rounds and len(self._rounds) >= _MAX_REMEMBERED_KEYS:
            self._rounds.clear()  # a new ballot then costs one extra round per key, nothing more
        self._rounds[key] = max(self._rounds.get(key, 0), round_)

    async def _exchange(self, sends: Sequence[tuple[str, p.Request]], feed: _Feed, finished: Callable[[], bool],
                        timeout_s: float | None) -> None:
        """Send ``sends`` at once; ``feed(node, request, reply or exception)`` each answer (it may
        return more requests to send) until ``finished()``. Owners believed down are fed a failure
        without being asked; requests still out at the end are cancelled (nothing relies on them)."""
        tasks: dict[asyncio.Future[NodeReply], tuple[str, p.Request]] = {}

        def send(batch: Sequence[tuple[str, p.Request]]) -> None:
            for node, msg in batch:
                if self.topology.is_live(node):
                    tasks[asyncio.ensure_future(self._call(node, msg, timeout_s=timeout_s))] = (node, msg)
                else:
                    send(feed(node, msg, ConnectionError(f"{node} is believed down")))

        try:
            send(sends)
            while tasks and not finished():
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    node, msg = tasks.pop(task)
                    exc = task.exception()
                    if exc is not None and not isinstance(exc, REQUEST_FAILURES):
                        raise exc
                    send(feed(node, msg, exc if exc is not None else task.result()[0]))
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
