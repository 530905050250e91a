"""``node.node-id-file`` outside an existing directory: its directory is created as the data
directory is (mode 0750, parents too); a path that cannot be used is one line naming the key and
exit 2, not a traceback and exit 1."""

from __future__ import annotations

import stat
import uuid
from pathlib import Path

import pytest

from giaannd.cli import main
from giaannd.daemon import load_or_create_node_id


def test_node_id_in_a_directory_that_does_not_exist_creates_it(tmp_path: Path) -> None:
    """FileNotFoundError from the temporary file's mkstemp: the daemon stopped with a traceback."""
    path = tmp_path / "state" / "ids" / "node-id"
    first = load_or_create_node_id(path)
    assert path.read_text() == f"{first}\n" and uuid.UUID(path.read_text().strip()) == first
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o027 == 0  # not group-writable, no others
    assert load_or_create_node_id(path) == first


def _run(tmp_path: Path, node_id_file: Path) -> int:
    return main(["run", "--set", f"node.data-dir={tmp_path / 'data'}",
                 "--set", f"node.node-id-file={node_id_file}", "--set", "admin.listen=127.0.0.1:0",
                 "--set", "membership.bind-port=0", "--set", 'transport.bind=["tcp://127.0.0.1:0"]'])


@pytest.mark.parametrize("kind", ["under-a-file", "a-directory"])
def test_cli_node_id_file_that_cannot_be_used_exits_2_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """A path under a regular file (ENOTDIR) or a directory in its place (EISDIR) gave a
    traceback and exit 1, which systemd restarts every few seconds."""
    if kind == "under-a-file":
        (tmp_path / "plain").write_text("x")
        node_id_file = tmp_path / "plain" / "node-id"
    else:
        node_id_file = tmp_path / "node-id"
        node_id_file.mkdir()
    assert _run(tmp_path, node_id_file) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("giaannd: error:")]
    assert len(line) == 1 and "$.node.node-id-file" in line[0] and str(node_id_file) in line[0], err
