"""A storage node's recovery (``DurableStore.open``) phase by phase, against a same-run baseline.

    python -m tools.bench.recovery [--entries 20000000] [--log-share 0] [--rounds 3]
                                   [--before-tree DIR] [--store-cache DIR] [--json]

A store of ``--entries`` entries of real-shaped rows (median 17 entries a row:
``tools.bench.restart.build_store``, with ``--log-share`` of that logged after the snapshot; 0:
a snapshot and an empty log) is opened in fresh processes, page cache warm (the file was just
written or read; a cold cache adds the disk's read time). Each open is timed whole and by phase,
wall and CPU seconds per GB of row data (entries × 21 bytes), by wrapping the functions each
phase is in (names both trees have, so an older checkout is measured the same way):

- ``read + checksum``: the snapshot's sections read into their final arrays, the xxh3 of the body
  (``snapshot._Reader.array``: the destination's page faults are here);
- ``row checks``: every row's order, segments and strengths (``snapshot.first_bad_row``);
- ``key index``: the row keys' hash table (``KeyIndex.from_keys``);
- ``install``: the rest of ``ColumnStore.load_bulk`` (lengths, touches, row-size counts);
- ``log replay``: ``recovery.replay`` (0 with an empty log);
- ``other``: the rest of ``DurableStore.open`` (headers, applied set, files, the new segment).

``--before-tree DIR`` opens the same files with another checkout's code too (its root first on
``PYTHONPATH``), taking turns round by round: the same-run baseline. Figures are medians over
``--rounds`` with their range, and the load average beside them. ``--store-cache DIR`` keeps the
generated store for later runs. ``--json`` prints one ``{"figure", "value", "target"}`` object per
figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.report import emit_figure, print_table
from tools.bench.restart import STORE_DIR, cached_store

__all__ = ["PHASES", "main"]

#: (phase, module, attribute path) wrapped in the child; ``install`` is ``load_bulk`` less the key
#: index, ``other`` the open less everything else (computed by the parent).
PHASES = [("read + checksum", "giaannd.storage.engine.snapshot", "_Reader.array"),
          ("row checks", "giaannd.storage.engine.snapshot", "first_bad_row"),
          ("key index", "giaannd.rowengine.keyindex", "KeyIndex.from_keys"),
          ("load_bulk", "giaannd.storage.engine.column_store", "ColumnStore.load_bulk"),
          ("log replay", "giaannd.storage.engine.recovery", "replay")]
_SHOWN = ["open", "read + checksum", "row checks", "key index", "install", "log replay", "other"]

#: The child: wraps each phase's function (wall and CPU seconds, summed over calls), opens the
#: store, prints one JSON object. Module-level functions are wrapped where their callers look them
#: up (their module's globals); a classmethod is re-wrapped as one.
_CHILD = """
import importlib, json, sys, time
phases = json.loads(sys.argv[2])
spent = {}
def wrap(name, fn):
    def timed(*args, **kwargs):
        w, c = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            a, b = spent.get(name, (0.0, 0.0))
            spent[name] = (a + time.perf_counter() - w, b + time.process_time() - c)
    return timed
for name, module, attr in phases:
    owner = importlib.import_module(module)
    *path, last = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = owner.__dict__[last]
    if isinstance(raw, classmethod):
        setattr(owner, last, classmethod(wrap(name, raw.__func__)))
    else:
        setattr(owner, last, wrap(name, raw))
from giaannd.storage import DurableStore
w, c = time.perf_counter(), time.process_time()
ds = DurableStore.open(sys.argv[1], 1 << 44)
spent["open"] = (time.perf_counter() - w, time.process_time() - c)
spent["entries"] = (ds.store.usage().num_entries, 0)
print(json.dumps(spent))
"""


def _open_once(store: Path, tree: Path) -> dict[str, tuple[float, float]]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(store), json.dumps(PHASES)], cwd=tree, env=env,
                         check=True, capture_output=True, text=True, timeout=600).stdout
    raw = json.loads(out.strip().splitlines()[-1])
    spent = {k: (float(v[0]), float(v[1])) for k, v in raw.items()}
    spent["install"] = _less(spent, "load_bulk", ["key index"])
    spent["other"] = _less(spent, "open", ["read + checksum", "row checks", "load_bulk", "log replay"])
    return spent


def _less(spent: dict[str, tuple[float, float]], whole: str, parts: list[str]) -> tuple[float, float]:
    """(wall, CPU) of ``whole`` less its ``parts`` (a phase never entered counts 0)."""
    zero = (0.0, 0.0)
    wall, cpu = spent.get(whole, zero)
    return (wall - sum(spent.get(p, zero)[0] for p in parts), cpu - sum(spent.get(p, zero)[1] for p in parts))


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def run(store: Path, trees: dict[str, Path], rounds: int) -> tuple[dict[str, dict[str, list[float]]], list[float], int]:
    """Per tree, per phase (``_SHOWN``, ``:wall`` and ``:cpu``), seconds of each round; the load
    averages seen; the store's entries."""
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    loads: list[float] = []
    entries = 0
    for _ in range(rounds):
        for name, tree in trees.items():
            loads.append(os.getloadavg()[0])
            spent = _open_once(store, tree)
            entries = int(spent["entries"][0])
            for phase in _SHOWN:
                for i, kind in enumerate(("wall", "cpu")):
                    runs[name].setdefault(f"{phase}:{kind}", []).append(spent.get(phase, (0.0, 0.0))[i])
    return runs, loads, entries


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=20_000_000, help="entries in the store (default 2·10^7)")
    ap.add_argument("--log-share", type=float, default=0.0, help="entries logged after the snapshot, share")
    ap.add_argument("--rounds", type=int, default=3, help="opens per tree (default 3), taking turns")
    ap.add_argument("--before-tree", type=Path, default=None, help="a checkout to compare with (same run)")
    ap.add_argument("--store-cache", type=Path, default=None, help="keep the generated store here")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    trees = {"this tree": Path(__file__).resolve().parents[2]}
    if args.before_tree is not None:
        trees = {"before": args.before_tree.resolve(), **trees}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as scratch:
        cache = args.store_cache or Path(scratch)
        cached_store(cache, args.entries, args.log_share)
        runs, loads, entries = run(cache / STORE_DIR, trees, args.rounds)
    gb = entries * 21 / 1e9
    per_gb = {name: {k: [v / gb for v in vals] for k, vals in r.items()} for name, r in runs.items()}
    if args.json:
        for name, r in per_gb.items():
            for key, vals in r.items():
                phase, kind = key.split(":")
                emit_figure(f"recovery {phase}, {kind} s/GB ({name})", statistics.median(vals),
                            "<= 1.0" if phase == "open" else None)
        return
    header = ["phase (s/GB, median (range))", *(f"{n}: {k}" for n in per_gb for k in ("wall", "CPU")), "target"]
    rows = [[phase, *(_cell(per_gb[n][f"{phase}:{k}"]) for n in per_gb for k in ("wall", "cpu")),
             "≤ 1" if phase == "open" else "–"] for phase in _SHOWN]
    print_table(f"DurableStore.open: {entries:,} entries, {gb:.3f} GB of rows, {args.rounds} rounds per tree, "
                f"page cache warm, load average {min(loads):.1f}-{max(loads):.1f}", header, rows)


if __name__ == "__main__":
    main()
