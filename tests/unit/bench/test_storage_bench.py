"""``tools.bench.storage``'s append-after-sync table runs and prints both logs' latencies."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.storage import bench_append_after_sync


def test_append_after_sync_prints_both_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench_append_after_sync(tmp_path, 20)
    out = capsys.readouterr().out
    assert "keeps its pages (baseline)" in out and "drops what it synced" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "µs" not in line and "---" not in line]
    assert len(rows) == 2 and all(float(cell) > 0 for row in rows for cell in row.strip("|").split("|")[1:])


def test_append_after_sync_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    bench_append_after_sync(tmp_path, 20, as_json=True)
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(figures) == 5 and all(set(f) == {"figure", "value", "target"} and f["value"] > 0 for f in figures)
    assert figures[-1]["figure"] == "update log append right after a sync, p50, the store's log / baseline"
