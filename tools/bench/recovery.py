"""A storage node's recovery (``DurableStore.open``) phase by phase, against a same-run baseline.

    python -m tools.bench.recovery [--entries 20000000] [--log-share 0] [--log-new-rows] [--rounds 3] [--applies 30]
                                   [--before-tree DIR] [--store-cache DIR] [--zipf BASE LOG] [--threads N] [--json]

A store of ``--entries`` entries of real-shaped rows (median 17 entries a row:
``tools.bench.restart.build_store``, with ``--log-share`` of that logged after the snapshot; 0:
a snapshot and an empty log; or, with ``--zipf BASE LOG``, the scale bench's Zipf training deltas,
BASE sentences snapshotted and LOG logged after them, as a node killed between two snapshots
holds them; ``--log-new-rows``: a log of rows of new columns only, as a stream's chunks) is
opened in fresh processes, page cache warm (the file was just
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

Then what the load leaves for the first writes (``--applies``, 0: none): that many training-like
batches (``tools.bench.snapshot.apply_stream``: adds to 1,500 stored rows' keys and 500 new rows
each, made once by the parent from the same snapshot, so no variant's child touches the rows
before timing them) applied with ``ColumnStore.apply`` (``first apply`` on its own, ``applies``
all of them), then ``fold``: ``ColumnStore.fold_deltas``, the first fold, which replaces the base's
arrays (a mapped load's included); ``open + applies + fold`` is the end-to-end figure. The child's
``RssAnon`` and ``RssFile`` (/proc/self/status, MB) after the open and after the fold are printed
in a second table (a mapped base's pages are page cache: ``RssFile``).

This tree is measured twice, reading the snapshot (``map_snapshot=False``) and mapping it
(``storage.snapshot-load-map``, the default: with an empty log after the snapshot, ``--log-share
0``); ``--before-tree DIR`` opens the same files with another checkout's code too (its root first
on ``PYTHONPATH``, its defaults), taking turns round by round: the same-run baselines. Figures are
medians over ``--rounds`` with their range, and the load average beside them. ``--store-cache DIR``
keeps the generated store for later runs. ``--json`` prints one ``{"figure", "value", "target"}``
object per figure (tools/bench/report.py).
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
from typing import Any

import numpy as np

from giaannd.storage.engine.snapshot import list_snapshots, read_snapshot
from giaannd.storage.replication.service import STORE_DIR
from tools.bench.replay_windows import build
from tools.bench.report import emit_figure, print_table
from tools.bench.restart import BIG, cached_store
from tools.bench.snapshot import apply_stream

__all__ = ["PHASES", "main", "write_batches"]

#: (phase, module, attribute path) wrapped in the child; ``install`` is ``load_bulk`` less the key
#: index, ``other`` the open less everything else (computed by the parent).
PHASES = [("read + checksum", "giaannd.storage.engine.snapshot", "_Reader.array"),
          ("row checks", "giaannd.storage.engine.snapshot", "first_bad_row"),
          ("key index", "giaannd.rowengine.keyindex", "KeyIndex.from_keys"),
          ("load_bulk", "giaannd.storage.engine.column_store", "ColumnStore.load_bulk"),
          ("log replay", "giaannd.storage.engine.recovery", "replay")]
_SHOWN = ["open", "read + checksum", "row checks", "key index", "install", "log replay", "other",
          "first apply", "applies", "fold", "open + applies + fold"]
#: /proc/self/status lines the child reports (kB there, MB here), after the open and after the fold
_RSS = ("RssAnon", "RssFile")
#: The batches' arrays, in RowBatch's field order (``write_batches``, the child's loader)
_BATCH_FIELDS = ("row_column", "row_feature", "offsets", "segment", "target_column", "target_feature", "strength")

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
import numpy as np
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import DurableStore
batches = []
if sys.argv[4]:
    with np.load(sys.argv[4]) as z:
        batches = [RowBatch(*(z[f"{i}:{f}"] for f in json.loads(sys.argv[5]))) for i in range(int(z["count"]))]
def rss(when):
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                spent[f"{name} {when}"] = (int(value.split()[0]) / 1024, 0.0)
w, c = time.perf_counter(), time.process_time()
ds = DurableStore.open(sys.argv[1], 1 << 44, **json.loads(sys.argv[3]))
spent["open"] = (time.perf_counter() - w, time.process_time() - c)
spent["entries"] = (ds.store.usage().num_entries, 0)
rss("after open")
if batches:
    w0, c0 = time.perf_counter(), time.process_time()
    for i, b in enumerate(batches):
        ds.store.apply(BatchId(3, i + 1), b, validate=False)
        if i == 0:
            spent["first apply"] = (time.perf_counter() - w0, time.process_time() - c0)
    spent["applies"] = (time.perf_counter() - w0, time.process_time() - c0)
    w, c = time.perf_counter(), time.process_time()
    ds.store.fold_deltas()
    spent["fold"] = (time.perf_counter() - w, time.process_time() - c)
    rss("after fold")
print(json.dumps(spent))
"""


