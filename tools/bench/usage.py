"""Row sizes and column contents (issue 21, server side): what the two new answers cost.

``python -m tools.bench.usage [--rows N] [--entries M] [--json]``. Measured in one process, each
against its same-run baseline, best of ``REPEATS``:

- **row-size histogram** (``ColumnStore.row_size_log2``, a storage node's ``GetUsage``) on a store
  of N rows loaded in bulk: the counts the store keeps as rows change (O(bins)) against the walk
  it avoids (every slot's region length by C-level ``map``s, then the same ``log2_histogram``);
- **apply with the counts kept**: training-like batches applied with and without the counting
  (``_count_sizes`` replaced by a no-op), the ratio being its cost;
- **column contents** (``cluster_export.column_contents``, ``GET /v1/columns/{c}/rows``): one column
  of M entries (1,000 rows, 2,000 target columns, 5,000 words) laid out as word arrays and encoded
  as JSON, against the export turning the same rows into its JSONL lines (``jsonl_bytes``), in ns
  per entry.

Targets: the issue sets none for speed; the one kept here is that keeping the counts costs applies
at most 5 % (``APPLY_OVERHEAD_TARGET``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from giaannd.client.column_rows import ColumnRead
from giaannd.compute.cluster_export import column_contents
from giaannd.model.export import jsonl_bytes
from giaannd.model.rows import Row, RowBatch
from giaannd.model.vocab import Vocabulary
from giaannd.protocol import BatchId
from giaannd.storage.engine import column_store
from giaannd.storage.engine.column_store import ColumnStore, log2_histogram
from tools.bench.report import emit_figure, print_table

REPEATS = 3
APPLY_OVERHEAD_TARGET = 1.05


def _best(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _walk(store: ColumnStore) -> list[int]:
    """The baseline: every row's length recounted (from the engine's lengths), then histogrammed."""
    return log2_histogram(store.engine.lengths())


def bench_histogram(n_rows: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    lengths = np.maximum(1, rng.lognormal(2.8, 1.0, n_rows).astype(np.int64))
    offsets = np.zeros(n_rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    store, n = ColumnStore(1 << 50), int(offsets[-1])
    store.load_bulk(np.arange(1, n_rows + 1, dtype=np.uint64), np.zeros(n_rows, np.uint64), offsets,
                    Row(np.zeros(n, np.uint8), np.zeros(n, np.uint64), np.zeros(n, np.uint64), np.zeros(n, np.float32)),
                    np.ones(n_rows, np.uint64))
    assert store.row_size_log2() == _walk(store)
    return {"kept_us": _best(store.row_size_log2, 100) * 1e6, "walk_us": _best(lambda: _walk(store)) * 1e6}


def _batches(rng: np.random.Generator, count: int, entries: int) -> list[RowBatch]:
    return [RowBatch.from_entries(rng.integers(1, 20_000, entries).astype(np.uint64), rng.integers(0, 20, entries),
                                  rng.integers(0, 9, entries), rng.integers(0, 500, entries).astype(np.uint64),
                                  rng.integers(0, 50, entries), rng.random(entries, dtype=np.float32))
            for _ in range(count)]


def bench_apply(count: int = 30, entries: int = 20_000) -> dict[str, float]:
    batches = _batches(np.random.default_rng(2), count, entries)

    def run() -> None:
        store = ColumnStore(1 << 40)
        for i, b in enumerate(batches):
            store.apply(BatchId(1, i + 1), b)

    kept = column_store.ColumnStore._count_sizes
    times: dict[str, float] = {"with_s": float("inf"), "without_s": float("inf")}
    try:
        for _ in range(REPEATS):  # interleaved, so drift hits both alike
            column_store.ColumnStore._count_sizes = kept  # type: ignore[method-assign]
            times["with_s"] = min(times["with_s"], _best(run, 1))
            column_store.ColumnStore._count_sizes = lambda self, lengths, sign=1: None  # type: ignore[method-assign]
            times["without_s"] = min(times["without_s"], _best(run, 1))
    finally:
        column_store.ColumnStore._count_sizes = kept  # type: ignore[method-assign]
    return times


def bench_column(entries: int) -> dict[str, float]:
    vocab = Vocabulary()
    col = vocab.add_column("water")
    cols = np.array([vocab.add_column(f"lemma{i}") for i in range(2000)], np.uint64)
    feats = np.array([0] + [vocab.add_feature(f"word{i}") for i in range(5000)], np.uint64)
    rng = np.random.default_rng(3)
    rows = RowBatch.from_entries(np.full(entries, col, np.uint64), feats[rng.integers(0, 1000, entries)],
                                 rng.integers(0, 9, entries), cols[rng.integers(0, 2000, entries)],
                                 feats[rng.integers(0, 5001, entries)], rng.random(entries, dtype=np.float32))
    read = ColumnRead(col, "bench", rows, rows.num_entries, False)

    async def no_lookup(keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
        return {}

    def contents() -> bytes:
        doc = asyncio.run(column_contents(read, vocab, no_lookup))
        assert doc is not None
        return msgspec.json.encode(doc)

    n = rows.num_entries
    return {"entries": n, "contents_ns": _best(contents) / n * 1e9,
            "export_ns": _best(lambda: jsonl_bytes(rows, vocab)) / n * 1e9}


def report(r: dict[str, dict[str, float]], as_json: bool) -> None:
    h, a, c = r["histogram"], r["apply"], r["column"]
    apply_ratio = a["with_s"] / a["without_s"]
    if as_json:
        emit_figure("row_size_log2_us", h["kept_us"])
        emit_figure("row_size_log2_walk_baseline_us", h["walk_us"])
        emit_figure("apply_with_size_counts_ratio", apply_ratio, f"<= {APPLY_OVERHEAD_TARGET:g}")
        emit_figure("column_contents_ns_per_entry", c["contents_ns"])
        emit_figure("column_contents_export_baseline_ns_per_entry", c["export_ns"])
        return
    print_table("Row sizes and column contents (same run)", ["figure", "new", "baseline", "new / baseline", "target"], [
        [f"row-size histogram, {r['rows']:,} rows (µs)", f"{h['kept_us']:.1f}", f"{h['walk_us']:.0f} (walk)",
         f"{h['kept_us'] / h['walk_us']:.5f}", "none"],
        [f"apply {a['count']:.0f} batches (s)", f"{a['with_s']:.2f}", f"{a['without_s']:.2f} (no counts)",
         f"{apply_ratio:.3f}", f"<= {APPLY_OVERHEAD_TARGET:g}"],
        [f"column contents + JSON, {c['entries']:,.0f} entries (ns/entry)", f"{c['contents_ns']:.0f}",
         f"{c['export_ns']:.0f} (export lines)", f"{c['contents_ns'] / c['export_ns']:.2f}", "none"],
    ])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.usage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the histogram's store (default 10^6)")
    ap.add_argument("--entries", type=int, default=1_000_000, help="entries of the column (default 10^6)")
    ap.add_argument("--batches", type=int, default=30, help="batches of the apply figure (default 30)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args()
    apply = bench_apply(args.batches)
    r = {"rows": args.rows, "histogram": bench_histogram(args.rows), "apply": {**apply, "count": args.batches},
         "column": bench_column(args.entries)}
    report(r, args.json)


if __name__ == "__main__":
    main()
