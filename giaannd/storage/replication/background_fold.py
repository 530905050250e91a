"""Folds of the store's delta runs into its base, in a worker thread: the event loop keeps serving.

Theory of operation
-------------------
A fold (rowengine/engine.py: the delta runs merged into the base once they hold 1/base_ratio of it,
and an idle node's before its heap trim, service.py ``fold_when_idle``) moves the whole base: ~0.1
s at 10^7 entries, seconds at 10^8, minutes at the 10^9-10^10 a node is meant to hold. Run on the
event loop, it stopped everything else on the node for that long, gossip's acks included (a node
folding for longer than the probe timeout was suspected by its peers). So the service sets the
store's ``on_fold_due`` (column_store.py: a commit then never folds, it reports the fold due) and
this object runs the fold in a worker thread; the fold's kernels release the GIL (jit.py), so the
loop runs beside it.

The gate, in three parts, every one needed:

- the writes' lock (the service's ``_snapshot_lock``: every apply, drop and snapshot freeze holds
  it) is held for the whole fold, so drops and freezes wait for it without blocking the loop. A
  writer's ``ApplyBatch`` does not wait: it is logged and acknowledged during the fold, and applied
  to the rows when the fold ends, before the gate opens (storage/engine/deferred_applies.py; one
  that cannot be deferred, a retry or a batch past the deferred bytes, waits as before);
- ``ready()`` (an event, open while no fold runs): what reads await before they touch the store
  (the service's request path), so they too wait without blocking the loop;
- the engine's lock (rowengine/engine.py "Threads"), held by the fold's thread: any other use of
  the runs that comes during a fold waits for it there. Correct, but that call blocks the loop
  until the fold ends, so the users outside the request path await ``ready()`` first too (a
  stream source's chunk reads and verification, a repair server's pages; a stream receiver skips
  its ``reserve`` hint); what is left is in docs/storage.md "Known gaps".

Around the gate, so that a fold costs the cluster less than its wall time (docs/storage.md, "Folds
off the event loop"):

- **reads go to another replica**: a ``ReadRows`` whose caller has another live replica of its rows
  (``busy_ok``) is answered ``Unavailable`` at once while a fold runs (the service's request path),
  and the client reads those rows from the next replica (client/reads.py, "Around folds");
- **replicas fold at different moments**: replicas of a column get the same writes, so with one
  fold point (delta runs at 1/base_ratio of the base) nodes holding the same rows would fold
  together and a write whose W replicas are all folding would wait for the folds. Each fold's
  point is the base_ratio threshold times a scale drawn per fold (``fold_scales``: ``1 + jitter *
  (2u - 1)``, u uniform from a generator seeded by the node's name, ``storage.fold-jitter``), so
  the mean point is unchanged and two nodes that fold together once drift apart.

Rows are what the plain path gives, bit for bit: the fold is the same ``RowEngine.compact``, and
nothing reads or writes the runs while it moves them. A snapshot's frozen view is never written
(run.py, "Merges in place"). Cancelled (the service stopping), a fold still waits for its thread (a
thread cannot be stopped) and keeps the writes' lock until then, so nothing, not the final snapshot
either, sees the runs mid-move.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.errors import Refused
from giaannd.storage.engine.column_store import DropResult
from giaannd.storage.engine.deferred_applies import DeferredApplies, Ops, Told

if TYPE_CHECKING:
    from giaannd.storage.engine.recovery import DurableStore

__all__ = ["APPLY_ON_LOOP_BYTES", "BackgroundFold", "Foldable", "FoldsClosed", "fold_scales", "thread_result"]

#: Writes held during a fold (deferred_applies.py) are applied in a worker thread while more than
#: this many bytes of them are held, the rest on the event loop (~5 ms of applies).
APPLY_ON_LOOP_BYTES = 1 << 20

log = logging.getLogger(__name__)

T = TypeVar("T")


async def thread_result(work: asyncio.Future[T]) -> T:
    """The result of ``work``, a worker thread's (``run_in_executor``). Cancelled, it still waits for
    the thread to end (a thread cannot be stopped), then raises ``CancelledError``; the caller
    reads what the thread made from ``work`` then (to release it)."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


