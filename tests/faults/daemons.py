"""``giaannd`` daemons in network namespaces (tools/netns.py) for the fault tests: one config per
node bound to its namespace's address, the process started inside the namespace, readiness and
member events read from its log (the admin API listens on the namespace's own loopback, which the
test process cannot reach)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from giaannd.config import ClusterConfig, Config, LoggingConfig, Role, TransportConfig, to_toml
from tools.netns import NetnsCluster

ROOT = Path(__file__).resolve().parents[2]
#: What peers/membership/node.py logs for every member event.
MEMBER_EVENT = re.compile(r"member (Member\w+) name=(\S+) incarnation=(\d+)")


def write_config(root: Path, name: str, *, ip: str, gossip_port: int, roles: list[Role], cluster: str,
                 key_file: Path, seeds: list[str], membership: dict[str, Any] | None = None,
                 storage: dict[str, Any] | None = None, bind: list[str] | None = None) -> Path:
    """A node's TOML config: gossip on ``ip:gossip_port``, data plane on ``bind``."""
    data_dir = root / name
    data_dir.mkdir(parents=True, exist_ok=True)
    base = Config.loopback(str(data_dir), name=name, roles=roles)
    cfg = msgspec.structs.replace(
        base,
        cluster=ClusterConfig(name=cluster, key_file=str(key_file), seeds=seeds),
        transport=TransportConfig(bind=bind or [f"tcp://{ip}:0"]),
        membership=msgspec.structs.replace(base.membership, bind_address=ip, bind_port=gossip_port,
                                           **(membership or {})),
        storage=msgspec.structs.replace(base.storage, **(storage or {})),
        logging=LoggingConfig(level="info", format="plain"))
    path = data_dir / "giaannd.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    return path


def spawn(net: NetnsCluster, i: int, config: Path, log: Path) -> subprocess.Popen[str]:
    """``python -m giaannd --config CONFIG`` in namespace ``i``, stdout and stderr to ``log``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("NOTIFY_SOCKET", None)
    with open(log, "ab") as out:
        return net.popen(i, [sys.executable, "-m", "giaannd", "--config", str(config)], cwd=ROOT, env=env,
                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_logged(proc: subprocess.Popen[str], log: Path, pattern: str, timeout_s: float) -> None:
    """Wait until ``log`` has a line matching ``pattern`` (bounded; fails if the daemon exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if re.search(pattern, text):
            return
        if proc.poll() is not None:
            raise AssertionError(f"{log.parent.name} exited ({proc.returncode}):\n{text[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in {log} within {timeout_s}s")


def member_events(log: Path) -> list[dict[str, Any]]:
    """Every member event a daemon logged: {"event", "name", "incarnation"}."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [{"event": m[1], "name": m[2], "incarnation": int(m[3])} for m in MEMBER_EVENT.finditer(text)]


def stop(procs: list[subprocess.Popen[str]], *, graceful: bool = True) -> None:
    """SIGCONT (a frozen one), then SIGTERM (``graceful``) or SIGKILL; SIGKILL what overran the
    graceful stop: always leaves nothing running."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            if graceful:
                proc.terminate()
            else:
                proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
