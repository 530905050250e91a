"""The cluster's topology-operation lock (rebalance/cluster_lock.py) over an in-memory register
with the CAS contract of client/registers.py: one holder at a time, stale holders taken over,
releases that name their own version, an unreachable register reported as such."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from giaannd.client.errors import RegisterUnavailable
from giaannd.client.registers import ABSENT, CasOutcome, RegisterRead, Version
from giaannd.storage.rebalance.cluster_lock import (
    LOCK_KEY,
    ClusterLock,
    LockHolder,
    OperationLockBusy,
    OperationLockSealed,
    OperationLockUnavailable,
    retry_release,
)

pytestmark = pytest.mark.asyncio


class MemoryRegister:
    """One process's stand-in for the replicated registers: linearizable CAS on versions."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[Version, bytes]] = {}
        self.down = False
        self.cas_calls = 0
        #: a write that lands between an acquirer's read and its CAS (a concurrent proposer)
        self.interleave: list[tuple[str, bytes]] = []

    async def cas(self, key: str, expect: Version | None, value: bytes = b"",
                  timeout_s: float | None = None) -> CasOutcome:
        self.cas_calls += 1
        if self.down:
            raise RegisterUnavailable("1 of 3 owners answered (need 2)")
        if expect is not None and self.interleave:
            k, v = self.interleave.pop(0)
            ver, _ = self.values.get(k, (ABSENT, b""))
            self.values[k] = ((ver[0] + 1, 7, 7), v)
        version, current = self.values.get(key, (ABSENT, b""))
        if expect is None or expect != version:
            return CasOutcome(expect is None, version, current)
        new = (version[0] + 1, 1, 1)
        self.values[key] = (new, value)
        return CasOutcome(True, new, value)

    async def read(self, key: str, timeout_s: float | None = None) -> RegisterRead:
        if self.down:
            raise RegisterUnavailable("1 of 3 owners answered (need 2)")
        version, value = self.values.get(key, (ABSENT, b""))
        return RegisterRead(version, value, True)

    def holder(self) -> LockHolder | None:
        value = self.values.get(LOCK_KEY, (ABSENT, b""))[1]
        return msgspec.msgpack.decode(value, type=LockHolder) if value else None


def _lock(reg: MemoryRegister, me: str, live: set[str]) -> ClusterLock:
    return ClusterLock(reg, me, lambda name: name in live)


async def test_cluster_lock_one_holder_at_a_time_and_the_refusal_names_it() -> None:
    reg, live = MemoryRegister(), {"s1", "s2", "s3"}
    a, b = _lock(reg, "s1", live), _lock(reg, "s2", live)
    token = await a.acquire("removenode:aa->bb", "removenode")
    holder = reg.holder()
    assert holder is not None and (holder.coordinator, holder.token, holder.kind) == ("s1", token, "removenode")
    with pytest.raises(OperationLockBusy) as info:
        await b.acquire("join:aa->cc", "join")
    assert info.value.holder.coordinator == "s1"
    assert "removenode" in str(info.value) and "s1" in str(info.value)
    assert await a.release(token)
    assert reg.holder() is None
    token_b = await b.acquire("join:aa->cc", "join")
    assert reg.holder() is not None and reg.holder().token == token_b  # type: ignore[union-attr]


async def test_cluster_lock_a_second_operation_of_the_same_node_is_refused_while_the_first_holds_it() -> None:
    reg = MemoryRegister()
    a = _lock(reg, "s1", {"s1"})
    await a.acquire("join:1", "join")
    with pytest.raises(OperationLockBusy):
        await a.acquire("decommission:2", "decommission")


async def test_cluster_lock_a_dead_coordinators_lock_is_taken_over() -> None:
    reg, live = MemoryRegister(), {"s1", "s2"}
    await _lock(reg, "s1", live).acquire("removenode:x", "removenode")
    live.discard("s1")  # the coordinator died with its operation
    b = _lock(reg, "s2", live)
    token = await b.acquire("removenode:y", "removenode")
    assert reg.holder().coordinator == "s2" and reg.holder().token == token  # type: ignore[union-attr]


async def test_cluster_lock_an_earlier_life_of_this_node_is_stale() -> None:
    reg, live = MemoryRegister(), {"s1", "s2"}
    await _lock(reg, "s1", live).acquire("join:x", "join")
    again = _lock(reg, "s1", live)  # the same node, restarted: its operation is not running
    with pytest.raises(OperationLockBusy):  # others still see a live holder
        await _lock(reg, "s2", live).acquire("join:y", "join")
    assert await again.release_own_stale()
    assert reg.holder() is None
    # and a restarted node's own next operation takes it over without the start-up release
    await _lock(reg, "s1", live).acquire("join:x", "join")
    token = await _lock(reg, "s1", live).acquire("join:x", "join")
    assert reg.holder().token == token  # type: ignore[union-attr]


