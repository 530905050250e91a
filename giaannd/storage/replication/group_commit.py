"""Group commit: many concurrent appends share one fsync (ARCHITECTURE §8).

Theory of operation
-------------------
Each apply appends a log record (seq ``s``) on the event loop and then awaits ``wait_durable(s)``.
At most one ``sync()`` runs at a time, in a worker thread. A waiter whose seq is not yet durable
joins the running sync if there is one, else starts one (after ``window_s``, so more appends can
join). A sync makes durable everything appended before it started, so when it finishes, every waiter
with ``seq <= durable`` is released together; those that appended while it ran start the next one.
Under load this gives one fsync per "generation" of concurrent appends, whatever their number.

A failed sync (``OSError``) fails every waiter of that generation; their batches are in the page cache
but not acknowledged, and the writer retries them elsewhere or later (idempotent by batch id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["GroupCommit"]


class GroupCommit:
    """Shares one threaded ``sync()`` among concurrent waiters.

    Args:
        sync: blocking, thread-safe, returns the highest durable seq (``DurableStore.sync``).
        durable_seq: what is already durable (after recovery).
        window_s: wait this long before syncing, so concurrent appends join (0: sync at once).
    """

    def __init__(self, sync: Callable[[], int], durable_seq: int = 0, window_s: float = 0.0) -> None:
        self._sync = sync
        self.durable_seq = durable_seq
        self.window_s = window_s
        self._running: asyncio.Task[int] | None = None
        #: number of fsyncs done (metrics: applies / fsyncs = the group-commit ratio)
        self.syncs = 0

    async def wait_durable(self, seq: int) -> None:
        """Return once ``seq`` is durable.

        Raises:
            OSError: the sync covering it failed.
        """
        while self.durable_seq < seq:
            task = self._running
            if task is None:
                task = self._running = asyncio.get_running_loop().create_task(self._run())
                # retrieved here too, so a failure whose waiters were all cancelled is not reported
                # as "never retrieved"
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            # shield: one waiter being cancelled (its request's deadline) must not cancel the
            # sync the others share
            await asyncio.shield(task)

    async def _run(self) -> int:
        try:
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            durable = await asyncio.to_thread(self._sync)
            self.syncs += 1
            self.durable_seq = max(self.durable_seq, durable)
            return durable
        finally:
            self._running = None

    async def drain(self) -> None:
        """Wait for a running sync to finish (shutdown)."""
        task = self._running
        if task is not None:
            try:
                await asyncio.shield(task)
            except OSError:
                pass
