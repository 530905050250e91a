"""The cluster's topology lock (rebalance/cluster_lock.py) where calls overlap or end early: two
acquisitions of one node in flight together, a write whose answer was lost, and a release that its
caller stops waiting for (Rebalance.release_lock's bound). Each must leave one holder at most, and
no lock held once the operation that took it ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from giaannd.client.errors import RegisterUnavailable
from giaannd.client.registers import CasOutcome, Version
from giaannd.cluster.view import StorageNode
from giaannd.storage.rebalance import operations
from giaannd.storage.rebalance.cluster_lock import ClusterLock, OperationLockBusy, OperationLockUnavailable
from giaannd.storage.rebalance.operations import Rebalance
from peers.placement import Member, Placement
from tests.unit.topology.test_cluster_lock import MemoryRegister

pytestmark = pytest.mark.asyncio


class GatedRegister(MemoryRegister):
    """A MemoryRegister whose writes (``expect`` not None) can be held after they took effect,
    as a quorum's accept that landed while its proposer has not resumed yet; or fail after they
    took effect (``lose_answers``: RegisterUnavailable, as a round whose answers were lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.landed = asyncio.Event()
        self.lose_answers = False

    async def cas(self, key: str, expect: Version | None, value: bytes = b"",
                  timeout_s: float | None = None) -> CasOutcome:
        out = await super().cas(key, expect, value, timeout_s)
        if expect is not None:
            self.landed.set()
            if self.gate is not None:
                await self.gate.wait()
            if self.lose_answers:
                raise RegisterUnavailable("1 of 3 owners answered (need 2)")
        return out


async def test_cluster_lock_a_second_acquire_of_the_same_node_does_not_take_over_one_in_flight() -> None:
    reg = GatedRegister()
    lock = ClusterLock(reg, "s1", lambda name: True)
    gate = reg.gate = asyncio.Event()
    first = asyncio.create_task(lock.acquire("removenode:a", "removenode"))
    await asyncio.wait_for(reg.landed.wait(), 10)  # its value is in the register; its answer not back
    reg.gate = None
    try:
        with pytest.raises(OperationLockBusy):
            await asyncio.wait_for(lock.acquire("removenode:b", "removenode"), 10)
    finally:
        gate.set()
    token = await asyncio.wait_for(first, 10)
    holder = reg.holder()
    assert holder is not None and holder.token == token


async def test_cluster_lock_a_write_whose_answer_was_lost_is_released_with_its_operation() -> None:
    reg = GatedRegister()
    reg.lose_answers = True
    control = _LockControl(ClusterLock(reg, "s1", lambda name: True))
    op = Rebalance(control, "removenode", [StorageNode("s1", "tcp://127.0.0.1:1", 1.0)])  # type: ignore[arg-type]
    await op.take_lock()  # the write took effect; its answer was lost: run without the lock
    assert op.lock_state.startswith("unavailable") and reg.holder() is not None
    reg.lose_answers = False
    await op.release_lock()  # the operation ended
    assert reg.holder() is None
    # and another node can take the lock now
    await asyncio.wait_for(ClusterLock(reg, "s2", lambda name: True).acquire("join:x", "join"), 10)


async def test_rebalance_release_lock_that_outlasts_its_bound_still_releases(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reg = GatedRegister()
    lock = ClusterLock(reg, "s1", lambda name: True)
    control = _LockControl(lock)
    op = Rebalance(control, "removenode", [StorageNode("s1", "tcp://127.0.0.1:1", 1.0)])  # type: ignore[arg-type]
    await op.take_lock()
    assert op.lock_state == "held"
    reg.gate = asyncio.Event()  # the release's write hangs past the bound
    monkeypatch.setattr(operations, "CUTOVER_TIMEOUT_S", 0.01)
    await asyncio.wait_for(op.release_lock(), 10)
    reg.gate.set()  # its owners answer at last
    await asyncio.wait_for(control.ended.wait(), 10)
    assert control.released and reg.holder() is None
    await asyncio.wait_for(ClusterLock(reg, "s2", lambda name: True).acquire("join:x", "join"), 10)


class _LockControl:
    """The lock calls of DaemonClusterControl over one ClusterLock (a failed release retried)."""

    def __init__(self, lock: ClusterLock) -> None:
        self.lock_ = lock
        placement = Placement((Member("s1"), Member("s2")), 2)
        self._view = SimpleNamespace(placement=placement, replicas=2, strategy="hash")
        self.ended = asyncio.Event()  # an unlock returned or was cancelled
        self.released = False

    def view(self) -> SimpleNamespace:  # (what Rebalance.op_id reads)
        return self._view

    async def lock(self, op_id: str, kind: str) -> int | None:
        return await self.lock_.acquire(op_id, kind)

    async def unlock(self, token: int) -> None:
        try:
            while not await self.lock_.release(token):
                await asyncio.sleep(0)
            self.released = True
        finally:
            self.ended.set()


class _DoubtControl:
    """A control whose lock register never answers: every ``lock`` is a write in doubt
    (OperationLockUnavailable with its token); the first one waits for ``gate``."""

    def __init__(self) -> None:
        self._view = _LockControl(ClusterLock(MemoryRegister(), "s1", lambda name: True))._view
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()
        self.tokens: list[int] = []
        self.unlocked: list[int] = []

    def view(self) -> SimpleNamespace:
        return self._view

    async def lock(self, op_id: str, kind: str) -> int | None:
        token = len(self.tokens) + 1
        self.tokens.append(token)
        if token == 1:
            self.waiting.set()
            await self.gate.wait()
        raise OperationLockUnavailable("1 of 3 owners answered (need 2)", token)

    async def unlock(self, token: int) -> None:
        self.unlocked.append(token)


async def test_operation_registry_begin_of_a_verb_started_meanwhile_releases_its_own_lock() -> None:
    control = _DoubtControl()
    registry = operations.OperationRegistry()
    members = [StorageNode("s1", "tcp://127.0.0.1:1", 1.0)]
    first, second = Rebalance(control, "removenode", members), Rebalance(control, "removenode", members)  # type: ignore[arg-type]
    hold = asyncio.Event()

    async def running() -> dict[str, object]:  # the first operation, running (it never ends here)
        await hold.wait()
        return {}

    first.run = running  # type: ignore[method-assign]
    late = asyncio.create_task(registry.begin(second))  # the same verb, issued twice at once
    await asyncio.wait_for(control.waiting.wait(), 10)
    assert await asyncio.wait_for(registry.begin(first), 10) is first
    control.gate.set()
    assert await asyncio.wait_for(late, 10) is first  # the running one answers the second request
    assert control.unlocked == [1]  # and the second's write in doubt was released
    hold.set()


async def test_cluster_lock_start_up_release_leaves_an_acquire_of_this_process_in_flight() -> None:
    reg = GatedRegister()
    lock = ClusterLock(reg, "s1", lambda name: True)
    gate = reg.gate = asyncio.Event()
    join = asyncio.create_task(lock.acquire("join:a", "join"))  # the auto-join, at start
    await asyncio.wait_for(reg.landed.wait(), 10)
    reg.gate = None
    try:
        assert await asyncio.wait_for(lock.release_own_stale(), 10)  # the start-up task, meanwhile
    finally:
        gate.set()
    token = await asyncio.wait_for(join, 10)
    holder = reg.holder()
    assert holder is not None and holder.token == token
