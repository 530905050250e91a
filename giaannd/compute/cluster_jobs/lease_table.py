"""The rows of a cluster training job and the pure transitions on them (issue 15, docs/compute.md
"One job across every compute node").

Theory of operation
-------------------
A cluster job lives in the storage cluster's replicated registers (small versioned rows with
compare-and-set, ``giaannd.client.registers``), never on one node's disk. Three kinds of rows:

* the **job index** ``jobs``: the ids of jobs not yet finished (how a node that joins finds them);
* the **job row** ``job/<id>``: :class:`JobRow` (spec, writer id, stage, state);
* the **lease shards** ``job/<id>/<stage>/<shard>``: :class:`Shard`, the lease table of a
  contiguous range of windows. A job of N windows has S shards per stage (S a little below the
  compute node count over a few: every CAS on one shard is serialised, so more shards, more grants
  per second; ``shard_range``).

**Windows.** Window ``w`` of a stage is in exactly one of three states, read off its shard::

    pending --grant/take over--> leased(lease id, node) --complete--> done
       ^                              |
       +---------- release -----------+        (take over: leased(a) -> leased(b), same windows)

``pending`` = ``[next, stop)`` plus the ``free`` ranges (windows given back by ``release``);
``leased`` = ``[cursor, stop)`` of one :class:`Lease`; ``done`` is a count (the windows of the shard
that are neither). A lease holds a contiguous range; its holder completes windows in order
(``cursor`` moves), renews it (``beats`` + 1, also on every completion) and may release it. Anyone
may **take over** a lease whose ``beats`` it has seen unchanged for the lease time: the same
windows get a new lease id and holder (``runs`` + 1). Every transition names the lease id and the
holder, so a lease that was taken over cannot be completed, renewed or released by its old holder.

**Job.** ``created -> running -> done``, and ``created|running -> cancelled|failed``
(``JOB_TRANSITIONS``; the three end states are final). ``created`` exists because creating a job is
several CAS writes (job row, shard rows, index): whoever finds a job ``created`` for a lease time
finishes the creation, which is idempotent (a shard row is created only if absent). Stages run one
after the other (stage ``k + 1`` of any window starts when every window of stage ``k`` is done):
whoever sees a shard of the current stage finished adds it to the job row's ``finished`` set
(``shard_finished``: idempotent, so no node needs to read every shard to see the stage end), and
the write that completes the set also moves ``stage`` on or, after the last stage, sets ``done``.

Rows are msgpack maps tagged with their kind (``type``: ``job``, ``shard``, ``index``), so a row
of one kind never decodes as another; unknown fields are ignored (a newer node may add some, last
and with defaults, as for wire messages).

**Invariants** (``check_shard``, asserted by the tests and the simulation on every row written):

1. the pending ranges, the leases' ranges and the done count partition the shard's windows;
2. lease ids are unique and below ``issued`` (an id is never reused: a late message naming an old
   lease can never match a new one);
3. ``done`` only grows, and only ``complete`` by the current holder grows it, by the windows it
   moves the cursor over: each window is counted done exactly once, by one lease.

What the data needs is not in these rows: every run of window ``w`` writes its delta under the batch
id ``(writer_id, w + 1)`` with the same bytes (docs/compute.md, "Exact results"), so storage applies
it once whoever runs it and however many times. The leases decide who *works*; the batch ids make
double work harmless.

Everything that decides a row transition lives in this file; ``leases.py`` decides *when* a node
asks for one. Pure: no I/O, no clock (times are arguments), no logging.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal, TypeVar

import msgspec

from giaannd.compute.timeline import MAX_REGISTER_TIMELINE_POINTS, TIMELINE_INTERVAL_S, step_points
from giaannd.errors import CorruptDataError, Refused

__all__ = [
    "INDEX_KEY",
    "JOB_TRANSITIONS",
    "JobIndex",
    "JobRow",
    "JobState",
    "Lease",
    "LeaseRefused",
    "LeaseRowCorrupt",
    "MAX_SHARD_TALLIES",
    "OTHERS",
    "Shard",
    "Tally",
    "check_shard",
    "complete",
    "decode_index",
    "decode_job",
    "decode_shard",
    "encode_row",
    "grant",
    "index_add",
    "index_remove",
    "job_key",
    "job_transition",
    "new_shard",
    "release",
    "renew",
    "shard_finished",
    "shard_key",
    "shard_range",
    "take_over",
]

JobState = Literal["created", "running", "done", "cancelled", "failed"]

#: Allowed job transitions (module docstring). End states have none.
JOB_TRANSITIONS: Final[dict[str, frozenset[str]]] = {
    "created": frozenset({"running", "cancelled", "failed"}),
    "running": frozenset({"done", "cancelled", "failed"}),
    "done": frozenset(),
    "cancelled": frozenset(),
    "failed": frozenset(),
}
#: The register holding the ids of unfinished jobs.
INDEX_KEY: Final = "jobs"
#: Unfinished jobs the index holds: each costs a few dozen bytes, and a node follows every one.
MAX_ACTIVE_JOBS: Final = 64
#: Tallies a shard row keeps (``_bounded``). A tally with a full timeline is ~1.3 KB (64 points of
#: ~20 bytes, and the node's name), so without a bound ~200-300 node names that ever completed a
#: window in one shard (a node restarted under a new name counts again) outgrew the register value
#: cap (``protocol.MAX_REGISTER_VALUE_BYTES``, 256 KiB) and the job failed. 128 tallies stay under
#: ~180 KB with names of 60 characters, leaving the rest for the leases and ``free`` ranges.
MAX_SHARD_TALLIES: Final = 128
#: The tally into which those of nodes holding no lease in the shard are folded past
#: ``MAX_SHARD_TALLIES`` (``by_node``'s entry for them). A node of that very name would share it:
#: harmless, the counts stay exact.
OTHERS: Final = "(other nodes)"


class LeaseRefused(Refused):
    """The transition does not apply to this row (not the holder, nothing pending...): nothing changed.
    ``code`` is a stable token (``not_holder``, ``none_pending``, ``renewed``, ``bad_range``,
    ``job_state``, ``too_many_jobs``)."""

    reason = "lease_refused"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class LeaseRowCorrupt(CorruptDataError):
    """A register holds bytes that are not a row of this kind (foreign or damaged data)."""

    reason = "corrupt_lease_row"


class JobRow(msgspec.Struct, frozen=True, kw_only=True, tag="job"):
    """``job/<id>``. ``spec`` is the glue's (corpus chunks, K, ...), opaque to the lease protocol."""

    job_id: str
    state: JobState = "created"
    windows: int
    shards: int
    stages: int = 1
    stage: int = 0
    writer_id: int
    spec: bytes = b""
    created_by: str = ""
    error: str = ""
    #: shards of the current stage seen finished (``shard_finished``); emptied when the stage moves on
    finished: tuple[int, ...] = ()


