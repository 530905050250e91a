"""A storage daemon's restart after kill -9, broken down (issue 14 item 4 on a real daemon).

    python -m tools.bench.restart [--entries 10000000] [--log-share 0.2] [--restarts 3]
                                  [--before-tree DIR] [--store-cache DIR] [--cold]
                                  [--read-ahead-beside] [--json]

One real storage daemon (``storage-2`` of a loopback ``LocalCluster`` of two storage daemons, tcp,
no compute: ``storage-1`` is the seed it joins) holds ``--entries`` entries of real-shaped rows
(median 17 entries: ``tools.bench.snapshot.realistic_batch``), written into its data directory
before the cluster starts: a snapshot, then ``--log-share`` of that again as logged batches after
it (new rows and training-like in-place adds: ``snapshot.apply_stream``), so every restart loads
the snapshot and replays the log (the snapshot timer is set to an hour: none is written meanwhile).
The daemon is killed (SIGKILL) and started again ``--restarts`` times; each restart's timeline, in
seconds since the ``exec``, from the daemon's own log lines (plain format, millisecond timestamps):

- ``imports + config``: ``starting giaannd`` (cli.py: the entry module's imports done, the config
  loaded and checked);
- ``roles built``: ``services built`` (the daemon, runtime, membership and role modules imported,
  the services constructed);
- ``admin up``: ``admin api listening`` (node id, admin token);
- ``listeners up``: ``data plane listening`` (the runtime's transports);
- ``joined``: ``joined cluster`` (gossip join to the seed) and ``ring synced`` (ring pulled);
- ``recovered``: ``storage recovered`` (logged once the storage role's start has the recovered
  store; its own split, from the same line: ``snapshot_load_s``, ``replay_s``);
- ``ready``: ``ready node=`` (READY=1: every service started, the node serves);
- ``seen ready``: ``/v1/status`` says ``running`` to the bench's poll (``LocalCluster.wait_ready``).

``--before-tree DIR`` restarts the same daemon, on the same files, from another checkout too (its
code first on ``PYTHONPATH``), taking turns with this one restart by restart: the same-run
baseline of a change (a checkout without the log lines above shows ``-`` for them). Baselines run
after each round, in fresh processes: ``import giaannd.daemon``, ``import giaannd.services.roles``
and ``DurableStore.open`` of a copy of the store (the recovery alone, imports included), and,
timed from the storage engine's import on, that recovery and the imports of the rest of the daemon
one after the other (as the daemon starts) against side by side (recovery in a thread): what
starting the recovery before the rest of the imports could gain, without the cluster's noise
around it (docs/storage.md "A daemon's restart, step by step": built, measured, not kept). Figures
are medians; s per GB of row data (entries × 21 bytes) for the whole restart (exec → ready) and
for recovery, target ≤ 1 s/GB (issue 14). ``--store-cache DIR`` keeps the generated store for later
runs. ``--cold`` drops the victim's store files from the page cache before each restart
(``drop_from_cache``: a reboot's restart, or one after other work evicted them);
The daemons restarted and the baselines' fresh processes run with the trees' bytecode compiled
ahead, as an installed daemon has it (``bytecode_env``; before Dec 1, in an environment with
``PYTHONDONTWRITEBYTECODE`` set, each start compiled its modules), and a before tree's config is
made before its clock starts. ``--read-ahead-beside`` adds restarts with a process beside the
``exec`` that asks for every file in the read-ahead's steps (an experiment: what reading during
the start-up's imports would add to the store's own read-ahead, docs/storage.md "Reading a
restart's files ahead"). ``--json`` prints one ``{"figure", "value", "target"}`` object per figure
(tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from giaannd.page_cache import drop_rest
from giaannd.protocol import BatchId
from giaannd.sdk.local_cluster import LocalCluster, Node
from giaannd.storage import DurableStore
from giaannd.storage.engine.column_store import ENTRY_BYTES
from giaannd.storage.engine.read_ahead import STEP_BYTES
from giaannd.storage.replication.service import STORE_DIR
from tools.bench.report import emit_figures, print_table
from tools.bench.snapshot import apply_stream, realistic_batch

__all__ = ["STAGES", "build_store", "main", "timeline"]

BIG = 1 << 44
TARGET_S_PER_GB = 1.0
#: (column label, the first log line's message prefix after the exec that marks it)
STAGES: tuple[tuple[str, str], ...] = (
    ("imports + config", "starting giaannd"),
    ("roles built", "services built"),
    ("admin up", "admin api listening"),
    ("listeners up", "data plane listening"),
    ("joined", "joined cluster"),
    ("ring synced", "ring synced at start"),
    ("recovered", "storage recovered"),
    ("ready", "ready node="),
)
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
_FIELD = re.compile(r"(\w+)=([\d.]+)")


def build_store(store_dir: Path, entries: int, log_share: float, seed: int = 0,
                new_rows_log: bool = False) -> tuple[int, int]:
    """Write a store of ``entries`` snapshotted entries plus about ``log_share`` of that logged
    after the snapshot (half new rows, half in-place adds to stored rows; ``new_rows_log``: rows
    of columns nothing before held only, as a stream's chunks bring). Returns (entries held,
    entries logged)."""
    rng = np.random.default_rng(seed)
    ds = DurableStore.open(store_dir, BIG)
    seq, column = 0, 0
    while ds.store.usage().num_entries < entries:
        seq += 1
        ds.apply(BatchId(1, seq), realistic_batch(rng, 20_000, column), validate=False)
        column += 5_000
    ds.snapshot()
    logged, goal = 0, int(entries * log_share)
    while logged < goal:
        batches = [realistic_batch(rng, 20_000, column)] if new_rows_log else apply_stream(rng, ds.store, 5, column)
        for batch in batches:
            seq += 1
            ds.apply(BatchId(1, seq), batch, validate=False)
            logged += batch.num_entries
        column += 5_000
    ds.sync()
    held = ds.store.usage().num_entries
    ds.close()
    return held, logged


def _log_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def timeline(log_text: str, exec_at: float) -> dict[str, float]:
    """Seconds since ``exec_at`` (wall clock) of each stage in ``STAGES`` (its first log line at or
    after ``exec_at``), plus ``snapshot_load_s`` and ``replay_s`` from the recovery line."""
    out: dict[str, float] = {}
    for line in log_text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        at = _log_time(m.group(1)) - exec_at
        if at < -0.001:  # an earlier start's line (the clock's milliseconds are truncated)
            continue
        message = m.group(2)
        for label, prefix in STAGES:
            if label not in out and message.startswith(prefix):
                out[label] = at
                if label == "recovered":
                    fields = dict(_FIELD.findall(message))
                    out["snapshot_load_s"] = float(fields["snapshot_load_s"])
                    out["replay_s"] = float(fields["replay_s"])
    return out


#: Where ``bytecode_env`` compiles the trees' modules (``run`` sets it: under the bench's directory).
_bytecode_prefix: Path | None = None
_compiled: set[Path] = set()


def bytecode_env(tree: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment (``base``, else this process's) to run ``tree``'s code with its bytecode
    cached, as an installed daemon has it (pip compiles a package's modules as it installs them):
    ``giaannd`` and ``peers`` compiled once into ``_bytecode_prefix`` (``compileall``,
    ``PYTHONPYCACHEPREFIX``) and ``PYTHONDONTWRITEBYTECODE`` unset. Without it, where that variable
    is set (this project's sandboxes set it), every start compiles the ~165 modules the daemon
    imports from source: 0.18-0.23 s (docs/storage.md "A daemon's restart, step by step")."""
    env = dict(os.environ if base is None else base)
    if _bytecode_prefix is None:
        return env
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(_bytecode_prefix)
    tree = tree.resolve()
    if tree not in _compiled:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "giaannd"), str(tree / "peers")],
                       env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
        _compiled.add(tree)
    return env


