"""``giaannd.LocalCluster``: N ``python -m giaannd`` processes on loopback, from Python.

    with giaannd.LocalCluster(storage=3, compute=1) as client:   # a connected giaannd.Client
        client.train(giaannd.bundled_corpus(), limit=300).wait()

Every node is a real daemon process with its own data directory under one root (a temporary
directory, removed on a clean exit, unless ``root`` is given or ``keep``), its own copy of a
freshly generated cluster key file, listeners on 127.0.0.1 with port 0, and the first node as the
seed. ``make demo`` (tools/local_cluster) and the integration tests drive the same launcher.
Leaving the ``with`` block, on an exception or Ctrl-C too, stops the daemons (SIGTERM, then
SIGKILL past ``STOP_TIMEOUT_S``); daemons left running when the interpreter exits (a notebook
kernel stopped without leaving the block) are killed by an ``atexit`` hook.

``LocalCluster`` writes one config and one cluster-key copy per node, starts the first node (the
seed), then the others with the seed's gossip address, waits (bounded) for READY and for every
node to hold the same storage ring, and stops them with SIGTERM (compute first) — or SIGKILLs one
to simulate a crash.

The storage nodes are a new cluster's initial nodes, so they start with ``storage.join-mode =
"bootstrap"``: each adds itself to the storage ring (giaannd/cluster/ring.py) and ring sync merges the
rings. (With the default ``auto`` every node after the first would wait standby for a streaming
join.)

Every node's ``compute.corpus-dir`` and ``compute.export-dir`` (the only directories the admin API
reads corpora from and writes exports to) are the cluster's ``corpus_dir`` and ``export_dir``,
``<root>/corpus`` and ``<root>/exports`` unless given: one place for the whole local cluster, as a
shared file system would be.

It is also the process mode of the test harness (tools/cluster_harness): there the nodes are named,
may have no role at all (membership only), keep their data-plane and stream ports across restarts
(``pin_ports``), and share the harness's cluster name and key file.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import gzip
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec

from giaannd.config import (
    ClusterConfig,
    ComputeConfig,
    Config,
    JoinMode,
    LoggingConfig,
    MembershipConfig,
    Role,
    StorageConfig,
    TransportConfig,
    to_toml,
)
from giaannd.sdk.client import Client
from giaannd.sdk.errors import ClientError
from giaannd.sdk.http import AdminClient
from peers.keyring import Keyring

__all__ = [
    "BUNDLED_CORPUS", "LocalCluster", "Node", "NodeFailed", "bundled_corpus", "running_cluster", "split_corpus",
]

#: The directory holding the ``giaannd`` package (a checkout, or site-packages): the daemons'
#: ``PYTHONPATH``, so they run the same code as this process.
CODE_ROOT: Final = Path(__file__).resolve().parents[2]
BUNDLED_CORPUS: Final = CODE_ROOT / "giaannd" / "data" / "web_excerpt.conllu.gz"
CLUSTER_NAME: Final = "giaann-local"
#: Bound on one daemon reaching READY (ucxx import + store recovery + join take ~1-2 s; CI's two
#: shared cores make it several times slower).
READY_TIMEOUT_S: Final = 60.0
#: Bound on every member seeing every other one alive (loopback gossip converges in < 1 s).
CONVERGE_TIMEOUT_S: Final = 30.0
#: Bound on every node holding the same storage ring (gossip of the digest + one pull).
RING_TIMEOUT_S: Final = 30.0
#: Bound on a graceful stop (drain + gossip leave); past it a daemon is killed and reported.
STOP_TIMEOUT_S: Final = 60.0
POLL_S: Final = 0.1
#: ``LocalCluster(transport=...)``: what ``_bind`` knows.
TRANSPORTS: Final = ("auto", "ucx", "tcp")


#: Every daemon this process started and has not seen exit: killed at interpreter exit (module
#: docstring), so an abandoned cluster never outlives its notebook.
_RUNNING: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_abandoned() -> None:
    for proc in list(_RUNNING):
        _RUNNING.discard(proc)
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def _child_env() -> dict[str, str]:
    """The environment of a daemon or giaannctl started here: this one, with the package first on
    ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CODE_ROOT), env.get("PYTHONPATH")]))
    return env


