"""A start deletes the temporaries of whole-file writes (giaannd/atomic_file.py) that a crash left
in the data directory, at any depth, and nothing else: before, only snapshot, register-compaction
and vocab-rewrite temporaries were deleted, and ``.node-id.<8 chars>.tmp`` and the like (the
admin address, the ring, the membership incarnation, compute state, job journals, exports in the
default ``<data-dir>/exports``) stayed for ever."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from giaannd.atomic_file import atomic_writer, remove_stale_temporaries
from giaannd.config import Config
from giaannd.daemon import Daemon

STALE = [".node-id.k3j4h5g6.tmp", "compute/jobs/.0123456789abcdef.journal.ab_12cd3.tmp",
         "exports/.model.jsonl.zzzzzzzz.tmp", "storage/.ring.json.00000000.tmp"]
#: names that only look like one of ours, and files that are not temporaries
KEPT = ["node-id", "notes.tmp", ".node-id.tmp", ".x.ABCDEFGH.tmp", ".x.abcdefg.tmp", ".x.abcdefghi.tmp",
        "x.abcdefgh.tmp", ".x.abcdefgh.tmp.old", "storage/.snapshot-00000000000000000012.snap"]


@contextmanager
def _held(path: Path) -> Iterator[None]:
    """A writer still writing ``path``: its temporary is open and locked (atomic_file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def _tree(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * 10)


def test_daemon_start_deletes_stale_whole_file_temporaries_in_the_data_dir(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    _tree(data, STALE + KEPT)
    (data / ".dir.abcdefgh.tmp").mkdir()  # a directory is never ours
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (data / ".link.abcdefgh.tmp").symlink_to(outside)  # nor is a link (nor what it points at)
    daemon = Daemon(Config.loopback(str(data)), handle_signals=False)
    with caplog.at_level(logging.INFO, logger="giaannd.daemon"):
        daemon._take_lock(data)
    daemon._release_lock()
    left = {str(p.relative_to(data)) for p in data.rglob("*")}
    assert not left & set(STALE), left
    assert set(KEPT) | {".dir.abcdefgh.tmp", ".link.abcdefgh.tmp"} <= left
    assert outside.read_text() == "keep"
    for name in STALE:
        assert f"removed a stale temporary file={data / name} bytes=10" in caplog.text


def test_remove_stale_temporaries_keeps_one_a_writer_holds(tmp_path: Path) -> None:
    """Another process (or a still-running export) writing that file holds its lock."""
    _tree(tmp_path, [".a.abcdefgh.tmp", ".a.ijklmnop.tmp"])
    with _held(tmp_path / ".a.abcdefgh.tmp"):
        assert remove_stale_temporaries(tmp_path) == [(tmp_path / ".a.ijklmnop.tmp", 10)]
    assert [p.name for p in tmp_path.iterdir()] == [".a.abcdefgh.tmp"]


def test_atomic_writer_holds_its_temporary_against_a_reclaim(tmp_path: Path) -> None:
    with atomic_writer(tmp_path / "f") as fh:
        fh.write(b"data")
        assert remove_stale_temporaries(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["f"] and (tmp_path / "f").read_bytes() == b"data"


def test_remove_stale_temporaries_of_one_destination_only(tmp_path: Path) -> None:
    _tree(tmp_path, [".m.jsonl.abcdefgh.tmp", ".other.jsonl.abcdefgh.tmp", "sub/.m.jsonl.abcdefgh.tmp"])
    assert remove_stale_temporaries(tmp_path, of="m.jsonl") == [(tmp_path / ".m.jsonl.abcdefgh.tmp", 10)]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.tmp")) == [
        ".other.jsonl.abcdefgh.tmp", "sub/.m.jsonl.abcdefgh.tmp"]
