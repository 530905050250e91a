"""Repair's comparison of replicas at scale: per-row digests (version 1, one Python call per row on
both ends) against page-at-once digests (version 2) and array bookkeeping, in one run.

    python -m tools.bench.repair [--rows 1000000] [--rounds 2] [--json]

Why: ``giaannctl node repair`` (and the automatic repair after a restart) compares every row a node
holds with its peers' copies (repair/remote.py, step 4). Before, each row cost a Python digest
call on the peer and on the node, a Python tuple in several sets and lists, and a Python row
comparison where the strengths' last bits differ (replicas sum in different orders): at 10^8
entries a node (~6·10^6 rows) minutes of CPU and gigabytes of Python objects. Now the peer hashes a
page of rows in one compiled pass (repair digest version 2, storage/engine/row_digest.py), the node
hashes its copies the same way and compares arrays, and the rows to look at again are compared in
one vectorised pass per page (``wire.rows_differ``).

The replicas: two in-process storage nodes (mem://, R = 2, both own every column) given the same
``--rows`` rows (lengths geometric with median ~17 entries, targets random), then, on one tenth of
the rows, three increments applied in one order on s0 and in the reverse order on s1 (float sums
that differ in the last bit: compared again within the tolerance, not divergent), and 100 rows
that really differ (one more target on s1) and 100 held only by s0. Each variant runs
``repair_self`` on s0 in a fresh process (the stores built there first, not timed), the two taking
turns, ``--rounds`` each: CPU µs per row compared (both ends: one process), wall seconds, and the
resident memory the repair adds at its peak, per row (``VmHWM`` reset before it). "version 1" is
this tree asking its peer for version 1 digests (the path kept for peers from before versions:
per-row hashing on both ends; the rest of the comparison is the arrays of today); the tree
before this change measured in the same way is in the closing note and docs/topology.md. Both
variants must report the same rows compared and divergent (checked). ``--json`` prints one
``{"figure", "value", "target"}`` object per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.repair.remote import RepairServer, repair_self, with_repair
from tools.bench.child import median_range, peak_reset, run_child, status_kb
from tools.bench.report import emit_figures, print_table
from tools.cluster_harness import Cluster

__all__ = ["main"]

VARIANTS = ((1, "per-row digests (version 1)"), (2, "page digests (version 2, now)"))
#: Rows per applied batch while the stores are built.
BATCH_ROWS = 20_000
#: Rows per column.
ROWS_PER_COLUMN = 20
#: Rows that really differ (one more target on s1) and rows held by s0 only.
DIFFERENT, ONLY_HERE = 100, 100






def _rows(rng: np.random.Generator, first: int, n: int) -> RowBatch:
    """Rows ``first .. first + n`` of the bench's replicas (keys from their index)."""
    idx = np.arange(first, first + n, dtype=np.uint64)
    lengths = np.maximum(1, rng.geometric(1 / 25, n)).astype(np.int64)
    total = int(lengths.sum())
    return RowBatch.from_entries(
        np.repeat(idx // ROWS_PER_COLUMN + 1, lengths), np.repeat(idx % ROWS_PER_COLUMN + 1, lengths),
        rng.integers(0, 4, total).astype(np.uint8), rng.integers(1, 2**62, total, dtype=np.uint64),
        rng.integers(1, 2**62, total, dtype=np.uint64), rng.random(total, dtype=np.float32))


def _bumps(base: RowBatch, rng: np.random.Generator) -> RowBatch:
    """An increment of every entry of ``base``'s rows (the same keys, other strengths)."""
    return RowBatch.from_entries(np.repeat(base.row_column, np.diff(base.offsets)),
                                 np.repeat(base.row_feature, np.diff(base.offsets)), base.segment,
                                 base.target_column, base.target_feature,
                                 rng.random(len(base.segment), dtype=np.float32))


def _build(cluster: Cluster, rows: int) -> None:
    """The replicas (module docstring), applied straight to the two stores (no log)."""
    here, there = (cluster.column_store(n) for n in ("s0", "s1"))
    rng = np.random.default_rng(11)
    seq = 0
    for first in range(0, rows, BATCH_ROWS):
        seq += 1
        batch = _rows(rng, first, min(BATCH_ROWS, rows - first))
        here.apply(BatchId(1, seq), batch)
        if first + BATCH_ROWS >= rows:  # the last rows: some only here, some with one more target there
            keep = np.ones(batch.num_rows, bool)
            keep[-ONLY_HERE:] = False
            batch = batch.select_rows(keep)
        there.apply(BatchId(1, seq), batch)
        # a tenth of the rows: three increments, in one order here and the reverse there
        pick = batch.select_rows(rng.random(batch.num_rows) < 0.1)
        bumps = [_bumps(pick, rng) for _ in range(3)]
        for i, b in enumerate(bumps):
            here.apply(BatchId(2, 3 * seq + i), b)
        for i, b in reversed(list(enumerate(bumps))):
            there.apply(BatchId(2, 3 * seq + i), b)
    differ = np.arange(DIFFERENT, dtype=np.uint64) * np.uint64((rows - ONLY_HERE) // DIFFERENT)  # row indices
    there.apply(BatchId(3, 1), RowBatch.from_entries(
        differ // ROWS_PER_COLUMN + 1, differ % ROWS_PER_COLUMN + 1, np.zeros(DIFFERENT, np.uint8),
        np.full(DIFFERENT, 2**63, np.uint64),
        np.arange(DIFFERENT, dtype=np.uint64), np.ones(DIFFERENT, np.float32)))
    for store in (here, there):  # as an idle node's store is (service.py, fold_when_idle)
        store.fold_deltas()


async def _measure(rows: int, version: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-repair-") as tmp:
        cluster = await Cluster(Path(tmp), 2, replicas=2, capacity_bytes=1 << 36).start()
        try:
            _build(cluster, rows)
            addresses = {}
            for name in ("s0", "s1"):
                handler = with_repair(RepairServer(cluster.services[name]), cluster.endpoints[name].handle)
                listener = await cluster.transport(f"{name}-repair").listen(f"mem://{name}-repair", handler)
                addresses[name] = listener.address
            kw = {} if version is None else {"digest_version": version}
            rss0 = status_kb("VmRSS")
            reset = peak_reset()
            cpu, wall = time.process_time(), time.perf_counter()
            report = await repair_self(cluster.services["s0"], cluster.transport("repairer"), {"s1": addresses["s1"]},
                                       cluster.client_topology.placement, **kw)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            peak = status_kb("VmHWM") - rss0 if reset else -1
            count = report.get("rows_divergent_count", len(report["rows_divergent"]))
            return {"cpu": cpu, "wall": wall, "peak_kb": peak, "compared": report["rows_compared"],
                    "divergent": count, "failed": report["peers_failed"]}
        finally:
            await cluster.close()






def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.repair", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per replica (default 10^6)")
    ap.add_argument("--rounds", type=int, default=2, help="repairs per variant, taking turns")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        version = None if args.child[1] == "default" else int(args.child[1])
        print(json.dumps(asyncio.run(_measure(int(args.child[0]), version))))
        return 0
    if args.rows < 10 * (DIFFERENT + ONLY_HERE) or args.rounds < 1:
        ap.error(f"--rows ≥ {10 * (DIFFERENT + ONLY_HERE)}, --rounds ≥ 1")
    load_before = os.getloadavg()[0]
    results: dict[int, list[dict[str, Any]]] = {v: [] for v, _ in VARIANTS}
    for _ in range(args.rounds):
        for version, _name in VARIANTS:
            results[version].append(run_child("tools.bench.repair", str(args.rows), str(version)))
    load_after = os.getloadavg()[0]
    outcomes = {(r["compared"], r["divergent"]) for rs in results.values() for r in rs}
    if len(outcomes) != 1 or any(r["failed"] for rs in results.values() for r in rs):
        raise SystemExit(f"the variants disagree or failed: {results}")
    compared, divergent = outcomes.pop()
    figures: list[tuple[str, float, str | None]] = []
    table = []
    for version, name in VARIANTS:
        rs = results[version]
        cpu = [r["cpu"] / r["compared"] * 1e6 for r in rs]
        peak = [r["peak_kb"] * 1024 / r["compared"] if r["peak_kb"] >= 0 else float("nan") for r in rs]
        table.append([name, median_range(cpu), median_range([r["wall"] for r in rs]), median_range(peak, 1)])
        tag = f"version {version}"
        figures += [(f"repair CPU µs per row compared, {tag}", statistics.median(cpu), "≤ 2" if version == 2 else None),
                    (f"repair peak RSS growth B per row, {tag}", statistics.median(peak),
                     "≤ 100" if version == 2 else None)]
    ratio = statistics.median(r["cpu"] for r in results[1]) / statistics.median(r["cpu"] for r in results[2])
    figures.append(("repair CPU version 1 / version 2", ratio, "≥ 10"))
    if args.json:
        emit_figures(figures)
        return 0
    print_table(f"Repair of one replica against another, {compared:,} rows compared, {divergent} divergent "
                f"({args.rounds} rounds, load average {load_before:.1f} → {load_after:.1f})",
                ["digests", "CPU µs / row (target ≤ 2)", "wall s", "peak RSS growth, B / row (target ≤ 100)"], table)
    print(f"version 1 / version 2 CPU: {ratio:.1f}× (target ≥ 10)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
