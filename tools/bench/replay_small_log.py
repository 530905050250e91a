"""A restart's replay of a small log over stores of growing size: its cost must follow the log, not
the store.

    python -m tools.bench.replay_small_log [--rows 10000 1000000 20000000] [--window-entries 1000]
                                           [--rounds 5] [--json]

Why: a node killed soon after a snapshot restarts with a few records to replay over everything it
holds. The replay groups a window's entries by row (``RowEngine.apply_in_order``, inorder.py
``by_row``); until Nov 29 that grouping made a count and a cursor per row of the *store* and
passed over them, and the store copied every row's length and marked the touched rows in a flag
per row (25 bytes a row: at 6·10^7 rows ~1.4 GB and seconds for a window of 1,000 entries; at the
mission's 10^9 rows a node, ~25 GB). Now both number the window's own rows.

Each size runs in a fresh process (``--child``): a column store of that many one-entry rows
installed at once (``ColumnStore.load_bulk``, as a snapshot's load leaves it: no delta run), then
one ``ColumnStore.apply_in_order`` of a batch of ``--window-entries`` entries over 200 of its rows
(a restart's single window: the engine's replay, then the row-size counts and touches), timed
(wall), with the peak resident memory it adds (``VmHWM`` reset before it); the same path runs once
first on a small store (first-call dispatch). The baseline is the smallest store, the same window,
the same run: each larger store's time is printed as a ratio to it, target ≤ 10 for stores up to
6,000 times larger (a cost of the log's size, not the store's, which before grew with it: 360× at
2·10^7 rows; the window's lookups into a larger key index and base still miss the caches and the
TLB more: 1.5-8× here, ~1-3 ms for the window's 200 rows). Median of ``--rounds`` processes per
size. ``--json`` prints one ``{"figure", "value", "target"}`` object per figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore
from tools.bench.child import peak_reset, run_child, status_kb
from tools.bench.report import emit_figures, print_table

__all__ = ["child", "main"]

#: this bench's bound on a larger store's time over the smallest's: a cost of the log, not of the store
#: (a cost linear in the store would be thousands of times the smallest's; the window's lookups into a
#: larger key index and base still miss the caches and the TLB more: 2-8x measured)
TARGET = "<= 10"
#: rows the window touches
WINDOW_ROWS = 200


def _store(rows: int) -> ColumnStore:
    """A store of ``rows`` one-entry rows installed at once, every page of its arrays written (as a
    snapshot's load leaves them)."""
    store = ColumnStore(1 << 50)
    store.load_bulk(np.arange(rows, dtype=np.uint64), np.zeros(rows, np.uint64), np.arange(rows + 1, dtype=np.int64),
                    Row(np.full(rows, 1, np.uint8), np.ones(rows, np.uint64), np.ones(rows, np.uint64),
                        np.ones(rows, np.float32)), np.ones(rows, np.uint64))
    return store


def _window(rng: np.random.Generator, rows: int, window_entries: int) -> RowBatch:
    per_row = max(1, window_entries // WINDOW_ROWS)
    keys = np.repeat(rng.choice(rows, min(rows, WINDOW_ROWS), replace=False).astype(np.uint64), per_row)
    n = keys.shape[0]
    return RowBatch.from_entries(keys, np.zeros(n, np.uint64), np.zeros(n, np.uint8),
                                 rng.integers(0, 1 << 40, n).astype(np.uint64), np.ones(n, np.uint64),
                                 np.ones(n, np.float32))


def child(rows: int, window_entries: int, seed: int = 1) -> dict[str, float]:
    """One store of ``rows`` one-entry rows and one replay window over it, in this process:
    {"seconds", "peak_mib"}. The same path runs once first over a store of ``WINDOW_ROWS`` rows
    (the kernels' first-call dispatch is not a cost of the store's size)."""
    rng = np.random.default_rng(seed)
    _store(WINDOW_ROWS).apply_in_order([(BatchId(1, 1), _window(rng, WINDOW_ROWS, window_entries))])
    store = _store(rows)
    batch = _window(rng, rows, window_entries)
    peak_reset()
    before = status_kb("VmHWM")
    start = time.perf_counter()
    store.apply_in_order([(BatchId(1, 1), batch)])
    took = time.perf_counter() - start
    return {"seconds": took, "peak_mib": (status_kb("VmHWM") - before) / 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000, 20_000_000],
                    help="store sizes in rows of one entry; the first is the baseline (default 10^4 10^6 2·10^7)")
    ap.add_argument("--window-entries", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, type=int, metavar=("ROWS", "WINDOW_ENTRIES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    if len(args.rows) < 2 or min(args.rows) < WINDOW_ROWS or args.window_entries < 1 or args.rounds < 1:
        ap.error(f"--rows needs two sizes or more, each at least {WINDOW_ROWS}; --window-entries and --rounds >= 1")
    sizes = sorted(set(args.rows))
    got: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    for _ in range(args.rounds):  # sizes taking turns
        for n in sizes:
            got[n].append(run_child("tools.bench.replay_small_log", str(n), str(args.window_entries)))
    med = {n: statistics.median(r["seconds"] for r in got[n]) for n in sizes}
    peak = {n: statistics.median(r["peak_mib"] for r in got[n]) for n in sizes}
    base = sizes[0]
    figures: list[tuple[str, float, str | None]] = []
    rows = []
    for n in sizes:
        ratio = med[n] / med[base] if med[base] > 0 else float("nan")
        rows.append([f"{n:,}", f"{med[n] * 1e3:.2f}", f"{peak[n]:.1f}",
                     "1.00 (baseline)" if n == base else f"{ratio:.2f}", "" if n == base else TARGET])
        if n != base:
            figures.append((f"replay of a {args.window_entries}-entry window, {n} rows / {base} rows", ratio, TARGET))
        figures.append((f"replay of a {args.window_entries}-entry window over {n} rows, peak MiB added", peak[n], None))
    if args.json:
        emit_figures(figures)
    else:
        print_table(f"A restart's replay of one {args.window_entries}-entry window over stores of one-entry rows "
                    f"(median of {args.rounds} fresh processes each)",
                    ["rows held", "replay ms", "peak memory added, MiB", f"time / {base:,} rows", "target"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
