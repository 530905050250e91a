"""``transport.bind`` and ``transport.advertise`` are refused by ``load_config`` (exit 2, one line
naming the key) like ``admin.listen``, ``cluster.seeds`` and ``storage.stream-bind``, instead of when
the runtime binds its listeners: after the data directory, its lock, the node id and the admin
token were made, and the admin API was listening."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.cli import main
from giaannd.config import load_config
from giaannd.errors import ConfigError


@pytest.mark.parametrize(("overrides", "path"), [
    (['transport.bind=["garbage"]'], "$.transport.bind"),
    (['transport.bind=["udp://127.0.0.1:7470"]'], "$.transport.bind"),
    (['transport.bind=["tcp://127.0.0.1"]'], "$.transport.bind"),
    (['transport.bind=["tcp://127.0.0.1:99999"]'], "$.transport.bind"),
    (['transport.bind=["tcp://:7470"]'], "$.transport.bind"),
    (['transport.bind=["mem://"]'], "$.transport.bind"),
    (['transport.bind=["tcp://127.0.0.1:0", "ucx://127.0.0.1"]'], "$.transport.bind"),
    # a wildcard no peer can dial, with nothing advertised for its scheme
    (['transport.bind=["tcp://0.0.0.0:7470"]'], "$.transport.advertise"),
    (['transport.bind=["tcp://[::]:7470"]'], "$.transport.advertise"),
    (['transport.bind=["tcp://0.0.0.0:7470", "ucx://10.0.0.5:7471"]',
      'transport.advertise=["ucx://10.0.0.5:7471"]'], "$.transport.advertise"),
    (['transport.advertise=["garbage"]'], "$.transport.advertise"),
    (['transport.advertise=["tcp://10.0.0.5"]'], "$.transport.advertise"),
    (['transport.advertise=["tcp://10.0.0.5:99999"]'], "$.transport.advertise"),
    (['transport.advertise=["tcp://:7470"]'], "$.transport.advertise"),
    (['transport.advertise=["tcp://10.0.0.5:0"]'], "$.transport.advertise"),  # port 0: nobody listens
    (['transport.advertise=["mem://"]'], "$.transport.advertise"),
    # a wildcard advertised: gossiped as is, no peer can dial it
    (['transport.bind=["tcp://0.0.0.0:7470"]', 'transport.advertise=["tcp://0.0.0.0:7470"]'],
     "$.transport.advertise"),
    (['transport.advertise=["tcp://[::]:7470"]'], "$.transport.advertise"),
    (['membership.advertise-address=0.0.0.0'], "$.membership.advertise-address"),
    (['membership.bind-address=0.0.0.0', 'membership.advertise-address=::'], "$.membership.advertise-address"),
    # advertised for a scheme this node has no listener of
    (['transport.advertise=["ucx://10.0.0.5:7471"]'], "$.transport.advertise"),
])
def test_config_transport_urls_no_listener_could_take_or_peer_dial_are_refused(
        overrides: list[str], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides=overrides)
    assert info.value.path == path
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [
    [],
    ['transport.bind=["tcp://127.0.0.1:0", "ucx://127.0.0.1:0"]'],
    ['transport.bind=["tcp://[::1]:7470"]', 'transport.advertise=["tcp://[::1]:7470"]'],
    ['transport.bind=["tcp://0.0.0.0:7470"]', 'transport.advertise=["tcp://10.0.0.5:7470"]'],
    ['transport.bind=["tcp://0.0.0.0:7470", "ucx://0.0.0.0:7471"]',
     'transport.advertise=["ucx://10.0.0.5:7471", "tcp://host.example:7470"]'],
    ['transport.bind=["mem://a"]', 'transport.advertise=["mem://a"]'],
])
def test_config_transport_urls_that_work_are_taken(overrides: list[str]) -> None:
    load_config(environ={}, overrides=overrides)


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1", "udp://127.0.0.1:0"])
def test_cli_bad_transport_url_exits_2_before_touching_the_data_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bind: str) -> None:
    """It was found when the runtime bound its listeners: after the data directory, lock, node id
    and admin token were made (and the admin API listened)."""
    data_dir = tmp_path / "data"
    status = main(["run", "--set", f"node.data-dir={data_dir}", "--set", "admin.listen=127.0.0.1:0",
                   "--set", "membership.bind-port=0", "--set", f'transport.bind=["{bind}"]'])
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "$.transport.bind" in err, err
    assert not data_dir.exists()
