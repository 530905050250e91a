"""A ``begin`` already taking the cluster's topology lock when the node's topology service stops
(rebalance/daemon.py ``StorageTopology.stop``) must not start its operation afterwards: it would
run against a closed stream endpoint, holding the lock. The registry refuses once stopped and
the lock is released (operations.py, ``OperationRegistry``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from giaannd.storage.rebalance.daemon import StorageTopology

pytestmark = pytest.mark.asyncio


class _Op:
    """A join whose lock is being taken (its register round in flight) until ``go`` is set."""

    def __init__(self) -> None:
        self.kind, self.new_members, self.state = "join", [], "planning"
        self.taking, self.go = asyncio.Event(), asyncio.Event()
        self.released = False

    async def take_lock(self) -> None:
        self.taking.set()
        await self.go.wait()

    async def release_lock(self) -> None:
        self.released = True

    async def run(self) -> dict[str, Any]:
        return {"state": "done"}

    def progress(self) -> dict[str, Any]:
        return {"state": self.state}


async def test_a_join_taking_the_lock_when_the_topology_stops_does_not_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = SimpleNamespace(on_join_needed=None, ring_listeners=[], node_name="s4",
                              ring=SimpleNamespace(get=lambda name: None),
                              rings=SimpleNamespace(operation_state=None))
    topo = StorageTopology(SimpleNamespace(), runtime, SimpleNamespace(data_dir=tmp_path))  # type: ignore[arg-type]
    op = _Op()
    monkeypatch.setattr(topo, "join_operation", lambda: op)
    join = asyncio.create_task(topo.join())
    try:
        await asyncio.wait_for(op.taking.wait(), 10)  # the lock's register round is in flight
        await asyncio.wait_for(topo.stop(), 10)  # the daemon stops meanwhile
        op.go.set()  # the lock is taken
        result = await asyncio.wait_for(join, 10)
    finally:
        join.cancel()
        task = topo.registry._task
        if task is not None:
            await asyncio.wait_for(task, 10)
    assert topo.registry.current is None  # not started by a stopped topology service
    assert op.released  # and the lock it took is given back
    assert result["state"] == "cancelled"
