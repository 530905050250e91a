"""Config tree: defaults, layering, errors naming the key path, TOML round trip, docs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import msgspec
import pytest

from giaannd.config import Config, load_config, parse_override, to_toml
from giaannd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "giaannd.toml"
    path.write_text(text)
    return path


def test_config_every_field_has_description_and_default() -> None:
    for section in msgspec.structs.fields(Config):
        cls = get_args(section.type)[0]
        for f in msgspec.structs.fields(cls):
            metas = [m for m in getattr(f.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
            assert metas and len(metas[0].description or "") > 20, f"{section.name}.{f.name}"
            assert f.required is False, f"{section.name}.{f.name} has no default"


def test_config_defaults_only() -> None:
    cfg = load_config(environ={})
    assert cfg == Config()
    assert cfg.admin.listen.startswith("127.0.0.1:")  # loopback by default
    assert cfg.storage.write_quorum <= cfg.storage.replication_factor


def test_config_toml_file_is_read(tmp_path: Path) -> None:
    path = _write(tmp_path, '[node]\nroles = ["compute"]\n[storage]\ncapacity-bytes = 1024\n')
    cfg = load_config(path, environ={})
    assert cfg.node.roles == ["compute"]
    assert cfg.storage.capacity_bytes == 1024


@pytest.mark.parametrize(("toml", "path", "fragment"), [
    ("[storage]\ncapacity-bytes = 0\n", "$.storage.capacity-bytes", ">= 1"),
    ("[storage]\ncapacity-bytes = 'big'\n", "$.storage.capacity-bytes", "Expected `int`"),
    ("[storage]\nbogus = 1\n", "$.storage.bogus", "unknown field"),
    ("[nosuch]\nx = 1\n", "$.nosuch", "unknown field"),
    ('[node]\nroles = ["gpu"]\n', "$.node.roles[0]", "Invalid enum value"),
    ("[storage]\nwrite-quorum = 4\n", "$.storage.write-quorum", "exceeds replication-factor"),
    ("[membership]\nbind-port = 70000\n", "$.membership.bind-port", "<= 65535"),
    ('[cluster]\nname = "a b"\n', "$.cluster.name", "matching regex"),
])
def test_config_bad_values_name_the_key(tmp_path: Path, toml: str, path: str,
                                        fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, toml), environ={})
    assert info.value.path == path
    assert path in str(info.value) and fragment in str(info.value)
    assert info.value.exit_code == 2


def test_config_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[node\n"), environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml", environ={})


def test_config_layers_env_over_file_and_set_over_env(tmp_path: Path) -> None:
    path = _write(tmp_path, "[compute]\ntrain-workers = 3\nmax-sessions = 5\n")
    env = {"GIAANND_COMPUTE__TRAIN_WORKERS": "4", "GIAANND_COMPUTE__MAX_SESSIONS": "6",
           "UNRELATED": "x"}
    cfg = load_config(path, environ=env, overrides=["compute.max-sessions=7"])
    assert (cfg.compute.train_workers, cfg.compute.max_sessions) == (4, 7)


def test_config_text_overrides_are_verbatim_and_others_are_toml() -> None:
    cfg = load_config(environ={"GIAANND_NODE__NAME": "123"},
                      overrides=['node.roles=["storage"]', "admin.metrics_require_token=true",
                                 "storage.capacity-bytes=1_000", "logging.level=debug"])
    assert cfg.node.name == "123"
    assert cfg.node.roles == ["storage"]
    assert cfg.admin.metrics_require_token is True
    assert cfg.storage.capacity_bytes == 1000
    assert cfg.logging.level == "debug"


@pytest.mark.parametrize(("override", "path"), [
    ("storage.nope=1", "$.storage.nope"),
    ("nope.x=1", "$.nope"),
    ("storage.capacity-bytes=[", "$.storage.capacity-bytes"),
    ("storage.capacity-bytes=-5", "$.storage.capacity-bytes"),
])
def test_config_bad_overrides_name_the_key(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides=[override])
    assert info.value.path == path


def test_config_malformed_override_and_env_name() -> None:
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(environ={}, overrides=["storage.capacity-bytes"])
    with pytest.raises(ConfigError, match="SECTION__FIELD"):
        load_config(environ={"GIAANND_STORAGE": "1"})
    with pytest.raises(ConfigError, match="section.field"):
        parse_override("capacity", "1")


def test_config_to_toml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(environ={}, overrides=['node.name=x "quoted" \\ name',
                                             'cluster.seeds=["a:1", "b:2"]'])
    assert load_config(_write(tmp_path, to_toml(cfg)), environ={}) == cfg


def test_config_example_file_loads() -> None:
    cfg = load_config(ROOT / "systemd" / "giaannd.toml.example", environ={})
    assert cfg.node.name == "storage-1"
    assert cfg.cluster.seeds


def test_config_docs_are_up_to_date() -> None:
    result = subprocess.run([sys.executable, "-m", "tools.gen_config_docs", "--check"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_config_docs_mention_every_key() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    for section, fields in msgspec.to_builtins(Config()).items():
        for key in fields:
            assert f"`{section}.{key}`" in text


def test_config_capacity_beyond_64_bits_is_refused(tmp_path: Path) -> None:
    """A capacity no 64-bit integer holds was taken, and the daemon died at start with an
    OverflowError traceback and exit 1 (gossiping it in NodeMeta): it is a config error now."""
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "[storage]\ncapacity-bytes = 18446744073709551616\n"), environ={})
    assert info.value.path == "$.storage.capacity-bytes" and info.value.exit_code == 2
    assert load_config(environ={}, overrides=[f"storage.capacity-bytes={2**63 - 1}"]
                       ).storage.capacity_bytes == 2**63 - 1
