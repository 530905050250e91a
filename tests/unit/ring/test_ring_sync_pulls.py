"""Ring sync's pull loop (giaannd/services/ring_sync.py) against a fake runtime and membership node:
a failed pull is retried with backoff while the peer's digest differs, the anti-entropy round
outlives a failure, and ``health`` names each peer's last error."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from giaannd.cluster.ring import Ring
from giaannd.services import ring_sync
from giaannd.services.ring_sync import RingSync
from peers.membership.meta import NodeMeta


@dataclass
class _Topology:
    schemes: tuple[str, ...] = ("tcp",)


@dataclass
class _Runtime:
    ring: Ring
    node_name: str = "s0"
    topology: _Topology = field(default_factory=_Topology)
    transports: dict[str, Any] = field(default_factory=dict)
    identity: Any = None

    async def commit_ring(self, ring: Ring) -> bool:
        merged = Ring(self.ring.entries)
        changed = merged.merge(ring)
        self.ring = merged
        return changed


@dataclass
class _Info:
    name: str
    meta: bytes


class _Node:
    def __init__(self, members: list[_Info]) -> None:
        self.members = members
        self.callbacks: list[Any] = []
        self.alive_calls = 0
        self.fail_alive = 0

    def alive_members(self) -> list[_Info]:
        self.alive_calls += 1
        if self.fail_alive:
            self.fail_alive -= 1
            raise RuntimeError("membership table busy")
        return self.members

    def on_event(self, callback: Any) -> None:
        self.callbacks.append(callback)


def _meta(ring: Ring) -> bytes:
    return NodeMeta(roles=("storage",), transports={"tcp": "tcp://127.0.0.1:1"}, ring=ring.digest()).encode()


async def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_failed_pull_is_retried_while_the_digest_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer answers only on the third try: ours converges without any anti-entropy round
    (interval one hour) and without another member event."""
    theirs = Ring().with_active("s0").with_active("s1")
    rt = _Runtime(Ring().with_active("s0"))
    tries: list[str] = []

    async def get_ring(transports: Any, identity: Any, address: str, *, timeout_s: float) -> Ring:
        tries.append(address)
        if len(tries) < 3:
            raise ConnectionRefusedError("not serving yet")
        return theirs

    monkeypatch.setattr(ring_sync, "get_ring", get_ring)
    sync = RingSync(rt, _Node([_Info("s1", _meta(theirs))]), interval_s=3600.0,  # type: ignore[arg-type]
                    min_pull_interval_s=0.01)
    sync.start()
    try:
        await _until(lambda: rt.ring.digest() == theirs.digest())
        assert len(tries) == 3
        health = sync.health()
        assert health["pull_errors"] == 2 and health["changes"] == 1
        assert health["peers"]["s1"]["error"] is None  # cleared by the pull that worked
    finally:
        await sync.stop()


@pytest.mark.asyncio
async def test_retries_stop_after_the_bound_and_health_names_the_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = Ring().with_active("s0").with_active("s1")
    rt = _Runtime(Ring().with_active("s0"))
    tries = 0

    async def get_ring(transports: Any, identity: Any, address: str, *, timeout_s: float) -> Ring:
        nonlocal tries
        tries += 1
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(ring_sync, "get_ring", get_ring)
    sync = RingSync(rt, _Node([_Info("s1", _meta(theirs))]), interval_s=3600.0,  # type: ignore[arg-type]
                    min_pull_interval_s=0.001)
    sync.pull_retries = 3
    sync.start()
    try:
        await _until(lambda: not sync.health()["peers"]["s1"]["pulling"] and tries > 0)
        assert tries == 1 + sync.pull_retries
        peer = sync.health()["peers"]["s1"]
        assert "refused" in peer["error"] and peer["digest"] == f"{theirs.digest():016x}"
    finally:
        await sync.stop()


@pytest.mark.asyncio
async def test_anti_entropy_round_outlives_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first rounds raise (the member table): later rounds still pull."""
    theirs = Ring().with_active("s0").with_active("s1")
    rt = _Runtime(Ring().with_active("s0"))

    async def get_ring(transports: Any, identity: Any, address: str, *, timeout_s: float) -> Ring:
        return theirs

    monkeypatch.setattr(ring_sync, "get_ring", get_ring)
    node = _Node([])  # nothing known at start: only anti-entropy can find the peer
    sync = RingSync(rt, node, interval_s=0.01, min_pull_interval_s=0.001)  # type: ignore[arg-type]
    sync.start()
    node.members = [_Info("s1", _meta(theirs))]
    node.fail_alive = 3
    try:
        await _until(lambda: rt.ring.digest() == theirs.digest())
        assert node.fail_alive == 0
    finally:
        await sync.stop()
