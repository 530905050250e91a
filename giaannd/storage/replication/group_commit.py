"""Group commit: many concurrent appends share one fsync (ARCHITECTURE §8).

Theory of operation
-------------------
Each apply appends a log record (seq ``s``) on the event loop and then awaits ``wait_durable(s)``.
At most one syncing run exists at a time, in a worker thread. A waiter whose seq is not yet durable
waits for the running one if there is one, else starts one (after ``window_s``, so more appends can
join). A sync makes durable everything appended before it started, and each sync's durable seq is
published to the loop as soon as it ends: every waiter with ``seq <= durable`` is released
together.

The run syncs again at once, in its thread, while records were appended after the sync it just
made (``appended``), up to ``MAX_ROUNDS`` syncs: a generation's fsync then starts when the one
before ends, not when the event loop gets round to noticing that it ended. A busy loop notices
late: measured on a stream's receiver (issue 19 item 3, docs/topology.md "A join's wall time"),
the loop saw a sync's end 22–33 ms after it, for syncs of 7–13 ms, and the next generation's sync
waited for that. Publishing each round's seq keeps the early waiters' latency that of their own
sync.

A failed sync (``OSError``, or any error of ``sync``) fails every waiter not yet durable; their
batches are in the page cache but not acknowledged, and the writer retries them elsewhere or later
(idempotent by batch id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

__all__ = ["GroupCommit", "MAX_ROUNDS"]

#: Syncs one run makes back to back in its thread while appends keep coming; then it ends and the
#: next waiter starts another (so a run under a stream of appends does not hold its thread for
#: ever, and ``drain`` ends).
MAX_ROUNDS: Final = 16


class GroupCommit:
    """Shares one threaded ``sync()`` among concurrent waiters.

    Args:
        sync: blocking, thread-safe, returns the highest durable seq (``DurableStore.sync``).
        durable_seq: what is already durable (after recovery).
        window_s: wait this long before syncing, so concurrent appends join (0: sync at once).
        appended: the seq of the last record appended (read from the sync's thread: an int
            attribute, ``UpdateLog.last_seq``); None: one sync per run.
    """

    def __init__(self, sync: Callable[[], int], durable_seq: int = 0, window_s: float = 0.0,
                 appended: Callable[[], int] | None = None) -> None:
        self._sync = sync
        self._appended = appended
        self.durable_seq = durable_seq
        self.window_s = window_s
        self._running: asyncio.Task[None] | None = None
        #: resolved at the next published seq (or failed with the sync's error); None: nobody waits
        self._advanced: asyncio.Future[None] | None = None
        #: number of fsyncs done (metrics: applies / fsyncs = the group-commit ratio)
        self.syncs = 0

    async def wait_durable(self, seq: int) -> None:
        """Return once ``seq`` is durable.

        Raises:
            OSError: the sync covering it failed.
        """
        loop = asyncio.get_running_loop()
        while self.durable_seq < seq:
            if self._running is None:
                self._running = loop.create_task(self._run())
            advanced = self._advanced
            if advanced is None:
                advanced = self._advanced = loop.create_future()
                # retrieved here too, so a failure whose waiters were all cancelled is not
                # reported as "never retrieved"
                advanced.add_done_callback(lambda f: f.cancelled() or f.exception())
            # shield: one waiter being cancelled (its request's deadline) must not cancel what
            # the others wait on
            await asyncio.shield(advanced)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            await asyncio.to_thread(self._rounds, loop)
        except asyncio.CancelledError:  # (shutdown) its waiters are cancelled too
            advanced, self._advanced = self._advanced, None
            if advanced is not None:
                advanced.cancel()
            raise
        except Exception as exc:  # (a closed log: ValueError) every waiter gets it, as a failed fsync
            self._wake(exc)
        finally:
            self._running = None
            # waiters whose records came after the last round look again (and start a new run)
            self._wake()

    def _rounds(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the worker thread: sync, publish, and again while records were appended since."""
        for _ in range(MAX_ROUNDS):
            durable = self._sync()
            loop.call_soon_threadsafe(self._publish, durable)
            if self._appended is None or self._appended() <= durable:
                return

    def _publish(self, durable: int) -> None:
        """On the loop: one sync ended, durable through ``durable``."""
        self.syncs += 1
        if durable > self.durable_seq:
            self.durable_seq = durable
            self._wake()

    def _wake(self, error: Exception | None = None) -> None:
        advanced, self._advanced = self._advanced, None
        if advanced is not None and not advanced.done():
            if error is None:
                advanced.set_result(None)
            else:
                advanced.set_exception(error)

    async def drain(self) -> None:
        """Wait for a running sync to finish (shutdown)."""
        task = self._running
        if task is not None:
            await asyncio.shield(task)
