"""Issue 5's hook without sockets: which client failures count as "unreachable", and the runtime's
per-peer rate limit in front of ``MembershipNode.report_unreachable``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from giaannd import protocol as p
from giaannd.client import storage_client as client_mod
from giaannd.client.row_memory import DEFAULT_KEEP_ROW_BYTES
from giaannd.client.storage_client import RemoteNotOwner, StorageClient
from giaannd.cluster.view import ClusterView
from giaannd.config import Config
from giaannd.runtime.node import NodeRuntime
from peers.errors import (
    DeadlineExceeded,
    HandshakeRejected,
    PeerDead,
    RemoteError,
    TransportClosed,
)
from peers.membership.config import MembershipConfig


@pytest.mark.parametrize(("exc", "connecting", "expected"), [
    (ConnectionRefusedError("refused"), True, True),
    (DeadlineExceeded("connect took too long"), True, True),
    (TransportClosed("cannot connect"), True, True),
    (HandshakeRejected("wrong key", reason="bad_key", by_peer=True), True, False),
    (PeerDead("declared dead"), True, False),
    (TransportClosed("connection lost: EOF"), False, True),
    (ConnectionResetError("reset"), False, True),
    (DeadlineExceeded("request deadline"), False, False),  # slow is not unreachable
    (TimeoutError(), False, False),
    (PeerDead("declared dead"), False, False),
    (RemoteError("handler raised", remote_type="ValueError"), False, False),
    (RemoteNotOwner("b", p.NotOwner("e1")), False, False),
])
def test_unreachable_classification(exc: BaseException, connecting: bool, expected: bool) -> None:
    assert client_mod._unreachable(exc, connecting) is expected


class FakeMembership:
    def __init__(self, probe_interval_s: float) -> None:
        self.config = MembershipConfig(probe_interval_s=probe_interval_s, probe_timeout_s=probe_interval_s / 2)
        self.reports: list[str] = []

    def report_unreachable(self, name: str) -> None:
        self.reports.append(name)


def test_runtime_rate_limits_reports_per_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = NodeRuntime(Config.loopback(str(tmp_path), name="a", roles=["storage"]))
    rt.node_name = "a"
    assert rt.report_unreachable("b") is False  # no membership yet: nothing to tell
    fake = FakeMembership(1.0)
    rt.membership = fake  # type: ignore[assignment]
    now = [100.0]
    monkeypatch.setattr("giaannd.runtime.node.time.monotonic", lambda: now[0])
    assert rt.report_unreachable("b") is True
    assert rt.report_unreachable("b") is False  # same peer, same probe interval
    assert rt.report_unreachable("c") is True  # another peer has its own budget
    assert rt.report_unreachable("a") is False  # never itself
    now[0] += 0.99
    assert rt.report_unreachable("b") is False
    now[0] += 0.02
    assert rt.report_unreachable("b") is True
    assert fake.reports == ["b", "c", "b"]
    assert (rt.unreachable_reported, rt.unreachable_suppressed) == (3, 2)


@pytest.mark.asyncio
async def test_client_calls_the_hook_on_connect_failure_only(monkeypatch: pytest.MonkeyPatch) -> None:
    told: list[str] = []
    client = StorageClient(ClusterView(local=None), {}, on_unreachable=told.append)

    async def refuse(node: str) -> Any:
        raise ConnectionRefusedError(f"{node} refused")
    monkeypatch.setattr(client, "_connection", refuse)
    with pytest.raises(ConnectionRefusedError):
        await client.usage("b")
    assert told == ["b"]

    async def no_transport(node: str) -> Any:
        raise KeyError(f"no tcp:// transport to reach {node}")  # our configuration, not the peer
    monkeypatch.setattr(client, "_connection", no_transport)
    with pytest.raises(KeyError):
        await client.usage("c")
    assert told == ["b"]

    def broken_hook(name: str) -> None:
        raise RuntimeError("hook bug")
    client.on_unreachable = broken_hook
    monkeypatch.setattr(client, "_connection", refuse)
    with pytest.raises(ConnectionRefusedError):  # the request's own error, not the hook's
        await client.usage("b")


def test_runtime_client_keeps_the_configured_large_row_memory(tmp_path: Path) -> None:
    config = Config.loopback(str(tmp_path), name="c1", roles=["compute"])
    assert config.compute.row_memory_keep_bytes == DEFAULT_KEEP_ROW_BYTES  # one default, two places
    config = msgspec.structs.replace(
        config, compute=msgspec.structs.replace(config.compute, row_memory_keep_bytes=12_345))
    assert NodeRuntime(config).storage_client().row_memory.max_idle_bytes == 12_345