def _fresh_process_s(code: str, cwd: Path) -> float:
    """Wall seconds of ``python -c code`` in a fresh interpreter (``cwd``'s bytecode cached)."""
    env = bytecode_env(cwd)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=cwd, timeout=600, env=env)
    return time.perf_counter() - start


#: Prints the config sections and keys the ``giaannd`` on ``sys.path`` knows, as JSON.
_KNOWN_KEYS = """
import json, typing, msgspec
from giaannd.config import Config
out = {}
for f in msgspec.structs.fields(Config):
    t = typing.get_args(f.type)[0] if typing.get_origin(f.type) is typing.Annotated else f.type
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        out[f.encode_name] = [g.encode_name for g in msgspec.structs.fields(t)]
if not out:
    raise SystemExit("no config sections found: the bench cannot filter this tree's config")
print(json.dumps(out))
"""


def known_keys_only(toml_text: str, known: dict[str, list[str]]) -> str:
    """``toml_text`` (``config.to_toml``'s: ``[section]`` lines, then ``key = value`` lines) without
    the keys, and sections, that ``known`` lacks: a config this tree wrote, for code from before a
    key was added (it refuses unknown keys)."""
    out, keys = [], None
    for line in toml_text.splitlines():
        head = re.fullmatch(r"\[([^\]]+)\]\s*", line)
        if head:
            keys = known.get(head.group(1))
            if keys is not None:
                out.append(line)
            continue
        key = re.match(r"\s*([A-Za-z0-9_-]+)\s*=", line)
        if keys is None or (key is not None and key.group(1) not in keys):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _config_for(victim: Node, tree: Path) -> Path:
    """The config to start ``victim`` with from ``tree``: the one ``LocalCluster`` wrote, less the
    keys ``tree``'s code does not know when it is another checkout."""
    if tree.resolve() == Path(__file__).resolve().parents[2]:
        return victim.config_path
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", _KNOWN_KEYS], env=env, cwd=tree, check=True, timeout=120,
                         capture_output=True, text=True)
    path = victim.config_path.with_name(f"giaannd.{tree.name}.toml")
    path.write_text(known_keys_only(victim.config_path.read_text(encoding="utf-8"), json.loads(out.stdout)),
                    encoding="utf-8")
    return path


