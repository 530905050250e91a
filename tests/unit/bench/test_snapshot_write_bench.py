"""tools.bench.snapshot's snapshot writes with delta runs run small and print every writer's figures."""

from __future__ import annotations

import json

from tools.bench.snapshot import bench_write_delta_runs


def test_snapshot_write_bench_prints_every_writer(tmp_path, capsys) -> None:
    bench_write_delta_runs(tmp_path, 3000, 1, True)
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [f["figure"].split(", ", 2)[-1] for f in figures[:2]] == [
        "through the page cache (baseline), CPU s/GB", "dropped from the page cache, CPU s/GB"]
    assert figures[2]["figure"].endswith("CPU s/GB") and "direct" in figures[2]["figure"]
    assert figures[3]["figure"] == "snapshot write, direct / through the page cache"
    assert all(f["value"] > 0 for f in figures) and not list(tmp_path.iterdir())  # files removed
