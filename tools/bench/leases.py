"""How many windows per second one cluster job can hand out, on the lease simulator (virtual time).

One job on 100 compute and 30 storage nodes (tests/sim/leases.py: the real lease agent, lease
rows and CASPaxos rounds; a seeded network with ~0.3-0.7 ms one-way delay; a register change or a
batch is durable ``--fsync-ms`` after it arrives). Windows take ``--work-ms`` each, far below a
real window (K = 256 sentences: 0.1-0.25 s), so the lease protocol, not the work, is what runs out:

* ``windows_per_s``: windows done per simulated second between 10 % and 90 % of the job (steady
  state), one stage. Target 1,000: 100 nodes each finishing a K = 256 window every 0.1 s (2,560
  sentences/s per node, the compute pipeline's rate on this host without storage).
* ``windows_per_s_fsync_5ms``: the same with 5 ms per durable register change (a disk without a
  write cache); same target.
* ``cas_rounds_per_window`` and ``ballot_conflicts_per_round``: register traffic per window
  (no target: what the figure costs).
* ``takeover_max_s``: the fault run of tests/sim/test_leases.py (5 compute nodes killed, 3 frozen
  and 3 cut off for 3 s, 2 % message loss): the longest time from a lease's last renewal to its
  take-over. Target: lease_s + probe_interval_s.

Run: ``python -m tools.bench.leases [--windows 6000] [--json]``; ``--json`` prints one object per
figure, ``{"figure", "value", "target"}`` (target null: no target).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

from giaannd.compute.cluster_jobs.lease_events import LeaseSettings
from giaannd.compute.cluster_jobs.lease_table import JobRow
from tests.sim.leases import LeaseSim, SimNet
from tools.bench.report import print_table

TARGET_WINDOWS_PER_S = 1000.0
SETTINGS = LeaseSettings(lease_s=2.0, renew_s=0.6, probe_interval_s=0.25, lease_windows=8, parallel=2,
                         retry_s=0.05)


def throughput(windows: int, shards: int, fsync_s: float, work_s: float, seed: int) -> dict[str, float]:
    sim = LeaseSim(seed=seed, compute=100, storage=30, settings=SETTINGS, net=SimNet(fsync_s=fsync_s),
                   work_s=(work_s, 1.5 * work_s))
    job = JobRow(job_id="bench", windows=windows, shards=shards, writer_id=1)
    sim.start_job("c0", job)
    if not sim.run_until(600.0, lambda: "bench" in sim.finished):
        raise SystemExit("the job did not finish in 600 simulated seconds")
    done_at = sim.check(job, slack_s=0.1)["done_at"]
    lo, hi = done_at[len(done_at) // 10], done_at[len(done_at) * 9 // 10]
    return {"windows_per_s": (len(done_at) * 8 // 10) / (hi - lo),
            "cas_rounds_per_window": sim.cas_rounds / windows,
            "ballot_conflicts_per_round": sim.cas_conflicts / sim.cas_rounds}


def takeover(seed: int) -> float:
    sim = LeaseSim(seed=seed, compute=100, storage=30, settings=SETTINGS, net=SimNet(loss=0.02),
                   work_s=(0.2, 0.4))
    job = JobRow(job_id="faults", windows=800, shards=16, stages=2, writer_id=2)
    sim.start_job("c0", job)
    names = sorted(sim.compute)
    for n in names[10:15]:
        sim.at(0.5, functools.partial(sim.kill, n))
    for n in names[20:23]:
        sim.at(0.6, functools.partial(sim.freeze, n, 3.0))
    for n in names[30:33]:
        sim.at(0.7, functools.partial(sim.partition, n))
        sim.at(3.7, functools.partial(sim.partition, n, False))
    if not sim.run_until(600.0, lambda: "faults" in sim.finished):
        raise SystemExit("the fault run did not finish")
    return float(sim.check(job, slack_s=0.1)["takeover_max_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=6000)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--work-ms", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args()
    wall = time.perf_counter()
    fast = throughput(args.windows, args.shards, 0.0005, args.work_ms / 1000, args.seed)
    slow = throughput(args.windows, args.shards, 0.005, args.work_ms / 1000, args.seed)
    figures: list[dict[str, Any]] = [
        {"figure": "windows_per_s", "value": round(fast["windows_per_s"]), "target": TARGET_WINDOWS_PER_S},
        {"figure": "windows_per_s_fsync_5ms", "value": round(slow["windows_per_s"]), "target": TARGET_WINDOWS_PER_S},
        {"figure": "cas_rounds_per_window", "value": round(fast["cas_rounds_per_window"], 2), "target": None},
        {"figure": "ballot_conflicts_per_round", "value": round(fast["ballot_conflicts_per_round"], 2),
         "target": None},
        {"figure": "takeover_max_s", "value": round(takeover(args.seed), 3),
         "target": SETTINGS.lease_s + SETTINGS.probe_interval_s},
    ]
    if args.json:
        for f in figures:
            print(json.dumps(f))
        return
    print_table(f"One job, 100 compute / 30 storage nodes, {args.windows} windows, {args.shards} shards, "
                f"{SETTINGS.lease_windows} windows per lease (simulated; {time.perf_counter() - wall:.0f} s real)",
                ["figure", "value", "target"],
                [[f["figure"], str(f["value"]), "-" if f["target"] is None else str(f["target"])] for f in figures])


if __name__ == "__main__":
    main()
