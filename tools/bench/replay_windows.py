"""A restart's log replay over a large base: windows per segment (before) against windows gathered
over segments that grow with the store (``recovery.replay_segments``), in one run.

    python -m tools.bench.replay_windows [--base-sentences 60000] [--log-sentences 12000]
                                         [--segment-mb 64 4 1] [--rounds 3] [--dir DIR] [--json]

Why: a window of log records that share rows (a training log) merges its new keys into the
engine's base once, which moves the whole base (``run.fold_into_base``). Before, a window ended
at its segment's end (64 MiB, ~3·10^6 entries), so replaying L logged entries over a base of B
moved about L / segment × B entries: at the mission's size (10^10 entries a node, a log of 10 %
of it) ~330 moves of the whole base. Now a window gathers segments until it holds
``replay_window_entries`` (1/``REPLAY_WINDOW_BASE_SHARE`` of the store, at least
``MAX_REPLAY_GROUP_ENTRIES``): at most that share's inverse of entries moved per logged entry, plus
one last move, whatever B.

The store: the scale bench's Zipf stream (``tools.bench.zipf_stream``) trained by the core in
batches of 256 sentences, ``--base-sentences`` of them snapshotted, the next ``--log-sentences``
logged after the snapshot (~10 % of the store by default, like a node killed between two
snapshots under ``storage.snapshot-min-log-ratio``), once per ``--segment-mb`` (the log's segment
size). What the per-segment windows cost grows with the base's size in segments: over the
default 1.8·10^7-entry base (0.38 GB), 4 MiB segments stand for 64 MiB ones over a 6 GB base
(3·10^8 entries), 1 MiB segments for a 24 GB one (1.2·10^9 entries); the mission's nodes are
larger still. Three variants (``VARIANTS``): windows per segment, and windows over segments
in one thread and in every usable CPU (``storage.replay-threads``). Each replays in a fresh
process (the snapshot loaded first, not timed), taking turns, ``--rounds`` each: CPU and wall
seconds of the replay per GB of logged entries (21 bytes each; median and range), base entries
moved by the windows' merges per logged entry (``RowEngine.stats.fold_entries``), windows
(``ColumnStore.apply_in_order`` calls), and the resident memory the replay adds at its peak, per
stored entry (``VmHWM`` reset after the load). The baseline is the windowing before (a window
per segment) run on today's engine, which folds each window's new keys at the start of the next
rather than at its end: the same moves but the last one's. Every variant must end with the same
rows (a digest of every field, checked). ``--child STORE VARIANT`` runs one replay and prints its
JSON (another checkout's child is a same-run baseline of a change). ``--json`` prints one
``{"figure", "value", "target"}`` object per figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from giaannd.cpus import usable_cpus
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, DurableStore
from giaannd.storage.engine import recovery
from giaannd.storage.engine.column_store import ENTRY_BYTES
from giaannd.storage.engine.snapshot import list_snapshots, read_snapshot
from giaannd.storage.engine.update_log import SegmentReader, list_segments, scan_segment
from tools.bench.child import median_range, peak_reset, run_child, status_kb
from tools.bench.report import emit_figures, print_table
from tools.bench.zipf_stream import ZipfStream, training_deltas

__all__ = ["main"]

BIG = 1 << 44
#: (name, windows over segments, threads: 0 = every usable CPU)
VARIANTS = (("windows per segment (before)", False, 1), ("windows over segments, 1 thread", True, 1),
            ("windows over segments, every CPU (now)", True, 0))


def build(root: Path, base_sentences: int, log_sentences: int, segment_sizes: list[int]) -> dict[int, Path]:
    """One store per segment size under ``root`` (kept: ``meta.json`` says what it holds), all
    from the same deltas: the base snapshotted, the log after it."""
    dirs = {mb: root / f"seg{mb}" for mb in segment_sizes}
    want = {"base": base_sentences, "log": log_sentences}
    todo = [mb for mb, d in dirs.items()
            if not (d / "meta.json").exists() or json.loads((d / "meta.json").read_text())["made"] != want]
    if not todo:
        return dirs
    batches = list(training_deltas(iter(ZipfStream(7)), base_sentences + log_sentences))
    split = -(-base_sentences // 256)
    for mb in todo:
        d = dirs[mb]
        for p in d.glob("*"):
            p.unlink()
        ds = DurableStore.open(d / "store", BIG, segment_max_bytes=mb << 20)
        for seq, rows in enumerate(batches, 1):
            ds.apply(BatchId(1, seq), rows, validate=False)
            if seq == split:
                ds.snapshot()
        ds.sync()
        logged = sum(b.num_entries for b in batches[split:])
        ds.close()
        (d / "meta.json").write_text(json.dumps({"made": want, "logged": logged}))
    return dirs


def _replay_before(store: ColumnStore, segments: list[tuple[int, Path]], after: int) -> None:
    """The open's loop before: each segment read into one reused buffer and replayed on its own
    (``replay`` with its default window: a window ends where its segment ends)."""
    reader = SegmentReader()
    for i, (first, path) in enumerate(segments):
        recovery.replay(store, scan_segment(path, first, i == len(segments) - 1, reader).records, after)


def child(store_dir: Path, variant: int) -> dict[str, Any]:
    """One replay in this process: the snapshot loaded (with the replay's room, as ``open`` does),
    then the log replayed by ``VARIANTS[variant]``."""
    _, over_segments, threads = VARIANTS[variant]
    threads = threads or usable_cpus()
    segments = list_segments(store_dir)
    snap = list_snapshots(store_dir)[-1][1]
    store, after = read_snapshot(snap, BIG, room=recovery.replay_room(segments))
    held = store.engine.num_entries
    windows = 0
    real = ColumnStore.apply_in_order

    def counted(self: ColumnStore, items: Any, threads: int = 1) -> int:
        nonlocal windows
        windows += 1
        return real(self, items, threads)

    moved0 = store.engine.stats.fold_entries
    rss0 = status_kb("VmRSS")
    reset = peak_reset()
    ColumnStore.apply_in_order = counted  # type: ignore[method-assign]
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        if not over_segments:
            _replay_before(store, segments, after)
        else:
            recovery.replay_segments(store, segments, after, threads)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        ColumnStore.apply_in_order = real  # type: ignore[method-assign]
    peak = status_kb("VmHWM") if reset else rss0 - 1  # (no reset: no figure, below)
    digest = hashlib.blake2b(digest_size=16)
    for buf in store.read_all().buffers():
        digest.update(buf.data.cast("B"))
    return {"cpu": cpu, "wall": wall, "threads": threads, "moved": store.engine.stats.fold_entries - moved0,
            "windows": windows, "peak_kb": peak - rss0, "held": held, "segments": len(segments),
            "digest": digest.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.replay_windows", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-sentences", type=int, default=60_000, help="Zipf sentences snapshotted (default 60,000)")
    ap.add_argument("--log-sentences", type=int, default=12_000, help="Zipf sentences logged after (default 12,000)")
    ap.add_argument("--segment-mb", type=int, nargs="+", default=[64, 4, 1], help="log segment sizes, MiB")
    ap.add_argument("--rounds", type=int, default=3, help="replays per variant and segment size, taking turns")
    ap.add_argument("--dir", type=Path, default=None, help="keep the stores here (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child[0]), int(args.child[1]))))
        return 0
    if min(args.segment_mb) < 1 or args.rounds < 1 or args.base_sentences < 256 or args.log_sentences < 256:
        ap.error("--segment-mb ≥ 1, --rounds ≥ 1, --base-sentences and --log-sentences ≥ 256")
    with tempfile.TemporaryDirectory(prefix="replay-windows-") as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        dirs = build(root, args.base_sentences, args.log_sentences, args.segment_mb)
        load_before = os.getloadavg()[0]
        results: dict[int, list[list[dict[str, Any]]]] = {mb: [[] for _ in VARIANTS] for mb in args.segment_mb}
        for _ in range(args.rounds):
            for mb in args.segment_mb:
                for variant in range(len(VARIANTS)):
                    results[mb][variant].append(
                        run_child("tools.bench.replay_windows", str(dirs[mb] / "store"), str(variant)))
        load_after = os.getloadavg()[0]
        figures: list[tuple[str, float, str | None]] = []
        rows = []
        threads = results[args.segment_mb[0]][-1][0]["threads"]
        for mb in args.segment_mb:
            logged = json.loads((dirs[mb] / "meta.json").read_text())["logged"]
            gb = logged * ENTRY_BYTES / 1e9
            digests = {r["digest"] for v in results[mb] for r in v}
            if len(digests) != 1:
                raise SystemExit(f"segments of {mb} MiB: the variants' rows differ ({sorted(digests)})")
            first = results[mb][0][0]
            for variant, (name, _, _) in enumerate(VARIANTS):
                rs = results[mb][variant]
                cpu = [r["cpu"] / gb for r in rs]
                wall = [r["wall"] / gb for r in rs]
                moved = rs[0]["moved"] / logged
                peak = [r["peak_kb"] * 1024 / r["held"] if r["peak_kb"] >= 0 else float("nan") for r in rs]
                rows.append([f"{mb} MiB ({first['segments']})", name, median_range(cpu), median_range(wall),
                             f"{moved:.1f}", str(rs[0]["windows"]), median_range(peak, 1)])
                tag = ("before", "now, 1 thread", f"now, {threads} threads")[variant]
                figures += [(f"replay CPU s/GB of log, {mb} MiB segments, {tag}", statistics.median(cpu), "≤ 1"),
                            (f"replay wall s/GB of log, {mb} MiB segments, {tag}", statistics.median(wall), "≤ 1"),
                            (f"base entries moved per logged entry, {mb} MiB segments, {tag}", moved, None),
                            (f"replay peak RSS growth B per stored entry, {mb} MiB segments, {tag}",
                             statistics.median(peak), None)]

            def med(variant: int, key: str, mb: int = mb) -> float:
                values: list[float] = [r[key] for r in results[mb][variant]]
                return statistics.median(values)

            figures.append((f"replay CPU before / now, {mb} MiB segments", med(0, "cpu") / med(1, "cpu"), "> 1"))
            figures.append((f"replay wall 1 thread / {threads} threads, {mb} MiB segments",
                            med(1, "wall") / med(2, "wall"), "> 1"))
        held = results[args.segment_mb[0]][0][0]["held"]
        logged0 = json.loads((dirs[args.segment_mb[0]] / "meta.json").read_text())["logged"]
        if args.json:
            emit_figures(figures)
            return 0
        print_table(f"Log replay over a base of {held:,} entries, {logged0:,} logged entries after it "
                    f"({args.rounds} rounds, {threads} usable CPUs, load average {load_before:.1f} → "
                    f"{load_after:.1f})",
                    ["segments (count)", "variant", "replay CPU s/GB of log (target ≤ 1)",
                     "replay wall s/GB of log (target ≤ 1)", "base entries moved / logged", "windows",
                     "peak RSS growth, B / stored entry"], rows)
        for name, value, _ in figures:
            if " / " in name:
                print(f"{name}: {value:.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
