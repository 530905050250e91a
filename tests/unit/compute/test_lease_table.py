"""giaannd.compute.cluster_jobs.lease_table: the job / shard rows and their pure transitions (tables)."""

import msgspec
import pytest

from giaannd.compute.cluster_jobs.cluster_train import job_document
from giaannd.compute.cluster_jobs.lease_table import (
    JobIndex,
    JobRow,
    Lease,
    LeaseRefused,
    LeaseRowCorrupt,
    Shard,
    check_shard,
    complete,
    decode_index,
    decode_job,
    decode_shard,
    encode_row,
    grant,
    index_add,
    index_remove,
    job_transition,
    new_shard,
    release,
    renew,
    shard_finished,
    shard_range,
    take_over,
)
from giaannd.compute.cluster_jobs.window_runner import ClusterSpec, encode_spec

JOB = JobRow(job_id="j", windows=10, shards=3, writer_id=5, stages=2)


def shard(**kw):
    base = dict(job_id="j", stage=0, shard=0, start=0, stop=10, next=0)
    base.update(kw)
    return Shard(**base)


@pytest.mark.parametrize(("windows", "shards", "want"), [
    (10, 3, [(0, 3), (3, 6), (6, 10)]),
    (2, 4, [(0, 0), (0, 1), (1, 1), (1, 2)]),  # more shards than windows: some are born finished
    (7, 1, [(0, 7)]),
])
def test_shard_range_splits_evenly(windows, shards, want):
    assert [shard_range(windows, shards, s) for s in range(shards)] == want


def test_grant_takes_given_back_windows_first_then_fresh_ones():
    s = shard()
    s, a = grant(s, "n1", 4)
    assert a == Lease(0, "n1", 0, 4) and s.next == 4 and s.issued == 1
    s = release(s, "n1", a.id)
    assert s.free == ((0, 4),) and s.leases == ()
    s, b = grant(s, "n2", 3)
    assert (b.cursor, b.stop) == (0, 3) and s.free == ((3, 4),)
    s, c = grant(s, "n3", 5)
    assert (c.cursor, c.stop) == (3, 4) and s.free == () and s.next == 4  # a free range is not extended
    s, d = grant(s, "n3", 100)
    assert (d.cursor, d.stop) == (4, 10) and s.pending == 0
    with pytest.raises(LeaseRefused) as exc:
        grant(s, "n4", 1)
    assert exc.value.code == "none_pending"
    check_shard(s)


def test_complete_moves_the_cursor_counts_each_window_once_and_renews():
    s, a = grant(shard(), "n1", 4)
    s = complete(s, "n1", a.id, 2)
    lease = s.lease(a.id)
    assert (lease.cursor, lease.beats, s.done) == (2, 1, 2)
    assert complete(s, "n1", a.id, 2) is s  # idempotent
    assert complete(s, "n1", a.id, 1) is s
    s = complete(s, "n1", a.id, 4)
    assert s.lease(a.id) is None and s.done == 4
    check_shard(s)


@pytest.mark.parametrize(("node", "lease_id", "upto", "code"), [
    ("n2", 0, 2, "not_holder"),
    ("n1", 7, 2, "not_holder"),
    ("n1", 0, 5, "bad_range"),
])
def test_complete_refusals(node, lease_id, upto, code):
    s, _ = grant(shard(), "n1", 4)
    with pytest.raises(LeaseRefused) as exc:
        complete(s, node, lease_id, upto)
    assert exc.value.code == code


def test_take_over_needs_the_beats_seen_and_fences_the_old_holder():
    s, a = grant(shard(), "n1", 4)
    s = complete(s, "n1", a.id, 1)  # beats 1
    with pytest.raises(LeaseRefused) as exc:
        take_over(s, "n2", a.id, 0)  # renewed since it was seen
    assert exc.value.code == "renewed"
    s, b = take_over(s, "n2", a.id, 1)
    assert (b.node, b.cursor, b.stop, b.runs, b.beats) == ("n2", 1, 4, 2, 0) and b.id != a.id
    for change in (lambda: complete(s, "n1", a.id, 2), lambda: release(s, "n1", a.id)):
        with pytest.raises(LeaseRefused):
            change()
    assert renew(s, "n1", [a.id]) == s  # the old holder's renewal changes nothing
    assert renew(s, "n2", [b.id]).lease(b.id).beats == 1
    check_shard(s)


@pytest.mark.parametrize("broken", [
    dict(next=11),
    dict(leases=(Lease(0, "a", 0, 3),), next=2, issued=1),          # overlaps the pending range
    dict(leases=(Lease(0, "a", 0, 3), Lease(0, "b", 3, 5)), next=5, issued=1),  # id repeated
    dict(leases=(Lease(3, "a", 0, 3),), next=3, issued=1),          # id never issued
    dict(done=1),                                                   # counts do not add up
    dict(free=((2, 1),)),
    dict(leases=(Lease(0, "a", 3, 3),), next=3, done=3, issued=1),  # an empty lease
])
def test_check_shard_catches_broken_rows(broken):
    with pytest.raises(ValueError):
        check_shard(shard(**broken))
    with pytest.raises(LeaseRowCorrupt):
        decode_shard(encode_row(shard(**broken)))


