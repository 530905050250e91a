"""giaannd.compute.cluster_jobs.leases: the lease agent as a sans-IO core, fed events by hand (no clock, no I/O)."""

import random

import msgspec

from giaannd.client.registers import ABSENT
from giaannd.compute.cluster_jobs.lease_events import (
    Begin,
    CancelJob,
    CasDone,
    CasRow,
    DropWindow,
    Finished,
    Halt,
    LeaseSettings,
    OpFailed,
    ReadRow,
    RowRead,
    RunWindow,
    SetTimer,
    Tick,
    WindowFailed,
    WindowWritten,
    batch_seq,
)
from giaannd.compute.cluster_jobs.lease_table import (
    INDEX_KEY,
    JobIndex,
    JobRow,
    Lease,
    decode_index,
    decode_job,
    decode_shard,
    encode_row,
    grant,
    job_key,
    new_shard,
    shard_key,
)
from giaannd.compute.cluster_jobs.leases import LeaseAgent

S = LeaseSettings(lease_s=10.0, renew_s=3.0, probe_interval_s=1.0, lease_windows=4, parallel=2, retry_s=0.1)
JOB = JobRow(job_id="j", windows=8, shards=1, writer_id=9, state="running")
SK = shard_key("j", 0, 0)


def v(n):
    return (n, n, 1)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def agent(node="n1"):
    return LeaseAgent(node, "j", S, random.Random(0))


def running(a, now=0.0, shard=None):
    """Feed the job row (running) and the shard row; returns the actions of the last event."""
    a.handle(now, Begin())
    a.handle(now, RowRead(job_key("j"), v(3), encode_row(JOB)))
    return a.handle(now, RowRead(SK, v(1), encode_row(shard or new_shard(JOB, 0, 0))))


def test_agent_reads_the_job_then_asks_for_windows_and_runs_them():
    a = agent()
    out = a.handle(0.0, Begin())
    assert of(out, ReadRow) == [ReadRow(job_key("j"))] and isinstance(out[-1], SetTimer)
    out = a.handle(0.0, RowRead(job_key("j"), v(3), encode_row(JOB)))
    assert ReadRow(SK) in out  # its home shard
    out = a.handle(0.0, RowRead(SK, v(1), encode_row(new_shard(JOB, 0, 0))))
    (cas,) = of(out, CasRow)
    assert cas.key == SK and cas.expect == v(1)
    wanted = decode_shard(cas.data)
    assert wanted.leases == (Lease(0, "n1", 0, 4),)
    out = a.handle(0.01, CasDone(SK, True, v(2), cas.data))
    assert of(out, RunWindow) == [RunWindow(0, 0, 9), RunWindow(0, 1, 9)]  # parallel = 2
    assert a.grants == 1 and batch_seq(0) == 1


def test_agent_completes_written_windows_when_it_writes_anyway():
    a = agent()
    out = running(a)
    (cas,) = of(out, CasRow)
    a.handle(0.0, CasDone(SK, True, v(2), cas.data))  # lease [0, 4); windows 0 and 1 run
    first = a.handle(0.1, WindowWritten(0, 0))
    assert not of(first, CasRow)  # one window written: no write for it alone (it rides along later)
    out = a.handle(0.2, WindowWritten(0, 1))
    assert of(first + out, RunWindow) == [RunWindow(0, 2, 9), RunWindow(0, 3, 9)]  # 2 at a time
    (cas,) = of(out, CasRow)  # nothing left unstarted: a grant, carrying the two completions
    row = decode_shard(cas.data)
    assert row.done == 2 and [(x.node, x.cursor, x.stop) for x in row.leases] == [("n1", 2, 4), ("n1", 4, 8)]
    a.handle(0.3, CasDone(SK, True, v(3), cas.data))
    a.handle(0.4, WindowWritten(0, 2))
    out = a.handle(0.5, WindowWritten(0, 3))
    (cas,) = of(out, CasRow)  # the first lease is fully written: completed, removed
    row = decode_shard(cas.data)
    assert row.done == 4 and [(x.cursor, x.stop) for x in row.leases] == [(4, 8)]


