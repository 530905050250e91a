"""Ring sync's start-up decision when the ring cannot be read (review, Nov 30).

A new storage node in join-mode ``auto`` joins a cluster whose members gossip a non-zero ring
digest, but no ``RingGet`` answers within the start-up bound (the peers' loops are busy, their data
plane is unreachable while gossip works). Its own ring is still empty, so ``join_action`` said
"bootstrap": the node committed itself active and gossiped it, and the cluster's ring took it in
at the next pull: an empty node owning columns at once, which is what the ring exists to prevent
(docs/topology.md, "The storage ring"). It now stays standby and runs the join (which re-checks
the ring once the storage role serves) when a peer is known to hold a ring it could not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from giaannd.cluster.ring import Ring
from giaannd.services import ring_sync
from giaannd.services.ring_sync import RingSync
from peers.membership.meta import NodeMeta


@dataclass
class _Runtime:
    ring: Ring
    node_name: str = "new"
    topology: Any = field(default_factory=lambda: SimpleNamespace(schemes=("tcp",)))
    transports: dict[str, Any] = field(default_factory=dict)
    identity: Any = None
    config: Any = field(default_factory=lambda: SimpleNamespace(
        node=SimpleNamespace(roles=("storage",)), storage=SimpleNamespace(placement_weight=1.0)))
    commits: list[Ring] = field(default_factory=list)

    async def commit_ring(self, ring: Ring) -> bool:
        self.commits.append(ring)
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

    def alive_members(self) -> list[_Info]:
        return self.members

    def on_event(self, callback: Any) -> None:
        pass


@pytest.mark.asyncio
async def test_auto_node_does_not_bootstrap_when_the_clusters_ring_could_not_be_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster_ring = Ring().with_active("s1").with_active("s2")
    meta = NodeMeta(roles=("storage",), transports={"tcp": "tcp://127.0.0.1:1"},
                    ring=cluster_ring.digest()).encode()

    async def unreachable(*_args: Any, **_kwargs: Any) -> Ring:
        raise ConnectionRefusedError("data plane unreachable")

    monkeypatch.setattr(ring_sync, "get_ring", unreachable)
    rt = _Runtime(Ring())
    sync = RingSync(rt, _Node([_Info("s1", meta), _Info("s2", meta)]),  # type: ignore[arg-type]
                    interval_s=3600.0)
    spawned: list[str] = []

    def spawn(coro: Any, name: str) -> None:
        coro.close()
        spawned.append(name)

    action = await sync.settle("auto", had_seeds=True, spawn=spawn)
    assert not rt.ring.is_active("new"), rt.ring  # was: bootstrapped itself into the cluster
    assert rt.commits == []
    assert action == "join" and spawned == ["ring-join"]


@pytest.mark.asyncio
async def test_auto_node_still_bootstraps_a_new_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers gossiping the empty ring (digest 0): a new cluster, bootstrap as before."""
    meta = NodeMeta(roles=("storage",), transports={"tcp": "tcp://127.0.0.1:1"}, ring=0).encode()

    async def empty(*_args: Any, **_kwargs: Any) -> Ring:
        return Ring()

    monkeypatch.setattr(ring_sync, "get_ring", empty)
    rt = _Runtime(Ring())
    sync = RingSync(rt, _Node([_Info("s1", meta)]), interval_s=3600.0)  # type: ignore[arg-type]
    action = await sync.settle("auto", had_seeds=True, spawn=lambda coro, name: coro.close())
    assert action == "bootstrap" and rt.ring.is_active("new")
