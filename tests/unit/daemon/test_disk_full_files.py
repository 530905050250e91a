"""The daemon's own small files (admin token, node id) when the disk is full as they are created:
start-up fails with the disk's error, leaves no file behind that the next start would refuse as
corrupt, and starts normally once space is back."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest

from giaannd.config import load_config
from giaannd.daemon import _load_token, load_or_create_node_id


class _FullDisk(io.FileIO):
    """A file on a disk with no room: every write fails with ENOSPC, as the kernel's does."""

    def write(self, b):  # type: ignore[override]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def full_disk(monkeypatch):
    """Files opened for writing with ``os.fdopen`` (how the daemon writes these) are on a full disk
    until the returned callable is called (space is back)."""
    real = os.fdopen

    def fdopen(fd, mode="r", *args, encoding=None, **kwargs):
        if "w" not in mode:
            return real(fd, mode, *args, encoding=encoding, **kwargs)
        raw = io.BufferedWriter(_FullDisk(fd, "w"))
        return raw if "b" in mode else io.TextIOWrapper(raw, encoding=encoding)

    monkeypatch.setattr(os, "fdopen", fdopen)
    return lambda: monkeypatch.setattr(os, "fdopen", real)


def test_admin_token_created_on_a_full_disk_does_not_stop_the_next_start(tmp_path: Path, full_disk) -> None:
    """The token file was created (O_EXCL) and then its write failed: the empty file it left made
    every later start stop with "empty admin token" (a corrupt file, exit 2) after space was back."""
    cfg = load_config(environ={}, overrides=[f"node.data-dir={tmp_path}"])
    with pytest.raises(OSError) as exc:
        _load_token(cfg)
    assert exc.value.errno == errno.ENOSPC
    full_disk()
    token = _load_token(cfg)
    assert token and (tmp_path / "admin.token").read_text().strip() == token
    assert (tmp_path / "admin.token").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin.token"]


def test_node_id_created_on_a_full_disk_does_not_stop_the_next_start(tmp_path: Path, full_disk) -> None:
    path = tmp_path / "node-id"
    with pytest.raises(OSError) as exc:
        load_or_create_node_id(path)
    assert exc.value.errno == errno.ENOSPC
    full_disk()
    first = load_or_create_node_id(path)
    assert load_or_create_node_id(path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node-id"]