def test_agent_refused_write_retries_from_the_row_it_gets_back():
    a = agent()
    running(a)
    other, _ = grant(new_shard(JOB, 0, 0), "n2", 4)  # someone else was faster
    out = a.handle(0.01, CasDone(SK, False, v(2), encode_row(other)))
    (cas,) = of(out, CasRow)
    assert cas.expect == v(2) and [x.node for x in decode_shard(cas.data).leases] == ["n2", "n1"]


def test_agent_adopts_a_lease_granted_by_a_write_whose_answer_it_lost():
    a = agent()
    out = running(a)
    (cas,) = of(out, CasRow)
    out = a.handle(0.05, OpFailed(SK, "timeout"))
    assert not of(out, CasRow)  # waits retry_s before writing that row again
    out = a.handle(0.2, RowRead(SK, v(2), cas.data))  # the write had landed
    assert of(out, RunWindow) == [RunWindow(0, 0, 9), RunWindow(0, 1, 9)]


def test_agent_takes_over_only_after_seeing_the_same_beats_for_the_lease_time():
    a = agent("n1")
    shard, lease = grant(new_shard(JOB, 0, 0), "n2", 8)  # n2 holds everything
    running(a, 0.0, shard)
    for t in (1.0, 5.0, 9.9):
        out = a.handle(t, RowRead(SK, v(2), encode_row(shard)))
        assert not of(out, CasRow)
    out = a.handle(10.0, RowRead(SK, v(2), encode_row(shard)))
    (cas,) = of(out, CasRow)
    (taken,) = decode_shard(cas.data).leases
    assert (taken.node, taken.runs, taken.cursor) == ("n1", 2, 0)
    # a renewal seen in between restarts the clock
    b = agent("n3")
    running(b, 0.0, shard)
    renewed = msgspec.structs.replace(shard, leases=(msgspec.structs.replace(lease, beats=1),))
    b.handle(6.0, RowRead(SK, v(3), encode_row(renewed)))
    assert not of(b.handle(10.5, RowRead(SK, v(3), encode_row(renewed))), CasRow)
    assert of(b.handle(16.0, RowRead(SK, v(3), encode_row(renewed))), CasRow)


def test_agent_drops_its_windows_when_its_own_deadline_passes():
    a = agent()
    out = running(a)
    (cas,) = of(out, CasRow)
    a.handle(0.0, CasDone(SK, True, v(2), cas.data))
    out = a.handle(5.0, Tick())  # renewal due (renew_s = 3)
    assert of(out, CasRow)
    a.handle(5.1, OpFailed(SK, "no quorum"))  # ...and it fails, again and again (partitioned)
    out = a.handle(10.0, Tick())
    assert sorted(of(out, DropWindow), key=lambda d: d.window) == [DropWindow(0, 0), DropWindow(0, 1)]


def test_agent_lease_taken_over_stops_the_old_holder():
    a = agent("n1")
    out = running(a)
    (cas,) = of(out, CasRow)
    mine = decode_shard(cas.data)
    a.handle(0.0, CasDone(SK, True, v(2), cas.data))
    taken = msgspec.structs.replace(mine, leases=(Lease(1, "n2", 0, 4, 0, 2),), issued=2)
    out = a.handle(12.0, RowRead(SK, v(3), encode_row(taken)))
    assert {d.window for d in of(out, DropWindow)} == {0, 1}
    assert not of(a.handle(12.1, WindowWritten(0, 0)), CasRow)  # a late write changes nothing


