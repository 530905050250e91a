"""Snapshot benchmarks on realistic rows (issue 14 items 3 and 4), each figure next to its target.

    python -m tools.bench.snapshot [--entries 10000000] [--zipf-sentences 60000] [--replay-only] [--json]
    python -m tools.bench.snapshot --latency-only [--neighbours N] [--applies 200]   (section 2 only)

Rows as training makes them: a median of 17 entries, lengths ``16 + Zipf(2)`` (capped at
``MAX_ROW_ENTRIES``), so most rows are short and a few are very long — ``tools/bench/storage.py``'s
restart table uses 5,000-entry rows, where per-row costs vanish and a loader looks 50x faster than
it is on real rows. Measured in one run:

1. restart, in s/GB of row data (target <= 1 s/GB, i.e. >= 1 GB/s), best of ``--repeat`` loads:
   the snapshot loader (``snapshot.read_snapshot``, with and without its row checks), the resident
   memory per entry a fresh process gains by loading it, log replay (open with no snapshot), and a
   snapshot write. The baseline is the same bench run on the code before the change (the README's
   table names the commits): the per-row loader this file once kept went with format 1's regions.
   Log replay has same-run baselines (``--replay-only`` measures only these): the bulk replay as it
   was before runs of new rows went straight into the base (each segment read into ``bytes``, each
   run concatenated, planned as a delta run and folded: ``_open_as_before``), and record-by-record
   replay (``recovery.replay_each``); the resident memory a fresh process gains by a replay, after
   it and at its peak; the replay of a training-like log, where batches share rows
   (``bench_replay_training_log``: window replay, with the same-run baselines of the group replay
   before it, ``replay_before.replay_groups_as_before``, and record by record, and the resident
   memory per entry after and at the peak of its restart); the same for the core's own
   training deltas on the scale bench's Zipf stream (``bench_replay_zipf_log``, ``--zipf-sentences``,
   0 to skip: sparse adds to big rows); and (``--replay-only``) the three replays' CPU by phase
   (``replay_phases``);
2. apply latency during a snapshot: the p99 of ``DurableStore.apply`` (training-like delta batches:
   in-place adds to stored rows plus new rows) while a snapshot is written in a worker thread
   (paced: ``--busy-share``, as ``storage.snapshot-busy-share``),
   against the p99 with no snapshot running (target ratio <= 2); and the baseline of the old
   design, where applies waited for the whole snapshot write (its duration is the latency of an
   apply that arrived as it began). And the writes' wait at a snapshot's start, the freeze plus
   the first apply after it (before the write's thread starts copying: the worst case), with the
   strengths', lengths' and touches' copies lazy (now: rowengine/cow.py, that apply copies the
   chunks it touches) against the same-run baseline of copies made in the freeze (snapshots
   alternate between the two). ``--neighbours N`` runs N processes that spin on a core each
   beside it (a loaded node's other daemons); ``--latency-only`` times nothing else.

``--json`` prints one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

from giaannd.model.columns import ColumnAssigner
from giaannd.model.rows import NUM_SEGMENTS, RowBatch
from giaannd.model.train import train_batch
from giaannd.protocol import BatchId
from giaannd.rowengine import RowEngine
from giaannd.rowengine import engine as engine_mod
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.storage import ColumnStore, DurableStore
from giaannd.storage.engine import recovery, update_log
from giaannd.storage.engine import snapshot as snapshot_mod
from giaannd.storage.engine.column_store import ENTRY_BYTES
from giaannd.storage.engine.recovery import replay_each
from giaannd.storage.engine.snapshot import read_snapshot
from giaannd.storage.engine.update_log import list_segments, scan_segment
from tools.bench.replay_before import open_as_before, replay_groups_as_before
from tools.bench.report import emit_figures, print_table
from tools.bench.zipf_stream import ZipfStream, training_deltas

BIG = 1 << 44
#: Longest row generated: the Zipf tail is cut here (a row of 100k entries is 2.1 MB).
MAX_ROW_ENTRIES = 100_000


def realistic_batch(rng: np.random.Generator, rows: int, first_column: int = 0) -> RowBatch:
    """``rows`` canonical rows of ``16 + Zipf(2)`` entries (median 17), keys spread over 2^40."""
    lengths = 16 + np.minimum(rng.zipf(2.0, rows), MAX_ROW_ENTRIES - 16).astype(np.int64)
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    row_of = np.repeat(np.arange(rows), lengths)
    seg = rng.integers(0, NUM_SEGMENTS, n).astype(np.uint8)
    col = rng.integers(0, 1 << 40, n, dtype=np.uint64)
    feat = rng.integers(0, 1 << 20, n, dtype=np.uint64)
    order = np.lexsort((feat, col, seg, row_of))  # canonical: (segment, column, feature) within a row
    row_column = np.uint64(first_column) + np.arange(rows, dtype=np.uint64) // np.uint64(4)
    row_feature = np.arange(rows, dtype=np.uint64) % np.uint64(4)
    return RowBatch(row_column, row_feature, offsets, seg[order], col[order], feat[order],
                    rng.random(n, dtype=np.float32))


_RSS_SCRIPT = """
import sys
from pathlib import Path
from giaannd.storage.engine.snapshot import read_snapshot
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
before = rss()
store, _ = read_snapshot(Path(sys.argv[1]), 1 << 50)
print(rss() - before, store.usage().num_entries)
"""


def loaded_rss_per_entry(snap: Path) -> float:
    """Resident bytes per entry a fresh process gains by loading ``snap`` (everything the store
    holds: rows, indexes, per-row objects where there are any)."""
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(snap)], capture_output=True, text=True, check=True,
                         timeout=600)
    rss, entries = map(int, out.stdout.split())
    return rss / max(entries, 1)


_REPLAY_RSS_SCRIPT = """
import sys
from giaannd.storage import DurableStore
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
before = status('VmRSS:')
ds = DurableStore.open(sys.argv[1], 1 << 50)
print(status('VmRSS:') - before, status('VmHWM:') - before, ds.store.usage().num_entries)
"""


def replay_rss_per_entry(store: Path) -> tuple[float, float]:
    """Resident bytes per entry a fresh process gains by replaying ``store``'s log: after the
    replay, and at its peak (VmHWM; the segments' buffers are held until the replay ends)."""
    out = subprocess.run([sys.executable, "-c", _REPLAY_RSS_SCRIPT, str(store)], capture_output=True, text=True,
                         check=True, timeout=600)
    rss, peak, entries = map(int, out.stdout.split())
    return rss / max(entries, 1), peak / max(entries, 1)


def _open_as_before(d: Path) -> None:
    """Baseline: ``DurableStore.open`` with the bulk replay as it was before runs of new rows went
    straight into the base: segments read into ``bytes`` and every run planned as one delta run of
    the run's concatenation, then folded (``append_new_rows`` refusing sends each run that way)."""
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(update_log.SegmentMapper, "read",
                                              lambda self, p: memoryview(p.read_bytes())))
        stack.enter_context(mock.patch.object(RowEngine, "append_new_rows", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(recovery, "replay", replay_groups_as_before))
        DurableStore.open(d, BIG).close()


def _replay_record_by_record(d: Path) -> None:
    """Baseline: every segment scanned, then replayed one record at a time (``replay_each``)."""
    segments = list_segments(d)
    store = ColumnStore(BIG)
    for n, (first, path) in enumerate(segments):
        replay_each(store, scan_segment(path, first, n == len(segments) - 1).records, 0)


def replay_phases(d: Path, gb: float, repeat: int, label: str = "") -> list[tuple[str, float, str | None]]:
    """Where a replay's CPU goes, s/GB by phase (best of ``repeat`` each): the segment reads (maps,
    as a restart's), the record checks (header and payload checksums), the payload decode with its row checks (in a
    second ``scan_segment``, which reads and checks again), and in ``replay`` the row-overlap
    lexsort, the key index, the copy into the engine's base, a group's search of the base
    (``search.find``), of the delta runs (``run.find_in_gaps``), the sort of its new keys
    (``_new_keys``), its commit (the adds, the new delta run and the folds it sets off) and the
    rest (the applied set, row counts, ...). A snapshot in ``d`` is loaded first (not timed). Timed by wrapping those
    functions (the wrappers' own cost is per call: a few dozen calls)."""
    spent: dict[str, float] = {}

    def timed(owner: object, name: str, phase: str) -> AbstractContextManager[object]:
        real = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.process_time()
            try:
                return real(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + time.process_time() - start
        return mock.patch.object(owner, name, wrapper)

    best: dict[str, float] = {}
    for _ in range(repeat):
        spent.clear()
        with ExitStack() as stack:
            for owner, name, phase in ((recovery, "_previous_record", "replay: row-overlap lexsort"),
                                       (KeyIndex, "lookup", "replay: key index"),
                                       (KeyIndex, "lookup_or_add", "replay: key index"),
                                       (KeyIndex, "append", "replay: key index"),
                                       (KeyIndex, "append_new", "replay: key index"),
                                       (engine_mod, "append_rows", "replay: copy into the base"),
                                       (engine_mod, "by_row", "replay: window grouped by row"),
                                       (engine_mod, "fold_rows", "replay: window's rows sorted, added, new keys"),
                                       (engine_mod, "fold_into_base", "replay: window's new keys merged into the base"),
                                       (update_log, "_decode_payload", "decode and row checks")):
                stack.enter_context(timed(owner, name, phase))
            reader = update_log.SegmentMapper()  # as a restart reads them
            snaps = list(d.glob("snapshot-*.snap"))
            segments = list_segments(d)
            store, after = read_snapshot(snaps[0], BIG, room=recovery.replay_room(segments)) if snaps else (
                ColumnStore(BIG), 0)
            for n, (first, path) in enumerate(segments):
                start = time.process_time()
                data = reader.read(path)
                read = time.process_time()
                for _rec in update_log.LOG_RECORD.scan(data, torn_tail=True):
                    pass
                checked = time.process_time()
                records = scan_segment(path, first, n == len(segments) - 1, reader).records
                scanned = time.process_time()
                recovery.replay(store, records, after)
                done = time.process_time()
                for phase, t in (("read", read - start), ("record checks", checked - read), ("replay", done - scanned)):
                    spent[phase] = spent.get(phase, 0.0) + t
            del records, data, store, reader
        inner = sum(v for k, v in spent.items() if k.startswith("replay: "))
        spent["replay: the rest"] = spent.pop("replay") - inner
        for k, v in spent.items():
            best[k] = min(best.get(k, float("inf")), v)
    return [(f"{label}replay phase: {k}, CPU (s/GB)", v / gb, None) for k, v in best.items()]


def bench_replay(d: Path, gb: float, repeat: int) -> list[tuple[str, float, str | None]]:
    """Log replay (open with no snapshot) and its same-run baselines, interleaved run by run (the
    machine is shared: each variant gets the same moments), best CPU and wall time of ``repeat``."""
    variants: dict[str, Callable[[], None]] = {
        "now": lambda: DurableStore.open(d, BIG).close(), "before": lambda: _open_as_before(d),
        "each": lambda: _replay_record_by_record(d)}
    wall = dict.fromkeys(variants, float("inf"))
    cpu = dict.fromkeys(variants, float("inf"))
    for _ in range(repeat):
        for name, fn in variants.items():
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - start)
            cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    rss, peak = replay_rss_per_entry(d)
    return [
        ("log replay, open with no snapshot (s/GB)", wall["now"] / gb, "<= 1.0"),
        ("log replay, CPU time (s/GB)", cpu["now"] / gb, "<= 1.0"),
        ("baseline: log replay as before (bytes reads, concatenated runs), CPU time (s/GB)", cpu["before"] / gb,
         None),
        ("baseline: log replay record by record, CPU time (s/GB)", cpu["each"] / gb, None),
        ("log replay CPU time, before / now (ratio)", cpu["before"] / cpu["now"], None),
        ("storage RSS per entry after a log replay (B)", rss, "<= 32"),
        ("peak RSS per entry during a log replay (B)", peak, None),
    ]


def bench_replay_training_log(tmp: Path, entries: int, repeat: int, phases: bool = False
                              ) -> list[tuple[str, float, str | None]]:
    """Log replay of a training-like log: a snapshot of ``entries`` * 0.4 entries grown by new rows,
    then ``apply_stream``'s batches (in-place adds to 1,500 stored rows + 500 new rows each) for
    about 1.4 times ``entries`` logged entries. Consecutive batches share rows: replayed in windows
    (``recovery.replay``, ``RowEngine.apply_in_order``). In s per GB of logged entries, the
    snapshot's load taken off; the baselines are the group replay before it
    (``replay_before.replay_groups_as_before``) and record-by-record replay of the same segments,
    timed in the same run, interleaved. Each batch adds to every key of the rows it picks (whole
    rows read back): a window's rows then hold few new keys."""
    rng = np.random.default_rng(16)
    d = tmp / "training"
    ds = DurableStore.open(d, BIG)
    seq, first_column = 0, 0
    while ds.store.usage().num_entries < entries * 2 // 5:
        seq += 1
        ds.apply(BatchId(1, seq), realistic_batch(rng, 20_000, first_column), validate=False)
        first_column += 5_000
    ds.snapshot()
    logged = 0
    for batch in apply_stream(rng, ds.store, max(10, entries * 30 // 1_000_000), 1 << 50):
        seq += 1
        ds.apply(BatchId(1, seq), batch, validate=False)
        logged += batch.num_entries
    ds.sync()
    ds.close()
    return _replay_log_figures(d, logged, repeat, "training-like log", phases)


def bench_replay_zipf_log(tmp: Path, sentences: int, repeat: int, phases: bool = False
                          ) -> list[tuple[str, float, str | None]]:
    """Log replay of the core's own training deltas: ``tools.bench.zipf_stream`` sentences (the
    scale bench's Zipf stream) encoded and trained in batches of 256 (``train_batch``), each
    batch's rows one logged record, as a storage node owning every column logs them. The first
    half is snapshotted, the second half replayed. Unlike ``bench_replay_training_log`` the
    batches add to a sparse subset of their rows' keys (a hot row gains a few hundred of its
    10^4-10^5 keys per batch), and most of the log's entries are new keys (the store doubles)."""
    d = tmp / "zipf"
    ds = DurableStore.open(d, BIG)
    assigner = ColumnAssigner()
    stream = iter(ZipfStream(7))
    logged = seq = 0
    for half in (0, 1):
        for _ in range(0, sentences // 2, 256):
            encoded = [e for e in assigner.encode_many(itertools.islice(stream, 256)) if e is not None]
            if not encoded:
                continue
            rows = train_batch(encoded).rows
            seq += 1
            ds.apply(BatchId(1, seq), rows, validate=False)
            logged += rows.num_entries * half
        if half == 0:
            ds.snapshot()
    ds.sync()
    ds.close()
    return _replay_log_figures(d, logged, repeat, "Zipf training log", phases)


def _replay_log_figures(d: Path, logged: int, repeat: int, label: str, phases: bool
                        ) -> list[tuple[str, float, str | None]]:
    """Replay timings of the store in ``d`` (a snapshot, then ``logged`` entries of log): window
    replay against the group replay before it (tools/bench/replay_before.py) and record by record,
    interleaved, in CPU s per GB of logged entries (the snapshot's load taken off); RSS after and
    at the peak of a restart."""
    gb = logged * ENTRY_BYTES / 1e9
    snap = next(d.glob("snapshot-*.snap"))

    def each() -> None:
        store, _ = read_snapshot(snap, BIG)
        segments = list_segments(d)
        for n, (first, path) in enumerate(segments):
            replay_each(store, scan_segment(path, first, n == len(segments) - 1).records, 0)

    variants = {"load": lambda: read_snapshot(snap, BIG), "now": lambda: DurableStore.open(d, BIG).close(),
                "groups": lambda: open_as_before(d, BIG), "each": each}
    cpu = dict.fromkeys(variants, float("inf"))
    for _ in range(repeat):
        for name, fn in variants.items():
            gc.collect()
            start = time.process_time()
            fn()
            cpu[name] = min(cpu[name], time.process_time() - start)
    rss, peak = replay_rss_per_entry(d)
    return [
        (f"{label} replay ({logged:,} entries logged), CPU time (s/GB of log)",
         (cpu["now"] - cpu["load"]) / gb, "<= 1.0"),
        (f"baseline: {label}, group replay before windows, CPU time (s/GB of log)",
         (cpu["groups"] - cpu["load"]) / gb, None),
        (f"baseline: {label}, record by record, CPU time (s/GB of log)", (cpu["each"] - cpu["load"]) / gb,
         None),
        (f"{label} replay CPU time, groups before / windows now (ratio)",
         (cpu["groups"] - cpu["load"]) / (cpu["now"] - cpu["load"]), None),
        (f"storage RSS per entry after a {label}'s restart (B)", rss, "<= 32"),
        (f"peak RSS per entry during a {label}'s restart (B)", peak, None),
    ] + (replay_phases(d, gb, repeat, f"{label}: ") if phases else [])


_CPU: dict[str, float] = {}


def _timed(fn: object, repeat: int = 1, cpu_as: str | None = None) -> float:
    """The best wall-clock time of ``repeat`` runs (the development VM is shared: the minimum is
    the least noisy); with ``cpu_as``, the best process CPU time is kept under that name too (a
    single-threaded load's CPU time is what its wall time would be on an idle machine, I/O waits
    aside)."""
    best = cpu = float("inf")
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    if cpu_as is not None:
        _CPU[cpu_as] = cpu
    return best


def bench_restart(tmp: Path, entries: int, repeat: int, as_json: bool, replay_only: bool = False,
                  zipf_sentences: int = 0, latency_only: bool = False) -> tuple[DurableStore, float] | None:
    """Section 1; returns the store (open, with a snapshot) and the snapshot write's seconds (None,
    the store closed, with ``replay_only``; with ``latency_only`` nothing but the write is timed)."""
    rng = np.random.default_rng(14)
    d = tmp / "store"
    ds = DurableStore.open(d, BIG)
    seq, first_column = 0, 0
    while ds.store.usage().num_entries < entries:
        seq += 1
        batch = realistic_batch(rng, 20_000, first_column)
        first_column += 5_000
        ds.apply(BatchId(1, seq), batch, validate=False)
    ds.sync()
    u = ds.store.usage()
    gb = u.num_entries * ENTRY_BYTES / 1e9
    ds.close()
    if latency_only:
        ds = DurableStore.open(d, BIG)
        return ds, _timed(ds.snapshot)
    title = (f"restart: {u.num_rows:,} rows, {u.num_entries:,} entries (median 17 per row), "
             f"{gb:.3f} GB of rows")
    replay_figures = (bench_replay(d, gb, repeat) + bench_replay_training_log(tmp, entries, repeat, replay_only)
                      + (bench_replay_zipf_log(tmp, zipf_sentences, repeat, replay_only) if zipf_sentences else []))
    if replay_only:
        _report(title, replay_figures + replay_phases(d, gb, repeat), as_json)
        return None
    ds = DurableStore.open(d, BIG)
    t_write = _timed(ds.snapshot)
    snap = next(d.glob("snapshot-*.snap"))
    t_new = _timed(lambda: read_snapshot(snap, BIG), repeat, "new")
    t_new_nv = _timed(lambda: read_snapshot(snap, BIG, verify_rows=False), repeat, "new_nv")
    rss = loaded_rss_per_entry(snap)
    figures = [
        ("snapshot load, row checks: bulk (s/GB)", t_new / gb, "<= 1.0"),
        ("snapshot load, checksum only: bulk (s/GB)", t_new_nv / gb, "<= 1.0"),
        ("storage RSS per entry after a snapshot load (B)", rss, "<= 32"),
        ("snapshot load, row checks: bulk, CPU time (s/GB)", _CPU["new"] / gb, "<= 1.0"),
        ("snapshot load, checksum only: bulk, CPU time (s/GB)", _CPU["new_nv"] / gb, "<= 1.0"),
        *replay_figures,
        ("snapshot write (s/GB)", t_write / gb, None),
    ]
    _report(title, figures, as_json)
    return ds, t_write


def apply_stream(rng: np.random.Generator, store: ColumnStore, count: int, first_column: int) -> list[RowBatch]:
    """Training-like deltas: each batch adds to 1,500 stored rows' stored keys (in place) and
    creates 500 new rows."""
    keys = store.keys()
    out = []
    for i in range(count):
        picked = sorted(keys[j] for j in rng.choice(len(keys), 1500, replace=False).tolist())
        rows = store.read_rows([k[0] for k in picked], [k[1] for k in picked])
        deltas = RowBatch(rows.row_column, rows.row_feature, rows.offsets, rows.segment, rows.target_column,
                          rows.target_feature, rng.random(rows.num_entries, dtype=np.float32))
        fresh = realistic_batch(rng, 500, first_column + 1000 * i)
        out.append(RowBatch.concat([deltas, fresh]))
    return out


def bench_apply_during_snapshot(ds: DurableStore, t_write: float, batches: int, busy_share: float,
                                as_json: bool, neighbours: int = 0) -> None:
    """Section 2; ``neighbours`` busy processes share the host meanwhile (a loaded node's other
    daemons)."""
    with _neighbours(neighbours):
        _apply_during_snapshot(ds, t_write, batches, busy_share, as_json, neighbours)


@contextmanager
def _neighbours(count: int) -> Iterator[None]:
    """``count`` processes that spin on a core each until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _apply_during_snapshot(ds: DurableStore, t_write: float, batches: int, busy_share: float, as_json: bool,
                           neighbours: int) -> None:
    gc.freeze()  # as the storage service does after recovery (service.py)
    rng = np.random.default_rng(15)
    next_column = 1 << 50
    seq = 1 << 20

    def run(stream: list[RowBatch], until: threading.Event | None) -> list[float]:
        nonlocal seq
        lat = []
        for b in stream:
            seq += 1
            start = time.perf_counter()
            ds.apply(BatchId(2, seq), b, validate=False)
            lat.append(time.perf_counter() - start)
            if until is not None and until.is_set():
                break
        return lat

    quiet = run(apply_stream(rng, ds.store, batches, next_column), None)
    next_column += 1 << 40
    busy: list[float] = []
    #: (lazy copies, a touched room) -> the freeze's durations; lazy (now, rowengine/cow.py) or the
    #: copies made in the freeze (before), with a room touched beforehand (as the service) or not
    freezes: dict[tuple[bool, bool], list[float]] = {(z, r): [] for z in (True, False) for r in (True, False)}
    #: lazy or not -> the writes' wait at a snapshot's start: the freeze, then the first apply after
    #: it (which, after a lazy freeze, copies the chunks it touches), with a room
    held: dict[bool, list[float]] = {True: [], False: []}
    snapshots = 0
    while len(busy) < batches or any(not v for v in freezes.values()):
        stream = apply_stream(rng, ds.store, max(2, batches - len(busy)), next_column)
        next_column += 1 << 40
        with_room = snapshots % 2 == 0
        lazy = snapshots % 4 < 2
        room = ds.freeze_room() if with_room else None  # before writes are held off
        ds.sync()  # as the service does before it holds writes off (the rotation then syncs little)
        start = time.perf_counter()
        job = ds.begin_snapshot(room, lazy)
        freezes[lazy, with_room].append(time.perf_counter() - start)
        first = run(stream[:1], None)  # before the write starts copying: the worst case
        if with_room:
            held[lazy].append(time.perf_counter() - start)
        done = threading.Event()

        def write_snapshot() -> None:
            job.write(busy_share)
            done.set()

        writer = threading.Thread(target=write_snapshot)
        writer.start()
        busy += first + run(stream[1:], done)
        writer.join()
        ds.finish_snapshot(job)
        snapshots += 1
    p99_quiet = float(np.percentile(quiet, 99))
    p99_busy = float(np.percentile(busy, 99))
    figures = [
        ("apply p99 during a snapshot / without", p99_busy / p99_quiet, "<= 2.0"),
        ("apply p99 without a snapshot (ms)", 1e3 * p99_quiet, None),
        ("apply p99 during a snapshot (ms)", 1e3 * p99_busy, None),
        ("freeze (applies held off), lazy copies (now), max (ms)", 1e3 * max(freezes[True, True]), None),
        ("baseline: freeze, copies made in it into a touched room, max (ms)", 1e3 * max(freezes[False, True]), None),
        ("baseline: freeze, copies made in it into fresh memory (no room touched beforehand), max (ms)",
         1e3 * max(freezes[False, False]), None),
        ("freeze + the first apply after it, lazy copies (now), max (ms)", 1e3 * max(held[True]), None),
        ("baseline: freeze + the first apply after it, copies made in the freeze, max (ms)", 1e3 * max(held[False]),
         None),
        ("baseline: applies held off for the whole write (ms)", 1e3 * t_write, None),
    ]
    _report(f"apply latency during a snapshot (busy share {busy_share}; {len(busy)} applies over {snapshots} "
            f"snapshots, {ds.store.usage().num_entries:,} entries stored; {neighbours} busy neighbour processes)",
            figures, as_json)


def _report(title: str, figures: list[tuple[str, float, str | None]], as_json: bool) -> None:
    if as_json:
        emit_figures(figures)
        return
    print_table(title, ["figure", "value", "target"], [[n, f"{v:.3f}", t or "-"] for n, v, t in figures])


def bench_write_delta_runs(tmp: Path, sentences: int, repeat: int, as_json: bool) -> None:
    """Snapshot writes of a store with several delta runs: the scale bench's Zipf training deltas
    (``sentences``, batches of 256) applied to a ``ColumnStore``, frozen once; its view written
    ``repeat`` times in each mode in turn (``snapshot.write_frozen``'s ``mode``, snapshot_io.py):
    through the page cache ("cached": a stop's final snapshot, and every snapshot before
    ``storage.snapshot-direct-io``; the same-run baseline), the same with its pages dropped as they
    reach the disk ("dropped", ``storage.snapshot-drop-cache``), and around the cache ("direct",
    ``O_DIRECT``: a timer's snapshot by default). Each file is deleted after its write, as the next
    snapshot deletes the one before. CPU s per GB written (process time: the kernel's part too),
    median of ``repeat``; the files are byte for byte the same (checked)."""
    store = ColumnStore(BIG)
    for seq, rows in enumerate(training_deltas(iter(ZipfStream(7)), sentences), 1):
        store.apply(BatchId(1, seq), rows, validate=False)
    view = store.freeze()
    assert view.engine is not None
    runs, entries = len(view.engine.deltas), view.engine.num_entries
    gb = entries * ENTRY_BYTES / 1e9
    modes: tuple[snapshot_mod.WriteMode, ...] = ("cached", "dropped", "direct")
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    digests: set[int] = set()
    try:
        for _ in range(repeat):
            for mode in modes:
                start = time.process_time()
                path = snapshot_mod.write_frozen(tmp, view, seq, mode=mode)
                cpu[mode].append((time.process_time() - start) / gb)
                digests.add(hash(path.read_bytes()))
                path.unlink()
    finally:
        view.release()
    if len(digests) != 1:
        raise SystemExit("snapshot writes in different modes wrote different files")
    direct = "direct (refused here: written cached)" if snapshot_mod.direct_io_refused(tmp) else "direct"
    median = {mode: statistics.median(values) for mode, values in cpu.items()}
    figures = [(f"snapshot write, {runs} delta runs, through the page cache (baseline), CPU s/GB",
                median["cached"], None),
               (f"snapshot write, {runs} delta runs, dropped from the page cache, CPU s/GB", median["dropped"], None),
               (f"snapshot write, {runs} delta runs, {direct}, CPU s/GB", median["direct"], "< baseline"),
               ("snapshot write, direct / through the page cache", median["direct"] / median["cached"], "< 1")]
    _report(f"Snapshot writes with delta runs ({sentences:,} Zipf sentences, {entries:,} entries, "
            f"median of {repeat})", figures, as_json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=10_000_000, help="entries in the store (default 10^7)")
    ap.add_argument("--applies", type=int, default=200, help="applies measured with and without a snapshot")
    ap.add_argument("--busy-share", type=float, default=0.5,
                    help="the snapshot thread's busy share (storage.snapshot-busy-share, default 0.5)")
    ap.add_argument("--repeat", type=int, default=3, help="loads timed, best of (default 3)")
    ap.add_argument("--replay-only", action="store_true", help="only the log replay figures (section 1)")
    ap.add_argument("--zipf-sentences", type=int, default=60_000,
                    help="Zipf-stream sentences trained for the Zipf training log (half logged; 0 skips it)")
    ap.add_argument("--write-sentences", type=int, default=60_000,
                    help="Zipf-stream sentences applied for the snapshot writes with delta runs (0 skips them)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--latency-only", action="store_true",
                    help="only section 2 (the store is built and snapshotted once, nothing else timed)")
    ap.add_argument("--neighbours", type=int, default=0,
                    help="section 2: this many busy processes share the host meanwhile (default 0)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="giaannd-bench-snapshot-", dir=args.dir))
    try:
        if args.write_sentences and not (args.replay_only or args.latency_only):
            bench_write_delta_runs(tmp, args.write_sentences, args.repeat, args.json)
        opened = bench_restart(tmp, args.entries, args.repeat, args.json, args.replay_only, args.zipf_sentences,
                               args.latency_only)
        if opened is None:
            return
        ds, t_write = opened
        try:
            bench_apply_during_snapshot(ds, t_write, args.applies, args.busy_share, args.json, args.neighbours)
        finally:
            ds.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
