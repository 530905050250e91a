"""tools.bench.snapshot's snapshot writes with delta runs run small and print every writer's figures."""

from __future__ import annotations

import json

from tools.bench.snapshot import bench_write_delta_runs


def test_snapshot_write_bench_prints_every_writer(tmp_path, capsys) -> None:
    bench_write_delta_runs(tmp_path, 3000, 1, True)
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [f["figure"].split(", ", 2)[2] for f in figures] == [
        "section by section (baseline), CPU s/GB", "one pass, CPU s/GB",
        "one pass, dropped from the page cache, CPU s/GB"]
    assert all(f["value"] > 0 for f in figures) and not list(tmp_path.iterdir())  # files removed
