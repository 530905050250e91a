"""A token file named with ``~`` (``Client(token_file=...)``, ``GIAANNCTL_TOKEN_FILE``,
``giaannctl --token-file``) is the home directory's, as the daemon reads ``admin.token-file``: the
expansion is made once, in giaannd/sdk/locate.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.admin import ctl
from giaannd.sdk.client import Client
from giaannd.sdk.locate import locate
from tests.unit.sdk.fake_api import serving


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME pointed at an empty directory (os.path.expanduser reads it first on POSIX)."""
    directory = tmp_path / "home"
    directory.mkdir()
    monkeypatch.setenv("HOME", str(directory))
    return directory


def test_locate_token_file_expands_home_from_argument_and_environment(home: Path) -> None:
    given = locate(addr="127.0.0.1:9", token_file="~/admin.token", data_dir=None, environ={})
    assert given.token_file == home / "admin.token"
    env = {"GIAANNCTL_TOKEN_FILE": "~/admin.token"}
    from_env = locate(addr="127.0.0.1:9", token_file=None, data_dir=None, environ=env)
    assert from_env.token_file == home / "admin.token"


def test_locate_data_dir_expands_home(home: Path) -> None:
    (home / "n1").mkdir()
    (home / "n1" / "admin.addr").write_text("127.0.0.1:9\n")
    found = locate(addr=None, token_file=None, data_dir="~/n1", environ={})
    assert found.token_file == home / "n1" / "admin.token"


def test_client_token_file_with_home_sends_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/status", {"node_name": "n1", "state": "running"})
        monkeypatch.setenv("HOME", str(data_dir))  # data_dir/admin.token holds the fake's token
        addr = (data_dir / "admin.addr").read_text().strip()
        client = Client(addr, "~/admin.token")
        assert client.token_problem is None
        assert client.status()["node_name"] == "n1"
        env = {"GIAANNCTL_ADDR": addr, "GIAANNCTL_TOKEN_FILE": "~/admin.token"}
        assert Client(environ=env).status()["node_name"] == "n1"


def test_ctl_token_file_with_home_from_flag_and_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """giaannctl reaches the same expansion through Client (ctl.py keeps no copy of it)."""
    for name in ("GIAANNCTL_ADDR", "GIAANNCTL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with serving(tmp_path) as (api, data_dir):
        api.on("GET", "/v1/status", {"node_name": "n1", "state": "running"})
        monkeypatch.setenv("HOME", str(data_dir))
        addr = (data_dir / "admin.addr").read_text().strip()
        assert ctl.main(["--addr", addr, "--token-file", "~/admin.token", "--json", "node", "status"]) == 0
        monkeypatch.setenv("GIAANNCTL_TOKEN_FILE", "~/admin.token")
        assert ctl.main(["--addr", addr, "--json", "node", "status"]) == 0
        assert capsys.readouterr().out.count('"n1"') == 2
