"""A local giaannd cluster on loopback, and the main demo (``make demo``).

    python -m tools.local_cluster [--storage 3] [--compute 1] [--sentences 2000] [--heldout 200]
                                  [--transport auto|ucx|tcp] [--quick] [--keep] [--dir DIR]
    python -m tools.local_cluster --serve [...]     # start the cluster and wait for Ctrl-C

Every node is a real ``python -m giaannd`` process with its own data directory under one root
(a temporary directory unless ``--dir``), its own copy of a freshly generated cluster key file,
listeners on 127.0.0.1 with port 0, and the first node as the seed. The demo then:

1. waits (bounded) until every daemon is READY and every member sees all the others alive;
2. prints the member table (``giaannctl members list``);
3. trains on the first ``--sentences`` sentences of the bundled corpus through the compute node's
   admin API (``POST /v1/train``, the same call as ``giaannctl train start``) with the progress bar;
4. evaluates top-1 on the ``--heldout`` sentences that follow them (never trained);
5. generates from a prompt;
6. prints the measured figures (what the compute node reports, plus its data-plane counters);
7. shuts the cluster down with SIGTERM and checks that every daemon exits 0.

Nothing is downloaded: the corpus ships in ``giaannd/data``. The data plane is UCX (ucxx) where
it starts here and TCP otherwise; the demo says which. ``LocalCluster`` is importable: the
integration tests drive the same launcher. Exit status: 0 success, 1 a step failed (the cluster
is still shut down and the node logs are kept for inspection), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec

from giaannd.admin.client import AdminClient, CtlError
from giaannd.admin.ctl import wait_for_job
from giaannd.config import ClusterConfig, Config, LoggingConfig, Role, StorageConfig, to_toml
from giaannd.config import TransportConfig
from peers.keyring import Keyring

__all__ = ["LocalCluster", "Node", "NodeFailed", "main", "split_corpus"]

ROOT: Final = Path(__file__).resolve().parent.parent
BUNDLED_CORPUS: Final = ROOT / "giaannd" / "data" / "web_excerpt.conllu.gz"
CLUSTER_NAME: Final = "giaann-local"
#: Bound on one daemon reaching READY (ucxx import + store recovery + join take ~1-2 s; CI's two
#: shared cores make it several times slower).
READY_TIMEOUT_S: Final = 60.0
#: Bound on every member seeing every other one alive (loopback gossip converges in < 1 s).
CONVERGE_TIMEOUT_S: Final = 30.0
#: Bound on a graceful stop (drain + gossip leave); past it a daemon is killed and reported.
STOP_TIMEOUT_S: Final = 60.0
POLL_S: Final = 0.1
DEFAULT_PROMPT: Final = "In the beginning, God created the heavens"


class NodeFailed(RuntimeError):
    """A daemon exited or did not become ready; the message ends with its log's tail."""


