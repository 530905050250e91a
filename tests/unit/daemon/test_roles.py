"""Role service discovery, listen-address parsing, the loopback profile and CLI role flags."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from giaannd import cli, daemon
from giaannd.config import Config, load_config, split_listen
from giaannd.errors import ConfigError


@pytest.fixture
def fake_roles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fakeroles"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(
        "class S:\n"
        "    def __init__(self, config):\n"
        "        self.name = 'storage'\n"
        "        self.config = config\n"
        "def create_service(config):\n"
        "    return S(config)\n")
    (pkg / "noattr.py").write_text("x = 1\n")
    (pkg / "brokendep.py").write_text("import fakeroles_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return pkg


def _roles(monkeypatch: pytest.MonkeyPatch, storage: str, compute: str) -> None:
    monkeypatch.setattr(daemon, "ROLE_FACTORIES", {"storage": storage, "compute": compute})


def test_roles_built_or_reported_unavailable(fake_roles: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _roles(monkeypatch, "fakeroles.good:create_service", "fakeroles.absent:create_service")
    cfg = Config()
    services, unavailable = daemon.build_role_services(cfg)
    assert [s.name for s in services] == ["storage"]
    assert services[0].config is cfg  # type: ignore[attr-defined]
    assert "fakeroles.absent is absent" in unavailable["compute"]


@pytest.mark.parametrize("roles", [["storage", "compute"], ["compute", "storage"]])
def test_roles_are_built_storage_first_however_they_are_listed(
        fake_roles: Path, monkeypatch: pytest.MonkeyPatch, roles: list[str]) -> None:
    """Services start in order and stop in reverse: compute must stop before storage (its jobs
    drain their writes into it). ``--role both`` listed the roles sorted, compute first, so storage
    stopped first and the draining jobs' writes failed."""
    (fake_roles / "named.py").write_text(
        "class S:\n"
        "    def __init__(self, name):\n"
        "        self.name = name\n"
        "def storage(config):\n"
        "    return S('storage')\n"
        "def compute(config):\n"
        "    return S('compute')\n")
    for name in [m for m in sys.modules if m == "fakeroles" or m.startswith("fakeroles.")]:
        monkeypatch.delitem(sys.modules, name)  # (an earlier test's fakeroles, from another directory)
    importlib.invalidate_caches()  # (the package's directory listing is cached since the fixture)
    _roles(monkeypatch, "fakeroles.named:storage", "fakeroles.named:compute")
    cfg = load_config(environ={}, overrides=["node.roles=" + msgspec.json.encode(roles).decode()])
    services, _ = daemon.build_role_services(cfg)
    assert [s.name for s in services] == ["storage", "compute"]


