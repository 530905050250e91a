"""A live storage node's resident memory per entry, in one process (issue 14 item 2).

    python -m tools.bench.live_rss [--sentences 300000] [--snapshot-interval-s 20] [--json]

The cluster scale bench (``tools.bench.scale --cluster``) measures a storage node's RSS per entry
after 30+ minutes and five daemons on the machine. This bench drives what a storage node runs with
the same deltas, in one process: a :class:`~giaannd.storage.DurableStore` (update log, group
commits) applies the core's training deltas of the scale bench's Zipf stream (tools/bench/zipf_stream.py,
batches of 256 sentences trained by ``train_batch``: every column, as a node of the R = 3 cluster
on three nodes holds), while a thread writes a snapshot from a frozen view every
``--snapshot-interval-s`` as the service does (``freeze_room``, then ``begin_snapshot`` with
applies held off, then ``write`` paced at ``storage.snapshot-busy-share`` while applies go on,
``finish_snapshot``) and another gives the C heap's free pages back every
``--heap-trim-interval-s`` (``storage.heap-trim-interval-s``).

The deltas are trained once into a cache file (``--cache``; the trainer's own memory stays out of
the measured process), then each variant runs in its own child process reading them, so its RSS
is its own and every variant applies the same batches:

- ``no snapshots``: the timers but the snapshot one;
- ``before``: with snapshots, the code before these changes (``--before-code``: a directory holding
  the ``giaannd`` package as it was, e.g. ``git archive cb636d7 giaannd | tar -x -C DIR``): folds
  and tier merges go ahead while a frozen view holds the runs (copies, the held arrays resident
  until the snapshot ends), and the view merges its delta runs into one copy to write them;
- ``after``: with snapshots, the store as it is.

Each child samples (every ``SAMPLE_S``) its RSS growth since just before the first apply, the
entries held, the bytes of the engine's arrays (``RowEngine.nbytes``), the C heap's free bytes
(glibc ``mallinfo2``: freed but still mapped) and whether a snapshot is being written. Figures per
variant: RSS growth per entry at the end of the stream (applies stopped, any snapshot still
running), the mean and the peak of (RSS growth / entries held then) over the second half of the run
(by entries), and at the peak: engine array bytes, free heap and the rest per entry.

``--json`` prints one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
Compare variants from one run: the machine is shared (the load average is printed).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench.report import emit_figure, print_table

TARGET = "<= 32"
#: Seconds between samples of a child's memory.
SAMPLE_S = 0.2
#: Sentences trained per batch (each batch one apply, as the scale bench's core trains them).
BATCH_SENTENCES = 256
#: Batches between group commits (``DurableStore.sync``).
SYNC_EVERY = 8
_FIELDS = ("row_column", "row_feature", "offsets", "segment", "target_column", "target_feature", "strength")
VARIANTS = ("no snapshots", "before", "after")


def generate(path: Path, sentences: int, seed: int) -> None:
    """Train ``sentences`` of the Zipf stream in batches and write each batch's rows to ``path``."""
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.train import train_batch
    from tools.bench.zipf_stream import ZipfStream

    assigner = ColumnAssigner()
    stream = iter(ZipfStream(seed))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for _ in range(0, sentences, BATCH_SENTENCES):
            encoded = [e for e in assigner.encode_many(itertools.islice(stream, BATCH_SENTENCES)) if e is not None]
            if not encoded:
                continue
            rows = train_batch(encoded).rows
            for name in _FIELDS:
                np.save(f, getattr(rows, name), allow_pickle=False)
    os.replace(tmp, path)