@dataclass
class Node:
    """One daemon process of the local cluster."""

    name: str
    roles: list[Role]
    data_dir: Path
    config_path: Path
    proc: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.data_dir / "giaannd.log"

    @property
    def admin(self) -> AdminClient:
        addr = (self.data_dir / "admin.addr").read_text().strip()
        token = (self.data_dir / "admin.token").read_text().strip()
        return AdminClient(addr, token, timeout_s=30.0)

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.admin.json("GET", "/v1/status")
        return result

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def ctl(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``giaannctl --data-dir <node> ARGS`` as a subprocess (what an operator types)."""
        return subprocess.run(
            [sys.executable, "-m", "giaannd.admin.ctl", "--data-dir", str(self.data_dir), *args],
            capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)


def split_corpus(out_dir: Path, train: int, heldout: int, source: Path = BUNDLED_CORPUS
                 ) -> tuple[Path, Path, int, int]:
    """Write the first ``train`` CoNLL-U sentences of ``source`` and the ``heldout`` after them.

    The held-out file shares no sentence position with the training file, so its top-1 is a
    test-set figure. Returns (train_path, heldout_path, train_count, heldout_count).
    """
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as fh:
        blocks = iter(fh.read().split("\n\n"))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / "train.conllu", out_dir / "heldout.conllu")
    counts = []
    for path, want in zip(paths, (train, heldout)):
        taken = [b.strip("\n") for b, _ in zip(blocks, range(want))]
        taken = [b for b in taken if b]
        path.write_text("\n\n".join(taken) + "\n\n", encoding="utf-8")
        counts.append(len(taken))
    return paths[0], paths[1], counts[0], counts[1]


class LocalCluster:
    """N storage + M compute daemons on loopback (module docstring).

    Args:
        root: directory for the nodes' data directories, configs, logs and the key file.
        storage / compute: node counts.
        transport: ``auto`` (UCX where it starts, else TCP), ``ucx`` or ``tcp``.
        replication_factor: R (default min(3, storage)); the write quorum is a majority.
        log_level: the daemons' log level.
    """

    def __init__(self, root: Path, *, storage: int = 3, compute: int = 1, transport: str = "auto",
                 replication_factor: int | None = None, log_level: str = "info") -> None:
        if storage < 1 and compute < 1:
            raise ValueError("a cluster needs at least one node")
        self.root = root
        self.transport = transport
        rf = replication_factor or max(1, min(3, storage))
        self.storage_cfg = StorageConfig(replication_factor=rf, write_quorum=rf // 2 + 1,
                                         capacity_bytes=2 << 30, fsync_group_commit_ms=2.0)
        self.log_level = log_level
        self.key_file = root / "cluster.key"
        self.nodes: list[Node] = []
        specs: list[tuple[str, list[Role]]] = [(f"storage-{i + 1}", ["storage"])
                                               for i in range(storage)]
        specs += [(f"compute-{i + 1}", ["compute"]) for i in range(compute)]
        for name, roles in specs:
            data_dir = root / name
            self.nodes.append(Node(name, roles, data_dir, data_dir / "giaannd.toml"))

    # -- lifecycle ----------------------------------------------------------------------------

    def _bind(self) -> list[str]:
        urls = {"auto": ["ucx://127.0.0.1:0", "tcp://127.0.0.1:0"], "ucx": ["ucx://127.0.0.1:0"],
                "tcp": ["tcp://127.0.0.1:0"]}
        return urls[self.transport]

    def _write_config(self, node: Node, seeds: list[str]) -> None:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        key_copy = node.data_dir / "cluster.key"  # one copy per node, as on separate hosts
        shutil.copyfile(self.key_file, key_copy)
        key_copy.chmod(0o600)
        base = Config.loopback(str(node.data_dir), name=node.name, roles=node.roles)
        cfg = msgspec.structs.replace(
            base,
            cluster=ClusterConfig(name=CLUSTER_NAME, key_file=str(key_copy), seeds=seeds),
            transport=TransportConfig(bind=self._bind()),
            storage=self.storage_cfg,
            logging=LoggingConfig(level=self.log_level, format="plain"),  # type: ignore[arg-type]
        )
        node.config_path.write_text(to_toml(cfg), encoding="utf-8")

    def _spawn(self, node: Node) -> None:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # the daemons are ours, not the service manager's
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(node.log_path, "ab") as log:
            # A new session: a Ctrl-C in the terminal reaches the launcher only, which then
            # stops the daemons with SIGTERM (graceful) instead of racing it with SIGINT.
            node.proc = subprocess.Popen(
                [sys.executable, "-m", "giaannd", "--config", str(node.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                start_new_session=True)

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start every node (the first is the seed) and wait until all are READY.

        Raises:
            NodeFailed: a daemon exited or was not ready in time (the rest are stopped by
                ``stop``/the context manager).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        Keyring.generate().save(self.key_file)
        first, rest = self.nodes[0], self.nodes[1:]
        self._write_config(first, [])
        self._spawn(first)
        self.wait_ready(first, timeout_s)
        seed = first.status()["services"]["membership"]["addr"]
        for node in rest:
            self._write_config(node, [seed])
            self._spawn(node)
        for node in rest:
            self.wait_ready(node, timeout_s)

    def wait_ready(self, node: Node, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Poll ``/v1/status`` until ``state`` is ``running`` (the daemon sent READY)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive(node)
            if (node.data_dir / "admin.addr").exists():
                with contextlib.suppress(CtlError, OSError):
                    status = node.status()
                    if status.get("state") == "running":
                        return status
            if time.monotonic() > deadline:
                raise NodeFailed(f"{node.name} not ready within {timeout_s:.0f}s; log tail:\n"
                                 f"{node.log_tail()}")
            time.sleep(POLL_S)

    def _check_alive(self, node: Node) -> None:
        if node.proc is not None and node.proc.poll() is not None:
            raise NodeFailed(f"{node.name} exited with status {node.proc.returncode}; log tail:\n"
                             f"{node.log_tail()}")

    def wait_converged(self, timeout_s: float = CONVERGE_TIMEOUT_S,
                       nodes: Sequence[Node] | None = None) -> None:
        """Wait until every running node sees every running node alive."""
        running = [n for n in (nodes or self.nodes) if n.proc is not None and n.exit_code is None]
        names = {n.name for n in running}
        deadline = time.monotonic() + timeout_s
        while True:
            views = {}
            for node in running:
                self._check_alive(node)
                with contextlib.suppress(CtlError, OSError):
                    rows = node.admin.json("GET", "/v1/members")["members"]
                    views[node.name] = {r["name"] for r in rows if r["status"] == "alive"}
            if all(names <= views.get(n, set()) for n in names):
                return
            if time.monotonic() > deadline:
                raise NodeFailed(f"membership did not converge in {timeout_s:.0f}s: {views}")
            time.sleep(POLL_S)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    @property
    def compute_nodes(self) -> list[Node]:
        return [n for n in self.nodes if "compute" in n.roles]

    def kill(self, node: Node) -> None:
        """SIGKILL (a crash: no leave, no snapshot)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(10)
        node.exit_code = node.proc.returncode if node.proc is not None else None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, int | None]:
        """SIGTERM every live daemon (compute first, so it drains while storage still serves),
        wait, SIGKILL what overran. Returns name -> exit status (-9: killed here)."""
        order = [n for n in self.nodes if "storage" not in n.roles] + \
                [n for n in self.nodes if "storage" in n.roles]
        for batch in ([n for n in order if "storage" not in n.roles],
                      [n for n in order if "storage" in n.roles]):
            for node in batch:
                if node.proc is not None and node.proc.poll() is None:
                    node.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for node in batch:
                if node.proc is None:
                    continue
                try:
                    node.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait(10)
                if node.exit_code is None:
                    node.exit_code = node.proc.returncode
        return {n.name: n.exit_code for n in self.nodes if n.proc is not None}

    def kill_all(self) -> None:
        """Last-resort cleanup (a ``finally``): SIGKILL anything still running."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(10)

    def data_plane(self) -> str:
        """Which data plane the cluster runs, from the nodes' own reports."""
        statuses = [n.status() for n in self.nodes if n.exit_code is None]
        advertised = [s["services"]["runtime"].get("advertised", {}) for s in statuses]
        skipped = {k: v for s in statuses
                   for k, v in s["services"]["runtime"].get("skipped_transports", {}).items()}
        if advertised and all("ucx" in a for a in advertised):
            return "UCX (ucxx: bulk over worker-address endpoints, control on TCP)"
        why = f"; ucx skipped: {skipped['ucx']}" if "ucx" in skipped else ""
        return f"TCP{why}"


