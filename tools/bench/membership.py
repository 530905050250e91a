"""Membership benchmark on the deterministic simulator (virtual time).

For each cluster size N with the LAN profile it measures:

* detection: kill -9 one member, time until *every* other member has declared it
  dead (p50/p95 over --trials trials, a different victim each time, restarted
  and re-converged between trials);
* convergence: one member updates its metadata, time until 100 % have it;
* false positives under loss: a quiet cluster on a lossy network (--loss), count
  of "failed" events about live members over --fp-seconds;
* idle gossip: bytes sent per node per second (UDP packets incl. sealing
  overhead, plus push-pull streams) over one scaled push-pull period with nothing
  happening.

Run: ``python -m tools.bench.membership [--sizes 10,32,100,1000] [--trials 20]``.
Targets are memberlist's, from the issue. Times are simulated seconds; the
network model is a LAN (0.5 ms +- 0.5 ms one way).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from peers.membership.config import MembershipConfig
from peers.membership.events import MemberEvent, MemberFailed, MemberUpdated
from peers.membership.messages import MemberStatus
from peers.membership.suspicion import push_pull_scale
from tests.sim.cluster import NetModel, SimCluster

TARGET_DETECT_P95 = {10: 7.0, 32: 10.0, 100: 12.0, 1000: 16.0}
TARGET_CONVERGE = {32: 1.5, 100: 2.0, 1000: 2.5}
TARGET_IDLE_BPS = {100: 25_000.0}


def _target(table: dict[int, float], n: int, fmt: str, unit: str = "") -> str:
    return format(table[n], fmt) + unit if n in table else "-"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def detection(c: SimCluster, trials: int) -> list[float]:
    names = sorted(c.nodes)
    times: list[float] = []
    for trial in range(trials):
        victim = names[1 + (trial * 7919) % (len(names) - 1)]
        seen: set[str] = set()

        def on_event(_t: float, observer: str, event: MemberEvent, v: str = victim) -> None:
            if isinstance(event, MemberFailed) and event.name == v:
                seen.add(observer)

        c.on_event = on_event
        c.kill(victim)
        t0 = c.now
        need = len(c.up_nodes())
        if c.run_until(t0 + 180.0, lambda: len(seen) >= need, check_every_s=0.01):
            times.append(c.now - t0)
        else:
            times.append(float("inf"))
        c.on_event = None
        c.restart(victim, [names[0]])
        c.run_until(c.now + 60.0, functools.partial(c.all_see, victim, MemberStatus.ALIVE), check_every_s=0.1)
        c.run_for(5.0)
    return times


def convergence(c: SimCluster, trials: int) -> list[float]:
    names = sorted(c.nodes)
    times: list[float] = []
    for trial in range(trials):
        subject = names[(trial * 104729) % len(names)]
        seen: set[str] = set()

        def on_event(_t: float, observer: str, event: MemberEvent, s: str = subject) -> None:
            if isinstance(event, MemberUpdated) and event.name == s and event.cause == "meta":
                seen.add(observer)

        c.on_event = on_event
        c.update_meta(subject, f"v{trial}".encode())
        t0 = c.now
        need = len(c.up_nodes()) - 1
        c.run_until(t0 + 30.0, lambda: len(seen) >= need, check_every_s=0.005)
        times.append(c.now - t0 if len(seen) >= need else float("inf"))
        c.on_event = None
        c.run_for(2.0)
    return times


def idle_bytes_per_node(c: SimCluster) -> float:
    window = push_pull_scale(c.config.push_pull_interval_s, len(c.nodes))
    before = sum(n.bytes_sent for n in c.nodes.values()) + c.stream_bytes
    c.run_for(window)
    after = sum(n.bytes_sent for n in c.nodes.values()) + c.stream_bytes
    return (after - before) / window / len(c.nodes)


def false_positives(n: int, loss: float, seconds: float, seed: int) -> tuple[int, int]:
    c = SimCluster(MembershipConfig.lan(), seed=seed, net=NetModel(loss=loss))
    c.bootstrap(n)
    c.run_for(seconds)
    failed = len([e for e in c.events if isinstance(e[2], MemberFailed)])
    suspected = c.nodes["n0"].core.counters.get("suspicions", 0)
    return failed, suspected


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,32,100,1000")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--convergence-trials", type=int, default=20)
    p.add_argument("--loss", type=float, default=0.05)
    p.add_argument("--fp-seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        wall = time.perf_counter()
        c = SimCluster(MembershipConfig.lan(), seed=args.seed)
        c.bootstrap(n)
        c.run_for(10.0)
        idle = idle_bytes_per_node(c)
        conv = convergence(c, args.convergence_trials)
        det = detection(c, args.trials)
        fp_failed, _ = false_positives(n, args.loss, args.fp_seconds, args.seed + 1)
        sim_s = c.now + args.fp_seconds
        rows.append((n, det, conv, fp_failed, idle, sim_s, time.perf_counter() - wall))
        print(f"N={n}: done in {rows[-1][-1]:.1f} s real for {sim_s:.0f} s simulated",
              flush=True)
    print()
    print(f"{'N':>5} | {'detect p50':>10} | {'detect p95':>10} | {'target':>6} | "
          f"{'conv p50':>8} | {'conv max':>8} | {'target':>6} | "
          f"{'false dead @' + format(args.loss, '.0%'):>15} | {'idle B/s/node':>13} | "
          f"{'target':>7} | {'sim s/real s':>12}")
    for n, det, conv, fp, idle, sim_s, wall in rows:
        print(f"{n:>5} | {_pct(det, .5):>9.2f}s | {_pct(det, .95):>9.2f}s | "
              f"{_target(TARGET_DETECT_P95, n, '.1f', 's'):>6} | "
              f"{statistics.median(conv):>7.2f}s | {max(conv):>7.2f}s | "
              f"{_target(TARGET_CONVERGE, n, '.1f', 's'):>6} | "
              f"{fp:>8d} in {args.fp_seconds:.0f}s | {idle:>13.0f} | "
              f"{_target(TARGET_IDLE_BPS, n, '.0f'):>7} | {sim_s / wall:>12.0f}")


if __name__ == "__main__":
    main()
