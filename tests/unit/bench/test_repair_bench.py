"""tools.bench.repair runs small: both digest versions find the same rows compared and divergent
(the 200 made to differ), and the JSON lists every figure with its target."""

from __future__ import annotations

import asyncio
import json

import pytest

from tools.bench import repair


def test_repair_bench_variants_agree() -> None:
    v1 = asyncio.run(repair._measure(3_000, 1))
    v2 = asyncio.run(repair._measure(3_000, 2))
    for r in (v1, v2):
        assert r["failed"] == {} and r["compared"] == 3_000
        assert r["divergent"] == repair.DIFFERENT + repair.ONLY_HERE


def test_repair_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert repair.main(["--rows", "2000", "--rounds", "1", "--json"]) == 0
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {f["figure"] for f in figures} >= {"repair CPU version 1 / version 2",
                                              "repair CPU µs per row compared, version 2"}
    assert all(set(f) == {"figure", "value", "target"} for f in figures)


def test_repair_bench_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit) as exc:
        repair.main(["--rows", "10"])
    assert exc.value.code == 2
