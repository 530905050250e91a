"""An export deletes the temporary a crashed export of the same destination left (the export
directory may be chosen by the operator, and shared: only that destination's temporaries, and
only those no live writer holds, are touched). Before, ``.<name>.<8 chars>.tmp`` stayed for ever."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from giaannd.atomic_file import make_temporary, remove_stale_temporaries
from giaannd.compute.cluster_export import export_cluster, write_export
from giaannd.model.export import JsonlWriter
from tests.unit.compute.test_export_disk_full import _vocab_batch


class _Client:
    def __init__(self, batch: Any) -> None:
        self.batch = batch

    async def scan_all(self, page_bytes: int | None = None) -> Any:
        yield self.batch


def _no_vocab(keys: Any) -> Any:
    raise AssertionError("the vocabulary is complete")


@pytest.mark.parametrize("how", ["stream", "one piece"])
def test_export_deletes_the_stale_temporary_of_its_destination(how: str, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    v, batch = _vocab_batch(20)
    for name in (".m.jsonl.abcdefgh.tmp", ".m.jsonl.held0000.tmp", ".other.jsonl.abcdefgh.tmp", "notes.tmp"):
        (tmp_path / name).write_bytes(b"x" * 10)
    fd = os.open(tmp_path / ".m.jsonl.held0000.tmp", os.O_RDONLY)  # another export of it, still writing
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with caplog.at_level(logging.INFO):
            if how == "stream":
                asyncio.run(asyncio.wait_for(export_cluster(_Client(batch), v, _no_vocab, tmp_path / "m.jsonl",
                                                            page_bytes=1 << 20, chunk_entries=7), 60))
            else:
                asyncio.run(asyncio.wait_for(write_export(batch, v, tmp_path / "m.jsonl"), 60))
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".m.jsonl.held0000.tmp", ".other.jsonl.abcdefgh.tmp", "m.jsonl", "notes.tmp"]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 20
    assert f"removed a stale export temporary file={tmp_path / '.m.jsonl.abcdefgh.tmp'} bytes=10" in caplog.text


def test_export_writer_holds_its_temporary_against_a_reclaim(tmp_path: Path) -> None:
    """A second export of the same destination (this node or another sharing the directory)
    must not delete the first one's file while it is written."""
    v, batch = _vocab_batch(20)
    first = JsonlWriter(tmp_path / "m.jsonl")
    first.write(batch, v)
    assert remove_stale_temporaries(tmp_path, of="m.jsonl") == []
    first.commit()
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]


def test_make_temporary_makes_another_when_a_reclaim_took_its_first(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A reclaim may lock and delete a temporary in the instant between its creation and its
    writer's lock: the writer must not write into a file no longer in the directory."""
    made: list[str] = []
    real = tempfile.mkstemp

    def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real(*args, **kwargs)
        made.append(name)
        if len(made) == 1:
            os.unlink(name)  # the reclaim's unlink
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    fd, name = make_temporary(tmp_path / "m.jsonl")
    os.close(fd)
    assert name == made[1] and [p.name for p in tmp_path.iterdir()] == [Path(made[1]).name]
