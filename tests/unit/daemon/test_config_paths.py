"""Path-valued keys follow one rule, applied once by ``load_config``: ``~`` is expanded; a relative
``node.data-dir`` is taken from the directory of the config file that set it (environment and
``--set``: the working directory); every other path key is relative to ``data-dir`` unless
absolute. Before, ``~`` was a directory named ``~``, and a relative ``data-dir``,
``admin.token-file`` or ``cluster.key-file`` was read from whatever directory the process was
started in (``/`` under systemd), so the daemon and giaannctl could read different files."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.admin import ctl
from giaannd.config import Config, load_config, to_toml
from giaannd.daemon import _load_token

#: Every path-valued key (``section.key``); data-dir first.
PATH_KEYS = ["node.data-dir", "node.node-id-file", "cluster.key-file", "admin.token-file",
             "compute.lexicon", "compute.corpus-dir", "compute.export-dir"]


def _get(cfg: Config, key: str) -> str:
    section, _, field = key.partition(".")
    value = getattr(getattr(cfg, section), field.replace("-", "_"))
    assert isinstance(value, str)
    return value


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative paths must not depend on it
    return home


@pytest.mark.parametrize("key", PATH_KEYS)
def test_config_path_keys_expand_the_home_directory(home: Path, tmp_path: Path, key: str) -> None:
    cfg = load_config(environ={}, overrides=[f"{key}=~/giaannd/x"])
    assert _get(cfg, key) == str(home / "giaannd" / "x")
    path = tmp_path / "giaannd.toml"
    section, _, field = key.partition(".")
    path.write_text(f'[{section}]\n{field} = "~/y"\n')
    assert _get(load_config(path, environ={}), key) == str(home / "y")
    env = {f"GIAANND_{section.upper()}__{field.upper().replace('-', '_')}": "~/z"}
    assert _get(load_config(environ=env), key) == str(home / "z")


def test_config_relative_data_dir_is_taken_from_the_config_files_directory(
        home: Path, tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    path = etc / "giaannd.toml"
    path.write_text('[node]\ndata-dir = "state"\n')
    assert load_config(path, environ={}).node.data_dir == str(etc / "state")
    # from --set or the environment: the working directory, made absolute once
    assert load_config(path, environ={}, overrides=["node.data-dir=other"]).node.data_dir == \
        str(Path.cwd() / "other")
    assert load_config(environ={"GIAANND_NODE__DATA_DIR": "env"}).node.data_dir == str(Path.cwd() / "env")


@pytest.mark.parametrize("key", PATH_KEYS[1:])
def test_config_relative_path_keys_are_inside_the_data_dir(home: Path, tmp_path: Path, key: str) -> None:
    """As ``node-id-file``, ``lexicon``, ``corpus-dir`` and ``export-dir`` were documented to be;
    ``token-file`` and ``key-file`` were read from the working directory."""
    data = tmp_path / "data"
    path = tmp_path / "giaannd.toml"
    section, _, field = key.partition(".")
    other = "" if section == "node" else f"[{section}]\n"
    path.write_text(f'[node]\ndata-dir = "data"\n{other}{field} = "sub/f"\n')
    cfg = load_config(path, environ={})
    assert _get(cfg, key) == str(data / "sub" / "f")
    assert str(cfg.data_path(_get(cfg, key))) == str(data / "sub" / "f")
    # data-dir from a later layer moves them with it
    cfg = load_config(path, environ={}, overrides=[f"node.data-dir={tmp_path / 'moved'}"])
    assert _get(cfg, key) == str(tmp_path / "moved" / "sub" / "f")


def test_config_path_defaults_stay_as_they_are() -> None:
    """Empty means "the default file in data-dir" or "none", and node-id-file's relative default
    must follow a data-dir given later: ``config show`` output reused under another data-dir
    (systemd's ``--set node.data-dir=/var/lib/giaannd/%i``) must not point every instance at one
    node-id."""
    cfg = load_config(environ={})
    assert cfg == Config() and cfg.node.node_id_file == "node-id" and cfg.admin.token_file == ""


def test_config_paths_read_back_from_config_show(home: Path, tmp_path: Path) -> None:
    cfg = load_config(environ={}, overrides=["node.data-dir=rel", "admin.token-file=~/t",
                                             "cluster.key-file=k"])
    path = tmp_path / "shown.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path, environ={}) == cfg


def test_daemon_relative_token_file_is_read_from_the_data_dir(home: Path, tmp_path: Path) -> None:
    """The daemon read ``token-file = "admin.secret"`` from its working directory: here a
    different file holding another token."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "admin.secret").write_text("right\n")
    (Path.cwd() / "admin.secret").write_text("wrong\n")
    cfg = load_config(environ={}, overrides=[f"node.data-dir={data}", "admin.token-file=admin.secret"])
    assert _load_token(cfg) == "right"


@pytest.mark.parametrize("how", ["flag", "flag=", "env"])
def test_ctl_token_file_expands_the_home_directory(
        home: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``--token-file=~/t`` (the shell expands no ``~`` after ``=``) and a quoted
    ``GIAANNCTL_TOKEN_FILE="~/t"`` were read as a directory named ``~``."""
    (home / "t").write_text("secret\n")
    monkeypatch.delenv("GIAANNCTL_TOKEN_FILE", raising=False)
    argv = ["--addr", "http://127.0.0.1:1"]
    if how == "flag":
        argv += ["--token-file", "~/t"]
    elif how == "flag=":
        argv += ["--token-file=~/t"]
    else:
        monkeypatch.setenv("GIAANNCTL_TOKEN_FILE", "~/t")
    args = ctl.build_parser().parse_args([*argv, "keys", "list"])
    client = ctl._client(args, args.op)
    assert client.token_problem is None


def test_config_path_keys_list_every_file_and_directory_key() -> None:
    """A new ``*-file`` / ``*-dir`` key must join the rule (``config._DATA_DIR_PATHS``)."""
    import msgspec

    from giaannd import config

    named = {f"{section.encode_name}.{f.encode_name}"
             for section in msgspec.structs.fields(Config)
             for f in msgspec.structs.fields(getattr(Config(), section.name))
             if f.encode_name.endswith(("-file", "-dir"))}
    assert named <= set(PATH_KEYS)
    assert {f"{s}.{f.replace('_', '-')}" for s, f in config._DATA_DIR_PATHS} == set(PATH_KEYS[1:])