def _spawn(victim: Node, tree: Path, config: Path) -> None:
    """Start ``victim``'s daemon from the code in ``tree`` (first on ``PYTHONPATH``), with ``config``:
    the one ``LocalCluster`` wrote for it (its seed, ``storage-1``, keeps its address: it is never
    restarted), less the keys that code does not know (``_config_for``, made before the clock
    starts: it runs a process of its own for another checkout)."""
    env = bytecode_env(tree, dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(tree), os.environ.get("PYTHONPATH")]))))
    env.pop("NOTIFY_SOCKET", None)
    with open(victim.log_path, "ab") as out:
        victim.proc = subprocess.Popen([sys.executable, "-m", "giaannd", "--config", str(config)],
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       cwd=victim.data_dir, env=env, start_new_session=True)
    victim.exit_code = None


#: The daemon's start-up after the storage engine is imported, in one fresh process: the store's
#: recovery (``DurableStore.open`` of ``argv[1]``) and the imports of the rest of the daemon, one
#: after the other (``argv[2]`` "then", as the daemon starts) or side by side (``beside``: the
#: recovery in a thread); prints the wall seconds of the two together.
_OVERLAP = """
import sys, threading, time
from giaannd.storage import DurableStore
import giaannd.storage.replication.service
start = time.perf_counter()
recover = threading.Thread(target=lambda: DurableStore.open(sys.argv[1], 1 << 44).close())
recover.start()
if sys.argv[2] == "then":
    recover.join()
import giaannd.daemon, giaannd.runtime.node, giaannd.services.membership, giaannd.services.roles
recover.join()
print(time.perf_counter() - start)
"""


