"""Parts of a big row that delta entries touch (issue 14 item 5): ``RowEngine.read_part`` against
the whole row merged for every part (the same-run baseline, as ``ColumnStore.read_part`` did before
Nov 30's sixth session), each figure next to its target.

    python -m tools.bench.row_parts [--entries 10000000] [--part-entries 400000] [--rounds 2] [--json]

One ``ColumnStore`` holds one folded row of ``--entries`` entries plus one delta entry (a row
written since the last fold); the row is read in parts of ``--part-entries`` (8 MiB of 21-byte
entries by default, the storage client's read chunk) both ways, alternately, ``--rounds`` times.
Per way: process CPU seconds for the whole row, and the peak of numpy's allocations during it
(``tracemalloc``: what a node's reads hold at once, the parts' copies included). Targets: the
memory of a read ≤ row size + 64 MiB on the node (issue 14 item 5); a part costs O(part), so the
ratio of the two ways grows with the row. ``--json`` prints one ``{"figure", "value", "target"}``
object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore
from tools.bench.report import emit_figures, print_table

__all__ = ["main", "measure"]


def _store(entries: int) -> tuple[ColumnStore, int]:
    store = ColumnStore(1 << 44)
    tf = np.arange(0, 2 * entries, 2, dtype=np.uint64)
    store.apply(BatchId(1, 1), RowBatch.from_entries(np.full(entries, 7), np.zeros(entries), np.zeros(entries),
                                                     np.zeros(entries), tf, np.ones(entries, np.float32)),
                validate=False)
    store.fold_deltas()
    u64 = np.uint64
    store.apply(BatchId(1, 2), RowBatch.from_entries(np.array([7], u64), np.array([0], u64), np.array([0], np.uint8),
                                                     np.array([0], u64), np.array([2 * (entries // 2) + 1], u64),
                                                     np.array([2.0], np.float32)))
    return store, store.engine.row_id(7, 0)


def measure(entries: int, part_entries: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Way -> (best CPU seconds, largest peak MiB) over ``rounds`` alternated rounds; both ways
    check that they read every entry of the row."""
    store, rid = _store(entries)
    engine = store.engine
    total = entries + 1

    def whole() -> int:  # the baseline: the row merged whole, then sliced, for every part
        got = 0
        for a in range(0, total, part_entries):
            got += len(engine.read(rid).seg[a:a + part_entries])
        return got

    def parts() -> int:
        got = 0
        for a in range(0, total, part_entries):
            got += len(engine.read_part(rid, a, a + part_entries)[1].seg)
        return got

    ways: dict[str, Callable[[], int]] = {"whole row merged per part (before)": whole, "read_part (now)": parts}
    out: dict[str, tuple[float, float]] = {}
    for _ in range(rounds):
        for name, fn in ways.items():
            tracemalloc.start()
            start = time.process_time()
            got = fn()
            cpu = time.process_time() - start
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            if got != total:
                raise AssertionError(f"{name} read {got} of {total} entries")
            best, worst = out.get(name, (float("inf"), 0.0))
            out[name] = (min(best, cpu), max(worst, peak))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=10_000_000, help="entries of the row (default 10^7)")
    ap.add_argument("--part-entries", type=int, default=400_000, help="entries per part (default 400,000: 8 MiB)")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    got = measure(args.entries, args.part_entries, args.rounds)
    (base_cpu, base_mib), (now_cpu, now_mib) = got["whole row merged per part (before)"], got["read_part (now)"]
    row_mib = 21 * (args.entries + 1) / 2**20
    figures = [
        ("row parts: CPU s, read_part (now)", now_cpu, None),
        ("row parts: CPU s, whole row merged per part (baseline)", base_cpu, None),
        ("row parts: CPU, baseline / now", base_cpu / max(now_cpu, 1e-9), "> 1"),
        ("row parts: peak MiB of numpy allocations, read_part (now)", now_mib, f"<= {row_mib + 64:.0f} (row + 64 MiB)"),
        ("row parts: peak MiB of numpy allocations, whole row merged per part (baseline)", base_mib, None),
    ]
    if args.json:
        emit_figures(figures)
        return
    print_table(f"parts of a {args.entries:,}-entry row with one delta entry, {args.part_entries:,} entries a part "
                f"(best CPU / largest peak of {args.rounds} alternated rounds)",
                ["figure", "value", "target"], [[n, f"{v:.3f}", t or "-"] for n, v, t in figures])


if __name__ == "__main__":
    main()
