"""The main job in CI: ``python -m tools.local_cluster --quick`` (what ``make demo`` runs, small).

It starts 3 storage + 1 compute daemons as real processes, trains, evaluates, generates, prints the
figures and stops the cluster; the test checks each step's output and the exit status (0 only if
every daemon exited 0). The launcher stops its daemons itself, even when a step fails; the
subprocess timeout bounds the whole run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def test_demo_quick_runs_end_to_end(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.local_cluster", "--quick", "--dir", str(root)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out}\n{proc.stderr}"
    assert "all 4 daemons READY and converged" in out
    assert re.search(r"data plane: (UCX|TCP)", out)
    table = out.split("$ giaannctl members list", 1)[1]
    for name in ("storage-1", "storage-2", "storage-3", "compute-1"):
        assert re.search(rf"^{name}\s", table, re.M), name
    assert "100% 300/300 sentences" in proc.stderr  # the progress bar reached the end
    top1 = re.search(r"top-1 held-out \(test constants\)\s+([0-9.]+)", out)
    assert top1 and 0.0 <= float(top1.group(1)) <= 1.0
    assert re.search(r"training sentences/s\s+[0-9.]+", out)
    # the default job is a cluster job (compute.cluster-jobs): what the node did, from the registers;
    # its document has no node-local write figures (coalescing ratio, bytes), which the demo leaves out
    assert re.search(r"^  compute-1: 300 sentences \(10 windows\), flag pass 10 windows", out, re.M)
    assert re.search(r"inference steps/s \(eval\)\s+[0-9.]+", out)
    assert re.search(r"God created the heavens -> \S+", out)
    assert "exit statuses: storage-1=0, storage-2=0, storage-3=0, compute-1=0" in out
    assert not root.exists()  # cleaned up without --keep


# -- in-process: the launcher's arguments, Ctrl-C and clean-up, on a stand-in cluster ---------------


class _FakeCluster:
    """Stands in for ``LocalCluster`` in ``demo.main``: records what the demo asks of it, makes the
    directories a start makes, and raises ``interrupt_in`` (a step name) with KeyboardInterrupt."""

    made: list[_FakeCluster] = []

    def __init__(self, root: Path, *, interrupt_in: tuple[str, ...] = (), **kwargs: object) -> None:
        self.root, self.interrupt_in, self.calls = Path(root), interrupt_in, []
        self.nodes = [SimpleNamespace(name="storage-1", data_dir=self.root / "storage-1")]
        self.compute_nodes: list[object] = []
        _FakeCluster.made.append(self)

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if name in self.interrupt_in:
            raise KeyboardInterrupt

    def start(self) -> None:
        self._step("start")
        for name in ("storage-1", "corpus", "exports"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        (self.root / "cluster.key").write_text("key")

    def wait_converged(self) -> None:
        self._step("wait_converged")

    def _check_alive(self, node: object) -> None:
        self._step("check_alive")

    def stop(self) -> dict[str, int | None]:
        self._step("stop")
        return {"storage-1": 0}

    def kill_all(self) -> None:
        self.calls.append("kill_all")


def _fake(monkeypatch: pytest.MonkeyPatch, *interrupt_in: str) -> None:
    from tools.local_cluster import demo

    _FakeCluster.made.clear()
    monkeypatch.setattr(demo, "LocalCluster",
                        lambda root, **kw: _FakeCluster(root, interrupt_in=interrupt_in, **kw))
    monkeypatch.setattr(demo, "_demo", lambda cluster, args: {})


def test_demo_dir_that_existed_keeps_what_it_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A successful run without --keep removed the whole --dir: ``--dir ~/work`` deleted the user's files."""
    from tools.local_cluster import demo

    _fake(monkeypatch)
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("the user's")
    assert demo.main(["--dir", str(root), "--quick"]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]  # what the demo added is gone
    fresh = tmp_path / "fresh"
    assert demo.main(["--dir", str(fresh), "--quick"]) == 0
    assert not fresh.exists()  # a --dir the demo created is removed whole, as before


def test_demo_relative_dir_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--dir rel`` failed every daemon: each runs in its data directory, where the relative
    ``--config rel/storage-1/giaannd.toml`` does not exist (exit 2, "config file ... does not exist")."""
    from tools.local_cluster import demo

    _fake(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--dir", "rel", "--quick"]) == 0
    assert _FakeCluster.made[-1].root == tmp_path / "rel"


def test_serve_ends_cleanly_on_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--serve`` waits for Ctrl-C, its only way to end; it said "FAILED: interrupted", exited 1
    and left its temporary root (node data, logs, key) behind."""
    from tools.local_cluster import demo

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _fake(monkeypatch, "check_alive")
    assert demo.main(["--serve", "--storage", "1", "--compute", "0"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out
    assert list(tmp_path.iterdir()) == []
    assert _FakeCluster.made[-1].calls[-2:] == ["stop", "kill_all"]


def test_demo_ctrl_c_stops_and_removes_and_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during the demo left the temporary root behind and exited 1 (a failed step's status);
    a second Ctrl-C during the graceful stop skipped ``kill_all`` and ended in a traceback."""
    from tools.local_cluster import demo

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _fake(monkeypatch, "wait_converged")
    assert demo.main(["--quick"]) == 130
    assert list(tmp_path.iterdir()) == []
    _fake(monkeypatch, "wait_converged", "stop")
    assert demo.main(["--quick"]) == 130
    assert _FakeCluster.made[-1].calls[-2:] == ["stop", "kill_all"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--max-tokens", "-1"], ["--max-tokens", "1025"], ["--prompt", "  "]])
def test_demo_bad_generate_arguments_exit_2_before_starting(
        argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The node refuses them (max_tokens in [0, 1024], a non-blank prompt) only at the generate
    step: the demo started the cluster, trained, then exited 1 with a BadRequestError."""
    from giaannd.compute.routes import MAX_GENERATE_TOKENS
    from tools.local_cluster import demo

    _fake(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2
    assert _FakeCluster.made == []
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("python -m tools.local_cluster: error:")
    assert demo.MAX_GENERATE_TOKENS == MAX_GENERATE_TOKENS  # the demo's copy of the node's bound


class _Terminated(Exception):
    """What this test's own SIGTERM handler raises: a demo that leaves SIGTERM alone shows it."""


def test_demo_sigterm_stops_the_cluster_like_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``timeout 600 make demo`` (or systemd, or a CI runner) ends the launcher with SIGTERM. The
    daemons run in sessions of their own and the launcher's atexit hook does not run on a signal, so
    before they were left running; now SIGTERM stops and removes them as Ctrl-C does (exit 130)."""
    import os
    import signal

    from tools.local_cluster import demo

    def raise_terminated(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        _fake(monkeypatch)
        monkeypatch.setattr(_FakeCluster, "wait_converged", lambda self: (self.calls.append("wait_converged"),
                                                                          os.kill(os.getpid(), signal.SIGTERM)))
        assert demo.main(["--quick"]) == 130
        assert _FakeCluster.made[-1].calls[-2:] == ["stop", "kill_all"]
        assert list(tmp_path.iterdir()) == []
        assert signal.getsignal(signal.SIGTERM) is raise_terminated  # the demo's handler is gone after
    finally:
        signal.signal(signal.SIGTERM, previous)
