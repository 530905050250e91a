"""Config values the daemon can only misuse are refused by ``load_config`` (exit 2, one line naming
the key) instead of at start, after the data directory, node id and listeners were made, or never."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest

from giaannd.cli import main
from giaannd.config import Config, load_config, to_toml
from giaannd.errors import ConfigError


def _has_float(tp: Any) -> bool:
    """``float`` itself, or inside ``Annotated`` / a union (the membership knobs are optional)."""
    if tp is float:
        return True
    args = get_args(tp)
    return any(_has_float(a) for a in (args[:1] if hasattr(tp, "__metadata__") else args))


def _float_keys() -> list[str]:
    """``section.key`` of every float-valued key."""
    return [f"{section.encode_name}.{f.encode_name}"
            for section in msgspec.structs.fields(Config)
            for f in msgspec.structs.fields(get_args(section.type)[0]) if _has_float(f.type)]


def test_config_float_keys_are_found() -> None:
    keys = _float_keys()
    assert {"node.drain-timeout-s", "membership.probe-interval-s",
            "storage.snapshot-interval-s"} <= set(keys)


@pytest.mark.parametrize("key", _float_keys())
def test_config_non_finite_floats_are_refused(key: str) -> None:
    """TOML's ``inf`` passed every key bounded only below: ``node.drain-timeout-s = inf`` then
    gave compute and storage no time at all to stop (inf - inf is nan: their graceful stops were
    abandoned at once, storage's final snapshot with them)."""
    for raw in ("inf", "+inf", "-inf", "nan"):
        with pytest.raises(ConfigError) as info:
            load_config(environ={}, overrides=[f"{key}={raw}"])
        section, _, field = key.partition(".")
        assert info.value.path == f"$.{section}.{field}", raw
        assert info.value.exit_code == 2


def test_config_non_finite_float_in_the_file_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "giaannd.toml"
    path.write_text("[node]\ndrain-timeout-s = inf\n")
    with pytest.raises(ConfigError, match="finite") as info:
        load_config(path, environ={})
    assert info.value.path == "$.node.drain-timeout-s"
    assert math.isfinite(load_config(environ={}, overrides=["node.drain-timeout-s=1e9"])
                         .node.drain_timeout_s)


@pytest.mark.parametrize(("override", "path"), [
    ("admin.listen=nonsense", "$.admin.listen"),
    ("admin.listen=127.0.0.1:70000", "$.admin.listen"),
    ("admin.listen=127.0.0.1:", "$.admin.listen"),
    ('cluster.seeds=["nonsense"]', "$.cluster.seeds"),
    ('cluster.seeds=["127.0.0.1:99999"]', "$.cluster.seeds"),
    ('cluster.seeds=[":7946"]', "$.cluster.seeds"),
    ("storage.stream-bind=garbage", "$.storage.stream-bind"),
    ("storage.stream-bind=tcp://127.0.0.1", "$.storage.stream-bind"),
    ("storage.stream-bind=ucx://127.0.0.1:0", "$.storage.stream-bind"),
    ("storage.stream-bind=mem://n", "$.storage.stream-bind"),  # (the node listens on tcp://)
])
def test_config_addresses_that_cannot_be_listened_on_or_dialled_are_refused(
        override: str, path: str) -> None:
    """Each was found at start only: after the node id, lock and admin token were made (a bad
    ``storage.stream-bind`` even after the node had bootstrapped itself into the ring, and with a
    traceback and exit 1)."""
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides=[override])
    assert info.value.path == path
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override", [
    "admin.listen=127.0.0.1:0", "admin.listen=[::1]:7480", "admin.listen=localhost:7480",
    "admin.listen=:7480",
    'cluster.seeds=["a:1", "[::1]:7946", " 10.0.0.1:7946 "]',
    "storage.stream-bind=", "storage.stream-bind=tcp://127.0.0.1:0",
])
def test_config_valid_addresses_are_taken(override: str) -> None:
    load_config(environ={}, overrides=[override])


def test_config_stream_bind_on_a_mem_only_node_is_mem() -> None:
    """An in-process cluster's nodes bind ``mem://`` only; their stream endpoint is mem:// too."""
    load_config(environ={}, overrides=['transport.bind=["mem://a"]', "storage.stream-bind=mem://a-s"])
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides=['transport.bind=["mem://a"]',
                                           "storage.stream-bind=tcp://127.0.0.1:0"])
    assert info.value.path == "$.storage.stream-bind"


