"""Node identity file: created once, stable, corrupt files are refused and left untouched."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from giaannd.daemon import load_or_create_node_id
from giaannd.errors import CorruptFileError


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
