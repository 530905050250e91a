"""A ``cluster.key-file`` in a Config built in code (``Config.loopback`` and a replace, as
tools/cluster_harness and embedders build theirs) is read as the key's documentation says and as
the daemon reads ``node-id-file`` and ``admin.token-file`` (``Config.data_path``): relative to
``data-dir`` unless absolute. The runtime read it from the working directory, so only
``load_config`` (which makes it absolute) gave the documented file."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from giaannd.config import ClusterConfig, Config, load_config
from giaannd.runtime.node import NodeRuntime
from peers.keyring import Keyring


def _config(data: Path, key_file: str) -> Config:
    base = Config.loopback(str(data), name="n1")
    return msgspec.structs.replace(base, cluster=ClusterConfig(key_file=key_file))


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data directory holding ``cluster.key``; the working directory holds another one."""
    data = tmp_path / "data"
    data.mkdir()
    Keyring.generate().save(data / "cluster.key")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    Keyring.generate().save(cwd / "cluster.key")
    monkeypatch.chdir(cwd)
    return data


def test_runtime_relative_key_file_is_read_from_the_data_dir(data: Path) -> None:
    runtime = NodeRuntime(_config(data, "cluster.key"))
    assert runtime.keyring_path == str(data / "cluster.key")
    assert runtime._load_keyring().keys == Keyring.load(data / "cluster.key").keys


def test_runtime_key_file_from_load_config_is_unchanged(data: Path) -> None:
    """``load_config`` made it absolute already: the runtime reads that file, as before."""
    cfg = load_config(environ={}, overrides=[f"node.data-dir={data}", "cluster.key-file=cluster.key"])
    assert NodeRuntime(cfg).keyring_path == cfg.cluster.key_file == str(data / "cluster.key")
    absolute = data.parent / "cwd" / "cluster.key"
    assert NodeRuntime(_config(data, str(absolute))).keyring_path == str(absolute)
    assert NodeRuntime(_config(data, "")).keyring_path is None  # no key file: the derived key