class Lease(msgspec.Struct, frozen=True, array_like=True):
    """Windows ``[cursor, stop)`` held by ``node`` (lease ``id`` of its shard)."""

    id: int
    node: str
    cursor: int
    stop: int
    beats: int = 0
    runs: int = 1


class Tally(msgspec.Struct, frozen=True, array_like=True):
    """What one node did in a shard (``GET /v1/jobs/{id}``'s ``by_node``): windows it completed
    (``tail``: the shard's last window among them, which may be shorter), leases taken over from
    it (``lost``: it let them expire) and leases it took over (``won``)."""

    node: str
    windows: int = 0
    tail: bool = False
    lost: int = 0
    won: int = 0
    #: what its completed windows counted (``complete``'s ``units``: sentences trained)
    units: int = 0
    #: ``(t, windows, units)`` after its completions, t in wall-clock unix seconds (timeline.py
    #: ``step_points``: bounded, the last point is always the totals above; added last, with a
    #: default, so rows written before it decode, and nodes before it ignore it)
    timeline: tuple[tuple[float, int, int], ...] = ()
    #: the timeline's sampling interval (doubles each time it is halved)
    every_s: float = TIMELINE_INTERVAL_S


class Shard(msgspec.Struct, frozen=True, kw_only=True, tag="shard"):
    """``job/<id>/<stage>/<shard>``: the lease table of windows ``[start, stop)``."""

    job_id: str
    stage: int
    shard: int
    start: int
    stop: int
    next: int
    free: tuple[tuple[int, int], ...] = ()
    leases: tuple[Lease, ...] = ()
    done: int = 0
    issued: int = 0
    #: per node, sorted by name (at most ``MAX_SHARD_TALLIES``: past it, nodes holding no lease
    #: here are folded into ``OTHERS``; added last, with a default, so rows written before it decode)
    tallies: tuple[Tally, ...] = ()

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def finished(self) -> bool:
        return self.done == self.size

    @property
    def pending(self) -> int:
        return (self.stop - self.next) + sum(b - a for a, b in self.free)

    def lease(self, lease_id: int) -> Lease | None:
        for lease in self.leases:
            if lease.id == lease_id:
                return lease
        return None

    def held_by(self, node: str) -> list[Lease]:
        return [lease for lease in self.leases if lease.node == node]


