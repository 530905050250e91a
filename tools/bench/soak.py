"""Soak benchmark (issue 16 item 10): a loopback cluster under load and churn for a set time.

    python -m tools.bench.soak [--minutes 20] [--kill-every-s 120] [--sample-s 10] [--json]

Starts 3 storage + 2 compute daemons (real processes, tools/local_cluster) and, for ``--minutes``:

* trains: compute-1 trains successive ``--chunk``-sentence chunks of the first ``--sentences`` of
  the bundled corpus, round and round (``POST /v1/train``), one job after the other;
* answers prompts: compute-2 alternates ``POST /v1/eval`` (held-out sentences) and
  ``POST /v1/generate``;
* crashes storage: every ``--kill-every-s`` one storage node (in turn) gets SIGKILL and is
  restarted ``--down-s`` later;
* reconnects clients: every ``--reconnect-s`` a fresh admin HTTP connection (``GET /v1/health``)
  and a fresh data-plane ``StorageClient`` that reads rows from each live storage node, then closes;
* samples every daemon every ``--sample-s``: RSS (``/proc/PID/status`` VmRSS), open fds
  (``/proc/PID/fd``) and asyncio tasks (the ``giaannd_event_loop_tasks`` gauge).

At the end (every node up again) compute-1 exports the model and the export is compared with the
single-process core trained on the same sentences (tools/local_cluster/exports.py). Figures:
least-squares slopes per hour of RSS, fds and tasks per daemon over the samples after warm-up
(the first ``WARMUP_FRACTION`` of the run); a restarted storage node's slope is taken over its
longest life after warm-up (a new process starts from scratch). Entries lost and entries
differing beyond tolerance (targets 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.errors import GiaannError
from giaannd.model.tokens import TaggedSentence, load_bundled_corpus, write_conllu
from giaannd.sdk.errors import ClientError
from giaannd.sdk.local_cluster import CLUSTER_NAME, LocalCluster, Node
from peers.keyring import Keyring
from peers.transport import Identity, make_transport
from tools.bench.report import print_table
from tools.local_cluster.exports import STRENGTH_REL_TOL, diff_exports, read_export, reference_export

__all__ = ["main"]

#: Share of the run left out of the slopes: start-up allocations, caches filling, the first jobs.
WARMUP_FRACTION: Final = 0.25
#: Bound on one training job (a chunk takes seconds; a storage crash adds a failure detection).
JOB_TIMEOUT_S: Final = 300.0
#: Bound on waiting for hinted handoff to settle before the export (a restarted node's missed
#: writes are delivered by the survivors' hint queues).
SETTLE_S: Final = 15.0
PROMPT: Final = "In the beginning, God created the heavens"
HOUR_S: Final = 3600.0


@dataclass
class Sample:
    t: float
    pid: int
    rss_kib: int
    fds: int
    tasks: float | None


@dataclass
class Stats:
    """What the load loops did (each loop owns its counters; read after they stop)."""

    jobs_ok: int = 0
    jobs_failed: list[str] = field(default_factory=list)
    trained: list[TaggedSentence] = field(default_factory=list)
    prompts_ok: int = 0
    prompts_failed: int = 0
    admin_ok: int = 0
    admin_failed: int = 0
    data_ok: int = 0
    data_failed: int = 0
    kills: int = 0


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="run length (default 20)")
    ap.add_argument("--kill-every-s", type=float, default=120.0,
                    help="SIGKILL a storage node this often, rotating (default 120)")
    ap.add_argument("--down-s", type=float, default=10.0,
                    help="how long a killed node stays down before its restart (default 10)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="sampling interval (default 10)")
    ap.add_argument("--reconnect-s", type=float, default=0.5,
                    help="pause between client reconnect rounds: bounds their rate (default 0.5)")
    ap.add_argument("--chunk", type=int, default=100, help="sentences per training job (default 100)")
    ap.add_argument("--sentences", type=int, default=2000,
                    help="training set, cycled through in chunks (default 2000): bounds the model "
                         "size and the reference's training time")
    ap.add_argument("--train-pause-s", type=float, default=5.0,
                    help="pause between training jobs (default 5)")
    ap.add_argument("--train-workers", type=int, default=None,
                    help="workers per training job (default: the node's compute.train-workers); 1 makes "
                         "the flag sets a function of the corpus alone, so the export comparison is exact")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--dir", type=Path, default=None, help="cluster root (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the data directories and logs")
    args = ap.parse_args(argv)
    if min(args.minutes, args.kill_every_s, args.sample_s, args.reconnect_s) <= 0 \
            or min(args.chunk, args.sentences, args.train_workers or 1) < 1 or args.train_pause_s < 0 \
            or not 0 <= args.down_s < args.kill_every_s:
        ap.error("durations must be positive, --chunk >= 1, 0 <= --down-s < --kill-every-s")
    return args


def _live(node: Node) -> bool:
    return node.proc is not None and node.proc.poll() is None


def _sample(node: Node) -> Sample | None:
    if not _live(node) or node.proc is None:
        return None
    pid = node.proc.pid
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (OSError, StopIteration):
        return None
    tasks: float | None = None
    with contextlib.suppress(ClientError, OSError):
        raw, _ = node.admin.request("GET", "/metrics")
        for line in raw.decode().splitlines():
            if line.startswith("giaannd_event_loop_tasks "):
                tasks = float(line.split()[1])
    return Sample(time.monotonic(), pid, rss, fds, tasks)


def _slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None under 3 points."""
    if len(points) < 3:
        return None
    t = np.array([p[0] for p in points])
    v = np.array([p[1] for p in points])
    return float(np.polyfit(t, v, 1)[0] * HOUR_S)


