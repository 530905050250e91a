"""The auto-join (rebalance/daemon.py ``StorageTopology.join``) waits while another operation holds
the cluster's topology lock; a node that stops meanwhile must not start its join after its
topology service stopped (its task lives until the end of the daemon's shutdown)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from giaannd.storage.rebalance import daemon
from giaannd.storage.rebalance.cluster_lock import LockHolder, OperationLockBusy
from giaannd.storage.rebalance.daemon import StorageTopology

pytestmark = pytest.mark.asyncio


async def test_auto_join_waiting_for_the_lock_ends_when_the_topology_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = SimpleNamespace(on_join_needed=None, ring_listeners=[], node_name="s4",
                              ring=SimpleNamespace(get=lambda name: None),
                              rings=SimpleNamespace(operation_state=None))
    topo = StorageTopology(SimpleNamespace(), runtime, SimpleNamespace(data_dir=tmp_path))  # type: ignore[arg-type]
    monkeypatch.setattr(daemon, "JOIN_LOCK_RETRY_S", 0.0)
    refused, go = asyncio.Event(), asyncio.Event()
    calls: list[object] = []

    async def begin(op: object) -> Any:
        calls.append(op)
        if len(calls) == 1:
            refused.set()
            await go.wait()
            raise OperationLockBusy(LockHolder(op="removenode:x", kind="removenode", coordinator="s1",
                                               token=1, since=0.0))
        return SimpleNamespace(progress=lambda: {"state": "streaming"})

    monkeypatch.setattr(topo.registry, "begin", begin)
    monkeypatch.setattr(topo, "join_operation", lambda: object())
    join = asyncio.create_task(topo.join())
    try:
        await asyncio.wait_for(refused.wait(), 10)  # waiting for another node's operation
        await asyncio.wait_for(topo.stop(), 10)  # the daemon stops meanwhile
        go.set()
        await asyncio.wait_for(join, 10)
    finally:
        join.cancel()
    assert len(calls) == 1  # no join started by a stopped topology service
