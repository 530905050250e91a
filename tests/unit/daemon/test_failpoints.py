"""Failpoints (giaannd/failpoints.py): off unless ``GIAANND_FAILPOINTS`` names them; a name this
build lacks or a malformed entry stops the daemon with exit status 2 (a fault test whose failpoint
did nothing would pass for the wrong reason); an armed one holds the task that hits it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from giaannd import failpoints
from giaannd.cli import main
from giaannd.errors import ConfigError


@pytest.fixture(autouse=True)
def _disarmed() -> Iterator[None]:
    yield
    failpoints.load({})


def test_parse_takes_sleep_entries_of_known_names() -> None:
    assert failpoints.parse("") == {}
    assert failpoints.parse(" cutover.after-writers=sleep:2.5 , cutover.after-targets=sleep:0") == {
        "cutover.after-writers": 2.5, "cutover.after-targets": 0.0}


@pytest.mark.parametrize("spec", [
    "cutover.after-writer=sleep:1",  # a typo of a name
    "cutover.after-writers=panic",
    "cutover.after-writers=sleep",
    "cutover.after-writers=sleep:-1",
    "cutover.after-writers=sleep:inf",
    "cutover.after-writers=sleep:nan",
    "cutover.after-writers",
])
def test_parse_refuses_what_it_would_not_do(spec: str) -> None:
    with pytest.raises(ConfigError, match="GIAANND_FAILPOINTS"):
        failpoints.parse(spec)


@pytest.mark.asyncio
async def test_hit_holds_only_when_armed() -> None:
    started = time.monotonic()
    await failpoints.hit("cutover.after-writers")  # not armed: returns at once
    assert failpoints.load({}) == {} and failpoints.active() == {}
    failpoints.load({failpoints.ENV: "cutover.after-writers=sleep:30"})
    held = asyncio.ensure_future(failpoints.hit("cutover.after-writers"))
    await asyncio.sleep(0.05)
    assert not held.done()  # held (the loop goes on: this test runs)
    held.cancel()
    await failpoints.hit("cutover.after-targets")  # another, not armed
    assert time.monotonic() - started < 30


def test_daemon_with_a_bad_failpoint_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(failpoints.ENV, "no.such.point=sleep:1")
    data_dir = tmp_path / "data"
    assert main(["run", "--set", f"node.data-dir={data_dir}"]) == 2
    err = capsys.readouterr().err
    assert "unknown failpoint 'no.such.point'" in err, err
    assert not data_dir.exists()