def test_cli_bad_address_exits_2_before_touching_the_data_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It made the data directory, lock, node id and admin token first, and logged, before the
    one line."""
    data_dir = tmp_path / "data"
    status = main(["run", "--set", f"node.data-dir={data_dir}", "--set", "admin.listen=nonsense"])
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "$.admin.listen" in err, err
    assert not data_dir.exists()


def test_config_env_names_without_a_section_separator_that_are_not_ours_are_ignored() -> None:
    """``GIAANND_TEST_CORPUS`` (docs/model.md: the oracle tests' corpus) stopped every daemon and
    ``giaannd config show`` started in a shell that set it with exit 2, as a malformed override."""
    assert load_config(environ={"GIAANND_TEST_CORPUS": "/x.conllu.gz"}) == Config()
    for typo in ("GIAANND_STORAGE", "GIAANND_STORAGE_CAPACITY_BYTES", "GIAANND_node_name"):
        with pytest.raises(ConfigError, match="SECTION__FIELD"):
            load_config(environ={typo: "1"})
    with pytest.raises(ConfigError) as info:  # the __ form is ours whatever the section
        load_config(environ={"GIAANND_TEST__CORPUS": "1"})
    assert info.value.path == "$.test"


@pytest.mark.parametrize("raw", ["1\nbogus = 2", "1\n[storage]\nwrite-quorum = 9"])
def test_config_override_value_that_is_more_than_one_toml_value_is_refused(raw: str) -> None:
    """The rest of a multi-line value (an environment variable can hold newlines) was dropped
    without a word: the first line was taken as the value."""
    with pytest.raises(ConfigError) as info:
        load_config(environ={"GIAANND_STORAGE__REPLICATION_FACTOR": raw})
    assert info.value.path == "$.storage.replication-factor"
    assert load_config(environ={}, overrides=["storage.write-quorum=1 # a comment"]
                       ).storage.write_quorum == 1


def test_config_show_output_with_a_delete_character_reads_back(tmp_path: Path) -> None:
    """``to_toml`` wrote U+007F raw (JSON leaves it unescaped; TOML forbids it in a string), so
    ``giaannd config show`` printed a file ``--config`` refused as not TOML."""
    cfg = load_config(environ={}, overrides=["node.name=a\x7fb", "cluster.key-file=/k\x7f"])
    path = tmp_path / "shown.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path, environ={}) == cfg


@pytest.mark.parametrize(("toml", "env", "override"), [
    ('[node]\n"a\\nb" = 1\n', None, None),
    ('["no\\u001b[2Jde"]\nx = 1\n', None, None),
    (None, {"GIAANND_STORAGE__A\nB": "1"}, None),
    (None, None, "sto\nrage.x=1"),
    (None, None, "storage.a\rb=1"),
])
def test_config_unknown_key_with_control_characters_is_one_printable_line(
        tmp_path: Path, toml: str | None, env: dict[str, str] | None, override: str | None) -> None:
    """An unknown key was echoed raw into the message and its path: a quoted TOML key (or an
    environment variable's name) with a newline made the one error line two, and an escape
    sequence reached the terminal or journal as is."""
    path = None
    if toml is not None:
        path = tmp_path / "giaannd.toml"
        path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=env or {}, overrides=[override] if override else [])
    assert str(info.value).isprintable(), str(info.value)
    assert info.value.path is not None and info.value.path.isprintable()


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]"])
def test_config_membership_wildcard_bind_needs_an_advertise_address(wildcard: str) -> None:
    """A node bound to a wildcard without ``advertise-address`` gossiped ``0.0.0.0:PORT`` as its
    address (``membership started addr=0.0.0.0:...``): no member on another host can probe it
    there. The data plane refuses the same (``transport.advertise``), and the shipped example
    config did it."""
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides=[f"membership.bind-address={wildcard}"])
    assert info.value.path == "$.membership.advertise-address"
    cfg = load_config(environ={}, overrides=[f"membership.bind-address={wildcard}",
                                             "membership.advertise-address=10.0.0.10"])
    assert cfg.membership.advertise_address == "10.0.0.10"


def test_config_unknown_key_with_a_backtick_is_named_whole(tmp_path: Path) -> None:
    """The key was cut at its first backtick: ``"a`b"`` was reported as ``$.node.a``."""
    path = tmp_path / "giaannd.toml"
    path.write_text('[node]\n"a`b" = 1\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert info.value.path == "$.node.a`b"


@pytest.mark.parametrize(("overrides", "path"), [
    (["admin.listen=127.0.0.1:17480", 'transport.bind=["tcp://127.0.0.1:17480"]'],
     "$.transport.bind"),
    (["admin.listen=127.0.0.1:17481", "membership.bind-port=17481"], "$.membership.bind-port"),
    (['transport.bind=["tcp://10.0.0.5:7470"]', "membership.bind-address=0.0.0.0",
      "membership.advertise-address=10.0.0.5", "membership.bind-port=7470"],
     "$.transport.bind"),
    (['transport.bind=["tcp://127.0.0.1:7470", "ucx://127.0.0.1:7470"]'], "$.transport.bind"),
    (["storage.stream-bind=tcp://127.0.0.1:7480"], "$.storage.stream-bind"),  # admin's default
])
def test_config_listeners_sharing_a_port_are_refused(overrides: list[str], path: str) -> None:
    """Found at start only, by the second bind's EADDRINUSE: after the node id, lock and admin
    token were made, and for membership in a line that named no key."""
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides=overrides)
    assert info.value.path == path


@pytest.mark.parametrize("overrides", [
    ["admin.listen=127.0.0.1:0", 'transport.bind=["tcp://127.0.0.1:0"]', "membership.bind-port=0"],
    ["admin.listen=127.0.0.1:7470", 'transport.bind=["tcp://10.0.0.5:7470"]'],
    ["admin.listen=[::1]:7470", 'transport.bind=["tcp://127.0.0.1:7470"]'],
])
def test_config_listeners_on_other_addresses_or_port_0_may_share_a_number(
        overrides: list[str]) -> None:
    load_config(environ={}, overrides=overrides)
