"""Reads and writes while one replica folds its delta runs: around the folding node (reads with
``busy_ok``) and logged at once (writes: storage/engine/deferred_applies.py) against waiting for it,
in the same run (client/reads.py "Around folds", protocol.py "Reads during a fold").

    python -m tools.bench.fold_reads [--entries 10000000] [--repeat 2] [--json]

Two storage nodes in this process (tcp on loopback, R = 2: each holds every row), filled through a
``StorageClient`` with ``--entries`` entries in rows of 16 and folded, so each base holds them all.
Then, per round: a delta of new keys scattered over the stored rows (2 % of the base: under the fold
point, so nothing folds by itself; the fold point's jitter is off), and on the event loop, on a
fixed timeline, a read of ``READ_ROWS`` random stored rows every ``READ_EVERY_S`` seconds and a write
of ``WRITE_ROWS`` new rows every ``WRITE_EVERY_S`` (W = 2: both nodes must acknowledge it; latency
from its time on the timeline); at ``FOLD_AT_S`` node s0 folds its delta runs (the service's
``BackgroundFold``, as a due fold runs: a worker thread, the gate), so every base entry behind an
inserted key moves. Requests go on until ``AFTER_S`` past the fold's end. A read's rows go to their
first owner, s0 or s1 by row, so most reads ask both nodes. Rounds alternate *wait* (the code
before: the client's ``read_around_folds`` off, and s0's ``storage.fold-defer-bytes`` 0, so every
request waits for the node it asks) and *around* (the defaults: s0 answers reads at once and they go
to s1; writes are logged and acknowledged, and applied when the fold ends).

Figures per round: the fold's wall time, the reads issued during it and their p50 / p99, the p99 of
the reads issued outside it (same round), the ratio of the two p99s (target for *around*: <= 2, as
issue 14 item 3 sets for applies during a snapshot), and the same for the writes. Every read's rows
are checked against the rows written (strengths bit for bit) at the end of the round.
``--json`` prints one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tools.cluster_harness import Cluster

#: Entries per stored row.
ROW = 16
#: Rows per fill batch.
FILL_ROWS = 8192
#: Stored rows per read.
READ_ROWS = 16
READ_EVERY_S = 0.01
#: New rows per write (4 entries each), one write every WRITE_EVERY_S.
WRITE_ROWS = 32
WRITE_EVERY_S = 0.02
FOLD_AT_S = 0.3
AFTER_S = 0.3
#: Seconds between a round's delta writes and its timeline.
SETTLE_S = 1.0
#: New keys of a round's delta, as a share of the base.
DELTA_SHARE = 0.02
RATIO_TARGET = 2.0


def _batch(cols: np.ndarray, feats: np.ndarray, per_row: int, rng: np.random.Generator) -> Any:
    """A canonical batch: rows ``(cols[i], feats[i])`` (unique), ``per_row`` random entries each."""
    from giaannd.model.rows import RowBatch

    n = cols.shape[0] * per_row
    return RowBatch.from_entries(np.repeat(cols, per_row), np.repeat(feats, per_row),
                                 rng.integers(0, 4, n).astype(np.uint8), rng.integers(1, 2**40, n, dtype=np.uint64),
                                 rng.integers(0, 2**20, n, dtype=np.uint64), rng.integers(1, 5, n).astype(np.float32))


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def _round(cluster: Any, keys: np.ndarray, rng: np.random.Generator, around: bool) -> dict[str, Any]:
    client = cluster.client
    client.read_around_folds = around
    s0 = cluster.services["s0"]
    s0.store.deferred.max_bytes = s0.settings.fold_defer_bytes if around else 0
    base = cluster.services["s0"].store.store.engine.num_entries
    # the delta: new keys in stored rows, spread over the whole base
    rows = np.sort(rng.choice(keys.shape[0], max(1, int(base * DELTA_SHARE) // 2), replace=False))
    for first in range(0, rows.shape[0], FILL_ROWS):
        pick = keys[rows[first : first + FILL_ROWS]]
        await client.write(_batch(pick[:, 0], pick[:, 1], 2, rng))
    folds = cluster.services["s0"].folds
    gc.collect()
    await asyncio.sleep(SETTLE_S)  # what the delta's writes left to do (their fsyncs, freed memory)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    lat: list[tuple[float, float]] = []  # (issued at, seconds)
    wlat: list[tuple[float, float]] = []
    reads: list[tuple[np.ndarray, Any]] = []
    fold_span: list[float] = []

    async def fold() -> None:
        await asyncio.sleep(FOLD_AT_S)
        fold_span.append(loop.time() - t0)
        await folds.fold()
        fold_span.append(loop.time() - t0)

    async def read(at: float, pick: np.ndarray) -> None:
        got = await client.read_rows(pick[:, 0], pick[:, 1])
        lat.append((at, loop.time() - t0 - at))
        reads.append((pick, got))

    async def write(at: float, batch: Any) -> None:
        await client.write(batch)
        wlat.append((at, loop.time() - t0 - at))

    fold_task = loop.create_task(fold())
    tasks = []
    k = 0
    every = round(WRITE_EVERY_S / READ_EVERY_S)
    while True:
        at = k * READ_EVERY_S
        if len(fold_span) == 2 and at > fold_span[1] + AFTER_S:
            break
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        pick = keys[np.unique(rng.integers(0, keys.shape[0], READ_ROWS))]  # (choice without replacement
        # permutes every key: tens of ms per read at 10^6 rows, the bench's own stall)
        tasks.append(loop.create_task(read(at, pick)))
        if k % every == 0:  # new rows (random keys): the reads' rows do not change
            fresh = rng.integers(1, 2**63, (WRITE_ROWS, 2), dtype=np.uint64)
            fresh = fresh[np.lexsort((fresh[:, 1], fresh[:, 0]))]
            tasks.append(loop.create_task(write(at, _batch(fresh[:, 0], fresh[:, 1], 4, rng))))
        k += 1
    await fold_task
    await asyncio.gather(*tasks)
    start, end = fold_span
    during = [s * 1e3 for at, s in lat if start <= at <= end]
    outside = [s * 1e3 for at, s in lat if not start <= at <= end]
    wduring = [s * 1e3 for at, s in wlat if start <= at <= end]
    woutside = [s * 1e3 for at, s in wlat if not start <= at <= end]
    # every read's rows, checked against the store they were read from (both replicas are equal:
    # R = 2, W = 2, nothing written during the round)
    ref = cluster.services["s1"].store.store
    bad = 0
    for pick, got in reads:
        want = ref.read_rows(pick[:, 0], pick[:, 1])
        bad += int(not all(np.array_equal(np.asarray(x), np.asarray(y))
                           for x, y in zip(got.buffers(), want.buffers())))
    counters = s0.core.counters
    return {"fold_s": end - start, "during": len(during), "p50_during": _pct(during, 50),
            "p99_during": _pct(during, 99), "p99_outside": _pct(outside, 99), "bad": bad,
            "redirected": counters.reads_redirected, "deferred": counters.applies_deferred,
            "writes_during": len(wduring), "w_p99_during": _pct(wduring, 99), "w_p99_outside": _pct(woutside, 99)}


async def _fold(cluster: Cluster, name: str) -> None:
    """A fold of in-process node ``name``'s delta runs now (its service's ``BackgroundFold``)."""
    folds = cluster.services[name].folds
    assert folds is not None, f"{name}'s storage service is not started"
    await folds.fold()


async def _main(entries: int, repeat: int, seed: int) -> list[tuple[str, dict[str, Any], str]]:
    from tools.cluster_harness import Cluster

    rng = np.random.default_rng(seed)
    nrows = max(FILL_ROWS, entries // ROW)
    cols = rng.integers(1, 2**63, nrows, dtype=np.uint64)
    feats = rng.integers(0, 2**16, nrows, dtype=np.uint64)
    keys = np.unique(np.stack([cols, feats], axis=1), axis=0)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = await Cluster(Path(tmp), 2, scheme="tcp", replicas=2, write_quorum=2,
                                capacity_bytes=64 * entries + (1 << 30), request_timeout_s=60.0).start(
            heap_trim_interval_s=0.0, fold_jitter=0.0, snapshot_interval_s=3600.0)
        try:
            for start in range(0, keys.shape[0], FILL_ROWS):
                part = keys[start : start + FILL_ROWS]
                await cluster.client.write(_batch(part[:, 0], part[:, 1], ROW, rng))
            for name in ("s0", "s1"):
                await _fold(cluster, name)
            for _ in range(repeat):
                for around in (False, True):
                    load = f"{os.getloadavg()[0]:.1f}"
                    r = await _round(cluster, keys, rng, around)
                    await _fold(cluster, "s1")  # s1 folds the round's delta too (not timed)
                    out.append(("around" if around else "wait", r, load))
        finally:
            await cluster.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from tools.bench.report import emit_figure, print_table

    started = time.perf_counter()
    results = asyncio.run(_main(args.entries, args.repeat, args.seed))
    if args.json:
        for i, (mode, r, _) in enumerate(results):
            n = f"round {i // 2 + 1}, {mode}"
            emit_figure(f"read p99 ms during a replica's fold, {n}", r["p99_during"])
            emit_figure(f"read p99 ms outside the fold, {n}", r["p99_outside"])
            emit_figure(f"read p99 during / outside the fold, {n}", r["p99_during"] / r["p99_outside"],
                        f"<= {RATIO_TARGET:g}" if mode == "around" else None)
            emit_figure(f"write p99 ms during a replica's fold, {n}", r["w_p99_during"])
            emit_figure(f"write p99 during / outside the fold, {n}", r["w_p99_during"] / r["w_p99_outside"],
                        f"<= {RATIO_TARGET:g}" if mode == "around" else None)
            emit_figure(f"fold wall s, {n}", r["fold_s"])
            emit_figure(f"reads that differ from the stored rows, {n}", r["bad"], "== 0")
        return
    rows = []
    for mode, r, load in results:
        ratio = r["p99_during"] / r["p99_outside"]
        wratio = r["w_p99_during"] / r["w_p99_outside"]
        target = f" (<= {RATIO_TARGET:g})" if mode == "around" else ""
        rows.append([mode, f"{r['fold_s']:.2f}", str(r["during"]), f"{r['p50_during']:.1f}", f"{r['p99_during']:.1f}",
                     f"{r['p99_outside']:.1f}", f"{ratio:.2f}{target}", str(r["writes_during"]),
                     f"{r['w_p99_during']:.1f}", f"{r['w_p99_outside']:.1f}", f"{wratio:.2f}{target}",
                     str(r["bad"]), load])
    print_table(f"Reads and writes while one of two replicas folds ({args.entries:.0e} entries per node, "
                f"{time.perf_counter() - started:.0f} s)",
                ["mode", "fold wall s", "reads during it", "read p50 ms during", "read p99 ms during",
                 "read p99 ms outside", "read p99 during / outside", "writes during it", "write p99 ms during",
                 "write p99 ms outside", "write p99 during / outside", "rows differing", "load (1 min)"], rows)


if __name__ == "__main__":
    main()
