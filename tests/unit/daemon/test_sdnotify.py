"""sd_notify over a real AF_UNIX datagram socket, path and abstract namespace."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from giaannd.sdnotify import SdNotifier, watchdog_interval_s


def _receiver(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_sdnotify_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with _receiver(path) as sock:
        notifier = SdNotifier(path)
        assert notifier.enabled
        assert notifier.notify("READY=1", "STATUS=ok")
        assert sock.recv(4096) == b"READY=1\nSTATUS=ok"


def test_sdnotify_abstract_socket() -> None:
    name = f"giaannd-test-{uuid.uuid4().hex}"
    with _receiver(b"\0" + name.encode()) as sock:
        assert SdNotifier("@" + name).notify("STOPPING=1")
        assert sock.recv(4096) == b"STOPPING=1"


def test_sdnotify_disabled_and_unreachable(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                           ) -> None:
    assert not SdNotifier("").enabled
    assert SdNotifier("").notify("READY=1") is False
    gone = SdNotifier(str(tmp_path / "absent"))
    assert gone.notify("READY=1") is False
    assert gone.notify("READY=1") is False
    assert len([r for r in caplog.records if "sd_notify failed" in r.message]) == 1


def test_sdnotify_reads_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "n")
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    with _receiver(path) as sock:
        assert SdNotifier().notify("WATCHDOG=1")
        assert sock.recv(100) == b"WATCHDOG=1"


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "junk"}, None),
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 1.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),
])
def test_sdnotify_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval_s(env) == expected


def test_sdnotify_never_blocks_when_the_manager_does_not_read(tmp_path: Path) -> None:
    path = str(tmp_path / "full")
    with _receiver(path):
        notifier = SdNotifier(path)
        started = time.monotonic()
        results = [notifier.notify("WATCHDOG=1") for _ in range(2000)]
        assert time.monotonic() - started < 5
        assert results[0] is True and results[-1] is False  # queue filled, later sends dropped
