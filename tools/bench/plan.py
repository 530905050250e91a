"""The rebalance planner at the mission's column counts: ``plan_transfers`` (whole-array passes,
giaannd/storage/rebalance/plan.py) against the loop per column it replaced, kept here as the
same-run baseline and as the reference its test compares plans with.

    python -m tools.bench.plan [--columns 1000000] [--members 10] [--replicas 3] [--rounds 3] [--json]

A join (one member more) and a removenode (one member fewer: several candidate sources per
column, chosen by hash) of ``--columns`` random columns, each plan computed by both, taking turns,
``--rounds`` times; figures are the medians of wall seconds and the ratio baseline / now (target:
none in the issue; "no per-row Python in a hot path"). Both must give the same plan (checked).
``--json`` prints one ``{"figure", "value", "target"}`` object per figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Collection

import numpy as np
import xxhash
from numpy.typing import ArrayLike

from giaannd.storage.rebalance.plan import Plan, Transfer, plan_transfers
from peers.placement import Member, Placement
from tools.bench.report import emit_figures, print_table

__all__ = ["choose_source_per_column", "main", "plan_per_column", "same_plan"]


def choose_source_per_column(column: int, target: str, candidates: Collection[str]) -> str:
    """The source rule as it was written for one (column, target): the candidate with the highest
    xxh3 of (column, target, candidate), the first in name order among equal hashes."""
    prefix = int(column).to_bytes(8, "little") + target.encode() + b"\x00"
    return max(sorted(candidates), key=lambda c: xxhash.xxh3_64_intdigest(prefix + c.encode()))


def _candidates(before: set[str], after: set[str], live: set[str], avoid: set[str]) -> set[str]:
    """The candidate tiers as they were written per column (``plan._moves`` has them as masks)."""
    holders = before & live
    released = holders - after
    ok = holders - avoid
    return (released & ok) or ok or released or holders


def plan_per_column(old: Placement, new: Placement, columns: ArrayLike, live: Collection[str],
                    avoid_sources: Collection[str] = ()) -> Plan:
    """``plan_transfers`` as it was before its whole-array form: a Python loop per column."""
    cols = np.unique(np.asarray(columns, dtype=np.uint64))
    live_set, avoid = set(live), set(avoid_sources)
    if cols.size == 0:
        return Plan((), np.zeros(0, np.uint64))
    old_idx, new_idx = old.owner_indices(cols), new.owner_indices(cols)
    work: dict[tuple[str, str], list[int]] = {}
    released: dict[str, list[int]] = {}
    lost: list[int] = []
    moved = 0
    for i, col in enumerate(cols.tolist()):
        before = {old.names[j] for j in old_idx[i]}
        after = {new.names[j] for j in new_idx[i]}
        gained = after - before
        for m in before - after:
            released.setdefault(m, []).append(col)
        if not gained:
            continue
        moved += 1
        preferred = _candidates(before, after, live_set, avoid)
        if not preferred:
            lost.append(col)
            continue
        for target in sorted(gained):
            work.setdefault((choose_source_per_column(col, target, preferred), target), []).append(col)
    transfers = tuple(Transfer(s, t, np.array(c, np.uint64)) for (s, t), c in sorted(work.items()))
    return Plan(transfers, np.array(lost, np.uint64),
                {m: np.array(c, np.uint64) for m, c in sorted(released.items())}, int(cols.size), moved)


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans are equal: transfers, lost columns, released columns, counts."""
    return (a.transfers == b.transfers and a.lost.tolist() == b.lost.tolist()
            and {m: c.tolist() for m, c in a.released.items()} == {m: c.tolist() for m, c in b.released.items()}
            and (a.columns_total, a.columns_moved) == (b.columns_total, b.columns_moved))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--columns", type=int, default=1_000_000, help="columns planned (default 10^6)")
    ap.add_argument("--members", type=int, default=10, help="members before the change (default 10)")
    ap.add_argument("--replicas", type=int, default=3, help="R (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="plans per variant and change, taking turns")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    if args.columns < 1 or args.members < 2 or args.replicas < 1 or args.rounds < 1:
        ap.error("--columns, --replicas, --rounds >= 1 and --members >= 2")
    names = [f"storage-{i:03d}" for i in range(args.members)]
    old = Placement(tuple(Member(n) for n in names), args.replicas)
    changes = {"join": (Placement(tuple(Member(n) for n in [*names, "storage-new"]), args.replicas),
                        [*names, "storage-new"]),
               "removenode": (Placement(tuple(Member(n) for n in names[1:]), args.replicas), names[1:])}
    cols = np.random.default_rng(7).integers(0, 2**63, args.columns, dtype=np.uint64)
    load = os.getloadavg()[0]
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for change, (new, live) in changes.items():
            plans = {}
            for variant, fn in (("per column (before)", plan_per_column), ("whole arrays (now)", plan_transfers)):
                start = time.perf_counter()
                plans[variant] = fn(old, new, cols, live)
                seconds.setdefault((change, variant), []).append(time.perf_counter() - start)
            if not same_plan(*plans.values()):
                raise SystemExit(f"{change}: the two plans differ")
    figures, rows = [], []
    for change in changes:
        before = statistics.median(seconds[(change, "per column (before)")])
        now = statistics.median(seconds[(change, "whole arrays (now)")])
        figures += [(f"plan {change} s, {args.columns} columns, per column (before)", before, None),
                    (f"plan {change} s, {args.columns} columns, whole arrays (now)", now, None),
                    (f"plan {change}, before / now", before / now, "> 1")]
        rows.append([change, f"{before:.2f}", f"{now:.2f}", f"{before / now:.1f}×"])
    if args.json:
        emit_figures(figures)
        return 0
    print_table(f"Rebalance plan of {args.columns:,} columns, {args.members} members, R = {args.replicas} "
                f"(median of {args.rounds}, load average {load:.1f} → {os.getloadavg()[0]:.1f}; same plans checked)",
                ["change", "per column (before), s", "whole arrays (now), s", "before / now"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