class JobIndex(msgspec.Struct, frozen=True, tag="index"):
    """``jobs``: unfinished job ids, oldest first."""

    jobs: tuple[str, ...] = ()


# -- keys and encoding ----------------------------------------------------------------------------
def job_key(job_id: str) -> str:
    return f"job/{job_id}"


def shard_key(job_id: str, stage: int, shard: int) -> str:
    return f"job/{job_id}/{stage}/{shard}"


_T = TypeVar("_T")
_ENCODER: Final = msgspec.msgpack.Encoder()
_JOB: Final = msgspec.msgpack.Decoder(JobRow)
_SHARD: Final = msgspec.msgpack.Decoder(Shard)
_INDEX: Final = msgspec.msgpack.Decoder(JobIndex)


def encode_row(row: JobRow | Shard | JobIndex) -> bytes:
    return _ENCODER.encode(row)


def _decode(decoder: msgspec.msgpack.Decoder[_T], data: bytes, what: str) -> _T:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LeaseRowCorrupt(f"register does not hold a {what}: {exc}") from None


def decode_job(data: bytes) -> JobRow:
    """Raises: LeaseRowCorrupt."""
    return _decode(_JOB, data, "job row")


def decode_shard(data: bytes) -> Shard:
    """Raises: LeaseRowCorrupt (also for a row that breaks the invariants)."""
    shard = _decode(_SHARD, data, "lease shard")
    try:
        check_shard(shard)
    except ValueError as exc:
        raise LeaseRowCorrupt(f"lease shard breaks its invariants: {exc}") from None
    return shard


def decode_index(data: bytes) -> JobIndex:
    """An absent register (empty bytes) is the empty index. Raises: LeaseRowCorrupt."""
    return _decode(_INDEX, data, "job index") if data else JobIndex()


# -- the job row ---------------------------------------------------------------------------------
def shard_range(windows: int, shards: int, shard: int) -> tuple[int, int]:
    """Windows ``[start, stop)`` of ``shard``: an even split, the first ones one window longer."""
    return shard * windows // shards, (shard + 1) * windows // shards


def new_shard(job: JobRow, stage: int, shard: int) -> Shard:
    start, stop = shard_range(job.windows, job.shards, shard)
    return Shard(job_id=job.job_id, stage=stage, shard=shard, start=start, stop=stop, next=start)