def test_agent_creates_the_job_step_by_step():
    a = LeaseAgent("c0", "j", S, random.Random(0))
    created = msgspec.structs.replace(JOB, state="created", shards=2)
    out = a.handle(0.0, Begin(created))
    (cas,) = of(out, CasRow)
    assert (cas.key, cas.expect, decode_job(cas.data)) == (job_key("j"), ABSENT, created)
    out = a.handle(0.0, CasDone(job_key("j"), True, v(1), cas.data))
    (idx,) = of(out, CasRow)
    assert idx.key == INDEX_KEY and decode_index(idx.data) == JobIndex(("j",))
    out = a.handle(0.0, CasDone(INDEX_KEY, True, v(1), idx.data))
    shards = of(out, CasRow)
    assert sorted(c.key for c in shards) == [shard_key("j", 0, 0), shard_key("j", 0, 1)]
    assert all(c.expect == ABSENT for c in shards)
    out = a.handle(0.0, CasDone(shards[0].key, True, v(1), shards[0].data))
    out = a.handle(0.0, CasDone(shards[1].key, False, v(1), shards[1].data))  # already there: fine
    (run,) = [c for c in of(out, CasRow) if c.key == job_key("j")]
    assert decode_job(run.data).state == "running"


def test_agent_fails_or_cancels_the_job_and_unlists_it():
    a = agent()
    out = running(a)
    out = a.handle(0.1, WindowFailed(0, 3, "store full"))
    (cas,) = [c for c in of(out, CasRow) if c.key == job_key("j")]
    failed = decode_job(cas.data)
    assert failed.state == "failed" and "store full" in failed.error
    out = a.handle(0.2, CasDone(job_key("j"), True, v(4), cas.data))
    (idx,) = of(out, CasRow)
    assert idx.key == INDEX_KEY and idx.expect == ABSENT
    out = a.handle(0.3, CasDone(INDEX_KEY, False, v(5), encode_row(JobIndex(("x", "j")))))
    (idx,) = of(out, CasRow)
    assert decode_index(idx.data).jobs == ("x",)
    out = a.handle(0.4, CasDone(INDEX_KEY, True, v(6), idx.data))
    assert of(out, Finished) == [Finished("failed", failed.error)]
    b = agent("n2")
    running(b)
    out = b.handle(0.1, CancelJob("operator"))
    (cas,) = [c for c in of(out, CasRow) if c.key == job_key("j")]
    assert decode_job(cas.data).state == "cancelled"


def test_agent_halt_completes_written_windows_and_releases_the_rest():
    a = agent()
    out = running(a)
    (cas,) = of(out, CasRow)
    a.handle(0.0, CasDone(SK, True, v(2), cas.data))
    a.handle(0.1, WindowWritten(0, 0))
    out = a.handle(0.2, Halt())
    (rel,) = of(out, CasRow)
    row = decode_shard(rel.data)
    assert row.done == 1 and row.leases == () and row.free == ((1, 4),)
    out = a.handle(0.3, CasDone(SK, True, v(3), rel.data))
    assert of(out, Finished) == [Finished("released")] and DropWindow(0, 1) in out


def test_agent_waits_a_probe_interval_before_reading_an_absent_job_again():
    # a node told of a job before its row is written used to read it again at once, forever
    a = agent()
    assert of(a.handle(0.0, Begin()), ReadRow) == [ReadRow(job_key("j"))]
    out = a.handle(0.001, RowRead(job_key("j"), ABSENT, b""))
    assert not of(out, ReadRow) and out[-1] == SetTimer(1.001)
    assert of(a.handle(1.001, Tick()), ReadRow) == [ReadRow(job_key("j"))]


def test_agent_with_nothing_left_in_the_stage_polls_the_job_row_sooner():
    """Issue 15 item 2: a node whose stage has no window left for it (all leased by others) sees
    the next stage within ``idle_probe_s`` (default 0.1 s), not a whole probe interval (1 s) later."""
    idle = 0.1
    a = agent("n1")
    everything, _ = grant(new_shard(JOB, 0, 0), "n2", 8)  # n2 leased every window of the stage
    out = running(a, 0.0, everything)
    assert not of(out, CasRow) and not of(out, RunWindow)
    out = a.handle(0.05, Tick())
    assert ReadRow(job_key("j")) not in out
    wake = out[-1]
    assert isinstance(wake, SetTimer) and wake.at <= idle + 1e-9
    assert ReadRow(job_key("j")) in a.handle(idle, Tick())
    busy = agent("n2")  # the node with windows to run reads the job row every probe interval
    out = running(busy)
    busy.handle(0.0, CasDone(SK, True, v(2), of(out, CasRow)[0].data))
    assert ReadRow(job_key("j")) not in busy.handle(idle, Tick())