def test_rows_round_trip_and_garbage_is_corrupt():
    s, _ = grant(new_shard(JOB, 1, 2), "n1", 2)
    assert decode_shard(encode_row(s)) == s and s.stage == 1 and (s.start, s.stop) == (6, 10)
    assert decode_job(encode_row(JOB)) == JOB
    assert decode_index(b"") == JobIndex() and decode_index(encode_row(JobIndex(("a",)))) == JobIndex(("a",))
    for data, decode in ((b"\xc1", decode_job), (msgspec.msgpack.encode({"x": 1}), decode_shard),
                         (encode_row(JOB), decode_index)):
        with pytest.raises(LeaseRowCorrupt):
            decode(data)


@pytest.mark.parametrize(("state", "to", "ok"), [
    ("created", "running", True), ("created", "cancelled", True), ("running", "done", True),
    ("running", "failed", True), ("created", "done", False), ("done", "running", False),
    ("cancelled", "running", False), ("failed", "done", False), ("running", "created", False),
])
def test_job_transition_table(state, to, ok):
    job = msgspec.structs.replace(JOB, state=state)
    if ok:
        assert job_transition(job, to, "why").state == to
    else:
        with pytest.raises(LeaseRefused):
            job_transition(job, to)
    assert job_transition(job, state) is job


def test_shard_finished_counts_each_shard_once_then_moves_the_stage():
    job = msgspec.structs.replace(JOB, state="running")  # 3 shards, 2 stages
    job = shard_finished(shard_finished(job, 0, 2), 0, 0)
    assert (job.stage, job.finished) == (0, (0, 2))
    assert shard_finished(job, 0, 2) is job  # seen twice: counted once
    second = shard_finished(job, 0, 1)
    assert (second.stage, second.finished, second.state) == (1, (), "running")
    assert shard_finished(second, 0, 1) is second  # a late report of stage 0 changes nothing
    done = shard_finished(shard_finished(shard_finished(second, 1, 0), 1, 1), 1, 2)
    assert done.state == "done" and shard_finished(done, 1, 2) is done
    with pytest.raises(LeaseRefused):
        shard_finished(JOB, 0, 0)  # still created


def test_index_add_remove_and_limit():
    idx = index_add(index_add(JobIndex(), "a"), "b")
    assert idx.jobs == ("a", "b") and index_add(idx, "a") is idx
    assert index_remove(idx, "a").jobs == ("b",) and index_remove(idx, "zz") is idx
    full = JobIndex(tuple(str(i) for i in range(64)))
    with pytest.raises(LeaseRefused) as exc:
        index_add(full, "new")
    assert exc.value.code == "too_many_jobs"


def test_complete_at_records_the_tally_timeline_and_the_document_sums_nodes():
    # one training-stage shard of 4 windows of K=10 sentences (36 in all: the last window holds 6)
    row = JobRow(job_id="j", windows=4, shards=1, writer_id=5, stages=2, stage=1, state="running",
                 spec=encode_spec(ClusterSpec(k=10, sentences=36, created_at=100.0)))
    s = shard(stage=1, stop=4)
    s, a = grant(s, "n1", 2)
    s, b = grant(s, "n2", 2)
    s = complete(s, "n1", a.id, 1, {0: 8}, at=101.0)
    s = complete(s, "n2", b.id, 3, {2: 9}, at=102.5)
    s = complete(s, "n1", a.id, 2, {1: 7}, at=104.0)
    s = complete(s, "n2", b.id, 4, {3: 5}, at=105.0)
    assert s.tallies[0].timeline == ((101.0, 1, 8), (104.0, 2, 15))
    assert decode_shard(encode_row(s)) == s
    doc = job_document(row, [s])
    assert doc["by_node"]["n2"]["timeline"] == {"t": [102.5, 105.0], "done": [10, 16], "trained": [9, 14],
                                                "bytes_sent": [0, 0]}
    # by hand: creation 0; n1 alone at 101; + n2 at 102.5; n1 moves at 104; n2's last (short) window at 105
    assert doc["timeline"] == {"t": [100.0, 101.0, 102.5, 104.0, 105.0], "done": [0, 10, 20, 30, 36],
                               "trained": [0, 8, 17, 24, 29], "bytes_sent": [0, 0, 0, 0, 0]}
    assert doc["done"] == 36 and doc["trained"] == 29
    # the rate over the job's life as the registers saw it (creation to the last window), as a
    # node-local job's document has it: 36 sentences in 5 s (the quickstart prints it)
    assert doc["elapsed_s"] == 5.0 and doc["sentences_per_s"] == pytest.approx(7.2)