def _stoppable(stop: threading.Event, fn: Callable[[], None], pause_s: float) -> None:
    while not stop.is_set():
        fn()
        stop.wait(pause_s)


def _train_loop(compute: Node, corpus_dir: Path, chunks: list[list[TaggedSentence]],
                pause_s: float, stats: Stats, stop: threading.Event, workers: int | None = None) -> None:
    i = 0
    while not stop.is_set():
        chunk = chunks[i % len(chunks)]
        path = corpus_dir / f"chunk-{i % len(chunks)}.conllu"
        write_conllu(chunk, path)
        stats.trained += chunk  # counted whether or not it succeeds: a failure shows as lost
        try:
            body: dict[str, object] = {"corpus": str(path)}
            if workers is not None:
                body["workers"] = workers
            job = compute.admin.json("POST", "/v1/train", body)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while (doc := compute.admin.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job['job_id']} still running after {JOB_TIMEOUT_S}s")
                time.sleep(0.5)
            if doc["state"] == "succeeded":
                stats.jobs_ok += 1
            else:
                stats.jobs_failed.append(f"chunk {i}: {doc['state']} {doc.get('error', '')}")
        except (ClientError, OSError, TimeoutError) as exc:
            stats.jobs_failed.append(f"chunk {i}: {type(exc).__name__}: {exc}")
        i += 1
        stop.wait(pause_s)


def _prompt_round(compute: Node, heldout: Path, stats: Stats, turn: list[int]) -> None:
    turn[0] += 1
    try:
        if turn[0] % 2:
            compute.admin.json("POST", "/v1/eval", {"corpus": str(heldout), "constants": "test",
                                                    "limit": 20})
        else:
            compute.admin.json("POST", "/v1/generate", {"prompt": PROMPT, "max_tokens": 8})
        stats.prompts_ok += 1
    except (ClientError, OSError):
        stats.prompts_failed += 1


async def _read_each(members: list[tuple[str, str]], keys: list[bytes]) -> None:
    topo = ClusterView(replicas=3)
    topo.set_members([StorageNode(name, addr) for name, addr in members])
    ident = Identity("soak-client", CLUSTER_NAME, keys)
    client = StorageClient(topo, {"tcp": make_transport("tcp", ident)},
                           request_timeout_s=2.0, connect_timeout_s=1.0)
    rng = np.random.default_rng()
    try:
        for name, _ in members:
            cols = rng.integers(1, 2**63, 16, dtype=np.uint64)
            await client.read_from(name, np.sort(cols), np.zeros(16, dtype=np.uint64))
    finally:
        await client.close()


def _reconnect_round(cluster: LocalCluster, keys: list[bytes], stats: Stats) -> None:
    live = [n for n in cluster.nodes if _live(n)]
    try:
        node = random.choice(live)
        node.admin.json("GET", "/v1/health")  # urllib: a new TCP connection every request
        rows = node.admin.json("GET", "/v1/members")["members"]
        stats.admin_ok += 1
    except (ClientError, OSError, IndexError):
        stats.admin_failed += 1
        return
    members = [(r["name"], r["data_plane"].split()[0]) for r in rows
               if r["status"] == "alive" and "storage" in r["roles"]
               and r["data_plane"].startswith("tcp://")]
    try:
        asyncio.run(asyncio.wait_for(_read_each(members, keys), 10.0))
        stats.data_ok += 1
    except (GiaannError, OSError, TimeoutError, LookupError, ValueError):
        stats.data_failed += 1


