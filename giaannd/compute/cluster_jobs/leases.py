"""One compute node's part in a cluster training job: when to read, grant, renew, complete and
take over leases (issue 15; the rows and their transitions are lease_table.py).

Theory of operation
-------------------
:class:`LeaseAgent` is a sans-IO core (STYLE.md item 1): ``handle(now, event) -> actions``. The
glue (the compute service, or the simulator in tests/sim/leases.py) runs the actions: register
reads and compare-and-set writes through the storage client (``ReadRow`` / ``CasRow``: every
write names the version it was computed from; a stale one comes back refused *with the current
row*, which is the re-read), windows (``RunWindow`` / ``DropWindow``), one timer (``SetTimer``),
and feeds the outcomes back as events. There is no coordinator: every agent runs the same rules
against the same rows, and the registers' compare-and-set serialises them.

What an agent does each time it is woken (``_plan``), against the rows as it last saw them:

* **job row** ``job/<id>``: read every ``probe_interval_s`` (a cancel is seen within one
  interval), and every ``idle_probe_s`` while the agent holds no lease and every shard of the
  stage has no window left to grant: it waits on a stage end others will write, and a probe
  interval of that wait per stage was most of a short job's overhead (issue 15 item 2). The
  creator writes it (``created``), adds the id to the index, creates the shards (each only if
  absent) and sets ``running``; an agent that sees a job ``created`` for a lease time
  does the same (the creator died half-way; every step is idempotent).
* **its leases**, per shard, in one CAS (one write in flight per row): completions (windows whose
  batches have W acks, contiguous from the lease's cursor), a renewal when ``renew_s`` passed since
  the last write that confirmed the lease, take-overs of expired leases, and a grant of
  ``lease_windows`` pending windows when fewer than ``parallel`` of its windows are left unstarted.
* **expiry** without synchronised clocks (the Kubernetes leader-election rule): a lease held by
  another node is *expired* once this agent has seen the same ``beats`` for ``lease_s`` of its own
  time. It first sees a value no earlier than the write that made it, so the expiry falls after
  the holder's own deadline (the send time of the last write that confirmed the lease + ``lease_s``,
  after which the holder drops the lease's windows: ``DropWindow``), given clocks that run at the
  same rate. The take-over CAS names the version it saw the lease in: if the holder renewed since,
  it is refused and the agent sees the new beats. The holder keeps the windows it had written
  under a lease it dropped so (``_expired``): if a row later still names it holder of that lease
  id (nobody took it over: its renewals were lost, not refused), it adopts the lease and completes
  those windows instead of running them again. Only acknowledged windows are kept; a take-over
  gives a new id, so the record never applies to another node's lease.
* **which rows it watches**: its home shard (``hash(node) mod S``) and the shards it holds leases
  in, each at least every ``probe_interval_s``, and one other unfinished shard in turn per interval
  (two when it has nothing left to run: looking for work). With N nodes each shard is read about
  ``2N / S`` times per interval, so an expired lease is seen by someone within one probe interval
  of its last renewal and taken over **within lease_s + probe_interval_s** of it (plus the CAS round
  trips), which the simulation checks. The work reads cost O(N) reads per interval, not O(N * S).
* **stage end**: a shard seen finished is added to the job row's ``finished`` set; the write that
  completes it moves the stage on (or sets ``done``: lease_table.py ``shard_finished``). The agent
  whose write ended the job (``done``/``failed``/``cancelled``) removes it from the index, and so
  does the one whose write listed it (a cancel made while that write was in flight found nothing
  to unlist).
* **halt** (the node stops): one write per shard completes what is written and releases the rest.
  The agent leaves once no row can still name it: no lease held, no shard request in flight (it
  may be a grant or a take-over) and every shard whose request lost its answer read again.

Unknown outcomes (``OpFailed``: no quorum, a timeout): the agent does not guess. The next write on
that row names the version it had; if the failed write did land, that write is refused with the
current row, where the agent finds, e.g., a lease granted to it that it did not know of: it
**adopts** every lease the row names it as holder (also after a restart under the same name).

Rows this node cannot use: a row that does not decode (``LeaseRowCorrupt``: damaged bytes, or a
newer version's row, e.g. a job state this one does not know) ends this node's part of the job
at once, ``Finished("failed", <key and error>)``, with no write: the node cannot tell what the
row says, so it neither fails the job for the others (a newer node may follow it) nor guesses;
its windows stop and its leases expire. A write the register client rejects (``WriteRejected``:
a shard row grown past the register value cap) can never land: on a shard the agent fails the
job (job row ``failed`` with the error, as a failed window does), on the job row or the index it
ends its part as for a corrupt row (the write that would fail the job is the one rejected).

Why double work is harmless: every run of window ``w`` writes under the batch id
``(writer_id, w + 1)`` (``batch_seq``) with the same bytes, and storage applies a batch id once.
Leases keep nodes from doing the same work; they are not what keeps the counts exact.

Everything that decides what an agent asks for lives in this file. Pure: no I/O, no clock (``now``
is an argument), randomness from an injected ``random.Random``.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from giaannd.client.registers import ABSENT, Version
from giaannd.compute.cluster_jobs.lease_events import (
    Action,
    Begin,
    CancelJob,
    CasDone,
    CasRow,
    DropWindow,
    Event,
    Finished,
    Halt,
    LeaseSettings,
    OpFailed,
    ReadRow,
    RowRead,
    RunWindow,
    SetTimer,
    WindowFailed,
    WindowWritten,
    WriteRejected,
)
from giaannd.compute.cluster_jobs.lease_table import (
    INDEX_KEY,
    JobRow,
    JobState,
    Lease,
    LeaseRefused,
    LeaseRowCorrupt,
    Shard,
    complete,
    decode_index,
    decode_job,
    decode_shard,
    encode_row,
    grant,
    index_add,
    index_remove,
    job_key,
    job_transition,
    new_shard,
    release,
    renew,
    shard_finished,
    shard_key,
    take_over,
)

__all__ = ["LeaseAgent"]

_END_STATES: Final = frozenset({"done", "cancelled", "failed"})




@dataclass
class _View:
    version: Version
    data: bytes
    read_at: float


@dataclass
class _Held:
    key: str
    stage: int
    lease: Lease
    confirmed_at: float  # send time of the last write of ours that renewed or created the lease
    started: set[int] = field(default_factory=set)
    written: dict[int, int] = field(default_factory=dict)  # window -> units (WindowWritten)

    def upto(self) -> int:
        """The end of the written run from the cursor (what ``complete`` may claim)."""
        upto = self.lease.cursor
        while upto in self.written:
            upto += 1
        return upto

    def unstarted(self) -> int:
        return sum(1 for w in range(self.lease.cursor, self.lease.stop) if w not in self.started)

    def running(self) -> int:
        return sum(1 for w in self.started - self.written.keys() if w >= self.lease.cursor)


@dataclass
class _Op:
    sent_at: float
    ends_job: bool = False
    lists_job: bool = False


def _shard_bytes(job: JobRow, stage: int, shard: int) -> bytes:
    return encode_row(new_shard(job, stage, shard))


class LeaseAgent:
    """One node's lease agent for one job (module docstring).

    Args:
        node: this node's name (lease holder names).
        job_id: the job.
        settings: times and sizes.
        rng: randomness (retry jitter).
    """

    def __init__(self, node: str, job_id: str, settings: LeaseSettings, rng: random.Random) -> None:
        self.node, self.job_id, self.settings, self._rng = node, job_id, settings, rng
        self.job: JobRow | None = None
        self._job_key = job_key(job_id)
        self._views: dict[str, _View] = {}
        self._shards: dict[str, Shard] = {}
        #: shard key -> lease id of another node's lease -> (beats, when we first saw those beats)
        self._observed: dict[str, dict[int, tuple[int, float]]] = {}
        self._held: dict[tuple[str, int], _Held] = {}
        #: leases dropped at our own deadline, with what was written under them (module docstring,
        #: "expiry"); forgotten once a row shows the lease gone or not ours
        self._expired: dict[tuple[str, int], _Held] = {}
        self._ops: dict[str, _Op] = {}
        self._retry_at: dict[str, float] = {}
        self._create: JobRow | None = None
        self._created_seen: float | None = None
        self._ended_it = False
        self._listed_it = False
        self._scout = 0
        self._halting = False
        #: shard rows whose last request's answer was lost: a grant or take-over may have landed
        self._unsure: set[str] = set()
        self._ending: tuple[JobState, str] | None = None
        self._drops: list[DropWindow] = []
        self.finished: Finished | None = None
        #: leases this agent got by a grant / by a take-over (counted when a write of ours confirms them)
        self.grants = 0
        self.takeovers = 0
        #: wall-clock unix seconds minus ``now`` (set by the glue): the tallies' timelines are in
        #: wall-clock time so nodes' timelines merge, while ``now`` may be any monotonic clock
        self.wall_offset_s = 0.0

    @property
    def ended_it(self) -> bool:
        """Whether a write of this agent ended the job, or may have (its answer was lost): it took
        the job off the index."""
        return self._ended_it

    # -- entry point ------------------------------------------------------------------------------
    def handle(self, now: float, event: Event) -> list[Action]:
        """Feed one event; returns what to do now (the last action is a ``SetTimer`` unless finished)."""
        if self.finished is not None:
            return []
        out: list[Action] = []
        try:
            leave = self._take(now, event)
            if leave is None:
                self._plan(now, out)
        except LeaseRowCorrupt as exc:  # (module docstring, "Rows this node cannot use")
            out, leave = [], str(exc)
        if leave is not None:
            self._give_up(out, leave)
        return out

    def _take(self, now: float, event: Event) -> str | None:
        """Apply ``event`` to what the agent knows; returns why this node leaves the job at once
        (module docstring, "Rows this node cannot use"), or None."""
        if isinstance(event, Begin):
            self._create = event.create
        elif isinstance(event, RowRead):
            self._ops.pop(event.key, None)
            self._unsure.discard(event.key)
            self._see(now, event.key, event.version, event.data, None)
        elif isinstance(event, CasDone):
            op = self._ops.pop(event.key, None)
            self._unsure.discard(event.key)
            self._ended_it = self._ended_it or (event.ok and op is not None and op.ends_job)
            self._listed_it = self._listed_it or (event.ok and op is not None and op.lists_job)
            self._see(now, event.key, event.version, event.data, op if event.ok else None)
        elif isinstance(event, OpFailed):
            op = self._ops.pop(event.key, None)
            # a write that would end the job and whose outcome is unknown may have ended it: then
            # this agent is the one to unlist it (no other node knows it has to)
            self._ended_it = self._ended_it or (op is not None and op.ends_job)
            self._listed_it = self._listed_it or (op is not None and op.lists_job)
            self._retry_at[event.key] = now + self.settings.retry_s * (0.5 + self._rng.random())
            if event.key not in (self._job_key, INDEX_KEY):
                self._unsure.add(event.key)
        elif isinstance(event, WindowWritten):  # (an ack that crossed our own deadline's drop counts)
            for held in (*self._held.values(), *self._expired.values()):
                if held.stage == event.stage and event.window in held.started:
                    held.written[event.window] = event.units
        elif isinstance(event, WindowFailed):
            self._ending = self._ending or ("failed", f"window {event.window} of stage {event.stage}: {event.error}")
        elif isinstance(event, CancelJob):
            self._ending = self._ending or ("cancelled", event.error)
        elif isinstance(event, Halt):
            self._halting = True
        elif isinstance(event, WriteRejected):
            self._ops.pop(event.key, None)
            error = f"{event.key}: write rejected: {event.error}"
            if event.key in (self._job_key, INDEX_KEY):  # no write of ours can end the job: leave it
                return error
            self._ending = self._ending or ("failed", error)
        return None

    # -- what a row tells us ----------------------------------------------------------------------
    def _see(self, now: float, key: str, version: Version, data: bytes, confirmed: _Op | None) -> None:
        # One request per row is in flight at a time, so answers never cross: the last one is current.
        self._views[key] = _View(version, data, now)
        try:
            if key == self._job_key:
                self.job = decode_job(data) if version[0] else None
                if self.job is not None and self.job.state == "created" and self._created_seen is None:
                    self._created_seen = now
            elif key == INDEX_KEY:
                decode_index(data)  # checked here, where the key is known (``_plan`` decodes it again)
            elif version[0]:
                self._see_shard(now, key, decode_shard(data), confirmed)
        except LeaseRowCorrupt as exc:
            raise LeaseRowCorrupt(f"{key}: {exc}") from None

    def _see_shard(self, now: float, key: str, shard: Shard, confirmed: _Op | None) -> None:
        self._shards[key] = shard
        observed = self._observed.get(key, {})
        fresh: dict[int, tuple[int, float]] = {}
        present = set()
        for lease in shard.leases:
            present.add(lease.id)
            if lease.node != self.node:
                seen = observed.get(lease.id)
                fresh[lease.id] = seen if seen is not None and seen[0] == lease.beats else (lease.beats, now)
                continue
            held = self._held.get((key, lease.id))
            expired = self._expired.pop((key, lease.id), None)
            if held is None and confirmed is not None:  # our grant or take-over (or renewal, expired)
                held = self._held[(key, lease.id)] = _Held(key, shard.stage, lease, confirmed.sent_at)
                if expired is None:
                    self.takeovers, self.grants = self.takeovers + (lease.runs > 1), self.grants + (lease.runs == 1)
            elif held is None:  # granted by a write whose answer we lost, or to an earlier run of this
                # node, or ours past our deadline: when it was last renewed is unknown, so renew it now
                held = self._held[(key, lease.id)] = _Held(key, shard.stage, lease, now - self.settings.renew_s)
            elif confirmed is not None and lease.beats != held.lease.beats:
                held.confirmed_at = max(held.confirmed_at, confirmed.sent_at)
            held.lease = lease
            if expired is not None:  # its acknowledged windows are completed, not run again
                held.written = {w: u for w, u in expired.written.items() if w >= lease.cursor}
                held.started = set(held.written)
        self._observed[key] = fresh
        for k in [k for k in self._expired if k[0] == key]:  # gone, or taken over (a new id)
            del self._expired[k]
        for k in [k for k in self._held if k[0] == key and k[1] not in present]:
            self._lose(k)

    def _lose(self, k: tuple[str, int]) -> _Held:
        """Lease ``k`` is gone (completed, taken over, past our deadline): unwritten windows stop."""
        held = self._held.pop(k)
        for w in sorted(held.started - held.written.keys()):
            if w >= held.lease.cursor:
                self._drops.append(DropWindow(held.stage, w))
        return held

    # -- deciding ---------------------------------------------------------------------------------
    def _plan(self, now: float, out: list[Action]) -> None:
        self._plan_job(now, out)
        job = self.job
        if self.finished is None and job is not None and job.state == "running" and self._ending is None:
            for k in [k for k, h in self._held.items() if now >= h.confirmed_at + self.settings.lease_s]:
                # our own deadline passed with no confirming write: stop its windows, and keep what
                # was written in case the lease is still ours (module docstring, "expiry")
                self._expired[k] = self._lose(k)
            keys = [shard_key(self.job_id, job.stage, s) for s in range(job.shards)]
            if self._halting:
                self._halt(now, out)
            else:
                work_key = self._work_key()
                for key in keys:
                    self._plan_shard(now, out, key, work_key)
                self._plan_reads(now, out, keys)
                self._plan_stage_end(now, out, job, keys)
                self._run_windows(out, job)
        elif self.finished is None and self._halting and self._may_leave(now, out):
            self._finish(out, "released")
        out.extend(self._drops)
        self._drops = []
        if self.finished is None:
            out.append(SetTimer(self._next_wake(now)))

    def _finish(self, out: list[Action], state: str, error: str = "") -> None:
        self.finished = Finished(state, error)
        out.append(self.finished)

    def _give_up(self, out: list[Action], error: str) -> None:
        """End this node's part of the job as ``failed`` without a write (module docstring, "Rows
        this node cannot use"): its windows stop; its leases expire and are taken over."""
        for k in list(self._held):
            self._lose(k)
        out.extend(self._drops)
        self._drops = []
        self._finish(out, "failed", error)

    def _plan_job(self, now: float, out: list[Action]) -> None:
        key, create = self._job_key, self._create
        view = self._views.get(key)
        if view is not None and now >= view.read_at + self._job_probe_s():
            self._read(now, out, key)
        if view is None or not view.version[0]:
            if create is not None:
                self._write(now, out, key, lambda: encode_row(create))
            elif view is None:
                self._read(now, out, key)  # (an absent row is read again every interval, above)
            return
        job = self.job
        assert job is not None
        if job.state in _END_STATES:
            self._end(now, out, job)
        elif self._ending is not None:
            state, error = self._ending
            self._write(now, out, key, lambda: encode_row(job_transition(job, state, error)), ends_job=True)
        elif job.state == "created" and not self._halting:
            self._finish_creation(now, out, job)

    def _job_probe_s(self) -> float:
        """How often the job row is read (module docstring, "job row")."""
        s, job = self.settings, self.job
        if job is None or job.state != "running" or self._held or self._halting:
            return s.probe_interval_s
        for i in range(job.shards):
            shard = self._shards.get(shard_key(self.job_id, job.stage, i))
            if shard is None or shard.stage != job.stage or shard.pending:
                return s.probe_interval_s
        return min(s.idle_probe_s, s.probe_interval_s)

    def _finish_creation(self, now: float, out: list[Action], job: JobRow) -> None:
        """The creator, or anyone who saw the job ``created`` for a lease time: index, shards, running."""
        mine = self._create is not None and self._create.job_id == job.job_id
        if not mine and (self._created_seen is None or now < self._created_seen + self.settings.lease_s):
            return
        index = self._views.get(INDEX_KEY)
        # anyone finishing the creation lists the job: the creator may have died before it did
        # (then only a node told of the job otherwise follows it: an upload's adopter, a resume)
        if index is None or job.job_id not in decode_index(index.data).jobs:
            try:
                listed = encode_row(index_add(decode_index(index.data if index is not None else b""), job.job_id))
            except LeaseRefused as exc:  # too many unfinished jobs: it cannot be listed; fail it
                error = f"the job could not be listed: {exc}"  # (while it is still ``created``)
                self._write(now, out, self._job_key, lambda: encode_row(job_transition(job, "failed", error)),
                            ends_job=True)
                return
            self._write(now, out, INDEX_KEY, lambda: listed, lists_job=True)
            return
        missing = [(st, s) for st in range(job.stages) for s in range(job.shards)
                   if shard_key(job.job_id, st, s) not in self._shards]
        for st, s in missing:
            self._write(now, out, shard_key(job.job_id, st, s), partial(_shard_bytes, job, st, s), absent=True)
        if not missing:
            self._write(now, out, self._job_key, lambda: encode_row(job_transition(job, "running")))

    def _end(self, now: float, out: list[Action], job: JobRow) -> None:
        """The job is over: stop its windows; the agent whose write ended it takes it off the index,
        and so does one whose write listed it (finishing its creation): a cancel while that write
        was in flight found the job unlisted, and the listing landed after it."""
        for k in list(self._held):
            self._lose(k)
        index = self._views.get(INDEX_KEY)
        if (self._ended_it or self._listed_it) and (index is None or job.job_id in decode_index(index.data).jobs):
            data = index.data if index is not None else b""
            self._write(now, out, INDEX_KEY, lambda: encode_row(index_remove(decode_index(data), job.job_id)))
            return
        self._finish(out, job.state, job.error)

    def _halt(self, now: float, out: list[Action]) -> None:
        """Stopping: one write per shard completes what is written and releases the rest."""
        for key in {h.key for h in self._held.values()}:
            def change(key: str = key) -> bytes:
                shard = self._shards[key]
                for held in [h for h in self._held.values() if h.key == key]:
                    done = complete(shard, self.node, held.lease.id, held.upto(), held.written,
                                    now + self.wall_offset_s)
                    shard = release(done, self.node, held.lease.id) if held.upto() < held.lease.stop else done
                return encode_row(shard)
            self._write(now, out, key, change)
        if self._may_leave(now, out):
            self._finish(out, "released")

    def _may_leave(self, now: float, out: list[Action]) -> bool:
        """Halting: whether no row can still name this node. A shard request in flight may be a
        grant or a take-over, and one whose answer was lost may have landed one: the agent waits
        for the answer, or reads the row (which adopts the lease; ``_halt`` releases it). Leaving
        earlier left a lease no one gave back (its windows waited for its expiry). A job-ending
        write in flight is waited for too: its writer is the one to unlist the job."""
        for key in self._unsure:
            self._read(now, out, key)
        return not self._held and not self._unsure and not any(
            op.ends_job or key not in (self._job_key, INDEX_KEY) for key, op in self._ops.items())

    def _plan_shard(self, now: float, out: list[Action], key: str, work_key: str | None) -> None:
        """At most one write per row, made when a lease is fully written, a renewal is due, a lease
        is to be taken over or windows are wanted; completions of written windows ride along (a
        write per window would cost ``lease_windows`` times more; a crash redoes at most a lease)."""
        shard = self._shards.get(key)
        view = self._views.get(key)
        if shard is None or view is None or key in self._ops or now < self._retry_at.get(key, 0.0):
            return
        mine = [h for h in self._held.values() if h.key == key]
        new = shard
        for held in mine:
            new = complete(new, self.node, held.lease.id, held.upto(), held.written, now + self.wall_offset_s)
        needed = any(h.upto() == h.lease.stop for h in mine)
        if any(now >= h.confirmed_at + self.settings.renew_s for h in mine):
            new, needed = renew(new, self.node, [h.lease.id for h in mine]), True
        if now < view.read_at + self.settings.probe_interval_s:  # take-overs only from a fresh view
            observed = self._observed.get(key, {})
            for lease in shard.leases:
                seen = observed.get(lease.id)
                if lease.node != self.node and seen is not None and now >= seen[1] + self.settings.lease_s:
                    (new, _), needed = take_over(new, self.node, lease.id, seen[0]), True
        if key == work_key and new.pending and self._unstarted() < self.settings.parallel:
            (new, _), needed = grant(new, self.node, self.settings.lease_windows), True
        if needed and new != shard:
            self._ops[key] = _Op(now)
            out.append(CasRow(key, view.version, encode_row(new)))

    def _plan_stage_end(self, now: float, out: list[Action], job: JobRow, keys: list[str]) -> None:
        """Add the shards we saw finished to the job row's set (the last one ends the stage)."""
        seen = [s for s, key in enumerate(keys) if key in self._shards and self._shards[key].finished
                and s not in job.finished]
        if not seen:
            return

        def change() -> bytes:
            row = job
            for s in seen:
                row = shard_finished(row, job.stage, s)
            return encode_row(row)

        last = len(job.finished) + len(seen) == job.shards and job.stage + 1 >= job.stages
        self._write(now, out, self._job_key, change, ends_job=last)

    def _unstarted(self) -> int:
        return sum(h.unstarted() for h in self._held.values())

    def _home(self, count: int) -> int:
        return zlib.crc32(self.node.encode()) % count

    def _work_key(self) -> str | None:
        """Where to ask for windows: the home shard, else the next watched one with windows pending."""
        job = self.job
        if job is None:
            return None
        keys = [shard_key(self.job_id, job.stage, s) for s in range(job.shards)]
        home = self._home(len(keys))
        for key in keys[home:] + keys[:home]:
            shard = self._shards.get(key)
            if shard is not None and shard.pending:
                return key
        return None

    def _plan_reads(self, now: float, out: list[Action], keys: list[str]) -> None:
        """Watch rows (module docstring): the home shard and our lease shards every interval, a
        shard whose lease looks expired in a view older than an interval (take-overs need a fresh
        view), and other unfinished shards in turn: one per interval, two when we have nothing
        left to start (looking for work)."""
        probe, lease_s = self.settings.probe_interval_s, self.settings.lease_s
        job = self.job
        done = set(job.finished) if job is not None else set()
        unfinished = [k for s, k in enumerate(keys)
                      if s not in done and not (k in self._shards and self._shards[k].finished)]
        watched = {keys[self._home(len(keys))]} | {h.key for h in self._held.values()}
        for key in unfinished:
            view = self._views.get(key)
            if view is None or now >= view.read_at + probe:
                expiring = any(now >= seen + lease_s for _, seen in self._observed.get(key, {}).values())
                if key in watched or expiring and view is not None:
                    self._read(now, out, key)
        # the rotation is over the *other* shards: a watched one (read above every interval) in it
        # was always fresh or in flight, so the scout stopped there and never reached the rest
        others = [k for k in unfinished if k not in watched]
        scouts = 2 if self._unstarted() == 0 else 1
        for _ in range(min(scouts, len(others))):
            key = others[self._scout % len(others)]
            view = self._views.get(key)
            if key in self._ops or view is not None and now < view.read_at + probe:
                return
            self._scout += 1
            self._read(now, out, key)

    def _run_windows(self, out: list[Action], job: JobRow) -> None:
        running = sum(h.running() for h in self._held.values())
        for held in sorted(self._held.values(), key=lambda h: (h.lease.runs == 1, h.key, h.lease.cursor)):
            for w in range(held.lease.cursor, held.lease.stop):
                if running >= self.settings.parallel:
                    return
                if w not in held.started:
                    held.started.add(w)
                    running += 1
                    out.append(RunWindow(held.stage, w, job.writer_id))

    # -- requests ---------------------------------------------------------------------------------
    def _read(self, now: float, out: list[Action], key: str) -> None:
        if key not in self._ops and now >= self._retry_at.get(key, 0.0):
            self._ops[key] = _Op(now)
            out.append(ReadRow(key))

    def _write(self, now: float, out: list[Action], key: str, change: Callable[[], bytes], *,
               ends_job: bool = False, lists_job: bool = False, absent: bool = False) -> None:
        """CAS ``change()`` onto the version of ``key`` we saw (``absent``: create only if absent). A
        change the rows refuse (``LeaseRefused``) or that changes nothing is not sent."""
        view = self._views.get(key)
        if key in self._ops or now < self._retry_at.get(key, 0.0):
            return
        try:
            data = change()
        except LeaseRefused:
            return
        if view is not None and view.version[0] and data == view.data:
            return
        self._ops[key] = _Op(now, ends_job, lists_job)
        out.append(CasRow(key, ABSENT if absent or view is None else view.version, data))

    def _next_wake(self, now: float) -> float:
        s = self.settings
        job_probe = self._job_probe_s()
        times = [v.read_at + (job_probe if k == self._job_key else s.probe_interval_s)
                 for k, v in self._views.items() if not (k in self._shards and self._shards[k].finished)]
        times += [h.confirmed_at + s.renew_s for h in self._held.values()]
        times += [h.confirmed_at + s.lease_s for h in self._held.values()]
        times += [seen + s.lease_s for leases in self._observed.values() for _, seen in leases.values()]
        times += list(self._retry_at.values())
        if self._created_seen is not None:
            times.append(self._created_seen + s.lease_s)
        future = [t for t in times if t > now]
        return min(future) if future else now + s.probe_interval_s
