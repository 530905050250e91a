"""What benches that measure in fresh processes share: running a bench module's child mode and
reading its JSON line, the process's resident memory and its peak (``VmHWM``, which Linux lets a
process reset), and a "median (min–max)" cell."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["median_range", "peak_reset", "run_child", "status_kb"]


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``); 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_reset() -> bool:
    """Reset the peak resident set size (``VmHWM``): "5" into /proc/self/clear_refs (Linux);
    whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def run_child(module: str, *args: str) -> dict[str, Any]:
    """``python -m module --child args...`` in a fresh process with this checkout first on the
    path; the JSON object of its last output line."""
    here = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-m", module, "--child", *args], env=env, check=True,
                         capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def median_range(values: list[float], digits: int = 2) -> str:
    """``median (min–max)``, or the one value."""
    med = f"{statistics.median(values):.{digits}f}"
    return f"{med} ({min(values):.{digits}f}–{max(values):.{digits}f})" if len(values) > 1 else med