def bundled_corpus() -> Path:
    """The path of the CoNLL-U corpus shipped with giaannd (gzip; ~6,000 sentences of web text)."""
    return BUNDLED_CORPUS


class NodeFailed(ClientError):
    """A daemon exited or did not become ready; the message ends with its log's tail."""

    reason = "node_failed"


#: where the kernel's ephemeral ports start when /proc does not say (Linux's default range)
DEFAULT_EPHEMERAL_LOW: Final = 32768
#: the ports below the ephemeral range that ``free_port`` draws from
PINNED_PORT_SPAN: Final = 16384


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range of ephemeral ports (the source ports of outgoing connections)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_LOW, 60999


#: the most ports ``free_port`` remembers having handed out (and does not hand out again)
RECENT_PORTS: Final = 4096
_recent: collections.deque[int] = collections.deque()
_recent_set: set[int] = set()
_recent_lock = threading.Lock()


def free_port(rng: random.Random | None = None) -> int:
    """A TCP port of 127.0.0.1 free right now, for a listener that binds it later and must keep it.

    Drawn below the kernel's ephemeral range where there is room: a port the kernel hands out (an
    ephemeral one, as ``bind(0)`` gives) may be given to an outgoing connection's source before
    the listener binds it, and the listener then fails with EADDRINUSE (seen in the topology
    stress, 1 run in ~200, where dozens of connections open while nodes start). Ports outside the
    range are never handed out by the kernel; one taken by another program fails the check bind
    here and the next is drawn. Nor is a port this process handed out among its last
    ``RECENT_PORTS``: a cluster's nodes draw their ports one after another before any of them
    binds, so two draws of one port both passed the check and the second listener failed with
    EADDRINUSE (the test suite, Dec 2: with 16,384 ports to draw from, 12 draws repeat one about
    once in 230). Falls back to ``bind(0)``."""
    draw = rng or random.Random()
    low, _ = ephemeral_port_range()
    start = max(1024, low - PINNED_PORT_SPAN)
    for _ in range(64 if low - start >= 1024 else 0):
        port = draw.randrange(start, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        with _recent_lock:
            if port in _recent_set:
                continue
            _recent.append(port)
            _recent_set.add(port)
            if len(_recent) > RECENT_PORTS:
                _recent_set.discard(_recent.popleft())
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    """One daemon process of the local cluster."""

    name: str
    roles: list[Role]
    data_dir: Path
    config_path: Path
    #: ``storage.join-mode`` of this node (None: the cluster's, "bootstrap" for the initial nodes)
    join_mode: JoinMode | None = None
    proc: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    #: (data-plane port, stream port) kept across restarts (``LocalCluster(pin_ports=True)``)
    ports: tuple[int, int] | None = None
    #: extra environment of the daemon at its next (re)start, e.g. ``GIAANND_FAILPOINTS``
    #: (giaannd/failpoints.py) for a fault test
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.data_dir / "giaannd.log"

    @property
    def admin(self) -> AdminClient:
        """The node's admin API, raw (``.json(method, path)``)."""
        return self.client().api

    def client(self, staging_dir: Path | None = None) -> Client:
        """A ``Client`` of this node (from its data directory's address and token files)."""
        return Client(data_dir=self.data_dir, staging_dir=staging_dir, environ={})

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
            capture_output=True, text=True, timeout=timeout_s, cwd=self.data_dir, check=False,
            env=_child_env())


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
        replication_factor: R (default min(3, storage)).
        write_quorum: W (default a majority of R).
        log_level: the daemons' log level.
        storage_options: further ``storage`` config keys (Python names).
        corpus_dir / export_dir: every node's ``compute.corpus-dir`` / ``export-dir`` (default
            ``<root>/corpus`` and ``<root>/exports``; created by ``start``).
        nodes: ``(name, roles)`` of every node, instead of ``storage`` / ``compute`` counts
            (roles may be empty: a membership-only node).
        cluster_name: ``cluster.name``.
        key_file: an existing cluster key file to copy to the nodes (default: one generated in
            ``root`` by ``start``).
        pin_ports: give every node fixed ports for its ``tcp://`` listener and its stream
            endpoint, kept across restarts (``tcp`` transport only).
        membership_options: ``membership`` config keys (Python names), e.g. ``profile``.
        compute_options: further ``compute`` config keys (Python names), e.g. ``cluster_jobs``.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, storage: int = 3, compute: int = 1,
                 transport: str = "auto", keep: bool = False,
                 replication_factor: int | None = None, write_quorum: int | None = None,
                 log_level: str = "info", storage_options: dict[str, Any] | None = None,
                 corpus_dir: str | os.PathLike[str] | None = None,
                 export_dir: str | os.PathLike[str] | None = None,
                 nodes: Sequence[tuple[str, Sequence[Role]]] | None = None,
                 cluster_name: str = CLUSTER_NAME, key_file: Path | None = None,
                 pin_ports: bool = False, membership_options: dict[str, Any] | None = None,
                 compute_options: dict[str, Any] | None = None) -> None:
        specs: list[tuple[str, list[Role]]] = [(f"storage-{i + 1}", ["storage"])
                                               for i in range(storage)]
        specs += [(f"compute-{i + 1}", ["compute"]) for i in range(compute)]
        if nodes is not None:
            specs = [(name, list(roles)) for name, roles in nodes]
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        if pin_ports and transport != "tcp":
            raise ValueError("pin_ports needs the tcp transport")
        n_storage = sum("storage" in roles for _, roles in specs)
        rf = replication_factor or max(1, min(3, n_storage))
        options: dict[str, Any] = {"capacity_bytes": 2 << 30, "fsync_group_commit_ms": 2.0,
                                   "join_mode": "bootstrap", **(storage_options or {})}
        # Checked before a temporary root exists: a constructor that raises leaves nothing behind.
        self.storage_cfg = StorageConfig(replication_factor=rf, write_quorum=write_quorum or rf // 2 + 1,
                                         **options)
        dirs = [None if d is None else Path(d) for d in (corpus_dir, export_dir)]  # text too, as root
        #: a temporary root is removed by ``close`` unless ``keep`` (or the start failed: the logs)
        self._temporary = root is None
        self.keep = keep
        # absolute: each daemon runs inside its own data directory, where a relative path to its
        # config, key file or logs would point nowhere (every daemon failed to start)
        root = Path(tempfile.mkdtemp(prefix="giaannd-local-")) if root is None else Path(root).absolute()
        self.root = root
        self.corpus_dir = (dirs[0] or root / "corpus").resolve()
        self.export_dir = (dirs[1] or root / "exports").resolve()
        self.transport = transport
        self.log_level = log_level
        self.cluster_name = cluster_name
        self.key_file = key_file or root / "cluster.key"
        self._own_key = key_file is None
        self.pin_ports = pin_ports
        self.membership_options = dict(membership_options or {})
        self.compute_options = dict(compute_options or {})
        self.nodes: list[Node] = []
        for name, roles in specs:
            self.nodes.append(self._node(name, roles))

    def _node(self, name: str, roles: list[Role], join_mode: JoinMode | None = None) -> Node:
        data_dir = self.root / name
        ports = (free_port(), free_port()) if self.pin_ports else None
        return Node(name, roles, data_dir, data_dir / "giaannd.toml", join_mode=join_mode, ports=ports)

    # -- lifecycle ----------------------------------------------------------------------------

    def _bind(self, node: Node) -> list[str]:
        if node.ports is not None:
            return [f"tcp://127.0.0.1:{node.ports[0]}"]
        urls = {"auto": ["ucx://127.0.0.1:0", "tcp://127.0.0.1:0"], "ucx": ["ucx://127.0.0.1:0"],
                "tcp": ["tcp://127.0.0.1:0"]}
        return urls[self.transport]

    def _write_config(self, node: Node, seeds: list[str]) -> None:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        key_copy = node.data_dir / "cluster.key"  # one copy per node, as on separate hosts
        if not key_copy.exists():  # a restart keeps the node's own (possibly rotated) keys
            shutil.copyfile(self.key_file, key_copy)
            key_copy.chmod(0o600)
        base = Config.loopback(str(node.data_dir), name=node.name, roles=node.roles)
        storage = self.storage_cfg if node.join_mode is None else \
            msgspec.structs.replace(self.storage_cfg, join_mode=node.join_mode)
        if node.ports is not None:
            storage = msgspec.structs.replace(storage, stream_bind=f"tcp://127.0.0.1:{node.ports[1]}")
        membership: MembershipConfig = base.membership
        if self.membership_options:
            membership = msgspec.structs.replace(membership, **self.membership_options)
        cfg = msgspec.structs.replace(
            base,
            cluster=ClusterConfig(name=self.cluster_name, key_file=str(key_copy), seeds=seeds),
            transport=TransportConfig(bind=self._bind(node)),
            membership=membership,
            storage=storage,
            logging=LoggingConfig(level=self.log_level, format="plain"),  # type: ignore[arg-type]
            compute=ComputeConfig(corpus_dir=str(self.corpus_dir), export_dir=str(self.export_dir),
                                  **self.compute_options),
        )
        node.config_path.write_text(to_toml(cfg), encoding="utf-8")

    def _spawn(self, node: Node) -> None:
        env = _child_env()
        env.pop("NOTIFY_SOCKET", None)  # the daemons are ours, not the service manager's
        env.update(node.env)
        with open(node.log_path, "ab") as log:
            # A new session: a Ctrl-C in the terminal reaches the launcher only, which then
            # stops the daemons with SIGTERM (graceful) instead of racing it with SIGINT.
            node.proc = subprocess.Popen(
                [sys.executable, "-m", "giaannd", "--config", str(node.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=node.data_dir, env=env,
                start_new_session=True)
        _RUNNING.add(node.proc)

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start every node (the first is the seed) and wait until all are READY.

        Raises:
            NodeFailed: a daemon exited or was not ready in time (the rest are stopped by
                ``stop``/the context manager).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.corpus_dir.mkdir(parents=True, exist_ok=True)
        self.export_dir.mkdir(parents=True, exist_ok=True)
        if self._own_key:
            Keyring.generate().save(self.key_file)
        if not self.nodes:
            raise ValueError("a cluster needs at least one node")
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
        self.wait_ring(timeout_s=RING_TIMEOUT_S)

    def add_node(self, name: str, roles: list[Role], *, join_mode: JoinMode = "auto",
                 timeout_s: float = READY_TIMEOUT_S, env: dict[str, str] | None = None) -> Node:
        """Start one more node (a storage node joining a running cluster: ``join_mode`` "auto"
        makes it run the streaming join once it is up) with the running members as seeds, and
        wait until it is READY (not until it joined the ring). ``env``: extra environment of the
        daemon (``Node.env``)."""
        if any(n.name == name for n in self.nodes):
            raise ValueError(f"{name} is already a node of this cluster")
        node = self._node(name, roles, join_mode)
        node.env.update(env or {})
        seeds = [n.status()["services"]["membership"]["addr"] for n in self.nodes
                 if n.proc is not None and n.proc.poll() is None]
        self.nodes.append(node)
        self._write_config(node, seeds)
        self._spawn(node)
        self.wait_ready(node, timeout_s)
        return node

    def ring_docs(self) -> dict[str, dict[str, Any]]:
        """``GET /v1/ring`` of every running node."""
        return {n.name: n.admin.json("GET", "/v1/ring") for n in self.nodes
                if n.proc is not None and n.proc.poll() is None}

    def wait_ring(self, timeout_s: float = RING_TIMEOUT_S) -> dict[str, Any]:
        """Wait until every running node holds the same storage ring and its active members are
        exactly the storage nodes started with the cluster. Returns one node's ring document."""
        want = sorted(n.name for n in self.nodes if "storage" in n.roles and n.join_mode is None)
        deadline = time.monotonic() + timeout_s
        while True:
            docs: dict[str, dict[str, Any]] = {}
            with contextlib.suppress(ClientError, OSError):
                docs = self.ring_docs()
            digests = {d["ring"]["digest"] for d in docs.values()}
            active = [sorted(d["ring"]["active"]) for d in docs.values()]
            if docs and len(digests) == 1 and all(a == want for a in active):
                return next(iter(docs.values()))
            if time.monotonic() > deadline:
                raise NodeFailed(f"storage rings did not converge in {timeout_s:.0f}s: "
                                 f"{ {k: d['ring'] for k, d in docs.items()} }\n"
                                 f"{self._ring_diagnosis()}")
            time.sleep(POLL_S)

    def _ring_diagnosis(self) -> str:
        """Each running node's ring sync view (peers' digests, pulls in flight, last errors) and
        the ring and membership lines of its log: what a failed ``wait_ring`` needs to be read."""
        parts = []
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            try:
                sync = node.status()["services"]["membership"].get("ring_sync")
            except (ClientError, OSError, KeyError) as exc:
                sync = f"(status failed: {exc!r})"
            try:
                lines = node.log_path.read_text(errors="replace").splitlines()
            except OSError:
                lines = []
            picked = [ln for ln in lines if "ring" in ln or "peers.membership" in ln][-40:]
            parts.append(f"--- {node.name} ring_sync={sync}\n" + "\n".join(picked))
        return "\n".join(parts)

    def wait_ready(self, node: Node, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Poll ``/v1/status`` until ``state`` is ``running`` (the daemon sent READY)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive(node)
            if (node.data_dir / "admin.addr").exists():
                with contextlib.suppress(ClientError, OSError):
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
                with contextlib.suppress(ClientError, OSError):
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

    def stop_node(self, node: Node, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM one node (graceful: drain, snapshot, leave) and wait; SIGKILL it if it overruns
        ``timeout_s``. Returns its exit status."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(10)
        node.exit_code = node.proc.returncode if node.proc is not None else None
        return node.exit_code

    def kill(self, node: Node) -> None:
        """SIGKILL (a crash: no leave, no snapshot)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(10)
        node.exit_code = node.proc.returncode if node.proc is not None else None

    def restart(self, node: Node, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start a stopped or killed node again (same data directory and node id).

        Its seeds are rewritten to the running members' current gossip addresses: with port 0
        every start gets new ports, so the addresses of the first start are stale.
        """
        if node.proc is not None and node.proc.poll() is None:
            raise RuntimeError(f"{node.name} is still running")
        seeds = [n.status()["services"]["membership"]["addr"] for n in self.nodes
                 if n is not node and n.proc is not None and n.proc.poll() is None]
        self._write_config(node, seeds)
        node.exit_code = None
        self._spawn(node)
        self.wait_ready(node, timeout_s)

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

    def client(self, node: Node | None = None) -> Client:
        """A ``Client`` of ``node`` (default: the first compute node, else the first node) that
        stages local corpus files into the cluster's corpus directory."""
        target = node or next(iter(self.compute_nodes), self.nodes[0])
        return target.client(staging_dir=self.corpus_dir)

    def __enter__(self) -> Client:
        """Start the cluster; a connected client (``client()``)."""
        try:
            self.start()
        except BaseException as exc:
            self.close(failed=isinstance(exc, NodeFailed))
            raise
        return self.client()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, failed: bool = False) -> None:
        """Stop every daemon (``stop``, then ``kill_all``) and remove a temporary root, unless
        ``keep`` or ``failed`` (a start that failed keeps the node logs, and says where)."""
        try:
            self.stop()
        finally:
            self.kill_all()
        if self._temporary and not self.keep and not failed:
            shutil.rmtree(self.root, ignore_errors=True)
        elif self._temporary:
            print(f"giaannd.LocalCluster: node data and logs kept in {self.root}", file=sys.stderr)

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
def running_cluster(root: str | os.PathLike[str] | None = None, **kwargs: Any) -> Iterator[LocalCluster]:
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
