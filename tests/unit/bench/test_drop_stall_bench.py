"""tools.bench.drop_stall runs small: both variants drop the same rows and end with equal digests,
the "after" one in worker threads, the "before" one on the event loop."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from giaannd.storage.engine.column_store import ColumnStore
from tools.bench import drop_stall
from tools.bench.restart import STORE_DIR, build_store


def test_drop_stall_variants_agree_and_drop_where_they_say(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drop_stall, "TRIGGER_AT_S", 0.02)
    build_store(tmp_path / "cache" / STORE_DIR, 60_000, 0.2)
    where: list[str] = []
    real = ColumnStore.drop_columns

    def noting(self: ColumnStore, columns):  # type: ignore[no-untyped-def]
        where.append(threading.current_thread().name)
        return real(self, columns)

    monkeypatch.setattr(ColumnStore, "drop_columns", noting)
    main = threading.main_thread().name
    before = drop_stall._child(tmp_path / "cache" / STORE_DIR, thread=False)
    assert where == [main]
    where.clear()
    after = drop_stall._child(tmp_path / "cache" / STORE_DIR, thread=True)
    assert where and where[0] != main
    assert before["digest"] == after["digest"] and before["rows_dropped"] == after["rows_dropped"] > 0
    assert before["entries_after"] == after["entries_after"] > 0
    assert not list((tmp_path / "cache").glob("tmp*"))  # the copies are gone