@contextlib.contextmanager
def running_cluster(root: Path, **kwargs: Any) -> Iterator[LocalCluster]:
    """Start a cluster; on exit stop it gracefully and kill whatever is left, always."""
    cluster = LocalCluster(root, **kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            cluster.kill_all()


# -- the demo --------------------------------------------------------------------------------

def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.local_cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", type=int, default=3, help="storage daemons (default 3)")
    ap.add_argument("--compute", type=int, default=1, help="compute daemons (default 1)")
    ap.add_argument("--sentences", type=int, default=None,
                    help="training sentences (default 2000; 300 with --quick)")
    ap.add_argument("--heldout", type=int, default=None,
                    help="held-out evaluation sentences (default 200; 50 with --quick)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="generation prompt")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 20)")
    ap.add_argument("--transport", choices=["auto", "ucx", "tcp"], default="auto")
    ap.add_argument("--quick", action="store_true", help="small sizes: under a minute (CI)")
    ap.add_argument("--keep", action="store_true", help="keep the data directories and logs")
    ap.add_argument("--dir", type=Path, default=None, help="root directory (default: a temp dir)")
    ap.add_argument("--verbose", action="store_true", help="print every figure the node reports")
    ap.add_argument("--serve", action="store_true",
                    help="start the cluster, print how to reach it, wait for Ctrl-C")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"],
                    help="daemon log level (logs go to <dir>/<node>/giaannd.log)")
    args = ap.parse_args(argv)
    args.sentences = args.sentences if args.sentences is not None else (300 if args.quick else 2000)
    args.heldout = args.heldout if args.heldout is not None else (50 if args.quick else 200)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (10 if args.quick else 20)
    if args.storage < 1 or args.compute < 0 or args.sentences < 1 or args.heldout < 0:
        ap.error("need --storage >= 1, --compute >= 0, --sentences >= 1, --heldout >= 0")
    if not args.serve and args.compute < 1:
        ap.error("the demo trains on a compute node: --compute must be >= 1")
    return args


