"""The cluster's topology lock (rebalance/cluster_lock.py) when the acquire's *write* meets an owner
that sealed the lock's register: refused as busy (409), as when its read meets one, never run
without the lock; and the write, whose outcome is unknown, is released all the same."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from giaannd.client.errors import RegisterUnavailable
from giaannd.client.registers import CasOutcome, Version
from giaannd.cluster.view import StorageNode
from giaannd.errors import AdminHTTPError
from giaannd.storage.engine.register_store import RegisterStore
from giaannd.storage.rebalance.cluster_lock import ClusterLock, OperationLockBusy, OperationLockSealed
from giaannd.storage.rebalance.operations import OperationRegistry, Rebalance
from tests.unit.topology.test_cluster_lock_lifecycle import GatedRegister, _LockControl

pytestmark = pytest.mark.asyncio


class SealedWriteRegister(GatedRegister):
    """Reads answer; a write takes effect, then fails as a round that met a sealed owner and lost
    its quorum's answers (``sealed_writes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sealed_writes = True

    async def cas(self, key: str, expect: Version | None, value: bytes = b"",
                  timeout_s: float | None = None) -> CasOutcome:
        out = await super().cas(key, expect, value, timeout_s)
        if expect is not None and self.sealed_writes:
            raise RegisterUnavailable("1 of 3 owners answered (need 2): s2: register sealed", sealed=True)
        return out


async def test_cluster_lock_a_write_that_meets_a_sealed_owner_is_busy_and_its_token_released() -> None:
    reg = SealedWriteRegister()
    lock = ClusterLock(reg, "s1", lambda name: True)
    with pytest.raises(OperationLockSealed) as info:
        await asyncio.wait_for(lock.acquire("removenode:a", "removenode"), 10)
    assert reg.holder() is not None  # the write took effect all the same
    token = info.value.token
    assert token is not None and reg.holder().token == token  # type: ignore[union-attr]
    reg.sealed_writes = False
    assert await asyncio.wait_for(lock.release(token), 10)
    assert reg.holder() is None


async def test_rebalance_take_lock_refused_as_sealed_releases_its_write_in_doubt() -> None:
    reg = SealedWriteRegister()
    control = _LockControl(ClusterLock(reg, "s1", lambda name: True))
    op = Rebalance(control, "removenode", [StorageNode("s1", "tcp://127.0.0.1:1", 1.0)])  # type: ignore[arg-type]
    with pytest.raises(OperationLockBusy):  # refused (409): never run without the lock
        await asyncio.wait_for(op.take_lock(), 10)
    assert not op.lock_state.startswith("unavailable")
    reg.sealed_writes = False  # the seal is gone: the release can reach the register
    await asyncio.wait_for(control.ended.wait(), 10)
    assert control.released and reg.holder() is None


async def test_register_unseal_refused_as_sealed_releases_its_write_in_doubt(tmp_path: Any) -> None:
    from tests.unit.topology.test_register_unseal import Control, _route

    class SealedControl(Control):
        async def lock(self, op_id: str, kind: str) -> int | None:
            raise OperationLockSealed("s2: register sealed", 7)  # its write met the seal

        async def unlock(self, token: int) -> None:
            self.unlocked.append(token)

    store = RegisterStore.open(tmp_path)
    try:
        control = SealedControl(store, None)
        with pytest.raises(AdminHTTPError) as info:
            await asyncio.wait_for(_route(control)(None, {}), 10)
        assert info.value.status == 409 and control.unlocked == [7]
    finally:
        store.close()


async def test_register_unseal_leaves_the_lock_of_an_operation_running_here_with_its_write_in_doubt(
        tmp_path: Any) -> None:
    """An operation of this node runs without the lock (its write's answer was lost) while the write
    landed: the register names it. The unseal verb on the same node is refused (an operation runs
    here), and must not take that lock over and release it meanwhile: other nodes would then start
    operations beside the running one."""
    from tests.unit.topology.test_register_unseal import Control, _route

    reg = GatedRegister()
    reg.lose_answers = True
    lock = ClusterLock(reg, "s1", lambda name: True)
    control = Control(RegisterStore.open(tmp_path), lock)
    for name, value in vars(_LockControl(lock).view()).items():  # (what Rebalance.op_id reads)
        setattr(control.view(), name, value)
    try:
        op = Rebalance(control, "removenode", [StorageNode("s1", "tcp://127.0.0.1:1", 1.0)])  # type: ignore[arg-type]
        await op.take_lock()
        assert op.lock_state.startswith("unavailable")
        landed = reg.holder()
        assert landed is not None and landed.coordinator == "s1"
        reg.lose_answers = False
        registry = OperationRegistry()
        registry.current = op  # running here
        op.state = "streaming"
        with pytest.raises(AdminHTTPError) as info:
            await asyncio.wait_for(_route(control, registry)(None, {}), 10)
        assert info.value.status == 409
        assert reg.holder() == landed  # still the running operation's
    finally:
        control.store.close()  # type: ignore[union-attr]
