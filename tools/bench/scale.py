"""Rows at scale (issue 14): the single-process core on a growing synthetic Zipf stream.

    python -m tools.bench.scale [--checkpoints 10000,100000,300000,1000000] [--engine both|old,new,serial]
                                [--old-checkpoints 10000] [--json] [--seed 0]
    python -m tools.bench.scale --write-conllu PATH N      # the stream as CoNLL-U, then exit
    python -m tools.bench.scale --cluster [--cluster-checkpoints 10000,100000,300000]
                                # 3 storage + 1 compute daemons on the same stream (scale_cluster.py)

The stream (tools/bench/zipf_stream.py) is generated as it is consumed. The core runs as
``Engine.train`` does: sentences encoded one at a time (column assignment, flags updated),
``--batch`` encoded sentences trained into one RowBatch, applied to the row store. At each checkpoint
(input sentences) the table gets:

- sentences/s over the last interval (wall clock of encode + train + apply; generating the stream
  is not counted), and CPU µs per input sentence by phase;
- entries, rows, the longest row; RSS growth since the start per entry (the process's resident
  memory now minus before training, over the store's entries) and the store's own bytes per entry
  where it counts them;
- a LIF step on the longest rows (``--lif-rows``): ns per row entry of ``LifSession.step`` on a
  fresh session (the row fires once; CPU time), of the step before issue 14 item 6 on the same rows (its
  baseline, tools/bench/baseline_lif.py; the ratio is "LIF old/new"), and of fetching the row from
  the store. ``python -m tools.bench.lif`` breaks the step down by phase on synthetic rows.

``--engine both`` (default) runs the pre-issue-14 store (tools/bench/baseline_rowstore.py, the
baseline) up to ``--old-checkpoints`` and the current ``giaannd.model.rowstore.RowStore`` to every
checkpoint, each in its own child process (so RSS is its own), in the same run. ``new`` is the
store as the single-process ``Engine`` makes it: folding in a thread of its own where the process
may use several CPUs (``RowStore(fold_thread=True)``; CPU time then counts both threads, and each
interval ends by waiting for its last fold, counted as apply); ``serial`` folds in the training
thread (the core before that); ``--engine new,serial`` compares the two in one run. Targets (printed
next to the figures): sentences/s at the last checkpoint ≥ 0.7× the first; RSS growth ≤ 32 B per
entry once there are ≥ 4·10^7 entries; LIF step ≤ 10 ns per entry. The machine load (1-minute load
average, CPUs) is printed before and after: compare ratios from one run, not absolute times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from tools.bench import scale_cluster
from tools.bench.report import print_table

TARGET_THROUGHPUT_RATIO = 0.7
TARGET_RSS_BYTES_PER_ENTRY = 32.0
TARGET_RSS_MIN_ENTRIES = 4 * 10**7
TARGET_LIF_NS_PER_ENTRY = 10.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: The stores a run can measure: the store before issue 14, the row engine as the single-process
#: ``Engine`` uses it (folding in a thread of its own where the process may use several CPUs), and
#: the row engine folding in the owner's thread (the core before Nov 30's fifth session).
ENGINES = ("old", "new", "serial")


def _make_store(engine: str) -> Any:
    if engine == "old":
        from tools.bench.baseline_rowstore import RowStore as OldStore

        return OldStore()
    from giaannd.cpus import usable_cpus
    from giaannd.model.rowstore import RowStore

    return RowStore(fold_thread=engine == "new" and usable_cpus() > 1)


def _applier(store: Any) -> Any:
    """``store.apply`` as the core's ``Engine`` calls it: without the batch check for the new store
    (train_batch's batches are canonical by construction); the old store has no such option."""
    if getattr(store, "fold_thread", None) is None:
        return store.apply
    return lambda rows: store.apply(rows, validate=False)


def _largest(store: Any, k: int) -> list[tuple[tuple[int, int], int]]:
    if hasattr(store, "largest_rows"):
        return list(store.largest_rows(k))
    batch = store.export()  # a store without the method: any store can export
    lengths = batch.offsets[1:] - batch.offsets[:-1]
    top = sorted(range(batch.num_rows), key=lambda i: -int(lengths[i]))[:k]
    return [(batch.key(i), int(lengths[i])) for i in top]


def _lif(store: Any, k: int, repeat: int = 3) -> dict[str, float]:
    """ns per entry of a LIF step (fresh session, the row fires once), of the same step before issue 14
    item 6 (tools/bench/baseline_lif.py, the baseline, timed alternately with it), and of the row fetch."""
    from giaannd.model.infer import TRAIN_SET, LifSession, NoDelimiters
    from tools.bench.baseline_lif import BaselineLifSession

    step_s = old_s = fetch_s = 0.0
    entries = 0
    for key, _ in _largest(store, k):
        best = {"new": float("inf"), "old": float("inf"), "fetch": float("inf")}
        for _ in range(repeat):
            t = time.perf_counter()
            row = store.get_row(*key)
            best["fetch"] = min(best["fetch"], time.perf_counter() - t)
            for name, cls in (("new", LifSession), ("old", BaselineLifSession)):
                session = cls([key, key], NoDelimiters(), TRAIN_SET)
                t = time.process_time()  # CPU time: on a loaded machine wall clock counts waits too
                session.step(row)
                best[name] = min(best[name], time.process_time() - t)
        step_s += best["new"]
        old_s += best["old"]
        fetch_s += best["fetch"]
        entries += len(row)
    per = 1e9 / max(entries, 1)
    return {"lif_ns": step_s * per, "lif_old_ns": old_s * per, "fetch_ns": fetch_s * per, "lif_entries": entries}


def _child(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Run one engine over the stream; yield one record per checkpoint."""
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.train import train_batch
    from tools.bench.zipf_stream import ZipfStream

    stream = iter(ZipfStream(args.seed))
    assigner = ColumnAssigner()
    store = _make_store(args.child)
    apply_rows = _applier(store)
    warm = ColumnAssigner()  # first calls (imports, torch set-up) outside the figures
    train_batch(list(warm.encode_many(itertools.islice(ZipfStream(args.seed + 1), 64))))
    del warm
    rss0 = _rss_bytes()
    done = 0
    pending: list[Any] = []
    for checkpoint in args.checkpoints:
        wall = {"encode": 0.0, "train": 0.0, "apply": 0.0}
        cpu = dict(wall)
        start = done
        while done < checkpoint:
            tagged = list(itertools.islice(stream, min(args.batch, checkpoint - done)))
            done += len(tagged)
            w, c = time.perf_counter(), time.process_time()
            for sentence in tagged:
                enc = assigner.encode(sentence, update_flags=True)
                if enc is not None:
                    pending.append(enc)
            w2, c2 = time.perf_counter(), time.process_time()
            wall["encode"] += w2 - w
            cpu["encode"] += c2 - c
            last = done >= checkpoint
            while len(pending) >= args.batch or (last and pending):
                todo, pending = pending[: args.batch], pending[args.batch:]
                w, c = time.perf_counter(), time.process_time()
                rows = train_batch(todo).rows
                w2, c2 = time.perf_counter(), time.process_time()
                apply_rows(rows)
                w3, c3 = time.perf_counter(), time.process_time()
                wall["train"] += w2 - w
                cpu["train"] += c2 - c
                wall["apply"] += w3 - w2
                cpu["apply"] += c3 - c2
        if hasattr(store, "settle"):  # the interval's last fold and the batches it held
            w, c = time.perf_counter(), time.process_time()
            store.settle()
            wall["apply"] += time.perf_counter() - w
            cpu["apply"] += time.process_time() - c
        n = done - start
        entries = store.num_entries
        largest = _largest(store, 1)
        record: dict[str, Any] = {
            "engine": args.child, "sentences": done, "sent_per_s": n / max(sum(wall.values()), 1e-9),
            "sent_per_cpu_s": n / max(sum(cpu.values()), 1e-9),
            **{f"cpu_us_{p}": cpu[p] / max(n, 1) * 1e6 for p in cpu},
            "entries": entries, "rows": len(store), "largest_row": largest[0][1] if largest else 0,
            "rss_per_entry": (_rss_bytes() - rss0) / max(entries, 1),
            "store_per_entry": (store.engine.nbytes / max(entries, 1)) if hasattr(store, "engine") else None,
            "fold_thread": bool(getattr(store, "fold_thread", False)),
            "thread_folds": getattr(store, "thread_folds", 0),
            "batches_deferred": getattr(store, "batches_deferred", 0),
        }
        record.update(_lif(store, args.lif_rows))
        yield record


def _run_child(engine: str, checkpoints: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "tools.bench.scale", "--child", engine, "--seed", str(args.seed),
           "--batch", str(args.batch), "--lif-rows", str(args.lif_rows),
           "--checkpoints", ",".join(map(str, checkpoints))]
    out: list[dict[str, Any]] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(json.loads(line))
            if not args.json and sys.stderr.isatty():
                r = out[-1]
                print(f"  [{engine}] {r['sentences']} sentences: {r['sent_per_s']:.0f} sentences/s, "
                      f"{r['entries']} entries", file=sys.stderr, flush=True)
    if proc.returncode:
        raise SystemExit(f"{engine} run failed with exit status {proc.returncode}")
    return out


def _fmt(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _targets(records: list[dict[str, Any]]) -> list[tuple[str, float | None, str, str]]:
    """(figure, value, target, verdict) for the targets, on one engine's records (throughput twice: by
    wall clock, as the issue states it, and by CPU time, which a loaded shared machine disturbs less)."""
    first, last = records[0], records[-1]
    ratio = last["sent_per_s"] / first["sent_per_s"]
    cpu_ratio = last["sent_per_cpu_s"] / first["sent_per_cpu_s"]
    big = [r for r in records if r["entries"] >= TARGET_RSS_MIN_ENTRIES]
    rss = big[-1]["rss_per_entry"] if big else None
    out = [
        (f"sentences/s at {last['sentences']:,} / at {first['sentences']:,}", ratio,
         f">= {TARGET_THROUGHPUT_RATIO}", "met" if ratio >= TARGET_THROUGHPUT_RATIO else "MISSED"),
        (f"sentences/CPU-s at {last['sentences']:,} / at {first['sentences']:,}", cpu_ratio,
         f">= {TARGET_THROUGHPUT_RATIO}", "met" if cpu_ratio >= TARGET_THROUGHPUT_RATIO else "MISSED"),
        (f"RSS growth B/entry at >= {TARGET_RSS_MIN_ENTRIES:.0e} entries", rss,
         f"<= {TARGET_RSS_BYTES_PER_ENTRY:.0f}",
         "not reached" if rss is None else "met" if rss <= TARGET_RSS_BYTES_PER_ENTRY else "MISSED"),
        (f"LIF step ns/entry at {last['sentences']:,}", last["lif_ns"], f"<= {TARGET_LIF_NS_PER_ENTRY:.0f}",
         "met" if last["lif_ns"] <= TARGET_LIF_NS_PER_ENTRY else "MISSED"),
        (f"LIF step old/new at {last['sentences']:,} (same rows, same run)",
         last["lif_old_ns"] / max(last["lif_ns"], 1e-9), "—", "context"),
    ]
    return out


def _thread_vs_serial(results: dict[str, list[dict[str, Any]]]) -> list[tuple[int, float, float, dict[str, Any]]]:
    """Per checkpoint both ``new`` and ``serial`` reached: (sentences, sent/s new/serial, sent/CPU-s
    new/serial, the ``new`` record)."""
    serial = {r["sentences"]: r for r in results.get("serial", ())}
    return [(r["sentences"], r["sent_per_s"] / s["sent_per_s"], r["sent_per_cpu_s"] / s["sent_per_cpu_s"], r)
            for r in results.get("new", ()) if (s := serial.get(r["sentences"]))]


def _print(results: dict[str, list[dict[str, Any]]]) -> None:
    header = ["engine", "sentences", "sent/s (interval)", "sent/CPU-s", "CPU µs/sent encode", "train", "apply",
              "entries", "rows", "largest row", "RSS growth B/entry", "store B/entry", "LIF ns/entry",
              "LIF old step ns/entry", "LIF old/new", "fetch ns/entry"]
    rows = [[r["engine"], f"{r['sentences']:,}", _fmt(r["sent_per_s"]), _fmt(r["sent_per_cpu_s"]),
             _fmt(r["cpu_us_encode"]),
             _fmt(r["cpu_us_train"]), _fmt(r["cpu_us_apply"]), f"{r['entries']:,}", f"{r['rows']:,}",
             f"{r['largest_row']:,}", _fmt(r["rss_per_entry"], 1), _fmt(r["store_per_entry"], 1),
             _fmt(r["lif_ns"], 1), _fmt(r.get("lif_old_ns"), 1),
             f"{r['lif_old_ns'] / max(r['lif_ns'], 1e-9):.2f}x" if "lif_old_ns" in r else "—",
             _fmt(r["fetch_ns"], 1)]
            for recs in results.values() for r in recs]
    print_table("Core rows at scale (synthetic Zipf stream)", header, rows)
    if "old" in results and "new" in results:
        both = {r["sentences"]: r for r in results["old"]}
        cmp_rows = []
        for r in results["new"]:
            o = both.get(r["sentences"])
            if o:
                cmp_rows.append([f"{r['sentences']:,}", f"{r['sent_per_s'] / o['sent_per_s']:.2f}x",
                                 f"{o['cpu_us_apply'] / max(r['cpu_us_apply'], 1e-9):.1f}x",
                                 f"{o['rss_per_entry'] / max(r['rss_per_entry'], 1e-9):.1f}x",
                                 f"{o['lif_ns'] / max(r['lif_ns'], 1e-9):.1f}x"])
        print_table("New vs old (same run, same checkpoint)", ["sentences", "sent/s new/old",
                    "apply CPU old/new", "RSS/entry old/new", "LIF ns, old store/new store"], cmp_rows)
    thread_rows = [[f"{n:,}", f"{wall:.2f}x", f"{cpu:.2f}x", f"{r['thread_folds']:,}", f"{r['batches_deferred']:,}"]
                   for n, wall, cpu, r in _thread_vs_serial(results)]
    if thread_rows:
        print_table("Fold thread vs folds in the training thread (same run, same checkpoint)",
                    ["sentences", "sent/s new/serial", "sent/CPU-s new/serial", "folds and merges in the thread",
                     "batches held"], thread_rows)
    for engine, recs in results.items():
        print_table(f"Targets ({engine})", ["figure", "value", "target", "verdict"],
                    [[f, _fmt(v, 2), t, verdict] for f, v, t, verdict in _targets(recs)])


#: The target each per-checkpoint figure is held to (None: context, no target).
_FIGURE_TARGETS = {
    "sent_per_s": f">= {TARGET_THROUGHPUT_RATIO}x the first checkpoint's",
    "sent_per_cpu_s": f">= {TARGET_THROUGHPUT_RATIO}x the first checkpoint's",
    "rss_per_entry": f"<= {TARGET_RSS_BYTES_PER_ENTRY:.0f} once entries >= {TARGET_RSS_MIN_ENTRIES:.0e}",
    "lif_ns": f"<= {TARGET_LIF_NS_PER_ENTRY:.0f}",
}


def _json(results: dict[str, list[dict[str, Any]]]) -> None:
    for engine, recs in results.items():
        for r in recs:
            for key, value in r.items():
                if key != "engine":
                    print(json.dumps({"figure": f"{engine}/{key}@{r['sentences']}", "value": value,
                                      "target": _FIGURE_TARGETS.get(key)}))
        for figure, value, target, _ in _targets(recs):
            print(json.dumps({"figure": f"{engine}/{figure}", "value": value, "target": target}))
    for n, wall, cpu, _ in _thread_vs_serial(results):
        print(json.dumps({"figure": f"sent/s new/serial@{n}", "value": wall, "target": None}))
        print(json.dumps({"figure": f"sent/CPU-s new/serial@{n}", "value": cpu, "target": None}))


def _engines(text: str) -> tuple[str, ...]:
    names = ("old", "new") if text == "both" else tuple(x for x in text.split(",") if x)
    if not names or any(n not in ENGINES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--engine: both, or distinct names of {', '.join(ENGINES)}")
    return names


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x]
    if not out or any(x <= 0 for x in out) or out != sorted(set(out)):
        raise argparse.ArgumentTypeError("checkpoints: increasing positive integers, comma-separated")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=_ints, default=_ints("10000,100000,300000,1000000"),
                    help="input sentences at which to measure (default 10000,100000,300000,1000000)")
    ap.add_argument("--engine", type=_engines, default=_engines("both"),
                    help="which stores, comma-separated, of old, new (the row engine, folding in a thread "
                         "of its own where several CPUs are usable), serial (the row engine folding in "
                         "the training thread); both = old,new (the default)")
    ap.add_argument("--old-checkpoints", type=_ints, default=None,
                    help="checkpoints for the old store when several stores run (default: the first one)")
    ap.add_argument("--batch", type=int, default=256, help="encoded sentences per training batch (default 256)")
    ap.add_argument("--lif-rows", type=int, default=8, help="longest rows the LIF step runs on (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--write-conllu", nargs=2, metavar=("PATH", "N"), help="write N stream sentences and exit")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--cluster", action="store_true",
                    help="run the cluster checkpoints instead of the core's (tools/bench/scale_cluster.py)")
    scale_cluster.add_arguments(ap, prefix="cluster-")
    args = ap.parse_args(argv)
    if args.cluster:
        scale_cluster.check_arguments(ap, args)
        return scale_cluster.run_from_args(args)
    if args.batch < 1 or args.lif_rows < 1:
        ap.error("--batch and --lif-rows must be >= 1")
    if args.write_conllu:
        from tools.bench.zipf_stream import write_stream

        path, count = args.write_conllu[0], int(args.write_conllu[1])
        print(f"wrote {write_stream(path, count, args.seed)} sentences to {path}")
        return 0
    if args.child:
        for record in _child(args):
            print(json.dumps(record), flush=True)
        return 0
    load = f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    results = {}
    for engine in args.engine:
        checkpoints = args.checkpoints
        if engine == "old" and len(args.engine) > 1:
            checkpoints = args.old_checkpoints or args.checkpoints[:1]
        results[engine] = _run_child(engine, checkpoints, args)
    load += f" before, {os.getloadavg()[0]:.2f} after"
    if args.json:
        print(json.dumps({"figure": "machine load", "value": load, "target": None}))
        _json(results)
    else:
        print(f"\nmachine: {load}")
        _print(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
