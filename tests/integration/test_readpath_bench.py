"""The read-path benchmark runs end to end on a few rows and prints one JSON object per figure
(tools/bench/readpath.py; speed targets are the benchmark's, never asserted here)."""

import json

import pytest

from tools.bench import readpath

pytestmark = pytest.mark.timeout(120)


def test_readpath_bench_prints_every_figure_with_its_target(capsys):
    assert readpath.main(["--rows", "40", "--iterations", "60", "--json"]) == 0
    figures = {f["figure"]: f for f in map(json.loads, capsys.readouterr().out.splitlines())}
    for k in (1, 16):
        assert figures[f"readpath.read_rows_{k}key_vs_transport"]["target"] == readpath.TARGET_RATIO
        for piece in ("p50_us", "client_us", "placement_us", "checks_us", "server_us", "core_us"):
            assert f"readpath.read_rows_{k}key_{piece}" in figures
        assert f"readpath.transport_{k}key_p50_us" in figures
    assert len(figures) == 2 * 8
    assert all(f["value"] is not None and f["value"] > 0 for f in figures.values())
