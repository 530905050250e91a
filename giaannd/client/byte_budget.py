"""ByteBudget: a bound on bytes in flight, the backpressure of writes.

The StorageClient keeps one per owner (``max_inflight_bytes_per_owner`` of ApplyBatch bytes): a
slow owner makes ``write`` wait instead of queueing unbounded memory. Training jobs keep one for
their unacknowledged batches. A request larger than the whole limit may go alone, so the budget
never deadlocks.
"""

from __future__ import annotations

import asyncio

__all__ = ["ByteBudget"]


class ByteBudget:
    """At most ``limit`` bytes in flight; one oversized request may go alone (never deadlocks).

    Shared by the client (per-owner in-flight writes) and training jobs (unacknowledged batches).
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()
