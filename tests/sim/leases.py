"""Deterministic simulator for one cluster training job: compute nodes running the lease agent
(giaannd/compute/leases.py) against storage nodes running the register acceptor rules
(giaannd/storage/engine/register_store.py), through the real CASPaxos proposer rounds
(giaannd/client/registers.py), on virtual time over a seeded network model.

Faults: message loss (every request and reply), delay with jitter, compute nodes that crash
(``kill``), come back under the same name (``restart``), freeze (their events wait until they thaw:
a GC pause or a blocked loop), are cut from the storage nodes (``partition``), and join mid-job
(``add_compute``); storage nodes that crash and restart with their (durable) acceptor state.

The oracle (``check``) reads the history the proposers saw succeed:

* every key's successful CASes form one chain (each names the version the previous one made);
* each window of each stage turns ``done`` in exactly one successful CAS, made by the holder of
  the lease that covered it; at the end every window is done;
* every take-over happened within ``lease_s + probe_interval_s`` (+ ``slack_s``) of the last
  successful write that renewed (or created) the lease taken over;
* storage applied every window's batch (dedupe by batch id: a redone window is a duplicate).
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from giaannd import protocol as p
from giaannd.client.errors import RemoteRegisterConflict
from giaannd.client.registers import ABSENT, CasRound, ReadRound, Version
from giaannd.compute.cluster_jobs.lease_events import (
    Begin,
    CasDone,
    CasRow,
    DropWindow,
    Finished,
    LeaseSettings,
    OpFailed,
    ReadRow,
    RowRead,
    RunWindow,
    SetTimer,
    Tick,
    WindowWritten,
)
from giaannd.compute.cluster_jobs.lease_table import INDEX_KEY, JobRow, Shard, decode_index, decode_shard
from giaannd.compute.cluster_jobs.leases import LeaseAgent
from giaannd.storage.engine.register_store import RegisterState, accept, prepare
from peers.placement import Member, Placement

__all__ = ["LeaseSim", "SimNet"]


@dataclass
class SimNet:
    loss: float = 0.0
    delay_s: float = 0.0003
    jitter_s: float = 0.0004
    fsync_s: float = 0.0005  # a register change or a batch is durable this long after it arrives
    request_timeout_s: float = 0.05
    write_quorum: int = 2


@dataclass
class _Storage:
    name: str
    up: bool = True
    registers: dict[str, RegisterState] = field(default_factory=dict)
    applied: dict[tuple[int, int, int], int] = field(default_factory=dict)
    duplicates: int = 0


@dataclass
class _Compute:
    name: str
    epoch: int = 0
    up: bool = True
    frozen_until: float = 0.0
    cut: bool = False
    agents: dict[str, LeaseAgent] = field(default_factory=dict)
    timers: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    windows: dict[tuple[str, int, int], int] = field(default_factory=dict)  # -> run token
    proposer: int = 0


class LeaseSim:
    """One job on ``compute`` + ``storage`` simulated nodes (module docstring)."""

    def __init__(self, *, seed: int, compute: int, storage: int, settings: LeaseSettings,
                 net: SimNet | None = None, replicas: int = 3, work_s: tuple[float, float] = (0.002, 0.004),
                 max_rounds: int = 12) -> None:
        self.rng = random.Random(seed)
        self.net = net or SimNet()
        self.settings = settings
        self.work_s = work_s
        self.max_rounds = max_rounds
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.storage = {f"s{i}": _Storage(f"s{i}") for i in range(storage)}
        self.placement = Placement(tuple(Member(n) for n in self.storage), replicas)
        self._owner_cache: dict[str, tuple[str, ...]] = {}
        # the oracle's history: every value a proposer sent to be accepted (it may take effect even
        # if that proposer's round is lost) and every CAS a proposer was told succeeded
        self.proposed: dict[tuple[str, Version], tuple[float, str, Version, bytes]] = {}
        self.successes: dict[str, list[tuple[float, str, Version, Version]]] = {}
        self.finished: dict[str, Finished] = {}
        self.runs: dict[tuple[int, int], int] = {}
        #: RunWindow actions per node
        self.runs_by: dict[str, int] = {}
        self._released: set[tuple[str, str]] = set()
        #: per compute node, the [start, end) of each fault (killed, frozen, cut off)
        self.faults: dict[str, list[tuple[float, float]]] = {}
        self.messages = 0
        self.cas_rounds = 0
        self.cas_conflicts = 0
        self.compute: dict[str, _Compute] = {}
        for i in range(compute):
            self.add_compute(f"c{i}", follow=False)

    # -- building and faults -----------------------------------------------------------------------
    def add_compute(self, name: str, *, follow: bool = True) -> None:
        """A compute node; with ``follow`` it finds jobs through the index (a node that joins)."""
        node = self.compute.get(name) or _Compute(name)
        node.proposer = self.rng.getrandbits(64)
        self.compute[name] = node
        self.runs_by.setdefault(name, 0)
        if follow:
            self._watch(node)

    def start_job(self, creator: str, job: JobRow) -> None:
        """``giaannctl train start`` on ``creator``; every other node finds the job in the index."""
        self._feed(self.compute[creator], job.job_id, Begin(job))
        for node in self.compute.values():
            if node.name != creator:
                self._watch(node)

    def kill(self, name: str) -> None:
        self._fault(name, float("inf"))
        node = self.compute[name]
        node.up, node.epoch = False, node.epoch + 1
        node.agents.clear()
        node.windows.clear()

    def restart(self, name: str) -> None:
        """The node comes back (same name, nothing in memory) and follows the jobs of the index."""
        node = self.compute[name]
        node.up, node.frozen_until, node.cut = True, 0.0, False
        self.faults[name][-1] = (self.faults[name][-1][0], self.now)
        self.add_compute(name)

    def freeze(self, name: str, duration_s: float) -> None:
        self._fault(name, self.now + duration_s)
        self.compute[name].frozen_until = max(self.compute[name].frozen_until, self.now + duration_s)

    def partition(self, name: str, cut: bool = True) -> None:
        """Cut ``name`` from every storage node (both ways) or heal it."""
        if cut:
            self._fault(name, float("inf"))
        else:
            self.faults[name][-1] = (self.faults[name][-1][0], self.now)
        self.compute[name].cut = cut

    def _fault(self, name: str, until: float) -> None:
        self.faults.setdefault(name, []).append((self.now, until))

    def storage_down(self, name: str, down: bool = True) -> None:
        self.storage[name].up = not down

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._push(t, fn)

    def feed(self, name: str, job_id: str, event: Any) -> None:
        """Hand ``event`` to ``name``'s agent of ``job_id`` now (an operator's cancel, a stop)."""
        self._on(self.compute[name], lambda: self._feed(self.compute[name], job_id, event))

    def register(self, key: str) -> bytes:
        """The value under the highest accepted ballot among the key's owners (the oracle's look)."""
        states = [self.storage[o].registers.get(key, RegisterState()) for o in self._owners(key)]
        return max(states, key=lambda st: st.accepted).value

    def released(self, name: str, job_id: str) -> bool:
        """``name``'s agent of ``job_id`` finished by giving its leases back (``Halt``)."""
        return (name, job_id) in self._released

    # -- running -----------------------------------------------------------------------------------
    def run_until(self, t: float, cond: Callable[[], bool] | None = None) -> bool:
        while self._heap and self._heap[0][0] <= t:
            at, _, fn = heapq.heappop(self._heap)
            self.now = max(self.now, at)
            fn()
            if cond is not None and cond():
                return True
        self.now = max(self.now, t)
        return cond() if cond is not None else False

    def _push(self, at: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, fn))

    def _on(self, node: _Compute, fn: Callable[[], None], at: float | None = None) -> None:
        """Run ``fn`` as ``node`` at ``at``: dropped if it died since, late if it is frozen."""
        epoch = node.epoch

        def run() -> None:
            if not node.up or node.epoch != epoch:
                return
            if node.frozen_until > self.now:
                self._push(node.frozen_until, run)
                return
            fn()

        self._push(self.now if at is None else at, run)

    def _delay(self) -> float:
        return self.net.delay_s + self.rng.random() * self.net.jitter_s

    # -- requests to storage ------------------------------------------------------------------------
    def _request(self, node: _Compute, dst: str, msg: Any, done: Callable[[Any], None]) -> None:
        """One request: delivered (or lost), served, answered (or lost); ``done`` gets the reply or
        a TimeoutError at the deadline, once."""
        answered = [False]

        def answer(result: Any) -> None:
            if not answered[0]:
                answered[0] = True
                done(result)

        self._on(node, lambda: answer(TimeoutError("timeout")), self.now + self.net.request_timeout_s)
        self.messages += 1
        if node.cut or self.rng.random() < self.net.loss:
            return
        storage = self.storage[dst]

        def serve() -> None:
            if not storage.up:
                return
            reply, durable = self._serve(storage, msg)
            if node.cut or self.rng.random() < self.net.loss:
                return
            self._on(node, lambda: answer(reply), self.now + durable + self._delay())

        self._push(self.now + self._delay(), serve)

    def _serve(self, storage: _Storage, msg: Any) -> tuple[Any, float]:
        if isinstance(msg, tuple):  # a window's batch: (writer, stage, window)
            if msg in storage.applied:
                storage.duplicates += 1
            else:
                storage.applied[msg] = self.now
            return "ack", self.net.fsync_s
        state = storage.registers.get(msg.key, RegisterState())
        if isinstance(msg, p.RegisterGet):
            return p.RegisterValue(*state.accepted, *state.version, state.value), 0.0
        if isinstance(msg, p.RegisterPrepare):
            got = prepare(state, (msg.round, msg.proposer))
        else:
            got = accept(state, (msg.round, msg.proposer), (msg.version, msg.origin_round, msg.origin_proposer),
                         msg.value)
        if not isinstance(got, RegisterState):
            return RemoteRegisterConflict(storage.name, p.RegisterConflict(*got)), 0.0
        storage.registers[msg.key] = got
        if isinstance(msg, p.RegisterPrepare):
            return p.RegisterValue(*got.accepted, *got.version, got.value), self.net.fsync_s
        return p.RegisterAccepted(), self.net.fsync_s

    def _owners(self, key: str) -> tuple[str, ...]:
        owners = self._owner_cache.get(key)
        if owners is None:
            owners = self._owner_cache[key] = self.placement.owners(p.register_key_id(key))
        return owners

    def _read(self, node: _Compute, key: str, done: Callable[[ReadRound], None]) -> None:
        rnd = ReadRound(key, self._owners(key))
        for dst, msg in rnd.start():
            def reply(result: Any, dst: str = dst) -> None:
                if not rnd.done:
                    rnd.on_reply(dst, result)
                    if rnd.done:
                        done(rnd)
            self._request(node, dst, msg, reply)

    def _cas(self, node: _Compute, key: str, expect: Version | None, value: bytes,
             done: Callable[[CasRound | None], None], attempt: int = 0) -> None:
        """CAS rounds as RegisterClient.cas runs them (new ballot above a conflict, jittered wait)."""
        n = node.rounds.get(key, 0) + 1
        node.rounds[key] = n
        rnd = CasRound(key, self._owners(key), (n, node.proposer), expect, value)
        self.cas_rounds += 1
        epoch = node.epoch

        def fed(dst: str, msg: Any, result: Any) -> None:
            if rnd.done or node.epoch != epoch:
                return
            if isinstance(msg, p.RegisterPrepare):
                for d, m in rnd.on_prepare(dst, result):
                    self._request(node, d, m, lambda r, d=d, m=m: fed(d, m, r))
                if rnd.proposal is not None and rnd.phase == "accept":
                    assert expect is not None
                    self.proposed.setdefault((key, rnd.proposal[0]), (self.now, node.name, expect, value))
            else:
                rnd.on_accept(dst, result)
            if not rnd.done:
                return
            if rnd.retry_above is not None and attempt + 1 < self.max_rounds:
                self.cas_conflicts += 1
                node.rounds[key] = max(node.rounds[key], rnd.retry_above[0])
                wait = self.rng.uniform(0, min(0.1, 0.002 * 2 ** attempt))
                self._on(node, lambda: self._cas(node, key, expect, value, done, attempt + 1), self.now + wait)
            else:
                done(rnd if rnd.outcome is not None else None)

        for dst, msg in rnd.start():
            self._request(node, dst, msg, lambda r, d=dst, m=msg: fed(d, m, r))

    # -- compute nodes -----------------------------------------------------------------------------
    def _watch(self, node: _Compute) -> None:
        """Read the job index every probe interval; follow every job listed."""
        def got(rnd: ReadRound) -> None:
            if rnd.outcome is not None:
                for job_id in decode_index(rnd.outcome.value).jobs:
                    if job_id not in node.agents and job_id not in self.finished:
                        self._feed(node, job_id, Begin())
            self._on(node, lambda: self._watch(node), self.now + self.settings.probe_interval_s)

        self._on(node, lambda: self._read(node, INDEX_KEY, got))

    def _agent(self, node: _Compute, job_id: str) -> LeaseAgent:
        agent = node.agents.get(job_id)
        if agent is None:
            agent = node.agents[job_id] = LeaseAgent(node.name, job_id, self.settings,
                                                     random.Random(f"{node.name}/{node.epoch}"))
        return agent

    def _feed(self, node: _Compute, job_id: str, event: Any) -> None:
        agent = self._agent(node, job_id)
        for action in agent.handle(self.now, event):
            self._act(node, job_id, action)

    def _act(self, node: _Compute, job_id: str, action: Any) -> None:
        if isinstance(action, SetTimer):
            token = node.timers[job_id] = node.timers.get(job_id, 0) + 1

            def tick() -> None:
                if node.timers.get(job_id) == token:
                    self._feed(node, job_id, Tick())

            self._on(node, tick, max(action.at, self.now))
        elif isinstance(action, ReadRow):
            def read_done(rnd: ReadRound, key: str = action.key) -> None:
                out = rnd.outcome
                self._feed(node, job_id, OpFailed(key, rnd.error or "") if out is None
                           else RowRead(key, out.version, out.value))
            self._read(node, action.key, read_done)
        elif isinstance(action, CasRow):
            self._cas(node, action.key, action.expect, action.data,
                      lambda rnd, a=action: self._cas_done(node, job_id, a, rnd))
        elif isinstance(action, RunWindow):
            self._run(node, job_id, action)
        elif isinstance(action, DropWindow):
            node.windows.pop((job_id, action.stage, action.window), None)
        elif isinstance(action, Finished) and action.state == "released":
            self._released.add((node.name, job_id))
        elif isinstance(action, Finished):
            self.finished.setdefault(job_id, action)

    def _cas_done(self, node: _Compute, job_id: str, action: CasRow, rnd: CasRound | None) -> None:
        if rnd is None or rnd.outcome is None:
            self._feed(node, job_id, OpFailed(action.key, "no quorum"))
            return
        out = rnd.outcome
        if out.ok and action.expect is not None:
            self.successes.setdefault(action.key, []).append((self.now, node.name, action.expect, out.version))
        self._feed(node, job_id, CasDone(action.key, out.ok, out.version, out.value))

    def _run(self, node: _Compute, job_id: str, action: RunWindow) -> None:
        """Work, then write the window's batch to its 3 owners until W acks (same id every time)."""
        key = (job_id, action.stage, action.window)
        token = self._seq
        node.windows[key] = token
        self.runs[(action.stage, action.window)] = self.runs.get((action.stage, action.window), 0) + 1
        self.runs_by[node.name] = self.runs_by.get(node.name, 0) + 1
        batch = (action.writer_id, action.stage, action.window)
        owners = self.placement.owners(zlib.crc32(repr(batch).encode()))

        def write(attempt: int) -> None:
            if node.windows.get(key) != token:
                return  # dropped (lease lost)
            acks = [0, 0]

            def reply(result: Any) -> None:
                acks[0 if result == "ack" else 1] += 1
                if acks[0] == self.net.write_quorum and node.windows.get(key) == token:
                    node.windows.pop(key, None)
                    self._feed(node, job_id, WindowWritten(action.stage, action.window))
                elif acks[1] == len(owners) - self.net.write_quorum + 1:  # W can no longer be reached
                    self._on(node, lambda: write(attempt + 1), self.now + 0.01 * (1 + attempt))

            for dst in owners:
                self._request(node, dst, batch, reply)

        self._on(node, lambda: write(0), self.now + self.rng.uniform(*self.work_s))

    # -- the oracle ----------------------------------------------------------------------------------
    def chain(self, key: str) -> list[tuple[float, str, Version, bytes]]:
        """The register's history, oldest first: from the newest success (or the value storage
        holds, when newer: a change whose answer was lost) back through the versions each change
        was made from (values of lost rounds that others built on included). Asserts that every
        success the proposers were told of is on it: no lost update."""
        wins = self.successes.get(key, [])
        if not wins:
            return []
        out: list[tuple[float, str, Version, bytes]] = []
        version = max(w[3] for w in wins)
        held = max((self.storage[o].registers.get(key, RegisterState()) for o in self._owners(key)),
                   key=lambda st: st.accepted).version
        if held[0] > version[0] and (key, held) in self.proposed:
            version = held
        while version != ABSENT:
            t, who, expect, data = self.proposed[(key, version)]
            assert expect[0] == version[0] - 1, f"{key}: {version} made from {expect}"
            out.append((t, who, version, data))
            version = expect
        out.reverse()
        on_chain = {v for _, _, v, _ in out}
        for _, who, expect, version in wins:
            assert version in on_chain and (expect == ABSENT or expect in on_chain), \
                f"{key}: {who}'s CAS {expect} -> {version} is not in the history (a lost update)"
        return out

    def check(self, job: JobRow, slack_s: float) -> dict[str, Any]:
        """The module docstring's checks (AssertionError naming the first one broken); returns figures."""
        takeovers: list[float] = []
        unfair: list[tuple[str, float]] = []  # take-overs from a holder with no fault meanwhile
        done_at: list[float] = []
        for key in self.successes:
            self.chain(key)
        for stage in range(job.stages):
            done_by: dict[int, str] = {}
            for s in range(job.shards):
                key = f"job/{job.job_id}/{stage}/{s}"
                confirmed: dict[int, float] = {}
                old: Shard | None = None
                for t, who, _, data in self.chain(key):
                    new = decode_shard(data)
                    if old is not None:
                        for w in _done(new) - _done(old):
                            assert w not in done_by, f"window {w} of stage {stage} done twice"
                            holder = next(x.node for x in old.leases if x.cursor <= w < x.stop)
                            assert holder == who, f"window {w} completed by {who}, held by {holder}"
                            done_by[w] = who
                            done_at.append(t)
                        for holder, delay in _takeovers(old, new, t, confirmed):
                            takeovers.append(delay)
                            window = (t - delay, t)  # from its last renewal to the take-over
                            if not any(a < window[1] and b > window[0] for a, b in self.faults.get(holder, [])):
                                unfair.append((holder, t))
                    for lease in new.leases:
                        before = old.lease(lease.id) if old is not None else None
                        if before is None or before.beats != lease.beats:
                            confirmed[lease.id] = t
                    old = new
                assert old is not None and old.finished, f"{key} unfinished: {old}"
            assert sorted(done_by) == list(range(job.windows)), f"stage {stage}: windows lost"
        late = [d for d in takeovers if d > self.settings.lease_s + self.settings.probe_interval_s + slack_s]
        assert not late, f"take-overs later than lease + probe interval: {sorted(late)[-5:]}"
        applied = {b[1:] for s in self.storage.values() for b in s.applied if b[0] == job.writer_id}
        assert len(applied) == job.windows * job.stages, "a window's batch never reached storage"
        return {"takeovers": len(takeovers), "unfair_takeovers": len(unfair),
                "takeover_max_s": max(takeovers, default=0.0),
                "takeover_min_s": min(takeovers, default=0.0),
                "redone_windows": sum(1 for n in self.runs.values() if n > 1),
                "duplicates_dropped": sum(s.duplicates for s in self.storage.values()),
                "done_at": sorted(done_at)}


def _done(shard: Shard) -> set[int]:
    """The windows of ``shard`` neither pending nor leased."""
    open_ = set(range(shard.next, shard.stop))
    for a, b in shard.free:
        open_ |= set(range(a, b))
    for lease in shard.leases:
        open_ |= set(range(lease.cursor, lease.stop))
    return set(range(shard.start, shard.stop)) - open_


def _takeovers(old: Shard, new: Shard, t: float, confirmed: dict[int, float]) -> list[tuple[str, float]]:
    """(holder, delay since the last write that renewed the lease) of each take-over from ``old`` to
    ``new``."""
    out = []
    ids = {x.id for x in new.leases}
    for lease in old.leases:
        if lease.id in ids:
            continue
        heir = next((x for x in new.leases if x.runs == lease.runs + 1 and x.stop == lease.stop
                     and x.id not in {y.id for y in old.leases}), None)
        if heir is not None:
            out.append((lease.node, t - confirmed[lease.id]))
    return out
