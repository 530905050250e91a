"""A scan of a store that gains rows while it runs (export, repair's digest pages under training),
in one run: a page on a quiet store, a page after new rows (now), and the same page after a sort
of every key (what each such page cost before: storage/engine/sorted_keys.py).

    python -m tools.bench.scan_live [--rows 2000000] [--pages 20] [--new-rows 10] [--json]

Why: the store lists rows in key order from a sorted copy of its keys. Before, any row created
since that copy was made (training creates rows all the time) made the next page sort every key
of the store again, on the event loop: ~0.5 s a page at 2·10^6 rows, seconds at 10^7. Now new
rows are merged into a small sorted tail and a page reads the keys after its cursor from both
runs (``SortedKeys.window``).

The store: ``--rows`` one-entry rows over ``--rows``/20 columns, folded. Each figure is the median
CPU milliseconds of a page of 4,096 rows (262,144 keys examined at most) over ``--pages`` pages:
"quiet" with nothing written between pages, "new rows" with ``--new-rows`` rows created before
each page, "before" the same plus one ``lexsort`` of every key per page. The target: a page
after new rows costs at most 2× a quiet page. ``--json`` prints one ``{"figure", "value",
"target"}`` object per figure.

``--burst N`` (default 10^6) adds the first page after N rows were created with no listing between
(hours of training on a node): the page sorting them itself, on the caller's thread (the baseline,
what every storage node did before Dec 2), against the page after the rows were sorted apart, as a
storage node now does in a worker thread once ``KEYS_BEHIND_APART_ROWS`` wait
(``ColumnStore.key_tail_source``, ``sorted_keys.extended_tail``, ``install_key_tail``; the sort
itself is timed apart: what the worker thread spends). Wall milliseconds on the thread that
serves the page, best of three bursts each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore
from tools.bench.report import emit_figures, print_table

__all__ = ["main"]

PAGE_ROWS, PAGE_EXAMINE = 4096, 262_144


def _rows(rng: np.random.Generator, n: int, columns: int) -> RowBatch:
    return RowBatch.from_entries(rng.integers(1, columns + 1, n).astype(np.uint64),
                                 rng.integers(1, 2**62, n, dtype=np.uint64), np.zeros(n, np.uint8),
                                 np.ones(n, np.uint64), np.ones(n, np.uint64), np.ones(n, np.float32))


def measure(rows: int, pages: int, new_rows: int) -> dict[str, list[float]]:
    """CPU seconds per page of each variant (module docstring), on one store."""
    rng = np.random.default_rng(1)
    columns = max(1, rows // 20)
    store = ColumnStore(1 << 40)
    store.apply(BatchId(1, 1), _rows(rng, rows, columns))
    store.fold_deltas()
    seq = 1
    out: dict[str, list[float]] = {"quiet": [], "new rows": [], "before": []}
    for variant in out:
        page = store.scan(None, PAGE_ROWS, 1 << 24, PAGE_EXAMINE)
        for _ in range(pages):
            if variant != "quiet":
                seq += 1
                store.apply(BatchId(1, seq), _rows(rng, new_rows, columns))
            cpu = time.process_time()
            if variant == "before":
                a, b = store.engine.keys()
                np.lexsort((b, a))
            page = store.scan(None if page.done else page.next_key, PAGE_ROWS, 1 << 24, PAGE_EXAMINE)
            out[variant].append(time.process_time() - cpu)
    return out


def measure_burst(rows: int, burst: int, rounds: int = 3) -> dict[str, float]:
    """Wall seconds of the first page after ``burst`` new rows: sorted by the page ("inline"), or
    sorted apart first ("apart"; "apart sort": the sort itself), best of ``rounds`` each."""
    from giaannd.storage.engine.sorted_keys import extended_tail

    rng = np.random.default_rng(2)
    columns = max(1, rows // 20)
    best = {"inline": float("inf"), "apart": float("inf"), "apart sort": float("inf")}
    for _ in range(rounds):
        for variant in ("inline", "apart"):
            store = ColumnStore(1 << 40)
            store.apply(BatchId(1, 1), _rows(rng, rows, columns))
            store.fold_deltas()
            store.scan(None, PAGE_ROWS, 1 << 24, PAGE_EXAMINE)  # the key order current
            store.apply(BatchId(1, 2), _rows(rng, burst, columns))
            if variant == "apart":
                t = time.perf_counter()
                got = store.key_tail_source()
                assert got is not None  # (rows wait: the burst)
                a, b, (rows_tail, first, num_rows, _) = got
                tail = extended_tail(a, b, rows_tail, first, num_rows)
                best["apart sort"] = min(best["apart sort"], time.perf_counter() - t)
                assert store.install_key_tail(tail, got[2])
            t = time.perf_counter()
            store.scan(None, PAGE_ROWS, 1 << 24, PAGE_EXAMINE)
            best[variant] = min(best[variant], time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.scan_live", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows in the store (default 2·10^6)")
    ap.add_argument("--pages", type=int, default=20, help="pages per variant")
    ap.add_argument("--new-rows", type=int, default=10, help="rows created before each page")
    ap.add_argument("--burst", type=int, default=1_000_000,
                    help="rows created with no listing between before the burst figures' page (0: skip them)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    if args.rows < PAGE_ROWS or args.pages < 1 or args.new_rows < 1 or args.burst < 0:
        ap.error(f"--rows ≥ {PAGE_ROWS}, --pages ≥ 1, --new-rows ≥ 1, --burst ≥ 0")
    load = os.getloadavg()[0]
    res = measure(args.rows, args.pages, args.new_rows)
    ms = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    figures = [("scan page CPU ms, quiet store", ms["quiet"], None),
               (f"scan page CPU ms, {args.new_rows} new rows before it", ms["new rows"], None),
               (f"scan page CPU ms, {args.new_rows} new rows and a sort of every key (before)", ms["before"], None),
               ("scan page after new rows / quiet page", ms["new rows"] / ms["quiet"], "≤ 2"),
               ("scan page before / now", ms["before"] / ms["new rows"], "> 1")]
    if args.burst:
        burst = {k: v * 1e3 for k, v in measure_burst(args.rows, args.burst).items()}
        figures += [(f"first page after {args.burst:,} new rows, ms: they sorted by the page (before Dec 2)",
                     burst["inline"], None),
                    (f"first page after {args.burst:,} new rows, ms: they sorted apart first (a storage node now)",
                     burst["apart"], None),
                    (f"the sort apart of {args.burst:,} new rows, ms (a worker thread's)", burst["apart sort"], None),
                    ("first page after a burst: sorted by the page / sorted apart", burst["inline"] / burst["apart"],
                     "> 1")]
    if args.json:
        emit_figures(figures)
        return 0
    print_table(f"Scan pages of a store of {args.rows:,} rows that gains rows ({args.pages} pages each, "
                f"load average {load:.1f})", ["figure", "value", "target"],
                [[name, f"{value:.2f}", target or ""] for name, value, target in figures])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
