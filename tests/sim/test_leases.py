"""One cluster training job on the deterministic simulator (tests/sim/leases.py): 100 compute and
30 storage nodes, message loss, crashes, pauses, partitions, joins; the oracle checks that no
window is done twice, none is lost, every CAS success is on one history, and every take-over
came within lease_s + probe_interval_s of the lease's last renewal."""

import pytest

from giaannd.compute.cluster_jobs.lease_events import CancelJob, Halt, LeaseSettings
from giaannd.compute.cluster_jobs.lease_table import JobRow, job_key
from tests.sim.leases import LeaseSim, SimNet

pytestmark = pytest.mark.sim

SETTINGS = LeaseSettings(lease_s=2.0, renew_s=0.6, probe_interval_s=0.25, lease_windows=4, parallel=2,
                         retry_s=0.05)
#: a take-over is a few CAS round trips after its deadline; 0.1 s is ~30 of them on this network
SLACK_S = 0.1


def job(windows=800, shards=16, stages=2, job_id="j1"):
    return JobRow(job_id=job_id, windows=windows, shards=shards, stages=stages, writer_id=0xAB)


@pytest.mark.parametrize("seed", [1, 2])
def test_sim_leases_one_job_many_faults(seed):
    # 800 windows of 0.2-0.4 s on 100 nodes running 2 each: ~1.2 s a stage without faults
    sim = LeaseSim(seed=seed, compute=100, storage=30, settings=SETTINGS, net=SimNet(loss=0.02),
                   work_s=(0.2, 0.4))
    j = job()
    sim.start_job("c0", j)
    names = sorted(sim.compute)
    killed, frozen, cut = names[10:15], names[20:23], names[30:33]
    for n in killed:
        sim.at(0.5, lambda n=n: sim.kill(n))
    for n in frozen:
        sim.at(0.6, lambda n=n: sim.freeze(n, 3.0))  # longer than a lease: they come back as zombies
    for n in cut:
        sim.at(0.7, lambda n=n: sim.partition(n))
        sim.at(3.7, lambda n=n: sim.partition(n, False))
    sim.at(0.8, lambda: sim.storage_down("s3"))
    sim.at(2.8, lambda: sim.storage_down("s3", False))
    sim.at(3.0, lambda: sim.storage_down("s7"))
    sim.at(4.0, lambda: sim.storage_down("s7", False))
    sim.at(1.0, lambda: sim.restart(killed[0]))  # same name, nothing in memory: adopts or is fenced
    for i in range(3):
        sim.at(1.2, lambda i=i: sim.add_compute(f"late{i}"))  # joins mid-job, finds it in the index
    assert sim.run_until(120.0, lambda: "j1" in sim.finished), "the job did not finish"
    assert sim.finished["j1"].state == "done"
    figures = sim.check(j, SLACK_S)
    assert figures["takeovers"] >= len(killed) - 1  # the dead (one came back) lost leases to others
    assert figures["redone_windows"] > 0 and figures["duplicates_dropped"] > 0
    assert figures["takeover_min_s"] >= SETTINGS.lease_s  # never before the lease expired
    assert figures["unfair_takeovers"] == 0  # only from nodes that were dead, frozen or cut off
    late = [n for n in sim.compute if n.startswith("late")]
    assert any(sim.runs_by[n] for n in late), "nodes that joined mid-job never got work"


def test_sim_leases_creator_dies_before_running():
    sim = LeaseSim(seed=3, compute=20, storage=30, settings=SETTINGS, work_s=(0.005, 0.01))
    j = job(windows=200, shards=4, stages=1, job_id="j2")
    sim.start_job("c0", j)
    # the creator wrote the job row and listed it in the index, then dies before the shards exist
    assert sim.run_until(5.0, lambda: b"j2" in sim.register("jobs"))
    sim.kill("c0")
    assert sim.run_until(60.0, lambda: "j2" in sim.finished)
    assert sim.finished["j2"].state == "done"
    sim.check(j, SLACK_S)


def test_sim_leases_cancel_stops_every_node():
    sim = LeaseSim(seed=4, compute=30, storage=30, settings=SETTINGS, work_s=(0.01, 0.02))
    j = job(windows=2000, shards=8, stages=1, job_id="j3")
    sim.start_job("c0", j)
    sim.run_until(0.5)
    sim.feed("c5", "j3", CancelJob("operator"))
    assert sim.run_until(10.0, lambda: "j3" in sim.finished)
    assert sim.finished["j3"].state == "cancelled"
    sim.run_until(sim.now + 2 * SETTINGS.probe_interval_s)
    assert all(not node.windows for node in sim.compute.values())  # nobody runs a window any more
    assert b"j3" not in sim.register("jobs")  # the canceller took it off the index
    sim.chain(job_key("j3"))


def test_sim_leases_halted_node_hands_windows_back_without_waiting():
    sim = LeaseSim(seed=5, compute=10, storage=30, settings=SETTINGS, work_s=(0.05, 0.06))
    j = job(windows=300, shards=2, stages=1, job_id="j4")
    sim.start_job("c0", j)
    sim.run_until(0.6)
    sim.feed("c3", "j4", Halt())
    sim.run_until(1.0)
    assert sim.released("c3", "j4")
    assert sim.run_until(60.0, lambda: "j4" in sim.finished)
    figures = sim.check(j, SLACK_S)
    assert figures["takeovers"] == 0  # released windows were granted again, not waited for


def test_sim_leases_a_shard_nobody_calls_home_is_watched_by_the_others():
    """S = 2, and the only node whose home is shard 1 dies holding a lease there. The others (home
    shard 0) must still read shard 1 in turn (the "one other shard per interval"), so its expired
    lease is taken over within lease + probe interval, not once their own shard is finished: the
    scout used to stop at the home shard, which comes first in its rotation, for good."""
    sim = LeaseSim(seed=6, compute=0, storage=30, settings=SETTINGS, work_s=(0.2, 0.4))
    for name in ("c4", "c5", "c0"):  # crc32 mod 2: c4 and c5 are at home in shard 0, c0 in shard 1
        sim.add_compute(name, follow=False)
    j = job(windows=200, shards=2, stages=1, job_id="j5")
    sim.start_job("c4", j)
    sim.at(0.5, lambda: sim.kill("c0"))
    assert sim.run_until(120.0, lambda: "j5" in sim.finished), "the job did not finish"
    assert sim.finished["j5"].state == "done"
    figures = sim.check(j, SLACK_S)
    assert figures["takeovers"] >= 1
