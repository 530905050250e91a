"""Node identity file: created once, stable, corrupt files are refused and left untouched; the admin
token file's errors."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from giaannd.config import load_config
from giaannd.daemon import _load_token, load_or_create_node_id
from giaannd.errors import ConfigError, CorruptFileError


def test_node_id_created_then_stable(tmp_path: Path) -> None:
    path = tmp_path / "node-id"
    first = load_or_create_node_id(path)
    assert path.read_text() == f"{first}\n"
    assert load_or_create_node_id(path) == first
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("content", [b"not-a-uuid\n", b"", b"\xff\xfe"])
def test_node_id_corrupt_file_is_refused_and_kept(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "node-id"
    path.write_bytes(content)
    with pytest.raises(CorruptFileError, match="node-id is corrupt"):
        load_or_create_node_id(path)
    assert path.read_bytes() == content


def test_node_id_accepts_existing_uuid(tmp_path: Path) -> None:
    known = uuid.uuid4()
    (tmp_path / "id").write_text(str(known))
    assert load_or_create_node_id(tmp_path / "id") == known


def test_admin_token_file_not_utf8_is_one_clear_error(tmp_path: Path) -> None:
    """A token file of non-UTF-8 bytes stopped the daemon with a UnicodeDecodeError traceback and
    exit 1: the configured file is a config error, ``<data-dir>/admin.token`` a corrupt file (both
    exit 2), and neither is touched."""
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfesecret\n")
    cfg = load_config(environ={}, overrides=[f"node.data-dir={tmp_path}", f"admin.token-file={token}"])
    with pytest.raises(ConfigError) as info:
        _load_token(cfg)
    assert info.value.path == "$.admin.token-file" and str(token) in str(info.value)
    assert "UTF-8" in str(info.value) and info.value.exit_code == 2
    (tmp_path / "admin.token").write_bytes(b"\xff\xfesecret\n")
    with pytest.raises(CorruptFileError, match="admin.token is corrupt") as corrupt:
        _load_token(load_config(environ={}, overrides=[f"node.data-dir={tmp_path}"]))
    assert corrupt.value.exit_code == 2
    assert token.read_bytes() == (tmp_path / "admin.token").read_bytes() == b"\xff\xfesecret\n"