def job_transition(job: JobRow, state: JobState, error: str = "") -> JobRow:
    """``job`` moved to ``state`` (``JOB_TRANSITIONS``); the same row if it is there already.

    Raises:
        LeaseRefused: ``job_state``, a transition the table does not allow.
    """
    if job.state == state:
        return job
    if state not in JOB_TRANSITIONS[job.state]:
        raise LeaseRefused("job_state", f"job {job.job_id} is {job.state}, cannot become {state}")
    return msgspec.structs.replace(job, state=state, error=error or job.error)


def shard_finished(job: JobRow, stage: int, shard: int) -> JobRow:
    """Shard ``shard`` of ``stage`` is finished; the write that completes the stage's set moves the
    job to the next stage, or ``done`` after the last (module docstring). Idempotent: a shard
    already counted, or a stage already past, returns ``job`` as is.

    Raises:
        LeaseRefused: ``job_state``, the job is not running.
    """
    if job.stage != stage or shard in job.finished or job.state == "done":
        return job
    if job.state != "running":
        raise LeaseRefused("job_state", f"job {job.job_id} is {job.state}")
    finished = tuple(sorted((*job.finished, shard)))
    if len(finished) < job.shards:
        return msgspec.structs.replace(job, finished=finished)
    if stage + 1 < job.stages:
        return msgspec.structs.replace(job, stage=stage + 1, finished=())
    return msgspec.structs.replace(job, state="done", finished=())


def index_add(index: JobIndex, job_id: str) -> JobIndex:
    """Raises: LeaseRefused ``too_many_jobs`` (``MAX_ACTIVE_JOBS``)."""
    if job_id in index.jobs:
        return index
    if len(index.jobs) >= MAX_ACTIVE_JOBS:
        raise LeaseRefused("too_many_jobs", f"{len(index.jobs)} unfinished jobs (the limit is {MAX_ACTIVE_JOBS})")
    return JobIndex((*index.jobs, job_id))


def index_remove(index: JobIndex, job_id: str) -> JobIndex:
    return JobIndex(tuple(j for j in index.jobs if j != job_id)) if job_id in index.jobs else index


# -- lease transitions ---------------------------------------------------------------------------
def _holder(shard: Shard, node: str, lease_id: int) -> Lease:
    lease = shard.lease(lease_id)
    if lease is None or lease.node != node:
        raise LeaseRefused("not_holder", f"{node} does not hold lease {lease_id} of shard {shard.shard}")
    return lease


def _tallied(shard: Shard, node: str, *, windows: int = 0, tail: bool = False, lost: int = 0,
             won: int = 0, units: int = 0, at: float | None = None) -> tuple[Tally, ...]:
    """``shard``'s tallies with ``node``'s counts increased (and, ``at`` a wall-clock time, a
    point of its timeline)."""
    old = next((t for t in shard.tallies if t.node == node), Tally(node))
    timeline, every_s = old.timeline, old.every_s
    if at is not None:
        timeline, every_s = step_points(timeline, every_s, (at, old.windows + windows, old.units + units))
    new = Tally(node, old.windows + windows, old.tail or tail, old.lost + lost, old.won + won, old.units + units,
                timeline, every_s)
    return _bounded(shard, node, (*(t for t in shard.tallies if t.node != node), new))