def write_batches(store: Path, count: int, path: Path) -> None:
    """``count`` training-like batches for the store's newest snapshot (``apply_stream``), saved to
    ``path`` (.npz) for the children: every variant applies the same ones, and none reads its rows
    to make them."""
    loaded, _ = read_snapshot(list_snapshots(store)[-1][1], BIG)
    arrays: dict[str, Any] = {"count": np.array(count)}
    for i, batch in enumerate(apply_stream(np.random.default_rng(21), loaded, count, 1 << 40)):
        arrays.update({f"{i}:{f}": getattr(batch, f) for f in _BATCH_FIELDS})
    np.savez(path, **arrays)


def _open_once(store: Path, tree: Path, kwargs: dict[str, Any] | None = None, batches: Path | None = None
               ) -> dict[str, tuple[float, float]]:
    """One open (``DurableStore.open(store, ..., **kwargs)``) in a fresh process with ``tree``'s
    code, then ``batches`` (``write_batches``' file) applied and folded when given: seconds (wall,
    CPU) by phase, and the RSS lines (MB, 0)."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, "-c", _CHILD, str(store), json.dumps(PHASES), json.dumps(kwargs or {}),
            str(batches or ""), json.dumps(_BATCH_FIELDS)]
    out = subprocess.run(argv, cwd=tree, env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    raw = json.loads(out.strip().splitlines()[-1])
    spent = {k: (float(v[0]), float(v[1])) for k, v in raw.items()}
    spent["install"] = _less(spent, "load_bulk", ["key index"])
    spent["other"] = _less(spent, "open", ["read + checksum", "row checks", "load_bulk", "log replay"])
    if "fold" in spent:
        spent["open + applies + fold"] = tuple(  # type: ignore[assignment]
            spent["open"][i] + spent["applies"][i] + spent["fold"][i] for i in range(2))
    return spent


def _less(spent: dict[str, tuple[float, float]], whole: str, parts: list[str]) -> tuple[float, float]:
    """(wall, CPU) of ``whole`` less its ``parts`` (a phase never entered counts 0)."""
    zero = (0.0, 0.0)
    wall, cpu = spent.get(whole, zero)
    return (wall - sum(spent.get(p, zero)[0] for p in parts), cpu - sum(spent.get(p, zero)[1] for p in parts))


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


Variants = dict[str, tuple[Path, dict[str, Any]]]


def run(store: Path, variants: Variants, rounds: int, batches: Path | None = None
        ) -> tuple[dict[str, dict[str, list[float]]], list[float], int]:
    """Per variant (name: tree, ``DurableStore.open`` keywords), per phase (``_SHOWN``, ``:wall``
    and ``:cpu``; the RSS lines as ``:MB``), the figure of each round, taking turns; the load
    averages seen; the store's entries."""
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    loads: list[float] = []
    entries = 0
    for _ in range(rounds):
        for name, (tree, kwargs) in variants.items():
            loads.append(os.getloadavg()[0])
            spent = _open_once(store, tree, kwargs, batches)
            entries = int(spent["entries"][0])
            for phase in _SHOWN:
                for i, kind in enumerate(("wall", "cpu")):
                    runs[name].setdefault(f"{phase}:{kind}", []).append(spent.get(phase, (0.0, 0.0))[i])
            for key in (k for k in spent if k.startswith(_RSS)):
                runs[name].setdefault(f"{key}:MB", []).append(spent[key][0])
    return runs, loads, entries


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=20_000_000, help="entries in the store (default 2·10^7)")
    ap.add_argument("--log-share", type=float, default=0.0, help="entries logged after the snapshot, share")
    ap.add_argument("--rounds", type=int, default=3, help="opens per variant (default 3), taking turns")
    ap.add_argument("--applies", type=int, default=30, help="batches applied after each open, then a fold (0: none)")
    ap.add_argument("--before-tree", type=Path, default=None, help="a checkout to compare with (same run)")
    ap.add_argument("--store-cache", type=Path, default=None, help="keep the generated store here")
    ap.add_argument("--zipf", type=int, nargs=2, metavar=("BASE", "LOG"), default=None,
                    help="instead, a store of the scale bench's Zipf training deltas: BASE sentences snapshotted, "
                         "LOG logged after them (tools.bench.replay_windows.build; --entries and --log-share unused)")
    ap.add_argument("--log-new-rows", action="store_true",
                    help="the log after the snapshot brings only rows of new columns (a stream's chunks), "
                         "not half adds to stored rows")
    ap.add_argument("--threads", type=int, default=1,
                    help="DurableStore.open's replay_threads for every variant (default 1; the daemon passes "
                         "storage.replay-threads, every usable CPU by default)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parents[2]
    threads = {"replay_threads": args.threads}
    variants: Variants = {"read": (here, {"map_snapshot": False, **threads}),
                          "map": (here, {"map_snapshot": True, **threads})}
    if args.before_tree is not None:
        variants = {"before": (args.before_tree.resolve(), dict(threads)), **variants}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as scratch:
        cache = args.store_cache or Path(scratch)
        if args.zipf:
            store = build(cache, args.zipf[0], args.zipf[1], [64])[64] / "store"
        else:
            cached_store(cache, args.entries, args.log_share, args.log_new_rows)
            store = cache / STORE_DIR
        batches = None
        if args.applies:
            batches = Path(scratch) / "batches.npz"
            write_batches(store, args.applies, batches)
        runs, loads, entries = run(store, variants, args.rounds, batches)
    gb = entries * 21 / 1e9
    per_gb = {name: {k: [v / gb for v in vals] for k, vals in r.items() if not k.endswith(":MB")}
              for name, r in runs.items()}
    shown = [p for p in _SHOWN if args.applies or p not in ("first apply", "applies", "fold", "open + applies + fold")]
    if args.json:
        for name, r in per_gb.items():
            for key, vals in r.items():
                phase, kind = key.split(":")
                emit_figure(f"recovery {phase}, {kind} s/GB ({name})", statistics.median(vals),
                            "<= 1.0" if phase == "open" else None)
        for name, r in runs.items():
            for key, vals in r.items():
                if key.endswith(":MB"):
                    emit_figure(f"recovery {key[:-3]}, MB ({name})", statistics.median(vals))
        return
    header = ["phase (s/GB, median (range))", *(f"{n}: {k}" for n in per_gb for k in ("wall", "CPU")), "target"]
    rows = [[phase, *(_cell(per_gb[n][f"{phase}:{k}"]) for n in per_gb for k in ("wall", "cpu")),
             "≤ 1" if phase == "open" else "–"] for phase in shown]
    print_table(f"DurableStore.open: {entries:,} entries, {gb:.3f} GB of rows, {args.rounds} rounds per variant "
                f"({', '.join(variants)}), {args.applies} batches applied after it, page cache warm, load average "
                f"{min(loads):.1f}-{max(loads):.1f}", header, rows)
    rss = sorted({k for r in runs.values() for k in r if k.endswith(":MB")})
    if rss:
        print_table("Resident memory of the child (MB, median (range))", ["", *variants],
                    [[k[:-3], *(_cell(runs[n][k]) if k in runs[n] else "–" for n in variants)] for k in rss])


if __name__ == "__main__":
    main()
