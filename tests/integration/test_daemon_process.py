"""A real ``python -m giaannd`` process: sd_notify READY/WATCHDOG/STOPPING over a datagram socket
the test binds, admin API with the token, giaannctl as a subprocess, signals and exit statuses.
Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from giaannd.storage.engine.vocab_store import VOCAB_RECORD
from tests.integration.small_fs import fill, remount, small_tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0


class NotifySocket:
    """The service manager's end of NOTIFY_SOCKET, drained continuously by a thread (as systemd
    does) so watchdog pings never fill the queue and crowd out READY or STOPPING."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self.messages.append(data.decode())
                self._cond.notify_all()

    def wait_for(self, assignment: str, timeout_s: float = WAIT_S) -> None:
        def seen() -> bool:
            return any(assignment in m.split("\n") for m in self.messages)
        with self._cond:
            if not self._cond.wait_for(seen, timeout_s):
                raise AssertionError(f"no {assignment} within {timeout_s}s: {self.messages}")

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    ns = NotifySocket(tmp_path / "notify.sock")
    yield ns
    ns.close()


def _write_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "giaannd.toml"
    path.write_text(f'[node]\nname = "proc-node"\ndata-dir = "{tmp_path / "data"}"\nroles = []\n'
                    f'drain-timeout-s = 60.0\n[admin]\nlisten = "127.0.0.1:0"\n'
                    f'[membership]\nprofile = "loopback"\nbind-port = 0\n{extra}')
    return path


