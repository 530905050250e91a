"""The big-row benchmark runs end to end on a small row and prints one JSON object per figure
(tools/bench/bigrow.py; speed targets are the benchmark's, never asserted here)."""

import json

import pytest

from tools.bench import bigrow

pytestmark = pytest.mark.timeout(120)


def test_bigrow_bench_prints_every_figure_with_its_target(capsys):
    assert bigrow.main(["--entries", "200000", "--repeat", "1", "--chunk-bytes", "262144", "--json"]) == 0
    figures = {f["figure"]: f for f in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(figures) == {"bigrow.raw_gbps", "bigrow.raw_fresh_gbps", "bigrow.ours_gbps", "bigrow.ours_fresh_gbps",
                            "bigrow.ratio_vs_raw", "bigrow.ratio_fresh_vs_raw", "bigrow.ratio_fresh_vs_raw_fresh",
                            "bigrow.node_rss_peak_delta_mib", "bigrow.client_rss_peak_delta_mib",
                            "bigrow.client_fresh_rss_peak_delta_mib"}
    assert figures["bigrow.ratio_vs_raw"]["target"] == ">= 0.5"
    assert figures["bigrow.node_rss_peak_delta_mib"]["target"] == f"<= {200_000 * 21 / 2**20 + 64:.0f}"
    assert all(f["value"] is not None and f["value"] >= 0 for f in figures.values())
