"""How long releasing columns stops a storage node's event loop: the drop on the loop, as a topology
change's release did until Nov 30, against the drop behind the fold gate in worker threads
(giaannd/storage/replication/background_fold.py ``drop``).

    python -m tools.bench.drop_stall [--entries 40000000] [--log-share 0.2] [--rounds 2]
        [--before-code DIR] [--cache DIR | --store DIR] [--json]

The store is ``tools.bench.restart``'s (real-shaped rows, median 17 entries, a snapshot and
``--log-share`` of it logged after: opened, the log is replayed into delta runs, as on a node that
restarted and trained), built once into ``--cache`` and copied for each child. Each variant runs
in its own process, alternated round by round: ``before`` the listing and the drop on the event
loop under the writes' lock, what ``release_unowned`` did (this checkout, or ``--before-code``: a
checkout of the code before, e.g. ``git worktree add --detach DIR HEAD``, whose sorted keys a drop
left to a rebuild); ``after`` ``BackgroundFold.drop`` on this checkout. Both drop the same third
of the columns (by a hash of the column id).

On one event loop: a ticker sleeping 1 ms; at 0.3 s the drop starts; once it is done, the next
listing of the held columns (what the next scan page or release asks for), timed on the loop. The
loop's stalls are the gaps between ticks: the longest inside the drop, and the listing's time. Both
variants must end with the same rows (a digest of the held columns, the entries and their
strengths' sum).

``--json`` prints one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

#: A stall of the event loop longer than this is one a node's peers notice (the fold bench's bound).
STALL_TARGET_MS = 50.0
TRIGGER_AT_S = 0.3
#: Seconds between two children: a drop that filled fresh memory in huge pages (the code before)
#: leaves the kernel compacting memory for a while, which the next child would meet.
SETTLE_S = 5.0
DROP_SHARE = 3  # one column in this many is dropped


def _dropped(held: NDArray[np.uint64]) -> NDArray[np.uint64]:
    dropped: NDArray[np.uint64] = held[(held * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(DROP_SHARE) == 0]
    return dropped


def _child(store_dir: Path, thread: bool) -> dict[str, Any]:
    """One variant's run (module docstring) on the ``giaannd`` on ``sys.path``; ``thread``: the drop
    through ``BackgroundFold.drop``, else on the loop."""
    from giaannd.storage.engine.recovery import DurableStore
    from giaannd.storage.replication.background_fold import BackgroundFold

    with tempfile.TemporaryDirectory(dir=store_dir.parent) as tmp:
        copy = Path(tmp) / "store"
        shutil.copytree(store_dir, copy)
        os.sync()  # (the copy's writeback would otherwise run during the phase, on this machine's disk)
        durable = DurableStore.open(copy, 1 << 50)
        try:
            return asyncio.run(_phase(durable, BackgroundFold, thread))
        finally:
            durable.close()


async def _phase(durable: Any, background_fold: Any, thread: bool) -> dict[str, Any]:
    # (the ticker is fold_stall's: written out again, since a child of another checkout imports
    # ``tools`` from that checkout, which may not have a shared helper)
    writes = asyncio.Lock()
    folds = background_fold(durable, writes)
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        ticks.append(time.perf_counter())
        while not done.is_set():
            await asyncio.sleep(0.001)
            ticks.append(time.perf_counter())

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(TRIGGER_AT_S)
    cpu0, t0 = time.process_time(), time.perf_counter()
    if thread:
        _, result = await folds.drop(durable, _dropped)
    else:
        async with writes:
            result = durable.drop_columns(_dropped(durable.store.held_columns()))
    t1 = time.perf_counter()
    cpu = time.process_time() - cpu0
    held = durable.store.held_columns()
    t2 = time.perf_counter()
    await asyncio.sleep(0.05)
    done.set()
    await tick
    gaps = np.diff(np.array(ticks))
    starts = np.array(ticks[:-1])
    inside = np.maximum(0.0, np.minimum(starts + gaps, t1) - np.maximum(starts, t0))
    entries = durable.store.usage().num_entries
    digest = hashlib.blake2b(held.tobytes(), digest_size=8)
    digest.update(str(entries).encode())
    pick = held[:: max(1, held.shape[0] // 200)]  # the rows of 200 held columns, evenly spread
    cols, feats, _ = durable.store.rows_of_columns(pick)
    for buf in durable.store.read_rows(cols, feats).buffers():
        digest.update(np.ascontiguousarray(buf).tobytes())
    return {"rows_dropped": result.rows, "entries_after": entries, "drop_wall_s": t1 - t0, "drop_cpu_s": cpu,
            "max_stall_ms": 1000 * float(inside.max(initial=0)), "listing_ms": 1000 * (t2 - t1),
            "digest": digest.hexdigest()}


def _run_child(code: Path, store_dir: Path, thread: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(store_dir),
                          *(["--thread"] if thread else [])],
                         env=env, cwd=str(code), capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=40_000_000, help="entries in the store (default 4e7)")
    ap.add_argument("--log-share", type=float, default=0.2, help="logged after the snapshot, share (default 0.2)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before-code", type=Path, default=None,
                    help="a checkout of the code before; default: this checkout, the drop on the loop")
    ap.add_argument("--cache", type=Path, default=Path("/var/tmp/giaannd-bench-drop"),
                    help="where the store is built once and kept")
    ap.add_argument("--store", type=Path, default=None,
                    help="a store directory to copy instead of the built one (e.g. tools.bench.recovery's cache)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--thread", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.thread)))
        return
    from giaannd.storage.replication.service import STORE_DIR
    from tools.bench.report import emit_figure, print_table
    from tools.bench.restart import cached_store

    if args.store is None:
        cache = args.cache / f"{args.entries}-{args.log_share}"
        held, logged = cached_store(cache, args.entries, args.log_share)
        store_dir = cache / STORE_DIR
    else:
        store_dir, held, logged = args.store, 0, 0
    after_code = Path(__file__).resolve().parents[2]
    results: list[tuple[str, dict[str, Any], str]] = []
    for _ in range(args.rounds):
        for variant, code in (("before", args.before_code or after_code), ("after", after_code)):
            time.sleep(SETTLE_S)
            load = os.getloadavg()[0]
            results.append((variant, _run_child(code, store_dir, variant == "after"), f"{load:.1f}"))
    digests = {r["digest"] for _, r, _ in results}
    if args.json:
        for variant, r, _ in results:
            target = f"<= {STALL_TARGET_MS:g}" if variant == "after" else None
            emit_figure(f"max loop stall ms during the drop, {variant}", r["max_stall_ms"], target)
            emit_figure(f"next listing of the held columns ms, {variant}", r["listing_ms"], target)
            emit_figure(f"drop wall s, {variant}", r["drop_wall_s"])
            emit_figure(f"drop CPU s, {variant}", r["drop_cpu_s"])
        emit_figure("variants ending with the same rows", float(len(digests) == 1), "== 1")
        return
    rows = [[variant, f"{r['max_stall_ms']:.1f}" + (f" (<= {STALL_TARGET_MS:g})" if variant == "after" else ""),
             f"{r['listing_ms']:.1f}" + (f" (<= {STALL_TARGET_MS:g})" if variant == "after" else ""),
             f"{r['drop_wall_s']:.2f}", f"{r['drop_cpu_s']:.2f}", str(r["rows_dropped"]), r["digest"], load]
            for variant, r, load in results]
    what = f"{held:.2e} entries ({logged:.1e} logged after its snapshot)" if held else str(store_dir)
    print_table(f"Releasing a third of the columns of a store of {what}; rows equal across variants: "
                + ("yes" if len(digests) == 1 else "NO"),
                ["code", "loop stall ms, drop", "next listing ms", "drop wall s", "drop CPU s", "rows dropped",
                 "rows digest", "load (1 min)"], rows)


if __name__ == "__main__":
    main()