def test_agent_whose_job_ending_write_lost_its_answer_still_unlists_the_job():
    """The write that ends the job lands but its answer is lost (no quorum in time): the agent must
    still take the job off the index, or no node ever does (the done job stays listed: followed
    again by every node that starts, its chunks never emptied, a slot of MAX_ACTIVE_JOBS gone)."""
    a = agent()
    finished = msgspec.structs.replace(new_shard(JOB, 0, 0), next=8, done=8)
    out = running(a, 0.0, finished)
    (end,) = [c for c in of(out, CasRow) if c.key == job_key("j")]
    assert decode_job(end.data).state == "done"
    a.handle(0.05, OpFailed(job_key("j"), "timeout"))  # ...but it landed
    out = a.handle(0.5, Tick())
    assert [a for a in out if isinstance(a, ReadRow | CasRow) and a.key == job_key("j")]
    # it learns the outcome: a read or a refused write of the job row answers the row it made
    out = a.handle(0.6, RowRead(job_key("j"), v(4), end.data) if of(out, ReadRow)
                   else CasDone(job_key("j"), False, v(4), end.data))
    (idx,) = [c for c in of(out, CasRow) if c.key == INDEX_KEY]
    assert decode_index(idx.data).jobs == ()
    out = a.handle(1.6, CasDone(INDEX_KEY, True, v(2), idx.data))
    assert of(out, Finished) == [Finished("done")]


def test_agent_finishing_a_dead_creators_job_lists_it():
    """The creator wrote the job row and died before listing it (a node adopting its upload, or a
    ``train resume``, follows it): whoever finishes the creation lists the job, or no other node
    ever finds it."""
    created = msgspec.structs.replace(JOB, state="created")
    a = agent("n2")
    a.handle(0.0, Begin())
    out = a.handle(0.0, RowRead(job_key("j"), v(1), encode_row(created)))
    assert not of(out, CasRow)  # the creator may still be at it
    out = a.handle(10.0, Tick())
    (idx,) = [c for c in of(out, CasRow) if c.key == INDEX_KEY]
    assert decode_index(idx.data).jobs == ("j",)
    out = a.handle(10.05, RowRead(job_key("j"), v(1), encode_row(created)))  # its probe of the job row
    out += a.handle(10.1, CasDone(INDEX_KEY, True, v(1), idx.data))
    (shard,) = [c for c in of(out, CasRow) if c.key == SK]
    out = a.handle(10.2, CasDone(SK, True, v(1), shard.data))
    (run,) = [c for c in of(out, CasRow) if c.key == job_key("j")]
    assert decode_job(run.data).state == "running"


def test_agent_creating_a_job_the_full_index_cannot_list_fails_it():
    """MAX_ACTIVE_JOBS unfinished jobs: the new job cannot be listed, so it fails with the reason
    (it stayed ``created`` for good, its creator's driver polling it forever)."""
    from giaannd.compute.cluster_jobs.lease_table import MAX_ACTIVE_JOBS

    created = msgspec.structs.replace(JOB, state="created")
    a = agent("n1")
    (cas,) = of(a.handle(0.0, Begin(created)), CasRow)
    (idx,) = of(a.handle(0.0, CasDone(job_key("j"), True, v(1), cas.data)), CasRow)
    full = JobIndex(tuple(f"x{i}" for i in range(MAX_ACTIVE_JOBS)))
    out = a.handle(0.1, CasDone(INDEX_KEY, False, v(7), encode_row(full)))
    (end,) = [c for c in of(out, CasRow) if c.key == job_key("j")]
    failed = decode_job(end.data)
    assert failed.state == "failed" and "too_many_jobs" in failed.error
    out = a.handle(0.2, CasDone(job_key("j"), True, v(2), end.data))
    assert of(out, Finished) == [Finished("failed", failed.error)]  # never listed: nothing to unlist


