"""tools.bench.replay_windows runs small: every variant leaves the same rows, the one before makes
a window per segment and moves the base with each, the ones now gather the segments (in one
thread and in every usable CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import replay_windows


def test_replay_windows_variants_agree_and_differ_in_windows(tmp_path: Path) -> None:
    dirs = replay_windows.build(tmp_path, 1_024, 768, [1])
    store = dirs[1] / "store"
    before = replay_windows.child(store, 0)
    now = replay_windows.child(store, 1)
    threaded = replay_windows.child(store, 2)
    assert before["digest"] == now["digest"] == threaded["digest"]
    assert now["threads"] == 1 and threaded["threads"] >= 1
    assert before["segments"] == now["segments"] >= 3
    assert now["windows"] == 1 and now["moved"] < before["moved"]
    assert before["held"] == now["held"] > 0


def test_replay_windows_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_windows.main(["--base-sentences", "512", "--log-sentences", "512", "--segment-mb", "1",
                                "--rounds", "1", "--dir", str(tmp_path), "--json"]) == 0
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    names = {f["figure"] for f in figures}
    assert "replay CPU before / now, 1 MiB segments" in names
    assert any(n.startswith("replay wall 1 thread / ") for n in names)
    assert all(set(f) == {"figure", "value", "target"} for f in figures)


def test_replay_windows_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit) as exc:
        replay_windows.main(["--segment-mb", "0"])
    assert exc.value.code == 2