def _batches(path: Path) -> Any:
    from giaannd.model.rows import RowBatch

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while f.tell() < size:
            yield RowBatch(*(np.load(f, allow_pickle=False) for _ in _FIELDS))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_free() -> int:
    """Bytes the C heap holds free (glibc ``mallinfo2().fordblks``), 0 where there is no such call."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return 0
    fn.restype = _Mallinfo2
    return int(fn().fordblks)


def child(cache: Path, variant: str, snapshot_interval_s: float, trim_interval_s: float, busy_share: float,
          before_code: Path | None = None) -> dict[str, Any]:
    """Run one variant (module docstring); returns its samples' figures."""
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    if variant == "before":
        if before_code is None:
            raise SystemExit("variant 'before' needs --before-code")
        sys.path.insert(0, str(before_code))  # (giaannd is not imported yet)
    from giaannd.protocol import BatchId
    from giaannd.storage import DurableStore
    from giaannd.storage.engine import column_store
    from giaannd.storage.engine.recovery import return_freed_heap

    if variant == "before":
        assert before_code is not None and Path(column_store.__file__).is_relative_to(before_code)
    snapshots = variant != "no snapshots"
    tmp = Path(tempfile.mkdtemp(prefix="live-rss-"))
    try:
        ds = DurableStore.open(tmp / "node", 1 << 50)
        engine = ds.store.engine
        batches = _batches(cache)
        first = next(batches)
        ds.apply(BatchId(1, 1), first, validate=False, track=True)  # compiles the kernels first
        return_freed_heap()
        rss0 = _status("VmRSS:")
        lock = threading.Lock()  # the service's writes lock: held per apply, and for a snapshot's freeze
        done = threading.Event()
        writing = threading.Event()
        samples: list[tuple[int, int, int, int, bool]] = []
        written = [0]
        freeze_s: list[float] = []
        share: list[float] = []

        def sampler() -> None:
            nbytes = 0
            while not done.wait(SAMPLE_S):
                if engine._base.num_entries:  # noqa: SLF001 - (else a fold is under way: the last figure)
                    nbytes = engine.nbytes
                samples.append((_status("VmRSS:") - rss0, engine.num_entries, nbytes, _heap_free(),
                                writing.is_set()))

        def snapshotter() -> None:
            while not done.wait(snapshot_interval_s):
                room = ds.freeze_room()
                with lock:
                    t = time.perf_counter()
                    share.append(sum(d.num_entries for d in engine._deltas) / max(engine.num_entries, 1))  # noqa: SLF001
                    job = ds.begin_snapshot(room)
                    freeze_s.append(time.perf_counter() - t)
                del room
                writing.set()
                job.write(busy_share)
                writing.clear()
                ds.finish_snapshot(job)
                written[0] += 1

        def trimmer() -> None:
            while not done.wait(trim_interval_s):
                return_freed_heap()

        threads = [threading.Thread(target=t, daemon=True) for t in
                   (sampler, trimmer, *((snapshotter,) if snapshots else ()))]
        for t in threads:
            t.start()
        start = time.perf_counter()
        for seq, batch in enumerate(batches, 2):
            with lock:
                ds.apply(BatchId(1, seq), batch, validate=False, track=True)
            if seq % SYNC_EVERY == 0:
                ds.sync()
        ds.sync()
        seconds = time.perf_counter() - start
        end_rss, end_snapshot = _status("VmRSS:") - rss0, writing.is_set()
        entries = engine.num_entries
        done.set()
        for t in threads:
            t.join()
        ds.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    late = [s for s in samples if s[1] >= entries // 2]
    per = [s[0] / s[1] for s in late]
    peak = late[int(np.argmax(per))] if late else (0, 1, 0, 0, False)
    during = [p for p, s in zip(per, late) if s[4]]
    return {"variant": variant, "entries": entries, "seconds": seconds, "snapshots": written[0],
            "end": end_rss / entries, "end_during_snapshot": end_snapshot,
            "mean": float(np.mean(per)) if per else 0.0,
            "mean_engine": float(np.mean([s[2] / s[1] for s in late])) if late else 0.0,
            "mean_heap_free": float(np.mean([s[3] / s[1] for s in late])) if late else 0.0,
            "mean_during_snapshots": float(np.mean(during)) if during else None,
            "peak": per[int(np.argmax(per))] if per else 0.0, "peak_during_snapshot": bool(peak[4]),
            "peak_engine": peak[2] / peak[1], "peak_heap_free": peak[3] / peak[1],
            "peak_rest": (peak[0] - peak[2] - peak[3]) / peak[1],
            "end_engine": engine.nbytes / entries, "folds": engine.stats.folds,
            "deferred_folds": getattr(engine.stats, "deferred_folds", 0), "freeze_s_max": max(freeze_s, default=0.0),
            "delta_share_at_freeze": float(np.mean(share)) if share else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=300_000, help="Zipf-stream sentences trained")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-interval-s", type=float, default=20.0)
    ap.add_argument("--heap-trim-interval-s", type=float, default=30.0)
    ap.add_argument("--busy-share", type=float, default=0.5, help="as storage.snapshot-busy-share")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--cache", type=Path, default=None,
                    help="the trained deltas (made when missing; default: in the temp directory, by seed and size)")
    ap.add_argument("--before-code", type=Path, default=None,
                    help="a directory holding the giaannd package as it was (variant before; skipped without it)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cache = args.cache or Path(tempfile.gettempdir()) / f"giaannd-live-rss-{args.seed}-{args.sentences}.npy"
    if args.child is not None:
        print(json.dumps(child(cache, args.child, args.snapshot_interval_s, args.heap_trim_interval_s,
                               args.busy_share, args.before_code)))
        return
    if not cache.exists():
        generate(cache, args.sentences, args.seed)
    results = []
    for variant in args.variants.split(","):
        if variant == "before" and args.before_code is None:
            continue
        load = os.getloadavg()
        out = subprocess.run([sys.executable, "-m", "tools.bench.live_rss", "--child", variant, "--cache", str(cache),
                              "--snapshot-interval-s", str(args.snapshot_interval_s),
                              "--heap-trim-interval-s", str(args.heap_trim_interval_s),
                              "--busy-share", str(args.busy_share),
                              *(["--before-code", str(args.before_code.resolve())] if args.before_code else [])],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.splitlines()[-1])
        r["load"] = load[0]
        results.append(r)
        if not args.json:
            print(f"# {variant}: {r}", file=sys.stderr)
    if args.json:
        for r in results:
            v = r["variant"]
            for key, target in (("end", TARGET), ("mean", TARGET), ("mean_engine", None), ("mean_heap_free", None),
                                ("mean_during_snapshots", TARGET), ("peak", None), ("peak_engine", None),
                                ("peak_heap_free", None), ("peak_rest", None)):
                emit_figure(f"live RSS B/entry {key} ({v})", r[key], target)
        return
    print_table(f"Live storage-node RSS growth per entry ({args.sentences} sentences, snapshots every "
                f"{args.snapshot_interval_s:g} s, heap trim every {args.heap_trim_interval_s:g} s; target <= 32)",
                ["variant", "entries", "apply s", "snapshots", "end", "mean (2nd half)", "mean: engine / free heap",
                 "during snapshots",
                 "peak", "at peak: engine / free heap / rest", "freeze s (max)", "folds (deferred)", "load"],
                [[r["variant"], f"{r['entries']:,}", f"{r['seconds']:.0f}", str(r["snapshots"]),
                  f"{r['end']:.1f}" + (" (snapshot)" if r["end_during_snapshot"] else ""), f"{r['mean']:.1f}",
                  f"{r['mean_engine']:.1f} / {r['mean_heap_free']:.1f}",
                  "-" if r["mean_during_snapshots"] is None else f"{r['mean_during_snapshots']:.1f}",
                  f"{r['peak']:.1f}", f"{r['peak_engine']:.1f} / {r['peak_heap_free']:.1f} / {r['peak_rest']:.1f}",
                  f"{r['freeze_s_max']:.2f}", f"{r['folds']} ({r['deferred_folds']})", f"{r['load']:.1f}"]
                 for r in results])


if __name__ == "__main__":
    main()