def test_agent_halted_while_its_grant_is_in_flight_releases_the_lease_it_gets():
    """Halt lands after the grant's CAS was sent and before its answer. The agent finished at once
    (it held nothing yet), so the grant landed with no one left to release it: its windows waited
    for the lease's expiry, charged to this node as a lease it let expire, although a halt gives
    windows back at once. It must wait for the answer, run nothing, and release what it got."""
    a = agent()
    (cas,) = of(running(a), CasRow)  # the grant of [0, 4), in flight
    out = a.handle(0.01, Halt())
    assert not of(out, Finished)
    out = a.handle(0.02, CasDone(SK, True, v(2), cas.data))  # it landed
    assert not of(out, RunWindow)
    (rel,) = of(out, CasRow)
    row = decode_shard(rel.data)
    assert row.leases == () and row.free == ((0, 4),) and row.done == 0
    out = a.handle(0.03, CasDone(SK, True, v(3), rel.data))
    assert of(out, Finished) == [Finished("released")]


def test_agent_halted_after_its_grant_lost_its_answer_reads_the_shard_before_leaving():
    """The grant's answer is lost (OpFailed: it may have landed), then Halt: the agent reads the
    shard (after retry_s), adopts the lease the grant made and releases it before it finishes."""
    a = agent()
    (cas,) = of(running(a), CasRow)
    a.handle(0.01, OpFailed(SK, "timeout"))
    out = a.handle(0.02, Halt())
    assert not of(out, Finished)
    out = a.handle(0.2, Tick())  # retry_s = 0.1 has passed
    assert ReadRow(SK) in out and not of(out, Finished)
    out = a.handle(0.21, RowRead(SK, v(2), cas.data))  # the grant had landed
    assert not of(out, RunWindow)
    (rel,) = of(out, CasRow)
    assert decode_shard(rel.data).leases == ()
    out = a.handle(0.22, CasDone(SK, True, v(3), rel.data))
    assert of(out, Finished) == [Finished("released")]
    b = agent()  # ...and when it had not landed, the read says so and the agent leaves
    (cas,) = of(running(b), CasRow)
    b.handle(0.01, OpFailed(SK, "timeout"))
    b.handle(0.02, Halt())
    b.handle(0.2, Tick())
    out = b.handle(0.21, RowRead(SK, v(1), encode_row(new_shard(JOB, 0, 0))))
    assert of(out, Finished) == [Finished("released")] and not of(out, CasRow)


def test_agent_whose_listing_landed_after_a_cancel_unlists_the_job():
    """Another node cancels the job while it is ``created`` and this creator's index write is in
    flight: the canceller finds the job unlisted (nothing to unlist) and the listing lands after.
    The creator learns of the cancel at its next write; it was not the one that ended the job, so
    nobody took the cancelled job off the index: listed for good (followed again by every node that
    starts, ``train list`` showing it, a slot of MAX_ACTIVE_JOBS gone)."""
    created = msgspec.structs.replace(JOB, state="created")
    a = LeaseAgent("c0", "j", S, random.Random(0))
    (row,) = of(a.handle(0.0, Begin(created)), CasRow)
    (idx,) = of(a.handle(0.0, CasDone(job_key("j"), True, v(1), row.data)), CasRow)
    (shard,) = of(a.handle(0.1, CasDone(INDEX_KEY, True, v(1), idx.data)), CasRow)  # listed
    (run,) = of(a.handle(0.2, CasDone(SK, True, v(1), shard.data)), CasRow)
    assert decode_job(run.data).state == "running"
    cancelled = msgspec.structs.replace(created, state="cancelled", error="operator")
    out = a.handle(0.3, CasDone(job_key("j"), False, v(2), encode_row(cancelled)))  # c1 cancelled it
    (unlist,) = [c for c in of(out, CasRow) if c.key == INDEX_KEY]
    assert unlist.expect == v(1) and decode_index(unlist.data).jobs == ()
    assert not of(out, Finished)
    out = a.handle(0.4, CasDone(INDEX_KEY, True, v(2), unlist.data))
    assert of(out, Finished) == [Finished("cancelled", "operator")]