def fold_scales(node_name: str, jitter: float) -> Iterator[float]:
    """The scale of each fold point of ``node_name``'s store, for ever (module docstring): ``1 +
    jitter * (2u - 1)``, u uniform in [0, 1) from a generator seeded by the name (stable across
    restarts).

    Raises:
        ValueError: a jitter outside [0, 1).
    """
    if not 0 <= jitter < 1:
        raise ValueError(f"fold jitter must be in [0, 1), got {jitter}")
    rng = random.Random(xxhash.xxh3_64_intdigest(b"fold:" + node_name.encode()))
    while True:
        yield 1 + jitter * (2 * rng.random() - 1)


class Foldable(Protocol):
    """What folds: a ``DurableStore`` (or its ``ColumnStore``)."""

    @property
    def deferred(self) -> DeferredApplies: ...

    def fold_deltas(self, due_only: bool = False) -> int: ...


class FoldsClosed(Refused, RuntimeError):
    """The store's worker-thread work was closed (the service is stopping): nothing was done."""

    reason = "stopping"


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await thread_result(asyncio.get_running_loop().run_in_executor(None, fn, *args))


class BackgroundFold:
    """Folds of ``store``'s delta runs in a worker thread, while ``writes`` (the lock every write to
    the store holds) is held (module docstring). ``due`` is the store's ``on_fold_due``;
    ``after_fold`` is called on the loop after each fold that moved entries (the service draws the
    next fold point there)."""

    def __init__(self, store: Foldable, writes: asyncio.Lock, after_fold: Callable[[], None] | None = None) -> None:
        self.store = store
        self.writes = writes
        self.after_fold = after_fold
        #: called with the seconds the gate was closed, after each fold (or large tier merge)
        self.observe: Callable[[float], None] | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._task: asyncio.Task[int] | None = None
        #: the event loop the gate is held on (``exclusive``): where ``due`` goes from a worker thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        #: folds done (each moved the base once) and the delta entries they moved
        self.folds = 0
        self.moved = 0

    @property
    def running(self) -> bool:
        """A fold is moving the runs now."""
        return not self._open.is_set()

    async def ready(self) -> None:
        """Return once no fold runs (at once when none does): what a read awaits before it touches
        the store, with no await between this and the read."""
        await self._open.wait()

    def due(self) -> None:
        """A commit found a fold due (``ColumnStore.on_fold_due``): start one in the background,
        unless one is started already (it folds every delta run there is then). A commit in a
        worker thread (the writes held behind the gate, applied by ``_apply_deferred``) hands this
        to the event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not on the loop: a worker thread's commit, inside ``exclusive``
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.due)
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.fold(due_only=True))
            self._task.add_done_callback(_log_failure)

    @contextlib.asynccontextmanager
    async def exclusive(self, observe: bool = False) -> AsyncIterator[None]:
        """Hold the store for work that moves its rows in worker threads, the way a fold holds it
        (module docstring: the writes' lock held, the gate closed; writes meanwhile are logged,
        acknowledged and applied when the body ends, before the gate opens again). ``observe``:
        the gate's closed time goes to ``observe`` (the folds' histogram).

        Raises:
            FoldsClosed: ``close`` was called (before or while waiting for the lock).
        """
        async with self.writes:
            if self._closed:
                raise FoldsClosed("the store is closing")
            self._loop = asyncio.get_running_loop()
            self._open.clear()
            started = time.perf_counter()
            try:
                yield
                await self._apply_deferred()
            finally:
                try:  # the last writes logged meanwhile (all of them after a failure or a
                    self.store.deferred.apply()  # cancellation), before anything reads the rows again
                finally:
                    self._open.set()
                    if observe and self.observe is not None:
                        self.observe(time.perf_counter() - started)

    async def fold(self, due_only: bool = False) -> int:
        """Fold the delta runs into the base in a worker thread, once the writes' lock is free, and
        return the entries moved (``DurableStore.fold_deltas``; ``due_only``: only if a fold is
        still due then, ``RowEngine.fold_due``)."""
        try:
            async with self.exclusive(observe=True):
                moved = await _in_thread(self.store.fold_deltas, due_only)
        except FoldsClosed:
            return 0
        if moved:
            self.folds += 1
            self.moved += moved
            if self.after_fold is not None:
                self.after_fold()
        return moved

    async def drop(self, durable: DurableStore, pick: Callable[[NDArray[np.uint64]], NDArray[np.uint64]],
                   among: Callable[[], NDArray[np.uint64] | None] = lambda: None
                   ) -> tuple[NDArray[np.uint64], DropResult]:
        """Drop columns from ``durable`` (this object's store) the way a fold moves rows: behind the
        gate (``exclusive``), the O(store) parts in worker threads. In order: ``among()`` on the
        event loop (the candidate columns, None: every column held); the columns held among them,
        in a thread (the sorted key index, brought up to date); ``pick(held)`` on the loop (the
        columns to drop: sorted and unique, as ``held`` is); the drop record logged on the loop
        (where writes held meanwhile are logged too, after it: replay meets them in the order the
        rows do); the rows dropped in a thread (``ColumnStore.drop_columns``: the engine's drop,
        O(store), seconds at 10^8 entries). Returns the columns picked and what went; durable once
        the log is synced past it. Before Nov 30 a topology change's release and a discarded
        stream did all of it on the event loop: 7.9 s at 8.6·10^7 entries, with gossip's acks
        waiting (docs/topology.md, "Releasing columns off the event loop").

        Raises:
            FoldsClosed: the store is closing; nothing was dropped.
            OSError: the log write failed; nothing was dropped.
        """
        async with self.exclusive():
            held = await _in_thread(durable.store.held_columns, among())
            columns = pick(held)
            if columns.shape[0] == 0:
                return columns, DropResult(0, 0)
            durable.log_drop(columns)
            # writes deferred while the listing ran are logged before the drop record: applied
            # before the drop, as replay applies them (after it, their rows outlived the drop until
            # the next restart); those deferred from here on come after it, at the gate's end
            deferred = durable.deferred
            ops = deferred.take()
            work = asyncio.get_running_loop().run_in_executor(None, _apply_then_drop, durable, ops, columns)
            try:
                told, result = await thread_result(work)
            finally:  # (settled however it ended, as ``_apply_deferred``)
                if work.done() and not work.cancelled() and work.exception() is None:
                    deferred.settle(ops, work.result()[0])
        return columns, result

    async def whole_store(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a pass over the whole store (O(rows): a repair's listing of every key by
        peer), in a worker thread behind the gate (``exclusive``), so that the event loop serves
        meanwhile, as during a fold.

        Raises:
            FoldsClosed: the store is closing; ``fn`` did not run.
        """
        async with self.exclusive():
            return await _in_thread(fn, *args)

    async def _apply_deferred(self) -> None:
        """Apply the writes logged during the fold in a worker thread while more than
        ``APPLY_ON_LOOP_BYTES`` of them are held (the gate stays closed; writes that come meanwhile
        are still deferred, and applied in the next round): a long fold's writes are not applied
        on the event loop all at once (deferred_applies.py)."""
        deferred = self.store.deferred
        while deferred.held_bytes > APPLY_ON_LOOP_BYTES and len(deferred):
            ops = deferred.take()
            work = asyncio.get_running_loop().run_in_executor(None, deferred.apply_ops, ops)
            try:
                await thread_result(work)
            finally:  # (settled however it ended: cancelled, it still waited for the thread)
                if work.done() and not work.cancelled() and work.exception() is None:
                    deferred.settle(ops, work.result())

    async def close(self) -> None:
        """Start no fold any more; cancel one started by ``due``, and wait for the thread of any
        fold under way (module docstring)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        await self._open.wait()


def _apply_then_drop(durable: DurableStore, ops: Ops, columns: NDArray[np.uint64]) -> tuple[Told, DropResult]:
    """``BackgroundFold.drop``'s thread: the writes logged before the drop record, then the drop."""
    told = durable.deferred.apply_ops(ops)
    return told, durable.store.drop_columns(columns)


def _log_failure(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("fold of the delta runs failed: %r", exc)