def _spawn(argv: list[str], notify: NotifySocket | None, stderr_path: Path,
           extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GIAANND_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}
    env["PYTHONPATH"] = str(ROOT)
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.path
    env.update(extra_env or {})
    with open(stderr_path, "wb") as err:
        return subprocess.Popen([sys.executable, *argv], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(WAIT_S)


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
        return resp.status, resp.read()


def test_daemon_process_lifecycle(tmp_path: Path, notify: NotifySocket) -> None:
    config = _write_config(tmp_path)
    stderr_path = tmp_path / "stderr.log"
    stderr_path.touch()
    st = os.stat(stderr_path)
    proc = _spawn(["-m", "giaannd", "--config", str(config)], notify, stderr_path,
                  {"WATCHDOG_USEC": "200000", "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    try:
        notify.wait_for("READY=1")
        notify.wait_for("WATCHDOG=1", timeout_s=5)
        data = tmp_path / "data"
        addr = (data / "admin.addr").read_text().strip()
        token = (data / "admin.token").read_text().strip()
        assert oct((data / "admin.token").stat().st_mode & 0o777) == "0o600"
        status, body = _get(f"{addr}/v1/status", token)
        doc = json.loads(body)
        assert status == 200 and doc["node_name"] == "proc-node" and doc["pid"] == proc.pid
        status, metrics = _get(f"{addr}/metrics", token)
        assert b'giaannd_info{node_name="proc-node",version=' in metrics

        def ctl(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "giaannd.admin.ctl", "--data-dir", str(data), *argv],
                cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)

        result = ctl("--json", "node", "status")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["node_id"] == doc["node_id"]
        assert _get(f"{addr}/v1/health", None) == (200, b'{"status":"ready"}')  # no token: for systemd, LBs
        result = ctl("node", "health", "--token-file", str(tmp_path / "absent"))
        assert (result.returncode, result.stdout) == (0, "status: ready\n"), result.stderr
        result = ctl("node", "status", "--json")  # global flags after the command words too
        assert result.returncode == 0 and json.loads(result.stdout)["pid"] == proc.pid, result.stderr
        result = ctl("column", "info", "dog")  # served by every node; no storage member yet
        assert result.returncode == 1 and "no storage members known" in result.stderr
        result = ctl("ring", "owners", "dog")  # served by membership; no storage member yet
        assert result.returncode == 1 and "no storage members known" in result.stderr

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        notify.wait_for("STOPPING=1", timeout_s=5)
    finally:
        _stop(proc)
    log = stderr_path.read_text()
    assert "<6>INFO giaannd.daemon: ready node=proc-node" in log  # journald format, no time
    assert "shutdown requested reason=SIGTERM" in log
    assert not (tmp_path / "data" / "admin.addr").exists()


def test_daemon_process_bad_config_exits_2(tmp_path: Path) -> None:
    config = _write_config(tmp_path, "[storage]\ncapacity-bytes = -1\n")
    result = subprocess.run([sys.executable, "-m", "giaannd", "--config", str(config)],
                            cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2
    assert "$.storage.capacity-bytes" in result.stderr
    result = subprocess.run([sys.executable, "-m", "giaannd", "--config", str(config),
                             "--set", "storage.capacity-bytes=5", "--set", "node.colour=red"],
                            cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2 and "$.node.colour" in result.stderr
    assert not (tmp_path / "data").exists()  # nothing created before the config is valid


def test_daemon_process_config_show(tmp_path: Path) -> None:
    config = _write_config(tmp_path)
    result = subprocess.run([sys.executable, "-m", "giaannd", "config", "show", "--config",
                             str(config), "--json", "--set", "compute.max-sessions=9"],
                            cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S,
                            env={**os.environ, "GIAANND_COMPUTE__TRAIN_WORKERS": "5"})
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["node"]["name"] == "proc-node"
    assert shown["compute"]["max-sessions"] == 9 and shown["compute"]["train-workers"] == 5
    defaults = subprocess.run([sys.executable, "-m", "giaannd", "config", "show", "--defaults"],
                              cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert defaults.returncode == 0 and 'data-dir = "/var/lib/giaannd"' in defaults.stdout


_SLOW_DAEMON = """
import asyncio, sys
from giaannd.cli import main

class SlowDrain:
    name = "slow"
    async def start(self, ctx): pass
    async def stop(self, graceful):
        if graceful:
            await asyncio.sleep(3600)  # a drain that would outlast any test
    def health(self): return {}

sys.exit(main(sys.argv[1:], extra_services=[SlowDrain()]))
"""


def test_daemon_process_second_sigint_forces_exit(tmp_path: Path, notify: NotifySocket) -> None:
    script = tmp_path / "slow_daemon.py"
    script.write_text(_SLOW_DAEMON)
    proc = _spawn([str(script), "--config", str(_write_config(tmp_path))], notify,
                  tmp_path / "stderr.log")
    try:
        notify.wait_for("READY=1")
        proc.send_signal(signal.SIGINT)
        notify.wait_for("STOPPING=1")
        time.sleep(0.2)
        assert proc.poll() is None  # still draining (drain-timeout-s is 60)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 130
        assert time.monotonic() - started < 10
    finally:
        _stop(proc)
    assert "forced shutdown reason=second SIGINT" in (tmp_path / "stderr.log").read_text()


def test_daemon_process_storage_role_loads_no_torch_or_spacy(tmp_path: Path, notify: NotifySocket) -> None:
    """A storage node needs neither torch nor spaCy (issue 18): once it is READY, none of their
    shared libraries is mapped into the process (``/proc/PID/maps``), i.e. nothing imported them."""
    config = _write_config(tmp_path, '[transport]\nbind = ["tcp://127.0.0.1:0"]\n')
    stderr_path = tmp_path / "stderr.log"
    proc = _spawn(["-m", "giaannd", "--config", str(config), "--role", "storage"], notify, stderr_path)
    try:
        notify.wait_for("READY=1")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "/site-packages/" in maps or "/dist-packages/" in maps  # the check sees packages
        for package in ("torch", "spacy", "thinc"):
            assert f"/{package}/" not in maps, f"{package} is loaded in a storage-only daemon"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
    finally:
        _stop(proc)


# -- start-up on a full or unusable disk, and start-up errors (issue 16 items 2 and 8) -------------

def _run_daemon(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GIAANND_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "giaannd", "--config", str(config), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S, env=env)


def _assert_one_error_line(result: subprocess.CompletedProcess[str], *names: str) -> str:
    """Exit 2 (systemd's RestartPreventExitStatus), no traceback, exactly one ``giaannd: error:``
    line, naming each of ``names``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("giaannd: error:")]
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert result.returncode == 2, result.stderr
    return lines[0]


def _storage_config(tmp_path: Path, data_dir: Path, extra: str = "") -> Path:
    path = tmp_path / "storage.toml"
    path.write_text(f'[node]\nname = "proc-storage"\ndata-dir = "{data_dir}"\nroles = ["storage"]\n'
                    f'drain-timeout-s = 30.0\n[admin]\nlisten = "127.0.0.1:0"\n'
                    f'[transport]\nbind = ["tcp://127.0.0.1:0"]\n'
                    f'[membership]\nprofile = "loopback"\nbind-address = "127.0.0.1"\nbind-port = 0\n'
                    f'[storage]\njoin-mode = "bootstrap"\nreplication-factor = 1\nwrite-quorum = 1\n{extra}')
    return path


def test_daemon_process_starts_on_a_disk_filled_by_a_failed_snapshot(tmp_path: Path, notify: NotifySocket) -> None:
    """A snapshot temporary a full disk left behind filled the file system: start-up deletes it
    before writing anything (lock, node id, incarnation...), recovers, and serves."""
    with small_tmpfs(tmp_path / "fs") as fs:
        store = fs / "data" / "storage" / "store"
        store.mkdir(parents=True)
        fill(store, ".snapshot-00000000000000000007.tmp")
        stderr_path = tmp_path / "stderr.log"
        proc = _spawn(["-m", "giaannd", "--config", str(_storage_config(tmp_path, fs / "data"))], notify,
                      stderr_path)
        try:
            notify.wait_for("READY=1")
            assert not list(store.glob(".snapshot-*.tmp"))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(WAIT_S) == 0, stderr_path.read_text()
        finally:
            _stop(proc)
    assert "reclaimed space service=storage files=1" in stderr_path.read_text()


def test_daemon_process_full_disk_at_start_exits_2_with_one_line(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs") as fs:
        fill(fs)  # not ours: nothing the daemon may delete
        result = _run_daemon(_storage_config(tmp_path, fs / "data"))
    _assert_one_error_line(result, "No space left on device", str(fs / "data"))


def test_daemon_process_read_only_data_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs") as fs:
        (fs / "data").mkdir()
        remount(fs, read_only=True)
        result = _run_daemon(_storage_config(tmp_path, fs / "data"))
    _assert_one_error_line(result, "Read-only file system", str(fs / "data"))


def test_daemon_process_non_utf8_config_exits_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "latin1.toml"
    config.write_bytes('[node]\nname = "n\u00e6ud"\n'.encode("latin-1"))
    result = _run_daemon(config)
    _assert_one_error_line(result, str(config), "UTF-8")


def test_daemon_process_corrupt_vocab_log_exits_2_with_one_line(tmp_path: Path) -> None:
    """Data corruption is exit 2 as well: a restart cannot repair the file, the operator must act
    (systemd must not restart-loop on it)."""
    data = tmp_path / "data"
    vocab = data / "storage" / "vocab"
    vocab.mkdir(parents=True)
    first = VOCAB_RECORD.encode(b"\x91\x93\x00\x01\xa3dog")
    damaged = first[:-1] + bytes([first[-1] ^ 0xFF])  # payload checksum fails; a record follows
    (vocab / "vocab.log").write_bytes(damaged + VOCAB_RECORD.encode(b"\x90"))
    result = _run_daemon(_storage_config(tmp_path, data))
    _assert_one_error_line(result, str(vocab / "vocab.log"))


@pytest.mark.parametrize("which", ["membership", "admin", "transport"])
def test_daemon_process_port_in_use_exits_2_with_one_line(tmp_path: Path, which: str) -> None:
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        port = tcp.getsockname()[1]
        udp.bind(("127.0.0.1", port))
        config = _storage_config(tmp_path, tmp_path / "data")
        text = config.read_text()
        if which == "membership":
            text = text.replace("bind-port = 0", f"bind-port = {port}")
        elif which == "admin":
            text = text.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"')
        else:
            text = text.replace('"tcp://127.0.0.1:0"', f'"tcp://127.0.0.1:{port}"')
        config.write_text(text)
        result = _run_daemon(config)
    _assert_one_error_line(result, str(port))


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this host may have a CUDA device")
def test_daemon_process_compute_device_cuda_without_a_device_exits_2(tmp_path: Path) -> None:
    config = _write_config(tmp_path, "[compute]\ndevice = \"cuda\"\n")
    result = _run_daemon(config, "--set", 'node.roles=["compute"]')
    line = _assert_one_error_line(result, "$.compute.device", "no CUDA device is usable")
    assert "auto or cpu" in line
