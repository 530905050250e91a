"""Ring sync's per-peer state (giaannd/services/ring_sync.py) while members come and go for good
(nodes replaced under new names): what it keeps per peer must go with the peer.

Before (Nov 30): the time of the last pull from each peer was kept for every name ever pulled, also
after the member left and was reaped; its other per-peer state went with the member's event."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from giaannd.cluster.ring import Ring
from giaannd.services import ring_sync
from giaannd.services.ring_sync import RingSync
from peers.membership.events import MemberJoined, MemberLeft, MemberReaped
from peers.membership.messages import MemberStatus
from peers.membership.meta import NodeMeta

from .test_ring_sync_pulls import _Node, _Runtime, _until

ROUNDS = 40


def _event(kind: Any, name: str, ring: Ring, status: MemberStatus) -> Any:
    meta = NodeMeta(roles=("storage",), transports={"tcp": "tcp://127.0.0.1:1"}, ring=ring.digest()).encode()
    return kind(name, f"id-{name}", ("127.0.0.1", 1), 1, status, meta, "test")


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_leak_ring_sync_forgets_peers_that_left(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _Runtime(Ring().with_active("s0"))
    pulled: list[str] = []

    async def get_ring(transports: Any, identity: Any, address: str, *, timeout_s: float) -> Ring:
        return rings[-1]

    monkeypatch.setattr(ring_sync, "get_ring", get_ring)
    sync = RingSync(rt, _Node([]), interval_s=3600.0, min_pull_interval_s=0.001)  # type: ignore[arg-type]
    sync.start()
    rings: list[Ring] = []
    kept: list[int] = []
    try:
        for i in range(ROUNDS):
            name = f"n{i}"
            rings.append(rt.ring.with_active(name))  # it gossips a ring ours lacks: pulled
            sync.on_event(_event(MemberJoined, name, rings[-1], MemberStatus.ALIVE))
            await _until(lambda: rt.ring.digest() == rings[-1].digest() and not sync._inflight)
            pulled.append(name)
            sync.on_event(_event(MemberLeft, name, rings[-1], MemberStatus.LEFT))
            sync.on_event(_event(MemberReaped, name, rings[-1], MemberStatus.LEFT))
            await asyncio.sleep(0)
            kept.append(len(sync._last_pull) + len(sync._peers) + len(sync._again))
        assert len(pulled) == ROUNDS and sync.pulls == ROUNDS
        assert kept[-1] <= 1, f"per-peer entries kept after each member left: {kept}"
    finally:
        await sync.stop()
