"""giaannd.compute.cluster_jobs.leases: a node whose own lease deadline passed (its renewals got no
answer) and that finds the lease still its own afterwards (nobody took it over) completes the
windows it had written under it; it does not run them again. Sans-IO, fed by hand."""

import random

import msgspec

from giaannd.compute.cluster_jobs.lease_events import (
    Begin,
    CasDone,
    CasRow,
    DropWindow,
    LeaseSettings,
    OpFailed,
    ReadRow,
    RowRead,
    RunWindow,
    Tick,
    WindowWritten,
)
from giaannd.compute.cluster_jobs.lease_table import (
    JobRow,
    Lease,
    decode_shard,
    encode_row,
    job_key,
    new_shard,
    shard_key,
)
from giaannd.compute.cluster_jobs.leases import LeaseAgent

S = LeaseSettings(lease_s=10.0, renew_s=3.0, probe_interval_s=1.0, lease_windows=4, parallel=2, retry_s=0.1)
#: one lease holds every window: no grant write rides along with the completions
JOB = JobRow(job_id="j", windows=4, shards=1, writer_id=9, state="running")
SK = shard_key("j", 0, 0)


def v(n):
    return (n, n, 1)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def leased_with_two_written():
    """n1 holds lease 0 on windows [0, 4) (granted at t=0), windows 0 and 1 written (acked), 2
    and 3 running; returns the agent and the row its grant wrote."""
    a = LeaseAgent("n1", "j", S, random.Random(0))
    a.handle(0.0, Begin())
    a.handle(0.0, RowRead(job_key("j"), v(3), encode_row(JOB)))
    (cas,) = of(a.handle(0.0, RowRead(SK, v(1), encode_row(new_shard(JOB, 0, 0)))), CasRow)
    assert of(a.handle(0.0, CasDone(SK, True, v(2), cas.data)), RunWindow) == [RunWindow(0, 0, 9), RunWindow(0, 1, 9)]
    out = a.handle(0.1, WindowWritten(0, 0, 5)) + a.handle(0.2, WindowWritten(0, 1, 7))
    assert of(out, RunWindow) == [RunWindow(0, 2, 9), RunWindow(0, 3, 9)] and not of(out, CasRow)
    return a, cas.data


def test_lease_own_expiry_retaken_lease_completes_written_windows_without_running_them_again():
    a, granted = leased_with_two_written()
    assert of(a.handle(3.0, Tick()), CasRow)  # renewal due; it would carry windows 0 and 1
    a.handle(3.05, OpFailed(SK, "no quorum"))  # ...and every retry fails until the deadline
    out = a.handle(10.0, Tick())  # own deadline (granted at 0 + lease_s): the running windows stop
    assert sorted(d.window for d in of(out, DropWindow)) == [2, 3]
    assert ReadRow(SK) in out
    # the quorum is back; nobody took the lease over (the row is still the grant's)
    assert decode_shard(granted).leases == (Lease(0, "n1", 0, 4),)
    out = a.handle(10.1, RowRead(SK, v(2), granted))
    # acknowledged windows 0 and 1 are not encoded, trained and sent again; 2 and 3 (dropped
    # before their acks) are run again
    assert of(out, RunWindow) == [RunWindow(0, 2, 9), RunWindow(0, 3, 9)]
    (cas,) = of(out, CasRow)  # the adopted lease is renewed at once, completing 0 and 1
    row = decode_shard(cas.data)
    assert row.done == 2 and [(x.node, x.id, x.cursor) for x in row.leases] == [("n1", 0, 2)]
    assert [(t.node, t.windows, t.units) for t in row.tallies] == [("n1", 2, 12)]
    assert a.grants == 1 and a.takeovers == 0
    a.handle(10.2, CasDone(SK, True, v(3), cas.data))
    a.handle(10.3, WindowWritten(0, 2, 1))
    (cas,) = of(a.handle(10.4, WindowWritten(0, 3, 1)), CasRow)
    row = decode_shard(cas.data)
    assert row.finished and not row.leases and row.tallies[0].units == 14


def test_lease_own_expiry_renewal_landing_after_the_deadline_keeps_what_was_written():
    """The renewal (sent before the windows' acks, so it completes none) is answered only after
    the deadline: the lease comes back through a confirmed write, not a read."""
    a = LeaseAgent("n1", "j", S, random.Random(0))
    a.handle(0.0, Begin())
    a.handle(0.0, RowRead(job_key("j"), v(3), encode_row(JOB)))
    (cas,) = of(a.handle(0.0, RowRead(SK, v(1), encode_row(new_shard(JOB, 0, 0)))), CasRow)
    a.handle(0.0, CasDone(SK, True, v(2), cas.data))
    (renewal,) = of(a.handle(3.0, Tick()), CasRow)
    assert decode_shard(renewal.data).done == 0
    a.handle(3.5, WindowWritten(0, 0))
    a.handle(3.6, WindowWritten(0, 1))
    out = a.handle(10.0, Tick())  # no answer yet: the deadline counts from the grant
    assert sorted(d.window for d in of(out, DropWindow)) == [2, 3]
    out = a.handle(10.2, CasDone(SK, True, v(3), renewal.data))
    assert of(out, RunWindow) == [RunWindow(0, 2, 9), RunWindow(0, 3, 9)]
    (cas,) = of(out, CasRow)  # renewal due again (sent at 3.0 + renew_s): completes 0 and 1
    assert decode_shard(cas.data).done == 2
    assert a.grants == 1  # the same lease, not a second grant


def test_lease_own_expiry_window_acked_just_after_the_deadline_is_kept():
    """A window whose ack came in after the deadline dropped it (the drop raced the ack): it is
    written, so it is not run again either."""
    a, granted = leased_with_two_written()
    a.handle(3.0, Tick())
    a.handle(3.05, OpFailed(SK, "no quorum"))
    a.handle(10.0, Tick())
    a.handle(10.05, WindowWritten(0, 2, 3))
    out = a.handle(10.1, RowRead(SK, v(2), granted))
    assert of(out, RunWindow) == [RunWindow(0, 3, 9)]
    (cas,) = of(out, CasRow)
    assert decode_shard(cas.data).done == 3


def test_lease_own_expiry_lease_taken_over_meanwhile_is_not_completed_by_the_old_holder():
    """Another node took the lease over (new id): the old holder's record does not apply; its
    written windows are the new holder's to run again (storage dedupes them by batch id)."""
    a, granted = leased_with_two_written()
    a.handle(3.0, Tick())
    a.handle(3.05, OpFailed(SK, "no quorum"))
    a.handle(10.0, Tick())
    taken = msgspec.structs.replace(decode_shard(granted), leases=(Lease(1, "n2", 0, 4, 0, 2),), issued=2)
    out = a.handle(10.1, RowRead(SK, v(3), encode_row(taken)))
    assert not of(out, RunWindow) and not of(out, CasRow)