def test_roles_missing_factory_is_reported(fake_roles: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _roles(monkeypatch, "fakeroles.noattr:create_service", "fakeroles.good:create_service")
    services, unavailable = daemon.build_role_services(load_config(
        environ={}, overrides=['node.roles=["storage"]']))
    assert services == [] and unavailable == {"storage": "fakeroles.noattr has no create_service()"}


def test_roles_broken_dependency_is_an_error_not_unavailable(
        fake_roles: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _roles(monkeypatch, "fakeroles.brokendep:create_service", "fakeroles.good:create_service")
    with pytest.raises(ModuleNotFoundError, match="fakeroles_missing_dependency"):
        daemon.build_role_services(Config())


@pytest.mark.parametrize(("listen", "expected"), [
    ("127.0.0.1:7480", ("127.0.0.1", 7480)),
    ("[::1]:0", ("::1", 0)),
    (":9000", ("127.0.0.1", 9000)),
])
def test_split_listen(listen: str, expected: tuple[str, int]) -> None:
    assert split_listen(listen) == expected


# "h:\u0663": a non-ASCII digit, which int() reads as 3
@pytest.mark.parametrize("listen", ["localhost", "host:port", "h:70000", "h:\u0663"])
def test_split_listen_rejects(listen: str) -> None:
    with pytest.raises(ConfigError) as info:
        split_listen(listen)
    assert info.value.path == "$.admin.listen"


def test_loopback_profile_is_valid_and_local() -> None:
    cfg = Config.loopback("/tmp/x", name="n1", roles=["compute"])
    assert cfg.admin.listen == "127.0.0.1:0" and cfg.membership.profile == "loopback"
    assert cfg.node.roles == ["compute"]
    assert cfg.storage.write_quorum <= cfg.storage.replication_factor


@pytest.mark.parametrize(("flags", "roles"), [
    ([], ["storage", "compute"]),
    (["--role", "storage"], ["storage"]),
    (["--role", "compute", "--role", "storage"], ["compute", "storage"]),
    (["--role", "both"], ["compute", "storage"]),
])
def test_cli_role_flags(flags: list[str], roles: list[str], monkeypatch: pytest.MonkeyPatch
                        ) -> None:
    for name in [k for k in __import__("os").environ if k.startswith("GIAANND_")]:
        monkeypatch.delenv(name)
    args = cli._parser().parse_args(flags)
    assert cli._load(args).node.roles == roles


def test_cli_usage_error_exits_2() -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--role", "gpu"])
    assert info.value.code == 2


def test_cli_loop_factory_prefers_uvloop_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import sys

    uvloop = pytest.importorskip("uvloop")
    assert cli.loop_factory() is uvloop.new_event_loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import now raises ImportError
    assert cli.loop_factory() is asyncio.new_event_loop


def test_storage_role_module_imports_no_compute_module() -> None:
    """A storage-only daemon imports the role adapters (``giaannd.services.roles``) but none of the
    compute role's modules: they are imported by the compute factory (start-up time)."""
    code = ("import sys, giaannd.services.roles\n"
            "print(sorted(m for m in sys.modules if m.startswith('giaannd.compute')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "[]"


def test_cli_flags_before_the_command_word_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """``giaannd --config F run`` runs with F (argparse's subcommand defaults replaced it with None:
    the daemon ran on the built-in defaults, /var/lib/giaannd and both roles, silently); flags after
    the word add to those before it, ``--config`` after it wins."""
    for name in [k for k in __import__("os").environ if k.startswith("GIAANND_")]:
        monkeypatch.delenv(name)
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    first.write_text('[node]\nname = "from-first"\ndata-dir = "/srv/first"\n')
    second.write_text('[node]\nname = "from-second"\n')
    parse = cli._parser().parse_args
    cfg = cli._load(parse(["--config", str(first), "--role", "storage", "run"]))
    assert (cfg.node.name, cfg.node.data_dir, cfg.node.roles) == ("from-first", "/srv/first", ["storage"])
    cfg = cli._load(parse(["--config", str(first), "config", "show"]))
    assert cfg.node.name == "from-first"
    cfg = cli._load(parse(["--set", "cluster.name=before", "--set", "node.name=before", "run",
                           "--set", "node.name=after", "--role", "compute"]))
    assert (cfg.cluster.name, cfg.node.name, cfg.node.roles) == ("before", "after", ["compute"])
    cfg = cli._load(parse(["--config", str(first), "run", "--config", str(second)]))
    assert cfg.node.name == "from-second"


def _unchecked(tmp_path: Path, **transport: list[str]) -> Config:
    """A storage node's config with these transport URLs, built as an embedder builds one (the
    runtime's own checks, not ``load_config``'s)."""
    from giaannd.config import NodeConfig, TransportConfig

    return Config(node=NodeConfig(data_dir=str(tmp_path), roles=["storage"]),
                  transport=TransportConfig(**transport))


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1", "mem://"])
def test_runtime_bind_url_it_cannot_parse_is_a_config_error(tmp_path: Path, url: str) -> None:
    """A listener URL the backend cannot parse is a config error (exit 2, one line), not a
    ValueError traceback and exit 1."""
    import asyncio

    from giaannd.runtime.node import LiveKeys, NodeRuntime
    from peers.keyring import Keyring
    from peers.transport import Identity

    cfg = _unchecked(tmp_path, bind=[url])  # (load_config refuses it first: test_config_transport_urls)
    rt = NodeRuntime(cfg)
    rt.identity = Identity("n1", cfg.cluster.name, LiveKeys(Keyring([b"k" * 32])))
    with pytest.raises(ConfigError) as info:
        asyncio.run(rt._bind())
    assert info.value.path == "$.transport.bind" and url in str(info.value)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("url", ["tcp://127.0.0.1", "tcp://127.0.0.1:99999", "tcp://:7471", "mem://"])
def test_runtime_advertise_url_peers_could_not_dial_is_a_config_error(tmp_path: Path, url: str) -> None:
    """An advertised URL that does not parse (no port, a port out of range, no host, mem:// with no
    name) is a config error at start (exit 2, one line). Before, only its scheme was checked: the
    node started and gossiped an address no peer could dial."""
    import asyncio

    from giaannd.runtime.node import LiveKeys, NodeRuntime
    from peers.keyring import Keyring
    from peers.transport import Identity

    scheme = url.partition("://")[0]
    bind = "tcp://127.0.0.1:0" if scheme == "tcp" else "mem://n1-listener"
    cfg = _unchecked(tmp_path, bind=[bind], advertise=[url])
    rt = NodeRuntime(cfg)
    rt.identity = Identity("n1", cfg.cluster.name, LiveKeys(Keyring([b"k" * 32])))

    async def bind_then_close() -> None:
        try:
            await rt._bind()
        finally:
            for listener in rt.listeners.values():
                await listener.close()

    with pytest.raises(ConfigError) as info:
        asyncio.run(bind_then_close())
    assert info.value.path == "$.transport.advertise" and url in str(info.value)
    assert info.value.exit_code == 2


def test_roles_reserve_drain_shares_for_the_final_snapshot_and_the_leave() -> None:
    """The shares the daemon keeps for the services stopped last (giaannd/service.py
    ``drain_reserve_of``): the storage role's final snapshot, then membership's leave; the compute
    role, stopped first, declares none and keeps the rest."""
    from giaannd.compute.service import ComputeService
    from giaannd.service import drain_reserve_of
    from giaannd.services.membership import MembershipService
    from giaannd.services.roles import StorageRole

    storage = drain_reserve_of(StorageRole)  # type: ignore[arg-type]
    membership = drain_reserve_of(MembershipService)  # type: ignore[arg-type]
    assert drain_reserve_of(ComputeService) == 0.0  # type: ignore[arg-type]
    assert 0 < membership < storage and storage + membership < 1
