"""The lock's register keeps changing under every attempt to take it (rebalance/cluster_lock.py,
``_MAX_DECISIONS``): the refusal carries the token of our last write, whose CAS lost but may still
take effect (a lost round that a later proposer completes), so the caller can ``release`` it.
Before, that refusal carried no token, and a write of ours that took effect held the lock for good
(another node sees its coordinator live: busy)."""

from __future__ import annotations

import msgspec
import pytest

from giaannd.client.registers import ABSENT, CasOutcome, Version
from giaannd.storage.rebalance.cluster_lock import _MAX_DECISIONS, LockHolder, OperationLockUnavailable
from tests.unit.topology.test_cluster_lock import MemoryRegister, _lock

pytestmark = pytest.mark.asyncio


class ChangingRegister(MemoryRegister):
    """Before each write of a lock (a non-empty value), a dead node's lock lands first, so the
    write loses; the last of the acquirer's writes loses too but takes effect (completed later)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    async def cas(self, key: str, expect: Version | None, value: bytes = b"",
                  timeout_s: float | None = None) -> CasOutcome:
        if expect is None or not value:
            return await super().cas(key, expect, value, timeout_s)
        self.writes += 1
        ver, _ = self.values.get(key, (ABSENT, b""))
        dead = msgspec.msgpack.encode(LockHolder(op=f"op-{self.writes}", kind="join", coordinator="dead",
                                                 token=1000 + self.writes, since=0.0))
        stale = ((ver[0] + 1, 7, 7), dead)
        self.values[key] = ((ver[0] + 2, 1, 1), value) if self.writes == _MAX_DECISIONS else stale
        return CasOutcome(False, *stale)


async def test_cluster_lock_kept_changing_refusal_carries_the_token_of_a_write_in_doubt() -> None:
    reg = ChangingRegister()
    lock = _lock(reg, "s1", {"s1", "s2"})
    with pytest.raises(OperationLockUnavailable, match="kept changing") as info:
        await lock.acquire("op-a", "join")
    assert reg.writes == _MAX_DECISIONS
    held = reg.holder()
    assert held is not None and held.coordinator == "s1"  # our last write took effect after all
    assert info.value.token == held.token  # so the caller can release it
    assert await lock.release(info.value.token)
    assert reg.holder() is None  # released: not held by s1 for good
