"""The Python client against real daemons: issue 21's "done when" snippet, verbatim, then the
report it wrote; and docs/examples/quickstart.py run as a user runs it."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.spacy]

ROOT = Path(__file__).resolve().parents[2]
IMG = re.compile(r'<figure id="([a-z0-9-]+)"><img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


def _daemons_of(root: Path) -> list[int]:
    """PIDs of running giaannd processes whose config lies under ``root``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"giaannd" in cmd and any(str(root).encode() in part for part in cmd):
            out.append(int(pid))
    return out


def test_sdk_local_cluster_snippet_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    import giaannd

    monkeypatch.chdir(tmp_path)
    with giaannd.LocalCluster(storage=2, compute=1) as c:
        root = c.staging_dir.parent if c.staging_dir is not None else None
        figures = c.train(giaannd.bundled_corpus(), limit=300).wait(progress=False)
        assert figures["trained"] > 0
        assert 0.0 <= c.eval(limit=50)["top1"] <= 1.0
        print(c.generate("In the beginning God created", max_tokens=5))
        c.report("report.html")
        column = c.column("god")
        assert len(column) > 0 and column.word == "god"
    assert root is not None and not root.exists() and not _daemons_of(root)  # stopped, temporary root removed

    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    images = dict(IMG.findall(page))
    assert list(images) == ["throughput", "bytes", "top1", "row-sizes", "fill", "owners"]
    for b64 in images.values():
        Image.open(io.BytesIO(base64.b64decode(b64))).load()
    # every part was there to draw: a job with a timeline, an evaluation, row sizes, fill, owners
    assert "no data" not in page and "Not available" not in page


def test_sdk_local_cluster_stops_daemons_on_an_exception(tmp_path: Path) -> None:
    import giaannd

    cluster = giaannd.LocalCluster(tmp_path / "c", storage=1, compute=0, transport="tcp")
    with pytest.raises(RuntimeError, match="user code failed"), cluster as client:
        assert client.status()["state"] == "running"
        raise RuntimeError("user code failed")
    assert all(n.proc is not None and n.proc.poll() is not None for n in cluster.nodes)
    assert (tmp_path / "c").exists()  # a root the caller gave is the caller's: kept


def test_quickstart_example_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "quickstart.py"),
                           str(tmp_path / "quickstart.html"), "--sentences", "200"],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "trained" in done.stdout and "column 'god'" in done.stdout and "report written" in done.stdout
    assert len(IMG.findall((tmp_path / "quickstart.html").read_text(encoding="utf-8"))) == 6


def test_local_cluster_ring_timeout_says_what_each_node_sees(tmp_path: Path) -> None:
    """A ring that does not converge in time fails with each node's ring sync view and its ring
    log lines (a CI failure must be readable from its message alone). Here the cluster expects a
    storage node that never started."""
    from giaannd.sdk.local_cluster import LocalCluster, Node, NodeFailed

    cluster = LocalCluster(tmp_path / "c", storage=1, compute=0, transport="tcp")
    with cluster:
        ghost = tmp_path / "c" / "ghost"
        cluster.nodes.append(Node("ghost", ["storage"], ghost, ghost / "giaannd.toml"))
        try:
            with pytest.raises(NodeFailed) as failed:
                cluster.wait_ring(timeout_s=0.2)
        finally:
            cluster.nodes.pop()
    text = str(failed.value)
    assert "did not converge" in text
    assert "--- storage-1 ring_sync={" in text and "'peers': {}" in text
    assert "ring: bootstrapped node=storage-1" in text
