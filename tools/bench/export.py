"""Export and scan stream (issue 14 item 7): scan MB/s, export MB/s and the exporter's memory.

``python -m tools.bench.export [--entries N] [--nodes 3] [--replicas 2] [--scheme mem] [--json]``:
an in-process storage cluster (tools/cluster_harness: real storage services, ``mem://`` or
``tcp://`` on loopback) holding N entries in rows of median 17 entries (log-normal lengths), every
id named in the exporting node's vocabulary. Measured, each path in the same run:

- **storage scan page** (one node's store, every row): the vectorised page (row_scan.py) against
  the per-row page of the dict-of-regions store (baseline_scan.py, a frozen copy), MB/s of row bytes (21 per entry),
  best of ``SCAN_REPEATS`` interleaved runs;
- **cluster scan**: ``StorageClient.scan_all`` (every node's share, merged k-way in key order),
  MB/s, best of ``SCAN_REPEATS``. Every node serves from this one process, so this is the
  nodes' page building, the transport and the client's checks and merge on one core, in series;
- **export**: ``export_cluster`` (the stream: pages merged, lines written as they come) against the
  one-piece path it replaced (``scan_cluster`` + ``write_export``: the whole model in one batch and
  one RowStore), MB/s of row bytes, and each one's **peak RSS growth** (VmHWM, reset through
  /proc/self/clear_refs before each, minus VmRSS then). The storage nodes live in this process, so
  their page copies count too: an upper bound for an exporter on its own.

Targets (the issue): scan >= 200 MB/s; the exporter holds <= 256 MiB whatever the model size.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from giaannd.compute.cluster_export import export_cluster, scan_cluster, write_export
from giaannd.model.rows import RowBatch, RowKey
from giaannd.model.vocab import Vocabulary
from giaannd.storage.engine.row_scan import ScanResult
from tools.bench import baseline_scan
from tools.bench.report import emit_figure, print_table
from tools.cluster_harness import Cluster

SCAN_TARGET_MB_S = 200.0
RSS_TARGET_MIB = 256.0
#: Rows written per client write (a training window's order of magnitude).
WRITE_ROWS = 60_000


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0); returns the RSS in KiB."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_kib("VmRSS")


def model_batch(rng: np.random.Generator, vocab: Vocabulary, ids: tuple[np.ndarray, np.ndarray], rows: int) -> RowBatch:
    """``rows`` random rows of median 17 entries over the ids of ``vocab``."""
    cols, feats = ids
    lengths = np.maximum(1, rng.lognormal(np.log(17), 0.8, rows).astype(np.int64))
    n = int(lengths.sum())
    return RowBatch.from_entries(np.repeat(rng.choice(cols, rows), lengths),
                                 np.repeat(rng.choice(feats, rows), lengths), rng.integers(0, 9, n).astype(np.uint8),
                                 rng.choice(cols, n), rng.choice(feats, n), rng.integers(1, 50, n).astype(np.float32))


#: Scans are timed this many times each, the best kept (a shared host is noisy; the export and its
#: memory are measured once: their run is long and the peak is what it is).
SCAN_REPEATS = 3


def store_scan_rates(cluster: Cluster) -> tuple[float, float]:
    """MB/s of the new and the baseline page over one node's whole store (4 MiB pages), best of
    ``SCAN_REPEATS`` each, interleaved."""
    store = cluster.column_store(next(iter(cluster.services)))
    cols = np.array([k[0] for k in store.keys()], np.uint64)
    feats = np.array([k[1] for k in store.keys()], np.uint64)
    # the baseline's dict of one region per row (built once, outside the timing)
    slots = {key: baseline_scan.RowSlot(np.frombuffer(region, np.uint8)) for key, _, region in store.iter_slots()}
    rates = [0.0, 0.0]
    pages: tuple[Callable[[RowKey | None], ScanResult | baseline_scan.ScanResult], ...] = (
        lambda after: store.scan(after, 65_536, 800_000, 262_144, limit_bytes=4 << 20),
        lambda after: baseline_scan.scan_page(slots, cols, feats, after, 65_536, 200_000, 262_144))
    for _ in range(SCAN_REPEATS):
        for i, page in enumerate(pages):
            t, nbytes = time.perf_counter(), 0
            after: RowKey | None = None
            while True:
                res = page(after)
                nbytes += res.batch.num_entries * 21
                if res.done:
                    break
                after = res.next_key
            rates[i] = max(rates[i], nbytes / (time.perf_counter() - t) / 1e6)
    return rates[0], rates[1]


async def run(entries: int, nodes: int, replicas: int, scheme: str, root: Path) -> dict[str, Any]:
    cluster = await Cluster(root / "storage", nodes, replicas=replicas, scheme=scheme,
                            capacity_bytes=max(1 << 30, entries * 21 * 4), request_timeout_s=120.0).start()
    try:
        vocab = Vocabulary()
        ids = (np.array([vocab.add_column(f"lemma{i}") for i in range(3_000)], np.uint64),
               np.array([vocab.add_feature(f"word{i}") for i in range(2_000)] + [0], np.uint64))
        rng = np.random.default_rng(14)
        written, t = 0, time.perf_counter()
        while written < entries:
            batch = model_batch(rng, vocab, ids, WRITE_ROWS)
            await cluster.client.write(batch)
            written += batch.num_entries
        out: dict[str, Any] = {"entries": written, "write_s": time.perf_counter() - t}
        out["store_new"], out["store_old"] = store_scan_rates(cluster)

        out["scan_mb_s"] = 0.0
        for _ in range(SCAN_REPEATS):
            t, nbytes = time.perf_counter(), 0
            async for page in cluster.client.scan_all():
                nbytes += page.num_entries * 21
            out["scan_mb_s"] = max(out["scan_mb_s"], nbytes / (time.perf_counter() - t) / 1e6)
        model_bytes = nbytes

        async def no_lookup(keys: Any) -> dict[tuple[int, int], str]:
            raise AssertionError("every id is in the vocabulary")

        base = _reset_peak()
        t = time.perf_counter()
        res = await export_cluster(cluster.client, vocab, no_lookup, root / "new.jsonl",
                                   page_bytes=4 << 20, chunk_entries=65_536)
        out["new_s"] = time.perf_counter() - t
        out["new_rss_mib"] = (_status_kib("VmHWM") - base) / 1024
        out["lines"] = res["lines"]
        out["jsonl_bytes"] = (root / "new.jsonl").stat().st_size

        base = _reset_peak()
        t = time.perf_counter()
        batch = await scan_cluster(cluster.client)
        await write_export(batch, vocab, root / "old.jsonl")
        del batch
        out["old_s"] = time.perf_counter() - t
        out["old_rss_mib"] = (_status_kib("VmHWM") - base) / 1024
        out["same_bytes"] = (root / "new.jsonl").read_bytes() == (root / "old.jsonl").read_bytes()
        out["model_mib"] = model_bytes / 2**20
        out["model_mb"] = model_bytes / 1e6
        return out
    finally:
        await cluster.close()


def report(r: dict[str, Any], as_json: bool) -> None:
    new_mb_s, old_mb_s = r["model_mb"] / r["new_s"], r["model_mb"] / r["old_s"]
    if as_json:
        emit_figure("store_scan_page_mb_s", r["store_new"], f">= {SCAN_TARGET_MB_S:g}")
        emit_figure("store_scan_page_baseline_mb_s", r["store_old"])
        emit_figure("cluster_scan_mb_s", r["scan_mb_s"], f">= {SCAN_TARGET_MB_S:g}")
        emit_figure("export_mb_s", new_mb_s)
        emit_figure("export_baseline_mb_s", old_mb_s)
        emit_figure("export_peak_rss_growth_mib", r["new_rss_mib"], f"<= {RSS_TARGET_MIB:g}")
        emit_figure("export_baseline_peak_rss_growth_mib", r["old_rss_mib"])
        return
    print(f"{r['entries']:,} entries ({r['model_mib']:.0f} MiB of rows, {r['lines']:,} lines, "
          f"{r['jsonl_bytes'] / 2**20:.0f} MiB of JSONL); written in {r['write_s']:.1f} s; "
          f"new export byte-identical to the old: {r['same_bytes']}")
    print_table("Export and scan stream (same run)", ["figure", "new", "old (baseline)", "new / old", "target"], [
        ["storage scan page, MB/s", f"{r['store_new']:.0f}", f"{r['store_old']:.0f}",
         f"{r['store_new'] / r['store_old']:.1f}x", f">= {SCAN_TARGET_MB_S:g}"],
        ["cluster scan (merged), MB/s", f"{r['scan_mb_s']:.0f}", "-", "-", f">= {SCAN_TARGET_MB_S:g}"],
        ["export, MB/s of rows", f"{new_mb_s:.1f}", f"{old_mb_s:.1f}", f"{new_mb_s / old_mb_s:.1f}x", "-"],
        ["exporter peak RSS growth, MiB", f"{r['new_rss_mib']:.0f}", f"{r['old_rss_mib']:.0f}",
         f"{r['new_rss_mib'] / max(r['old_rss_mib'], 1e-9):.2f}x", f"<= {RSS_TARGET_MIB:g}"],
    ])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=10_000_000, help="model entries (default 10^7)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--scheme", choices=("mem", "tcp"), default="mem")
    ap.add_argument("--json", action="store_true", help="one {figure, value, target} object per line")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="giaannd-bench-export-") as tmp:
        r = asyncio.run(run(args.entries, args.nodes, args.replicas, args.scheme, Path(tmp)))
    report(r, args.json)


if __name__ == "__main__":
    main()
