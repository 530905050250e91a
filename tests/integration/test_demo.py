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
from pathlib import Path

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
