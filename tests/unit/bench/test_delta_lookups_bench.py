"""tools.bench.delta_lookups runs small: both engines end with the same rows, and the filter leaves
far fewer keys to delta-run searches than the baseline, which searches every one the base lacks."""

from __future__ import annotations

import json

import pytest

from tools.bench import delta_lookups


def test_delta_lookups_engines_agree_and_the_filter_rules_keys_out() -> None:
    res = delta_lookups.run([1_000, 3_000], batch=128)
    assert res["same"]
    last_now, last_before = res["now"][-1], res["before"][-1]
    assert last_before["searched"] > 0.2  # most keys the base lacks are new: the baseline searched them all
    assert last_now["searched"] < last_before["searched"] / 10
    assert last_now["entries"] == last_before["entries"] > 0
    assert 0 < last_now["filter_b"] < 2


def test_delta_lookups_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert delta_lookups.main(["--checkpoints", "500,1000", "--batch", "128", "--json"]) == 0
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    names = {f["figure"] for f in figures}
    assert "plan ns/entry to 1,000, before / now" in names
    assert "rows equal (2,000 sampled, every field)" in names
    assert all(set(f) == {"figure", "value", "target"} for f in figures)


@pytest.mark.parametrize("args", [["--checkpoints", "5,3"], ["--checkpoints", "x"], ["--batch", "0"]])
def test_delta_lookups_rejects_bad_arguments(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        delta_lookups.main(args)
    assert exc.value.code == 2