def _figures(samples: dict[str, list[Sample]], started: float, ended: float
             ) -> list[tuple[str, float | None, str]]:
    cut = started + WARMUP_FRACTION * (ended - started)
    out: list[tuple[str, float | None, str]] = []
    for name, rows in samples.items():
        lives: dict[int, list[Sample]] = {}
        for s in rows:
            if s.t >= cut:
                lives.setdefault(s.pid, []).append(s)
        life = max(lives.values(), key=len, default=[])
        series: list[tuple[str, str, list[float | None]]] = [
            ("rss", "MiB", [s.rss_kib / 1024 for s in life]),
            ("fds", "fds", [float(s.fds) for s in life]),
            ("tasks", "tasks", [s.tasks for s in life])]
        for what, unit, values in series:
            points = [(s.t, v) for s, v in zip(life, values, strict=True) if v is not None]
            out.append((f"{name} {what} slope ({unit}/h)", _slope_per_hour(points), "~0"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="giaann-soak-"))
    cluster = LocalCluster(root, storage=3, compute=2, transport="tcp", log_level="warning")
    corpus = load_bundled_corpus(args.sentences + 50)
    train_sentences, heldout_sentences = corpus[:args.sentences], corpus[args.sentences:]
    chunks = [train_sentences[i:i + args.chunk] for i in range(0, len(train_sentences), args.chunk)]
    stats = Stats()
    samples: dict[str, list[Sample]] = {n.name: [] for n in cluster.nodes}
    stop = threading.Event()
    failed: str | None = None
    figures: list[tuple[str, float | None, str]] = []
    try:
        cluster.start()
        cluster.wait_converged()
        heldout = cluster.corpus_dir / "heldout.conllu"
        write_conllu(heldout_sentences, heldout)
        keys = list(Keyring.load(cluster.key_file).keys)
        compute1, compute2 = cluster.compute_nodes
        turn = [0]
        loops = [
            threading.Thread(target=_train_loop, daemon=True,
                             args=(compute1, cluster.corpus_dir, chunks, args.train_pause_s, stats, stop,
                                   args.train_workers)),
            threading.Thread(target=_stoppable, daemon=True, args=(
                stop, lambda: _prompt_round(compute2, heldout, stats, turn), 1.0)),
            threading.Thread(target=_stoppable, daemon=True, args=(
                stop, lambda: _reconnect_round(cluster, keys, stats), args.reconnect_s)),
        ]
        started = time.monotonic()
        end = started + args.minutes * 60
        for t in loops:
            t.start()
        storage = [n for n in cluster.nodes if "storage" in n.roles]
        next_kill, next_sample, victim = started + args.kill_every_s, started, 0
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                for node in cluster.nodes:
                    if (s := _sample(node)) is not None:
                        samples[node.name].append(s)
                next_sample += args.sample_s
            if now >= next_kill and now + args.down_s < end:
                node = storage[victim % len(storage)]
                victim += 1
                cluster.kill(node)
                stats.kills += 1
                time.sleep(args.down_s)
                cluster.restart(node)
                next_kill += args.kill_every_s
            time.sleep(0.2)
        ended = time.monotonic()
        stop.set()
        for t in loops:
            t.join(JOB_TIMEOUT_S)
        time.sleep(SETTLE_S)  # every node is up: let the hint queues drain
        out = cluster.export_dir / "soak-export.jsonl"
        compute1.admin.json("POST", "/v1/export", {"path": str(out)})
        diff = diff_exports(reference_export(stats.trained), read_export(out))
        figures = _figures(samples, started, ended)
        figures += [
            ("entries lost", float(diff.lost), "0"),
            (f"entries differing beyond rel {STRENGTH_REL_TOL:g}", float(diff.differing), "0"),
            ("entries extra", float(diff.extra), "0"),
            ("reference entries", float(diff.reference), "-"),
            ("sentences trained / jobs ok / jobs failed",
             None, f"{len(stats.trained)} / {stats.jobs_ok} / {len(stats.jobs_failed)}"),
            ("storage kills (SIGKILL + restart)", float(stats.kills), "-"),
            ("prompts ok / failed", float(stats.prompts_ok), f"failed {stats.prompts_failed}"),
            ("admin reconnects ok / failed", float(stats.admin_ok), f"failed {stats.admin_failed}"),
            ("data-plane reconnects ok / failed", float(stats.data_ok),
             f"failed {stats.data_failed}"),
            ("run length (min)", (ended - started) / 60, f"{args.minutes:g}"),
        ]
        for why in stats.jobs_failed:
            print(f"job failed: {why}")
    except Exception as exc:  # noqa: BLE001 - a bench reports and still stops the cluster
        failed = f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
        codes = cluster.stop()
        cluster.kill_all()
    if args.json:
        for name, value, target in figures:
            print(json.dumps({"figure": name, "value": value, "target": target}))
    else:
        print_table("Soak", ["figure", "value", "target"],
                    [(n, "n/a" if v is None else f"{v:.4g}", t) for n, v, t in figures])
    print(f"exit statuses: {codes}")
    if failed:
        print(f"FAILED: {failed}; logs kept in {root}")
    elif args.keep:
        print(f"logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