async def test_cluster_lock_release_own_stale_leaves_another_nodes_and_its_own_live_lock() -> None:
    reg, live = MemoryRegister(), {"s1", "s2"}
    s1 = _lock(reg, "s1", live)
    token = await s1.acquire("join:x", "join")
    assert await s1.release_own_stale()  # held by this process: kept
    assert await _lock(reg, "s2", live).release_own_stale()  # another node's: kept
    assert reg.holder() is not None and reg.holder().token == token  # type: ignore[union-attr]


async def test_cluster_lock_release_after_a_take_over_leaves_the_new_holder() -> None:
    reg, live = MemoryRegister(), {"s1", "s2"}
    a = _lock(reg, "s1", live)
    token_a = await a.acquire("op-a", "removenode")
    live.discard("s1")
    token_b = await _lock(reg, "s2", live).acquire("op-b", "removenode")
    assert await a.release(token_a)  # no longer ours: nothing to do, and not retried
    assert reg.holder().token == token_b  # type: ignore[union-attr]


async def test_cluster_lock_a_write_between_the_read_and_the_cas_is_decided_again() -> None:
    reg, live = MemoryRegister(), {"s1", "s2"}
    other = msgspec.msgpack.encode(LockHolder(op="op-b", kind="join", coordinator="s2", token=5, since=0.0))
    reg.interleave.append((LOCK_KEY, other))  # s2 takes it while s1 decides
    with pytest.raises(OperationLockBusy) as info:
        await _lock(reg, "s1", live).acquire("op-a", "removenode")
    assert info.value.holder.coordinator == "s2"


async def test_cluster_lock_an_unreadable_value_is_taken_over() -> None:
    reg = MemoryRegister()
    reg.values[LOCK_KEY] = ((3, 1, 1), b"\xc1not msgpack")
    token = await _lock(reg, "s1", {"s1"}).acquire("op", "join")
    assert reg.holder().token == token  # type: ignore[union-attr]


async def test_cluster_lock_unreachable_register_is_unavailable_not_busy() -> None:
    reg = MemoryRegister()
    reg.down = True
    lock = _lock(reg, "s1", {"s1"})
    with pytest.raises(OperationLockUnavailable, match="cannot be reached"):
        await lock.acquire("op", "join")
    assert await lock.release_own_stale() is False


async def test_cluster_lock_release_is_retried_until_the_register_answers() -> None:
    reg = MemoryRegister()
    lock = _lock(reg, "s1", {"s1"})
    token = await lock.acquire("op", "join")
    reg.down = True
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 3:
            reg.down = False
        await asyncio.sleep(0)

    assert await retry_release(lock, token, sleep, every_s=1.0)
    assert len(sleeps) == 3 and reg.holder() is None
    token2 = await lock.acquire("op2", "join")
    reg.down = True
    assert not await retry_release(lock, token2, sleep, every_s=1.0, attempts=2)


async def test_cluster_lock_a_sealed_register_is_busy_not_unavailable() -> None:
    """An owner that sealed the lock's register (an operation's handoff moves it) refuses it: that
    says an operation is under way, so the acquire is refused as busy (409), never run without the
    lock, which is for owners that are down."""
    reg = MemoryRegister()

    async def sealed(key: str, expect: Version | None, value: bytes = b"",
                     timeout_s: float | None = None) -> CasOutcome:
        raise RegisterUnavailable("1 of 2 owners answered (need 2): s1: register sealed", sealed=True)

    reg.cas = sealed  # type: ignore[method-assign]
    with pytest.raises(OperationLockSealed) as info:
        await _lock(reg, "s0", {"s0", "s1"}).acquire("op", "join")
    assert isinstance(info.value, OperationLockBusy) and "sealed" in str(info.value)


async def test_register_round_reports_an_owner_that_sealed_the_key() -> None:
    from giaannd import protocol as p
    from giaannd.client.errors import RemoteNotOwner
    from giaannd.client.registers import ReadRound

    rnd = ReadRound("k", ["s0", "s1"])
    rnd.on_reply("s0", RemoteNotOwner("s0", p.NotOwner("e", p.REGISTER_SEALED)))
    assert rnd.done and rnd.outcome is None and rnd.sealed
    other = ReadRound("k", ["s0", "s1"])
    other.on_reply("s0", RemoteNotOwner("s0", p.NotOwner("e", "another reason")))
    assert other.done and not other.sealed