def _bounded(shard: Shard, node: str, tallies: tuple[Tally, ...]) -> tuple[Tally, ...]:
    """``tallies`` sorted by name, at most ``MAX_SHARD_TALLIES``: past it, those of the nodes that
    hold no lease in ``shard`` (``node``'s, being counted now, is kept), fewest windows first, are
    folded into ``OTHERS``. The counts stay exact (the job document sums them; the job's last
    window is in at most one tally, so ``tail`` is kept by or-ing), only who did what is lost for
    the folded nodes; a folded node that completes windows again gets a tally of its own again."""
    if len(tallies) > MAX_SHARD_TALLIES:
        holders = {lease.node for lease in shard.leases} | {node, OTHERS}
        movable = sorted((t for t in tallies if t.node not in holders), key=lambda t: (t.windows, t.node))
        # one more leaves room for OTHERS itself when it is not there yet
        excess = len(tallies) - MAX_SHARD_TALLIES + (not any(t.node == OTHERS for t in tallies))
        folded = movable[:excess]
        if folded:
            names = {t.node for t in folded}
            others = next((t for t in tallies if t.node == OTHERS), Tally(OTHERS))
            for t in folded:
                others = _fold(others, t)
            tallies = (*(t for t in tallies if t.node not in names and t.node != OTHERS), others)
    return tuple(sorted(tallies, key=lambda t: t.node))


def _fold(into: Tally, t: Tally) -> Tally:
    """``into`` with ``t``'s counts added; its timeline the sum of both (each cumulative value
    carried forward between its own points, as the job document's ``merge_timelines``), halved
    from the newest point down to ``MAX_REGISTER_TIMELINE_POINTS``: its last point is the totals.
    Its interval is the larger one, not doubled: no completion samples ``OTHERS``, and doubling
    at every fold would grow it without bound."""
    points: list[tuple[float, int, int]] = []
    a, b = into.timeline, t.timeline
    i = j = 0
    for at in sorted({p[0] for p in a} | {p[0] for p in b}):
        while i < len(a) and a[i][0] <= at:
            i += 1
        while j < len(b) and b[j][0] <= at:
            j += 1
        pa, pb = a[i - 1] if i else (at, 0, 0), b[j - 1] if j else (at, 0, 0)
        points.append((at, pa[1] + pb[1], pa[2] + pb[2]))
    while len(points) > MAX_REGISTER_TIMELINE_POINTS:
        points = points[(len(points) - 1) % 2::2]
    return Tally(into.node, into.windows + t.windows, into.tail or t.tail, into.lost + t.lost, into.won + t.won,
                 into.units + t.units, tuple(points), max(into.every_s, t.every_s))


def _replace_lease(shard: Shard, old: Lease, new: Lease | None) -> tuple[Lease, ...]:
    return tuple(x for x in (new if lease.id == old.id else lease for lease in shard.leases) if x is not None)


def grant(shard: Shard, node: str, want: int) -> tuple[Shard, Lease]:
    """A new lease on up to ``want`` pending windows for ``node``: given-back windows first, then
    the never-leased ones.

    Raises:
        LeaseRefused: ``none_pending``.
    """
    if want < 1:
        raise ValueError("want must be >= 1")
    if shard.free:
        a, b = shard.free[0]
        stop = min(b, a + want)
        free = ((stop, b), *shard.free[1:]) if stop < b else shard.free[1:]
        lease = Lease(shard.issued, node, a, stop)
        return msgspec.structs.replace(shard, free=free, leases=(*shard.leases, lease),
                                       issued=shard.issued + 1), lease
    if shard.next >= shard.stop:
        raise LeaseRefused("none_pending", f"shard {shard.shard} has no pending window")
    stop = min(shard.stop, shard.next + want)
    lease = Lease(shard.issued, node, shard.next, stop)
    return msgspec.structs.replace(shard, next=stop, leases=(*shard.leases, lease), issued=shard.issued + 1), lease


def renew(shard: Shard, node: str, lease_ids: Iterable[int]) -> Shard:
    """``beats`` + 1 on each lease of ``lease_ids`` that ``node`` still holds (the others are gone:
    taken over or never granted; the caller sees which in the row it gets back)."""
    ids = set(lease_ids)
    leases = tuple(msgspec.structs.replace(x, beats=x.beats + 1) if x.id in ids and x.node == node else x
                   for x in shard.leases)
    return msgspec.structs.replace(shard, leases=leases)