def _overlap_s(store: Path, how: str, cwd: Path) -> float:
    out = subprocess.run([sys.executable, "-c", _OVERLAP, str(store), how], check=True, cwd=cwd, timeout=600,
                         env=bytecode_env(cwd),
                         capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def drop_from_cache(directory: Path) -> None:
    """Write back and drop every file under ``directory`` from the page cache (``fsync``, then
    ``POSIX_FADV_DONTNEED``): the next read of them comes from the disk, as after a host's reboot
    or once other work has evicted them."""
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            drop_rest(fd)
        finally:
            os.close(fd)


#: The experiment's helper: every file asked for in the read-ahead module's steps (``argv[1]``; one
#: call over a whole file is cut to the device's readahead size: giaannd/storage/engine/read_ahead.py).
_PREFETCH = """
import os, sys
step = int(sys.argv[1])
for name in sys.argv[2:]:
    fd = os.open(name, os.O_RDONLY)
    size = os.fstat(fd).st_size
    for off in range(0, size, step):
        os.posix_fadvise(fd, off, step, os.POSIX_FADV_WILLNEED)
    os.close(fd)
"""


def _restart(cluster: LocalCluster, victim: Node, tree: Path, cold: bool = False,
             helper: bool = False) -> dict[str, float]:
    """kill -9 ``victim``, start it from ``tree``, wait until ready: its timeline. ``cold``: its
    store's files dropped from the page cache first (``drop_from_cache``); ``helper``: a process
    beside the exec asks the kernel to read the store's files ahead (``POSIX_FADV_WILLNEED``), an
    experiment."""
    cluster.kill(victim)
    store = victim.data_dir / "storage" / STORE_DIR
    if cold:
        drop_from_cache(store)
    config = _config_for(victim, tree)
    exec_at = time.time()
    reader = None
    if helper:
        files = sorted(str(p) for p in store.iterdir() if p.is_file())
        reader = subprocess.Popen([sys.executable, "-c", _PREFETCH, str(STEP_BYTES), *files], start_new_session=True)
    _spawn(victim, tree, config)
    cluster.wait_ready(victim)
    if reader is not None:
        reader.wait(timeout=600)
    seen = time.time() - exec_at
    out = timeline(victim.log_path.read_text(encoding="utf-8", errors="replace"), exec_at)
    out["seen ready"] = seen
    return out


def cached_store(cache: Path, entries: int, log_share: float, new_rows_log: bool = False) -> tuple[int, int]:
    """``build_store`` into ``cache`` unless it holds that store already (``meta.json``: what was
    asked for and its counts), so that later runs restart from the same files."""
    meta = cache / "meta.json"
    asked = {"entries": entries, "log_share": log_share, "new_rows_log": new_rows_log}
    doc = json.loads(meta.read_text()) if meta.exists() else {}
    if doc.get("asked", asked) != asked or not doc:
        shutil.rmtree(cache, ignore_errors=True)
        held, logged = build_store(cache / STORE_DIR, entries, log_share, new_rows_log=new_rows_log)
        meta.write_text(json.dumps({"held": held, "logged": logged, "asked": asked}))
    doc = json.loads(meta.read_text())
    return int(doc["held"]), int(doc["logged"])


def run(entries: int, log_share: float, restarts: int, root: Path, cache: Path, trees: dict[str, Path],
        cold: bool = False, helper: bool = False
        ) -> tuple[dict[str, list[dict[str, float]]], dict[str, list[float]], float, float]:
    """(restart timelines by tree, baselines by name, GB held, GB of log replayed). The trees take
    turns restart by restart, the baselines run after each round. ``cold``, ``helper``:
    ``_restart``'s (``--cold``, ``--read-ahead-beside``)."""
    global _bytecode_prefix
    _bytecode_prefix = root / "pycache"
    cluster = LocalCluster(root / "cluster", storage=2, compute=0, transport="tcp", log_level="info",
                           storage_options={"capacity_bytes": 16 << 30, "snapshot_interval_s": 3600.0})
    victim = cluster.node("storage-2")
    held, logged = cached_store(cache, entries, log_share)
    shutil.copytree(cache / STORE_DIR, victim.data_dir / "storage" / STORE_DIR)
    copy = root / "copy"  # for the one-process baseline (an open may cut or start log segments)
    shutil.copytree(cache / STORE_DIR, copy)
    here = Path(__file__).resolve().parents[2]
    baselines: dict[str, list[float]] = {"import giaannd.daemon": [], "import giaannd.services.roles": [],
                                         "DurableStore.open (one process)": [], _THEN: [], _BESIDE: []}
    records: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    if helper:
        records.update({f"{name}, read ahead beside": [] for name in trees})
    try:
        cluster.start()
        cluster.wait_converged()
        for _ in range(restarts):
            for name, tree in trees.items():
                records[name].append(_restart(cluster, victim, tree, cold))
                if helper:
                    records[f"{name}, read ahead beside"].append(_restart(cluster, victim, tree, cold, helper=True))
            baselines["import giaannd.daemon"].append(_fresh_process_s("import giaannd.daemon", here))
            baselines["import giaannd.services.roles"].append(
                _fresh_process_s("import giaannd.services.roles", here))
            baselines["DurableStore.open (one process)"].append(_fresh_process_s(
                f"from giaannd.storage import DurableStore; DurableStore.open({str(copy)!r}, {BIG}).close()",
                here))
            baselines[_THEN].append(_overlap_s(copy, "then", here))
            baselines[_BESIDE].append(_overlap_s(copy, "beside", here))
    finally:
        cluster.stop()
        cluster.kill_all()
    return records, baselines, held * ENTRY_BYTES / 1e9, logged * ENTRY_BYTES / 1e9


def _figures(name: str, med: dict[str, float], gb: float) -> list[tuple[str, float, str | None]]:
    recovery_s = med["snapshot_load_s"] + med["replay_s"]
    return [
        *((f"{name}: {label} (s since exec)", med[label], None) for label in _LABELS),
        (f"{name}: recovery, snapshot load (s)", med["snapshot_load_s"], None),
        (f"{name}: recovery, log replay (s)", med["replay_s"], None),
        (f"{name}: restart exec -> ready (s/GB held)", med["ready"] / gb, f"<= {TARGET_S_PER_GB}"),
        (f"{name}: recovery in the daemon (s/GB held)", recovery_s / gb, f"<= {TARGET_S_PER_GB}"),
        (f"{name}: ready less the store's recovery (s)", med["ready"] - recovery_s, None),
    ]


_LABELS = [label for label, _ in STAGES] + ["seen ready"]
_THEN = "recovery, then the daemon's other imports"
_BESIDE = "recovery beside the daemon's other imports"
_KEYS = [*_LABELS, "snapshot_load_s", "replay_s"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.restart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=10_000_000, help="entries in the snapshot (default 10^7)")
    ap.add_argument("--log-share", type=float, default=0.2,
                    help="entries logged after the snapshot, as a share of --entries (default 0.2)")
    ap.add_argument("--restarts", type=int, default=3, help="kill -9 restarts timed per tree (default 3)")
    ap.add_argument("--before-tree", type=Path, default=None,
                    help="also restart the daemon from this checkout (e.g. a worktree of the commit before a "
                         "change), taking turns with this one")
    ap.add_argument("--store-cache", type=Path, default=None,
                    help="keep the generated store here and reuse it in later runs (default: a temporary one)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the victim's store files from the page cache before each restart (fsync, "
                         "POSIX_FADV_DONTNEED): the restart reads them from the disk")
    ap.add_argument("--read-ahead-beside", action="store_true",
                    help="also restart with a process beside the exec that asks the kernel to read the store's "
                         "files ahead (an experiment: what reading during the start-up would save)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    load = Path("/proc/loadavg").read_text().split()[:3]
    trees = {"now": Path(__file__).resolve().parents[2]}
    if args.before_tree is not None:
        trees["before"] = args.before_tree.resolve()
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        cache = args.store_cache or Path(tmp) / "store-cache"
        records, baselines, gb, log_gb = run(args.entries, args.log_share, args.restarts, Path(tmp), cache, trees,
                                                    args.cold, args.read_ahead_beside)
    med = {name: {k: statistics.median([r[k] for r in recs if k in r] or [math.nan]) for k in _KEYS}
           for name, recs in records.items()}
    base = {k: statistics.median(v) for k, v in baselines.items()}
    figures = [f for name in records for f in _figures(name, med[name], gb)]
    if "before" in med:
        figures.append(("restart exec -> ready, before / now (ratio)", med["before"]["ready"] / med["now"]["ready"],
                        None))
    figures += [
        *((f"baseline: {name}, fresh process (s)", v, None) for name, v in base.items()),
        ("recovery and the daemon's other imports, one after the other / side by side (ratio)",
         base[_THEN] / base[_BESIDE], None),
        ("baseline: DurableStore.open, one process (s/GB held)", base["DurableStore.open (one process)"] / gb,
         f"<= {TARGET_S_PER_GB}"),
    ]
    if args.json:
        emit_figures(figures)
        return
    print(f"load average {' '.join(load)} at start; {gb:.2f} GB held ({log_gb:.2f} GB of it logged after the "
          f"snapshot), {args.restarts} kill -9 restarts per tree ({', '.join(f'{k}: {v}' for k, v in trees.items())}),"
          " taking turns")
    print_table("A storage daemon's restart after kill -9: seconds since exec",
                ["tree", *_LABELS, "snapshot load", "log replay"],
                [[name, *(f"{r[k]:.2f}" if k in r else "-" for k in _KEYS)]
                 for name, recs in records.items() for r in recs])
    print_table("Figures (medians; baselines run after each round)", ["figure", "value", "target"],
                [[n, f"{v:.3f}", t or ""] for n, v, t in figures])
    print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])} at end")


if __name__ == "__main__":
    main()
