"""tools.bench.scan_live runs small and prints every figure with its target."""

from __future__ import annotations

import json

import pytest

from tools.bench import scan_live


def test_scan_live_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert scan_live.main(["--rows", "20000", "--pages", "3", "--burst", "5000", "--json"]) == 0
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {f["figure"] for f in figures} >= {"scan page after new rows / quiet page", "scan page before / now",
                                              "first page after a burst: sorted by the page / sorted apart"}
    assert all(set(f) == {"figure", "value", "target"} and f["value"] > 0 for f in figures)


def test_scan_live_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit) as exc:
        scan_live.main(["--rows", "10"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        scan_live.main(["--burst", "-1"])
    assert exc.value.code == 2
