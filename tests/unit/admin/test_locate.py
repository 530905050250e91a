"""Which node giaannctl talks to (giaannd/sdk/locate.py): flags, environment, --data-dir, then a
bare giaannctl finds the host's only systemd instance under STATE_ROOT (issue 18.4)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from giaannd.sdk import locate as locate_mod
from giaannd.sdk.errors import ClientError
from giaannd.sdk.locate import DEFAULT_ADDR, Target, find_instances, locate


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """STATE_ROOT pointed at an empty directory (what /var/lib/giaannd is to the unit)."""
    state = tmp_path / "var-lib-giaannd"
    state.mkdir()
    monkeypatch.setattr(locate_mod, "STATE_ROOT", state)
    return state


def _instance(root: Path, name: str, port: int, running: bool = True) -> Path:
    data = root / name
    data.mkdir(mode=0o750)
    (data / "admin.token").write_text(f"token-{name}\n")
    if running:
        (data / "admin.addr").write_text(f"http://127.0.0.1:{port}\n")
    return data


def _bare(env: dict[str, str] | None = None) -> Target:
    return locate(addr=None, token_file=None, data_dir=None, environ=env or {})


def test_locate_bare_finds_the_only_running_instance(root: Path) -> None:
    main = _instance(root, "main", 7481)
    _instance(root, "old", 7482, running=False)  # stopped: its admin.addr was removed on exit
    (root / "stray-file").write_text("x")
    assert _bare() == Target("http://127.0.0.1:7481", main / "admin.token", locate_mod._TOKEN_HINT)
    assert find_instances(root) == [main]


def test_locate_bare_refuses_to_guess_between_instances(root: Path) -> None:
    _instance(root, "storage", 7481)
    _instance(root, "compute", 7482)
    with pytest.raises(ClientError) as info:
        _bare()
    assert info.value.exit_code == 2
    assert str(info.value) == (f"2 giaannd instances run here (compute, storage): choose one with --data-dir "
                               f"{root}/INSTANCE, e.g. --data-dir {root}/compute")


def test_locate_anything_given_skips_the_search(root: Path) -> None:
    _instance(root, "storage", 7481)
    _instance(root, "compute", 7482)
    assert _bare({"GIAANNCTL_ADDR": "127.0.0.1:9"}).addr == "http://127.0.0.1:9"
    assert _bare({"GIAANNCTL_TOKEN_FILE": "/t"}) == Target(DEFAULT_ADDR, Path("/t"), locate_mod._TOKEN_HINT)
    target = locate(addr=None, token_file=None, data_dir=str(root / "compute"), environ={})
    assert target == Target("http://127.0.0.1:7482", root / "compute" / "admin.token", locate_mod._TOKEN_HINT)
    target = locate(addr="h:1", token_file="/tok", data_dir=str(root / "compute"), environ={"GIAANNCTL_ADDR": "x:2"})
    assert (target.addr, target.token_file) == ("http://h:1", Path("/tok"))  # flags beat env and --data-dir


def test_locate_default_data_dir_comes_first(root: Path) -> None:
    """A daemon run with the default node.data-dir keeps its files in STATE_ROOT itself."""
    _instance(root, "main", 7481)
    (root / "admin.token").write_text("t\n")
    assert _bare() == Target(DEFAULT_ADDR, root / "admin.token", locate_mod._TOKEN_HINT)
    (root / "admin.addr").write_text("http://127.0.0.1:7490\n")
    assert _bare().addr == "http://127.0.0.1:7490"


def test_locate_nothing_found_says_where_it_looked(root: Path) -> None:
    target = _bare()
    assert (target.addr, target.token_file) == (DEFAULT_ADDR, root / "admin.token")
    assert f"no running giaannd found in {root} or {root}/*" in target.hint
    os.rmdir(root)  # not a systemd host at all
    assert _bare().addr == DEFAULT_ADDR


def test_locate_explicit_data_dir_without_a_running_daemon(root: Path) -> None:
    stopped = _instance(root, "main", 7481, running=False)
    with pytest.raises(ClientError,
                       match=r"cannot read .*/main/admin.addr: No such file .*is the daemon running") as info:
        locate(addr=None, token_file=None, data_dir=str(stopped), environ={})
    assert info.value.exit_code == 1


def test_locate_bad_address_file_is_a_usage_error(root: Path) -> None:
    (_instance(root, "main", 7481) / "admin.addr").write_text("not an address\n")
    with pytest.raises(ClientError, match=r"/main/admin.addr: 'not an address' is not an admin API address") as info:
        _bare()
    assert info.value.exit_code == 2


def test_locate_unreadable_instances_are_reported(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit's directories are the giaannd user's (0750): another user cannot tell whether one
    runs, so "exactly one" cannot be decided. (EACCES is simulated: these tests may run as root.)"""
    _instance(root, "compute", 7481)
    locked = _instance(root, "main", 7482)
    real_stat = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(f"{locked}/"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(ClientError, match=r"cannot search .*/\{main\} for a running giaannd: permission denied "
                                       r"\(run giaannctl as root or as the giaannd user") as info:
        _bare()
    assert info.value.exit_code == 2
