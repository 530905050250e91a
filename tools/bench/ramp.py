"""Ramp-up of a returning storage node (ramp.py): reads and hint delivery, with and without ramp.

    python -m tools.bench.ramp [--ramp-s 8] [--hint-mb 6] [--seconds 10]

Three in-process storage nodes (mem://, tools/cluster_harness), R = 3. A node is stopped, writes continue (its share
becomes hints on the others), then it comes back while a reader keeps reading. Printed per second
after its return: the share of the rows it is first in line for that it served, the rows it served
(and their share of all rows read), and the hint bytes delivered to it — once with the ramp off (the baseline: what it
got
before this change) and once with ``--ramp-s`` for both reads and hints, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from giaannd.client.storage_client import StorageClient
from giaannd.config import StorageConfig
from tools.bench.report import print_table
from tools.cluster_harness import Cluster, make_batch

READ_ROWS = 2000


async def _phase(root: Path, ramp_s: float, hint_mb: float, seconds: int, start_rate: float
                 ) -> list[tuple[float, int, float, float]]:
    cluster = await Cluster(root, n=3, replicas=3, capacity_bytes=4 << 30).start(
        ramp_up_s=ramp_s, hint_ramp_start_bytes_per_s=start_rate)
    reader = StorageClient(cluster.client_topology, cluster.client.transports, read_ramp_s=ramp_s)
    rng = np.random.default_rng(11)
    try:
        base = make_batch(rng, 20_000)
        await cluster.client.write(base)
        await cluster.stop_node("s1")
        per = make_batch(rng, 1000, columns=rng.choice(base.row_column, 1000)).nbytes
        for _ in range(max(1, int(hint_mb * 2**20 / per))):
            await cluster.client.write(make_batch(rng, 1000, columns=rng.choice(base.row_column, 1000)))
        await cluster.client.flush()
        holders = [s.hints for s in cluster.services.values() if s.hints is not None and s.hints.held]
        held0 = sum(h.held_bytes for h in holders)
        placement = cluster.client_topology.placement
        s1 = placement.names.index("s1")
        svc = await cluster.restart_node("s1")
        assert svc is not None  # (an in-process node)
        t0 = time.monotonic()
        buckets = [[0, 0, 0, 0] for _ in range(seconds)]  # rows it served, rows it is first for, rows read, hint bytes
        last_held = held0
        while (t := time.monotonic() - t0) < seconds:
            b = buckets[int(t)]
            idx = rng.choice(base.num_rows, READ_ROWS, replace=False)
            cols, feats = base.row_column[idx], base.row_feature[idx]
            rows0 = svc.counters.rows_read
            await reader.read_rows(cols, feats)
            b[0] += svc.counters.rows_read - rows0
            b[1] += int((placement.owner_indices(cols)[:, 0] == s1).sum())
            b[2] += READ_ROWS
            held = sum(h.held_bytes for h in holders)
            b[3] += last_held - held
            last_held = held
            await asyncio.sleep(0.01)
        return [(r / max(f, 1), r, r / max(q, 1), h / 2**20) for r, f, q, h in buckets]
    finally:
        await reader.close()
        await cluster.close()


async def _main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        off = await _phase(Path(tmp) / "off", 0.0, args.hint_mb, args.seconds, args.start_rate)
        on = await _phase(Path(tmp) / "on", args.ramp_s, args.hint_mb, args.seconds, args.start_rate)
    rows = [[f"{i}–{i + 1}", f"{a[0]:.2f}", f"{a[1]:,} ({a[2]:.0%})", f"{a[3]:.2f}",
             f"{b[0]:.2f}", f"{b[1]:,} ({b[2]:.0%})", f"{b[3]:.2f}"]
            for i, (a, b) in enumerate(zip(off, on))]
    print_table(f"Returning node, per second after it came back (ramp {args.ramp_s:g} s, "
                f"{args.hint_mb:g} MiB of hints, hint start rate {args.start_rate / 2**20:g} MiB/s)",
                ["second", "no ramp: share of its rows", "no ramp: rows it served (of all)", "no ramp: hint MiB",
                 "ramp: share of its rows", "ramp: rows it served (of all)", "ramp: hint MiB"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ramp-s", type=float, default=8.0)
    ap.add_argument("--hint-mb", type=float, default=6.0)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--start-rate", type=float, default=StorageConfig().hint_ramp_start_bytes_per_s / 16,
                    help="hint bytes/s at the start of the ramp (scaled down with the hint volume)")
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    main()