def _say(text: str = "") -> None:
    print(text, flush=True)


def _metric(client: AdminClient, name: str) -> float:
    """Sum of one metric's samples from a node's /metrics (0 when absent)."""
    raw, _ = client.request("GET", "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


def _figure_lines(doc: Any, prefix: str = "") -> list[str]:
    """Every numeric/text leaf of a job/eval/generate reply, as ``key: value`` lines."""
    if isinstance(doc, dict):
        out = []
        for key, value in doc.items():
            out += _figure_lines(value, f"{prefix}{key}.")
        return out
    if isinstance(doc, float):
        return [f"  {prefix[:-1]}: {doc:.4g}"]
    if isinstance(doc, (int, str, bool)) or doc is None:
        return [f"  {prefix[:-1]}: {doc}"]
    return [f"  {prefix[:-1]}: {json.dumps(doc)[:200]}"]


def _demo(cluster: LocalCluster, args: argparse.Namespace, root: Path) -> None:
    """Steps 2-6 of the module docstring; raises on the first failing step."""
    compute = cluster.compute_nodes[0]
    status = compute.status()
    if not str(status["roles"].get("compute", "")).startswith("running"):
        raise NodeFailed(f"{compute.name} does not run the compute role: "
                         f"{status['roles'].get('compute')}")
    _say(f"data plane: {cluster.data_plane()}")
    _say("\n$ giaannctl members list")
    _say(compute.ctl("members", "list").stdout.rstrip())

    train_path, held_path, n_train, n_held = split_corpus(root / "corpus", args.sentences,
                                                          args.heldout)
    _say(f"\ncorpus: {n_train} training sentences -> {train_path}; {n_held} held-out -> "
         f"{held_path} (bundled {BUNDLED_CORPUS.name}, nothing downloaded)")
    client = compute.admin
    _say(f"\n$ giaannctl --data-dir {compute.data_dir} train start {train_path}")
    started = time.perf_counter()
    job = client.json("POST", "/v1/train", {"corpus": str(train_path), "epochs": 1})
    final = wait_for_job(client, str(job["job_id"]), progress=True, stream=sys.stderr)
    train_s = time.perf_counter() - started
    _say(f"training job {job['job_id']} {final.get('state')} in {train_s:.1f}s wall")

    _say(f"\n$ giaannctl eval --corpus {held_path}")
    started = time.perf_counter()
    # Held-out sentences are scored with the test-set constants, as tools/single_process does.
    ev = client.json("POST", "/v1/eval", {"corpus": str(held_path), "constants": "test"})
    eval_s = time.perf_counter() - started
    _say(f"top-1 {_num(ev.get('top1'))} on {ev.get('prompts', '?')} held-out sentences "
         f"({ev.get('matches', '?')}/{ev.get('prediction_tokens', '?')} prediction tokens)")

    _say(f"\n$ giaannctl generate {args.prompt!r} --max-tokens {args.max_tokens}")
    gen = client.json("POST", "/v1/generate", {"prompt": args.prompt,
                                               "max_tokens": args.max_tokens})
    tokens = gen.get("tokens") if isinstance(gen, dict) else None
    _say(f"{args.prompt} -> {' '.join(map(str, tokens)) if tokens else json.dumps(gen)}")

    sent = _metric(client, "giaannd_transport_bytes_sent_total")
    received = sum(_metric(n.admin, "giaannd_transport_bytes_received_total")
                   for n in cluster.nodes if "storage" in n.roles and n.exit_code is None)
    _say("\nmeasured figures (reported by the compute node; wall times measured here)")
    rows = [
        ("training sentences/s", _num(final.get("sentences_per_s"))),
        ("sentences trained / skipped", f"{final.get('trained', '?')} / {final.get('skipped', '?')}"),
        ("training wall time", f"{train_s:.2f} s"),
        ("update bytes sent", _num(final.get("bytes_sent"))),
        ("bytes per sentence", _num(final.get("bytes_per_sentence"))),
        ("coalescing ratio (entries before/after)", _num(final.get("coalescing_ratio"))),
        ("write batches / retries", f"{final.get('batches', '?')} / {final.get('retries', '?')}"),
        ("top-1 held-out (test constants)", _num(ev.get("top1"))),
        ("inference steps/s (eval)", _num(ev.get("steps_per_s"))),
        ("eval wall time", f"{eval_s:.2f} s"),
        ("data plane bytes: compute sent / storage received",
         f"{sent / 2**20:.2f} MiB / {received / 2**20:.2f} MiB"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        _say(f"  {key:<{width}}  {value}")
    if args.verbose:
        _say("\nall job figures:\n" + "\n".join(_figure_lines(final)))
        _say("all eval figures:\n" + "\n".join(_figure_lines(ev)))


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "n/a" if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="giaann-cluster-"))
    cluster = LocalCluster(root, storage=args.storage, compute=args.compute,
                           transport=args.transport, log_level=args.log_level)
    _say(f"starting {args.storage} storage + {args.compute} compute daemons on loopback "
         f"(root {root})")
    failed: str | None = None
    started = time.perf_counter()
    try:
        cluster.start()
        cluster.wait_converged()
        _say(f"all {len(cluster.nodes)} daemons READY and converged in "
             f"{time.perf_counter() - started:.1f}s")
        if args.serve:
            _serve(cluster)
        else:
            _demo(cluster, args, root)
    except (NodeFailed, CtlError, OSError, KeyError, urllib.error.URLError) as exc:
        failed = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        _say("\nstopping the cluster (SIGTERM)")
        codes = cluster.stop()
        cluster.kill_all()
    _say("exit statuses: " + ", ".join(f"{k}={v}" for k, v in codes.items()))
    bad = {k: v for k, v in codes.items() if v != 0}
    if failed:
        _say(f"FAILED: {failed}")
    if bad and not failed:
        failed = f"daemons did not exit cleanly: {bad}"
        _say(f"FAILED: {failed}")
    if failed or args.keep:
        _say(f"node data and logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    if not failed:
        _say(f"demo finished in {time.perf_counter() - started:.1f}s")
    return 1 if failed else 0


def _serve(cluster: LocalCluster) -> None:
    for node in cluster.nodes:
        _say(f"  {node.name:<10} giaannctl --data-dir {node.data_dir} node status")
    _say("Ctrl-C stops the cluster")
    while True:
        for node in cluster.nodes:
            cluster._check_alive(node)
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
