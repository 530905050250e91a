"""How long a fold of the delta runs stops a storage node's event loop, before and after the fold
moved to a worker thread (giaannd/storage/replication/background_fold.py).

    python -m tools.bench.fold_stall [--entries 10000000,50000000] [--before-code DIR] [--json]

Each variant runs in its own child process (its memory its own): ``before``, the fold inline on
the event loop (this checkout with no ``on_fold_due``: a commit folds, as every commit did before
the fold moved to a thread; or, with ``--before-code``, a checkout of the code before, e.g. ``git
worktree add --detach DIR b2be5e8``), ``after`` on this checkout (the store's ``on_fold_due``
hands the fold to a ``BackgroundFold``, as the service does). Sizes alternate before, after, so
both meet the same load on this shared machine.

A child builds a column store of N entries (rows of 16, loaded as a snapshot's: ``load_bulk``, the
buffers with room, so the fold goes in place as on a node) and delta runs of new keys scattered
over every row up to just under the fold's threshold (1/4 of the base, applies of canonical
batches). Then, on one asyncio event loop, for ``PHASE_S`` or until the fold ends: a ticker
sleeping 1 ms, and requests on a fixed timeline,
one every ``REQUEST_EVERY_S``, alternately a read of 64 random rows and an apply adding to 256
held keys, each served as the service serves it (a read after the fold gate, an apply under the
writes' lock); a request's latency runs from its time on the timeline (so a request the loop could
not even start during a stall counts it). At ``TRIGGER_AT_S`` one apply of new keys makes the fold
due. The fold's CPU is the thread time of the thread that ran it (``RowEngine.compact``, timed
around the call), its wall time likewise. The loop's stalls are the gaps between the ticker's
ticks, split by when they fall: the longest part of a gap inside the fold (*the fold's stall*), inside
the ``DRAIN_S`` after it (*the drain*: the requests held back during the fold, all woken at once,
run back to back; it grows with the fold's length times the request rate) and the longest gap
elsewhere (the machine's own noise, for comparison). Every child applies the same batches in the same order:
the digest of the store's strengths and keys after the run must match between variants (rows bit
for bit).

``--json`` prints one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from giaannd.storage.replication.background_fold import Foldable

#: Entries per base row.
ROW = 16
#: Seconds of the measured phase (longer if the fold is still running then).
PHASE_S = 2.0
#: When, in the phase, the apply that makes the fold due comes.
TRIGGER_AT_S = 0.3
#: One request (a read or an apply, alternately) every this many seconds.
REQUEST_EVERY_S = 0.004
READ_ROWS = 64
APPLY_ROWS = 256
STALL_TARGET_MS = 50.0
#: New keys per apply while the delta runs grow (a training batch's size: the tier merges, not the
#: batch's own search, are then what the longest apply shows).
SETUP_BATCH = 1 << 15
#: Seconds after the fold in which the requests it held back are served (the *drain*, module docstring).
DRAIN_S = 1.0
CPU_TARGET = 1.2


def _child(entries: int, seed: int, inline: bool = False) -> dict[str, Any]:
    """One variant's run (module docstring), on the ``giaannd`` on ``sys.path``; ``inline``: the
    fold in the commit, on the loop (the code before, or this code with no ``on_fold_due``)."""
    from giaannd.model.rows import Row, RowBatch
    from giaannd.protocol import BatchId
    from giaannd.storage.engine.column_store import ColumnStore

    try:
        from giaannd.storage.replication.background_fold import BackgroundFold
    except ImportError:  # the code before: folds inline
        BackgroundFold = None  # type: ignore[assignment,misc]  # noqa: N806

    rng = np.random.default_rng(seed)
    rows = entries // ROW
    n = rows * ROW
    cols = np.arange(1, rows + 1, dtype=np.uint64)
    feats = np.zeros(rows, np.uint64)

    def room(dtype: Any, fill: Any) -> np.ndarray:
        buf = np.empty(n + n // 2, dtype)
        buf[:n] = fill
        return buf[:n]

    tc = room(np.uint64, 0)
    tc.reshape(rows, ROW)[:] = 2 * np.arange(1, ROW + 1, dtype=np.uint64)  # even: the base's keys
    store = ColumnStore(1 << 50)
    store.load_bulk(cols, feats, np.arange(0, n + 1, ROW, dtype=np.int64),
                    Row(room(np.uint8, 0), tc, room(np.uint64, 0), room(np.float32, 1.0)),
                    np.zeros(rows, np.uint64), spare=True)
    del tc  # (a reference to a base field held here would defer every fold: run.held)

    seq = [0]

    def batch(which: np.ndarray, key: int) -> RowBatch:
        k = which.shape[0]
        return RowBatch.from_entries(cols[which], feats[which], np.zeros(k, np.uint8), np.full(k, key, np.uint64),
                                     np.zeros(k, np.uint64), np.ones(k, np.float32))

    def apply(b: RowBatch) -> None:
        seq[0] += 1
        store.apply(BatchId(1, seq[0]), b, validate=False)

    # delta runs: new keys (odd target columns) in every row, up to just under 1/4 of the base; each
    # apply timed (the tier merges it does inline are the loop's: *the longest apply while the delta
    # runs grow*). After: a commit leaves large merges to the worker thread (RowEngine.merge_due),
    # which they run in here, untimed, after the apply that left them.
    left: list[int] = []
    if not inline and BackgroundFold is not None:
        store.on_fold_due = lambda: left.append(1)
    longest_apply = 0.0
    below = n // 4 - rows // 10
    key = 1
    while below > 0:
        take = min(rows, below, SETUP_BATCH)
        which = np.sort(rng.choice(rows, take, replace=False)) if take < rows else np.arange(rows)
        b = batch(which, key)
        t = time.perf_counter()
        apply(b)
        longest_apply = max(longest_apply, time.perf_counter() - t)
        if left:
            left.clear()
            store.fold_deltas(due_only=True)  # (the worker thread's: a merge, or a fold if due)
        below -= take
        key += 2
    store.on_fold_due = None
    folds_before = store.engine.stats.folds
    trigger = batch(np.sort(rng.choice(rows, rows // 5, replace=False)), key)

    fold_cpu: list[float] = []
    fold_span: list[tuple[float, float]] = []
    real_compact = store.engine.compact

    def timed_compact() -> None:
        c0, w0 = time.thread_time(), time.perf_counter()
        real_compact()
        fold_cpu.append(time.thread_time() - c0)
        fold_span.append((w0, time.perf_counter()))

    store.engine.compact = timed_compact  # type: ignore[method-assign]
    reads = [np.sort(rng.choice(rows, READ_ROWS, replace=False)) for _ in range(64)]
    adds = [batch(np.sort(rng.choice(rows, APPLY_ROWS, replace=False)), 2) for _ in range(64)]
    requests = int(PHASE_S / REQUEST_EVERY_S)

    async def run() -> dict[str, Any]:
        writes = asyncio.Lock()
        folds = None
        if BackgroundFold is not None and not inline:
            try:  # what a fold applies when it ends: nothing in this bench (no write is held back)
                from giaannd.storage.engine.deferred_applies import DeferredApplies

                store.deferred = DeferredApplies(store, None)  # type: ignore[attr-defined,arg-type]
            except ImportError:  # the code before: nothing held
                pass
            # a Foldable: the ColumnStore with its ``deferred`` attached above (the code before's
            # BackgroundFold wants none)
            folds = BackgroundFold(cast("Foldable", store), writes)
            store.on_fold_due = folds.due
        latencies: dict[str, list[float]] = {"read": [], "apply": []}
        ticks: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            ticks.append(time.perf_counter())
            while not done.is_set():
                await asyncio.sleep(0.001)
                ticks.append(time.perf_counter())

        async def read(i: int, due: float) -> None:
            if folds is not None:
                await folds.ready()
            store.read_rows(cols[reads[i % 64]], feats[reads[i % 64]])
            latencies["read"].append(time.perf_counter() - due)

        async def add(b: RowBatch, due: float, kind: str | None = "apply") -> None:
            async with writes:
                apply(b)
            if kind is not None:
                latencies[kind].append(time.perf_counter() - due)

        tick = asyncio.create_task(ticker())
        tasks = []
        t0 = time.perf_counter()
        trigger_k = int(TRIGGER_AT_S / REQUEST_EVERY_S)
        for k in range(requests):  # on the timeline: a request the loop is late for counts the delay
            due = t0 + k * REQUEST_EVERY_S
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            if k == trigger_k:
                tasks.append(asyncio.create_task(add(trigger, due, None)))
            tasks.append(asyncio.create_task(read(k // 2, due) if k % 2 == 0 else add(adds[k // 2 % 64], due)))
        await asyncio.gather(*tasks)
        while store.engine.stats.folds == folds_before or (folds is not None and folds.running):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        done.set()
        await tick
        return {"ticks": np.array(ticks), "latencies": latencies}

    cpu0 = time.process_time()
    got = asyncio.run(run())
    cpu = time.process_time() - cpu0
    store.fold_deltas()
    digest = hashlib.blake2b(digest_size=8)
    for f in store.engine.base_fields():
        digest.update(np.ascontiguousarray(f).data.cast("B"))
    ticks: NDArray[np.float64] = got["ticks"]
    (f0, f1), = fold_span  # one fold in the phase

    def overlap(lo: float, hi: float) -> NDArray[np.float64]:
        """Each gap's time inside [lo, hi]."""
        inside: NDArray[np.float64] = np.maximum(0.0, np.minimum(ticks[1:], hi) - np.maximum(ticks[:-1], lo))
        return inside

    drain = overlap(f1, f1 + DRAIN_S)
    other = (overlap(f0, f1 + DRAIN_S) == 0) & (ticks[1:] - ticks[:-1] > 0)
    return {"entries": store.engine.num_entries, "max_gap_ms": 1000 * float(overlap(f0, f1).max(initial=0)),
            "max_drain_ms": 1000 * float(drain.max(initial=0)),
            "max_gap_other_ms": 1000 * float(np.diff(ticks)[other].max(initial=0)),
            "read_p99_ms": 1000 * float(np.percentile(got["latencies"]["read"], 99)),
            "apply_p99_ms": 1000 * float(np.percentile(got["latencies"]["apply"], 99)),
            "requests": len(got["latencies"]["read"]) + len(got["latencies"]["apply"]),
            "fold_cpu_s": fold_cpu[0], "fold_wall_s": f1 - f0,
            "longest_apply_ms": 1000 * longest_apply, "phase_cpu_s": cpu, "digest": digest.hexdigest(),
            "rss_mb": _rss_mb(), "stats": repr(store.engine.stats)}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _run_child(code: Path, entries: int, seed: int, inline: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(entries), "--seed", str(seed),
                          *(["--inline"] if inline else [])],
                         env=env, cwd=str(code), capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", default="10000000,50000000", help="comma-separated base sizes")
    ap.add_argument("--before-code", type=Path, default=None,
                    help="a checkout of the code before (giaannd/ at its root); default: this checkout, "
                         "folding inline")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.seed, args.inline)))
        return
    from tools.bench.report import emit_figure, print_table

    after_code = Path(__file__).resolve().parents[2]
    results: list[tuple[int, str, dict[str, Any], str]] = []
    for entries in (int(e) for e in args.entries.split(",")):
        for _ in range(args.repeat):
            for variant, code in (("before", args.before_code or after_code), ("after", after_code)):
                load_1min = os.getloadavg()[0]
                inline = variant == "before" and args.before_code is None
                results.append((entries, variant, _run_child(code, entries, args.seed, inline), f"{load_1min:.1f}"))
    if args.json:
        for entries, variant, r, _ in results:
            emit_figure(f"max loop stall ms during the fold, {variant}, {entries:.0e} entries", r["max_gap_ms"],
                        f"<= {STALL_TARGET_MS:g}" if variant == "after" else None)
            emit_figure(f"max loop stall ms in the drain after the fold, {variant}, {entries:.0e} entries",
                        r["max_drain_ms"])
            emit_figure(f"max loop stall ms elsewhere, {variant}, {entries:.0e} entries", r["max_gap_other_ms"])
            emit_figure(f"read p99 ms, {variant}, {entries:.0e} entries", r["read_p99_ms"])
            emit_figure(f"apply p99 ms, {variant}, {entries:.0e} entries", r["apply_p99_ms"])
            emit_figure(f"fold CPU s, {variant}, {entries:.0e} entries", r["fold_cpu_s"])
            emit_figure(f"longest apply ms while the delta runs grow, {variant}, {entries:.0e} entries",
                        r.get("longest_apply_ms"))
        return
    rows = []
    for i, (entries, variant, r, load) in enumerate(results):
        base = results[i - 1][2] if variant == "after" else r  # the before just run, same size
        ratio = r["fold_cpu_s"] / base["fold_cpu_s"] if r["fold_cpu_s"] and base["fold_cpu_s"] else float("nan")
        rows.append([f"{entries:.0e}", variant, f"{r['max_gap_ms']:.1f}" + (f" (<= {STALL_TARGET_MS:g})"
                                                                            if variant == "after" else ""),
                     f"{r['max_drain_ms']:.1f}", f"{r['max_gap_other_ms']:.1f}", f"{r['read_p99_ms']:.1f}",
                     f"{r['apply_p99_ms']:.1f}",
                     f"{r['fold_wall_s']:.3f}", f"{r.get('longest_apply_ms', float('nan')):.1f}",
                     f"{r['fold_cpu_s']:.3f}", f"{ratio:.2f}" + (f" (<= {CPU_TARGET:g})" if variant == "after" else ""),
                     str(r["requests"]), f"{r['rss_mb']:.0f}", r["digest"], load])
    print_table("Fold stall: event loop and requests while the delta runs fold into the base",
                ["entries", "code", "loop stall ms, fold", "drain after it", "elsewhere", "read p99 ms", "apply p99 ms",
                 "fold wall s", "longest apply ms as the deltas grow", "fold CPU s", "fold CPU / before", "requests",
                 "peak RSS MB", "rows digest", "load (1 min)"], rows)


if __name__ == "__main__":
    main()