def complete(shard: Shard, node: str, lease_id: int, upto: int, units: Mapping[int, int] | None = None,
             at: float | None = None) -> Shard:
    """Windows ``[cursor, upto)`` of ``node``'s lease are done (their batches have W acks); counts
    as a renewal too. Idempotent: ``upto <= cursor`` changes nothing. ``units`` (window -> count)
    of those windows are added to ``node``'s tally, and with ``at`` (wall-clock unix seconds) a
    point to its timeline.

    Raises:
        LeaseRefused: ``not_holder`` (taken over, released, never granted), ``bad_range``.
    """
    lease = _holder(shard, node, lease_id)
    if upto <= lease.cursor:
        return shard
    if upto > lease.stop:
        raise LeaseRefused("bad_range", f"lease {lease_id} ends at {lease.stop}, not {upto}")
    new = None if upto == lease.stop else msgspec.structs.replace(lease, cursor=upto, beats=lease.beats + 1)
    return msgspec.structs.replace(shard, leases=_replace_lease(shard, lease, new),
                                   done=shard.done + (upto - lease.cursor),
                                   tallies=_tallied(shard, node, windows=upto - lease.cursor,
                                                    tail=upto == shard.stop,
                                                    units=sum((units or {}).get(w, 0)
                                                              for w in range(lease.cursor, upto)), at=at))


def take_over(shard: Shard, node: str, lease_id: int, beats: int) -> tuple[Shard, Lease]:
    """``node`` takes the windows left in lease ``lease_id``, which the caller saw with ``beats``
    for at least the lease time (leases.py decides when). A new lease id; ``runs`` + 1.

    Raises:
        LeaseRefused: ``renewed`` (gone, or renewed since it was seen).
    """
    old = shard.lease(lease_id)
    if old is None or old.beats != beats:
        raise LeaseRefused("renewed", f"lease {lease_id} of shard {shard.shard} is gone or was renewed")
    new = Lease(shard.issued, node, old.cursor, old.stop, 0, old.runs + 1)
    lost = msgspec.structs.replace(shard, tallies=_tallied(shard, old.node, lost=1))
    return msgspec.structs.replace(lost, leases=_replace_lease(shard, old, new), issued=shard.issued + 1,
                                   tallies=_tallied(lost, node, won=1)), new


def release(shard: Shard, node: str, lease_id: int) -> Shard:
    """``node`` gives the windows left in its lease back (pending again; a node stopping).

    Raises:
        LeaseRefused: ``not_holder``.
    """
    lease = _holder(shard, node, lease_id)
    free = _merge((*shard.free, (lease.cursor, lease.stop)))
    return msgspec.structs.replace(shard, free=free, leases=_replace_lease(shard, lease, None))


def _merge(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def check_shard(shard: Shard) -> None:
    """The invariants of the module docstring (1, 2).

    Raises:
        ValueError: naming the first one broken.
    """
    if not shard.start <= shard.next <= shard.stop:
        raise ValueError(f"next {shard.next} outside [{shard.start}, {shard.stop}]")
    ranges = [(shard.next, shard.stop), *shard.free, *((x.cursor, x.stop) for x in shard.leases)]
    if any(a > b or a < shard.start or b > shard.stop for a, b in ranges):
        raise ValueError("a range lies outside the shard or is reversed")
    if any(x.cursor >= x.stop for x in shard.leases):
        raise ValueError("a lease holds no window")
    ordered = sorted(r for r in ranges if r[0] < r[1])
    if any(b > c for (_, b), (c, _) in zip(ordered, ordered[1:])):
        raise ValueError("pending and leased ranges overlap")
    if sum(b - a for a, b in ordered) + shard.done != shard.size:
        raise ValueError(f"pending + leased + done ({shard.done}) != {shard.size} windows")
    ids = [x.id for x in shard.leases]
    if len(set(ids)) != len(ids) or any(i < 0 or i >= shard.issued for i in ids):
        raise ValueError("lease ids repeat or were never issued")
