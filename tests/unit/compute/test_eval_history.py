"""The evaluation history store (giaannd/compute/state.py EvalHistory): bound, persistence, corrupt file."""

from __future__ import annotations

import json
import logging

from giaannd.compute.state import EVAL_HISTORY_FILE, EvalHistory, EvalRecord


def record(i: int) -> EvalRecord:
    return EvalRecord(at=1000.0 + i, top1=i / 100, matches=i, prediction_tokens=100, prompts=10,
                      constants="train", mode="teacher", trained=10 * i, source="heldout")


def test_eval_history_keeps_the_newest_entries_oldest_first() -> None:
    h = EvalHistory(3)
    for i in range(5):
        h.add(record(i))
    assert [e["trained"] for e in h.as_dict()["evals"]] == [20, 30, 40]
    assert set(h.as_dict()["evals"][0]) == {"at", "top1", "matches", "prediction_tokens", "prompts", "constants",
                                            "mode", "trained", "source"}


def test_eval_history_persists_and_reload_trims_to_a_smaller_bound(tmp_path) -> None:
    h = EvalHistory(10)
    for i in range(4):
        h.add(record(i))
    path = h.save(tmp_path)
    assert path == tmp_path / EVAL_HISTORY_FILE
    assert EvalHistory.load(tmp_path, 10).entries == h.entries
    assert [e.matches for e in EvalHistory.load(tmp_path, 2).entries] == [2, 3]
    assert EvalHistory.load(tmp_path / "absent", 10).entries == []


def test_eval_history_disabled_keeps_and_writes_nothing(tmp_path) -> None:
    h = EvalHistory(0)
    h.add(record(1))
    assert h.entries == [] and h.save(tmp_path) is None
    assert not (tmp_path / EVAL_HISTORY_FILE).exists()


def test_eval_history_corrupt_file_starts_empty_and_is_kept_aside(tmp_path, caplog) -> None:
    for garbage in (b"{not json", json.dumps({"version": 1, "evals": [{"at": "x"}]}).encode(),
                    json.dumps({"version": 99, "evals": []}).encode()):
        (tmp_path / EVAL_HISTORY_FILE).write_bytes(garbage)
        with caplog.at_level(logging.WARNING):
            h = EvalHistory.load(tmp_path, 10)
        assert h.entries == []
        assert (tmp_path / (EVAL_HISTORY_FILE + ".corrupt")).read_bytes() == garbage
        assert not (tmp_path / EVAL_HISTORY_FILE).exists()
        assert "evaluation history unreadable" in caplog.text
    h.add(record(7))  # and it goes on: the next save writes a fresh file
    h.save(tmp_path)
    assert [e.matches for e in EvalHistory.load(tmp_path, 10).entries] == [7]
