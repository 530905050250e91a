"""Planning lists the remote old owners' columns at once (``Rebalance._columns``): a plan waited
for each member's reply in turn, and ``LIST_COLUMNS_TIMEOUT_S`` for every member that did not
answer, one after the other."""

import asyncio

import numpy as np
import pytest

from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.storage.rebalance import operations
from giaannd.storage.rebalance.operations import Rebalance

pytestmark = pytest.mark.asyncio

NAMES = ["s0", "s1", "s2", "s3"]
HELD = {name: np.arange(10 * i, 10 * i + 10, dtype=np.uint64) for i, name in enumerate(NAMES)}


class _RemoteMembers:
    """A cluster whose members all run in other processes (ClusterControl, planning only)."""

    transport = None

    def __init__(self, names=NAMES) -> None:
        self._view = ClusterView(replicas=2)
        self._view.set_members([StorageNode(n, f"tcp://{n}") for n in names])

    def view(self) -> ClusterView:
        return self._view

    def service(self, name):
        return None

    def stream_address(self, name: str) -> str:
        return name


async def test_remote_members_are_listed_at_once_and_silent_ones_time_out_together(monkeypatch):
    timeout_s = 0.4
    monkeypatch.setattr(operations, "LIST_COLUMNS_TIMEOUT_S", timeout_s)
    asked, answering = [], 0
    most = 0

    async def list_columns(transport, address):
        nonlocal answering, most
        asked.append(address)
        answering += 1
        most = max(most, answering)
        try:
            if address in ("s1", "s3"):  # up in the view, but they never answer
                await asyncio.sleep(3600)
            await asyncio.sleep(0.05)
            return HELD[address]
        finally:
            answering -= 1

    monkeypatch.setattr(operations, "list_columns", list_columns)
    control = _RemoteMembers()
    op = Rebalance(control, "join", [StorageNode(n, f"tcp://{n}") for n in [*NAMES, "s4"]])
    plan = await op.make_plan()
    # every member asked before any answered: the silent ones' timeouts run side by side (asked
    # in turn, the plan took a timeout for each, and the others' replies one after the other)
    assert sorted(asked) == NAMES and most == len(NAMES)
    assert op._unreachable == {"s1", "s3"}
    assert plan.columns_total == HELD["s0"].size + HELD["s2"].size  # the answering members' columns


async def test_at_most_the_concurrency_bound_of_members_are_asked_at_once(monkeypatch):
    """Each reply holds a node's column ids (8 MB for 10^6 columns): a large cluster's members
    are asked LIST_COLUMNS_CONCURRENCY at a time, not all at once."""
    names = [f"n{i}" for i in range(operations.LIST_COLUMNS_CONCURRENCY + 8)]
    answering = most = 0

    async def list_columns(transport, address):
        nonlocal answering, most
        answering += 1
        most = max(most, answering)
        await asyncio.sleep(0.01)
        answering -= 1
        return np.array([int(address[1:]) + 1], np.uint64)

    monkeypatch.setattr(operations, "list_columns", list_columns)
    op = Rebalance(_RemoteMembers(names), "join", [StorageNode(n, f"tcp://{n}") for n in [*names, "new"]])
    plan = await op.make_plan()
    assert most == operations.LIST_COLUMNS_CONCURRENCY
    assert plan.columns_total == len(names) and not op._unreachable
