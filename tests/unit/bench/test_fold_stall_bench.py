"""tools.bench.fold_stall runs small, its variants keep the rows bit for bit equal, and the fold
runs where each variant says (inline in the commit, or in a worker thread)."""

from __future__ import annotations

import threading

import pytest

from tools.bench import fold_stall


def test_fold_stall_children_agree_and_fold_where_they_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fold_stall, "PHASE_S", 0.6)
    monkeypatch.setattr(fold_stall, "TRIGGER_AT_S", 0.1)
    monkeypatch.setattr(fold_stall, "DRAIN_S", 0.1)
    where: list[str] = []
    from giaannd.rowengine.engine import RowEngine

    compact = RowEngine.compact

    def noting(self: RowEngine) -> None:
        where.append(threading.current_thread().name)
        compact(self)

    monkeypatch.setattr(RowEngine, "compact", noting)
    main = threading.main_thread().name
    inline = fold_stall._child(200_000, 0, inline=True)
    assert where and where[0] == main  # the phase's fold, in the commit (a final fold may follow)
    where.clear()
    thread = fold_stall._child(200_000, 0)
    assert where and where[0] != main
    assert inline["digest"] == thread["digest"] and inline["entries"] == thread["entries"] > 200_000
    assert inline["requests"] > 0 and thread["requests"] > 0
    assert inline["fold_cpu_s"] > 0 and thread["fold_cpu_s"] > 0


def test_fold_stall_background_fold_ends_cleanly(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The background variant's folds end without an error (a fold task that failed is only logged)."""
    monkeypatch.setattr(fold_stall, "PHASE_S", 0.6)
    monkeypatch.setattr(fold_stall, "TRIGGER_AT_S", 0.1)
    monkeypatch.setattr(fold_stall, "DRAIN_S", 0.1)
    with caplog.at_level("ERROR"):
        fold_stall._child(200_000, 0)
    assert not [r for r in caplog.records if "fold" in r.getMessage()]
