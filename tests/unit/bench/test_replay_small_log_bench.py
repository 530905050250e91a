"""tools.bench.replay_small_log runs small: a window's replay over stores of two sizes, a ratio to
the smaller one, the peak memory each added; bad arguments exit 2."""

from __future__ import annotations

import json

import pytest

from tools.bench import replay_small_log


def test_child_replays_one_window_and_adds_little_memory() -> None:
    got = replay_small_log.child(50_000, 1_000)
    assert got["seconds"] > 0
    assert got["peak_mib"] < 16


def test_json_has_the_ratio_and_the_peaks(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_small_log.main(["--rows", "1000", "20000", "--rounds", "1", "--json"]) == 0
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    names = {f["figure"]: f for f in figures}
    assert names["replay of a 1000-entry window, 20000 rows / 1000 rows"]["target"] == "<= 10"
    assert "replay of a 1000-entry window over 20000 rows, peak MiB added" in names
    assert all(set(f) == {"figure", "value", "target"} for f in figures)


@pytest.mark.parametrize("argv", [["--rows", "1000"], ["--rows", "100", "1000"], ["--rounds", "0"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        replay_small_log.main(argv)
    assert exc.value.code == 2
