"""Inference over the storage cluster: LIF sessions fed by a shared, batched, cached row fetcher.

Theory of operation
-------------------
A :class:`~giaannd.model.infer.LifSession` (the core's sans-IO session) asks for one row per step
(``needs_row()``: the current node's outgoing synapses, giaann-algorithm.md §4.4). Here an asyncio
task per session awaits that row from a :class:`RowFetcher` shared by every session of the node:

* **cache**: a byte-bounded LRU :class:`RowCache` (rows are read-only during inference, §4.4).
  Absent rows are cached too (as empty rows): an unknown node is asked for once. A read's reply is
  cached as one block (:meth:`RowCache.put_reply`): the rows are views of one compact copy of the
  reply, charged once while any of them is cached, so ``bytes`` is the memory really kept.
  Lookups count as hits, misses (read storage for this lookup) or ``in_flight_joins`` (served by
  a read made for another lookup: joined in flight, or held by the session since an earlier step).
* **batching and single flight**: keys asked for in the same event-loop tick — by any number of
  sessions — become one ``StorageClient.read_rows`` call; a key already in flight is awaited,
  never fetched twice. So each token costs at most one row fetch, and 8 concurrent sessions share
  round trips. The call groups its rows on as few live owners as possible
  (``inference_reader``, ``compute.infer-read-fewest-nodes``, on by default): a session waits for
  the reply, and each request costs a fixed ~0.1 ms at both ends, so a prompt's rows from one
  node instead of one request per first owner halve the wait (R = 3 on 3 nodes: 1.35 → 0.66 ms).
* **prefetch** (:class:`Lookahead`): in teacher-forced evaluation the rows the session will need
  are the prompt's own tokens, known in advance. The session's first step asks for the first
  ``prefetch_depth`` of them in one request (a whole prompt, at the default depth), and whenever
  fewer than half the window is left it asks for the next half in one request, so reads are
  batched (a round trip and the per-request work on both ends are paid once per half window, not
  once per token) and pipelined (the next half is on the wire while the steps before it run). The
  prefetched rows are *held by the session* until its step takes them, not only offered to the
  cache: without a cache (or with one too small to keep them) they would otherwise be read twice
  (issue 19: the no-cache runner read every row twice, one request per step). Held rows are at
  most ``prefetch_depth`` per session. A step whose row is already here takes it without a
  coroutine or an event-loop hand-off (:meth:`Lookahead.ready`). A prefetched read that fails is
  dropped (counted in ``prefetch_failures``, logged): its rows are read when a step needs them, and
  only that read's error fails the session; a step that joined a prefetch in flight (another
  prompt's read-ahead, say) reads its row again the same way. Free-running sessions know only
  their seed tokens ahead (those are prefetched); past them the next row is the one the step just
  chose (the choice is made the moment the row arrives), so prefetching "top candidates" would only
  ride in the same request as the real fetch; we do not do it.
* **read-ahead across prompts** (:class:`PromptReadAhead`, ``compute.infer-readahead-prompts``):
  an evaluation knows all its prompts, so when a prompt's session starts the first windows of the
  next ``readahead_prompts`` prompts are asked for too, refilled by halves: one request carries
  several prompts, and their rows arrive while earlier prompts step. One session at a time (or a
  prompt waiting for a session slot) therefore no longer waits one read per prompt that nothing
  overlaps. The read-ahead is asked for one loop iteration after the starting session's own
  window, so the request the running sessions wait for is not made larger by it. Sessions run in
  prompt order, ``max_sessions`` worker tasks taking the next prompt (a task per slot, not per
  prompt). Rows held are bounded by ``(max_sessions + readahead_prompts) × prefetch_depth``.
* **one read, one future**: a read of the fetcher (``_Flight``) has a single future and keeps the
  reply's rows, built once per read; a waiter takes its row (a view of the reply) once the read
  completed. Per key there is a dict entry, not a future, a done-callback and a loop callback.

**Invalidation rule** (the cache must never serve a row older than a write this node made): a
training job on this node calls :meth:`RowCache.invalidate_batch` with every batch once a quorum
acknowledged it; a fetch that was in flight across an invalidation is not cached (generation
check) nor joined by a lookup made after it (that lookup reads again), and a session drops every
row it holds once the cache's generation moved past the one its prefetch started at (held rows
are read again). Writes made by *other* compute nodes are not
seen by this cache: call ``clear()`` (the service does at the start of every eval and every
generation) — documented in docs/compute.md.

**Device**: ``Inference(device=...)`` (``compute.device``, resolved) picks the session class:
the numpy ``LifSession`` on ``cpu``, the torch ``TorchLifSession`` (giaannd/model/gpu/lif.py, the
activation state on the device) on ``cuda``. Rows still arrive here as host arrays (validated on
the host; the cache holds host rows) and the torch session moves what a step needs to the device.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np
from numpy.typing import NDArray

from giaannd.model.evaluate import EvalResult, Mode, continuation, generation_session, prediction_matches, token_matches
from giaannd.model.gpu.device import Device
from giaannd.model.gpu.lif import make_session
from giaannd.model.infer import REMEMBER_BYTES, SEED_TOKENS, DelimiterFlags, LifConstants, LifSession
from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.model.sentence import EncodedSentence

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PREFETCH_DEPTH", "DEFAULT_READAHEAD_PROMPTS", "Inference", "Lookahead", "PromptReadAhead",
           "RowCache", "RowFetcher", "drive_session", "inference_reader"]

#: Rows prefetched ahead of a teacher-forced session's current step (the window; it is refilled by
#: halves). 64 holds an evaluation prompt whole (bundled corpus: 25 tokens mean, 62 the longest of
#: the first 64; 32 left a fifth of them a second request of their own), so a prompt costs no
#: request of its own beyond the read-ahead's; rows held per session are bounded by it (module
#: docstring, "prefetch").
DEFAULT_PREFETCH_DEPTH: Final = 64
#: Prompts of an evaluation read ahead of the latest session started (``compute.infer-readahead-prompts``).
DEFAULT_READAHEAD_PROMPTS: Final = 16
#: Bytes charged per cached row on top of its arrays (dict + Row object); bounds empty rows too.
ROW_OVERHEAD_BYTES: Final = 160
#: Largest single read the fetcher issues (the client splits further per owner and MAX_READ_ROWS).
MAX_FETCH_ROWS: Final = 16_384

ReadRows = Callable[[NDArray[np.uint64], NDArray[np.uint64]], Awaitable[RowBatch]]


class _RowReader(Protocol):
    """What ``inference_reader`` needs of a ``StorageClient``."""

    async def read_rows(self, row_column: Any, row_feature: Any, timeout_s: float | None = None, *,
                        fewest: bool | None = None) -> RowBatch: ...


def inference_reader(client: _RowReader, *, fewest: bool) -> ReadRows:
    """The fetcher's ``read``: ``client.read_rows`` with the rows of each fetch grouped on as few
    live owners as possible when ``fewest`` (module docstring, "batching")."""
    async def read(row_column: NDArray[np.uint64], row_feature: NDArray[np.uint64]) -> RowBatch:
        return await client.read_rows(row_column, row_feature, fewest=fewest)

    return read


#: A reply is cached as one shared block (its rows views of one compact copy) when the block is at
#: most this fraction of the cache's bound; a larger one is cached row by row (compact copies), so
#: one reply cannot take the cache whole.
SHARED_BLOCK_FRACTION: Final = 8


def _own(row: Row) -> Row:
    """A compact copy (a fetched row is a view into a whole reply's buffers)."""
    return Row(row.segment.copy(), row.target_column.copy(), row.target_feature.copy(), row.strength.copy())


def _compact(batch: RowBatch) -> RowBatch:
    """``batch`` with its entry arrays copied compact (a reply's may be views of a larger receive
    buffer); one copy per array, not per row."""
    return RowBatch(batch.row_column, batch.row_feature, batch.offsets, batch.segment.copy(),
                    batch.target_column.copy(), batch.target_feature.copy(), batch.strength.copy())


def _rows_of(batch: RowBatch) -> dict[RowKey, Row]:
    """Every row of ``batch`` by key, as views of its arrays, in one pass (Python ints from
    ``tolist``, not a numpy scalar per offset)."""
    seg, col, feat, strength = batch.segment, batch.target_column, batch.target_feature, batch.strength
    off = batch.offsets.tolist()
    return {key: Row(seg[a:b], col[a:b], feat[a:b], strength[a:b])
            for key, a, b in zip(zip(batch.row_column.tolist(), batch.row_feature.tolist()), off, off[1:])}


def _entry_nbytes(batch: RowBatch) -> int:
    return int(batch.segment.nbytes + batch.target_column.nbytes + batch.target_feature.nbytes
               + batch.strength.nbytes)


class _Block:
    """The entry arrays of one reply, shared by the cached rows that are views of them: charged to
    the cache once, while at least one of its rows is cached."""

    __slots__ = ("nbytes", "rows")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.rows = 0


class RowCache:
    """Byte-bounded LRU of rows (see the module docstring for the invalidation rule).

    Args:
        max_bytes: capacity; 0 disables caching (every lookup misses).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.generation = 0
        self.hits = self.misses = self.evictions = self.invalidations = 0
        #: lookups neither served by the cache nor reading storage: their row came from a read made
        #: for another lookup (joined in flight, or held by a session since an earlier step)
        self.in_flight_joins = 0
        self._rows: OrderedDict[RowKey, Row] = OrderedDict()
        self._blocks: dict[RowKey, _Block] = {}  # the shared reply of each cached row that is a view of one

    def get(self, key: RowKey) -> Row | None:
        """The cached row of ``key`` (a hit), else None counted as a miss."""
        row = self.find(key)
        if row is None:
            self.misses += 1
        return row

    def find(self, key: RowKey) -> Row | None:
        """As :meth:`get`, but a None is not counted: the caller counts a miss or a join."""
        row = self._rows.get(key)
        if row is None:
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return row

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def put(self, key: RowKey, row: Row, generation: int) -> None:
        """Cache ``row`` unless an invalidation happened since ``generation`` was read."""
        if generation != self.generation or self.max_bytes == 0:
            return
        size = row.nbytes + ROW_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        self._remove(key)
        self._rows[key] = row
        self.bytes += size
        self._evict()

    def put_reply(self, keys: Iterable[RowKey], rows: dict[RowKey, Row], batch: RowBatch, generation: int) -> None:
        """Cache the row of every key (empty if ``rows`` lacks it), ``rows`` being views of
        ``batch``'s compact entry arrays: charged once for the arrays (a :class:`_Block`, freed with
        its last row) instead of a copy per row. A block over ``max_bytes / SHARED_BLOCK_FRACTION``
        is cached row by row (compact copies)."""
        if generation != self.generation or self.max_bytes == 0:
            return
        nbytes = _entry_nbytes(batch)
        if nbytes > self.max_bytes // SHARED_BLOCK_FRACTION:
            for key in keys:
                row = rows.get(key)
                self.put(key, _EMPTY if row is None else _own(row), generation)
            return
        block = _Block(nbytes)
        self.bytes += nbytes
        cached, blocks = self._rows, self._blocks
        for key in keys:
            self._remove(key)
            row = rows.get(key)
            if row is None:
                row = _EMPTY
            else:
                blocks[key] = block
                block.rows += 1
            cached[key] = row
            self.bytes += ROW_OVERHEAD_BYTES
        if block.rows == 0:
            self.bytes -= nbytes
        self._evict()

    def _remove(self, key: RowKey) -> bool:
        """Uncache ``key`` (its block's bytes go with the block's last row); whether it was cached."""
        row = self._rows.pop(key, None)
        if row is None:
            return False
        self._uncharge(key, row)
        return True

    def _uncharge(self, key: RowKey, row: Row) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            self.bytes -= row.nbytes + ROW_OVERHEAD_BYTES
            return
        self.bytes -= ROW_OVERHEAD_BYTES
        block.rows -= 1
        if block.rows == 0:
            self.bytes -= block.nbytes

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._rows:
            key, dropped = self._rows.popitem(last=False)
            self._uncharge(key, dropped)
            self.evictions += 1

    def invalidate(self, keys: Iterable[RowKey]) -> None:
        self.generation += 1
        for key in keys:
            if self._remove(key):
                self.invalidations += 1

    def invalidate_batch(self, batch: RowBatch) -> None:
        """Drop every row ``batch`` wrote (called after a local training write is acknowledged)."""
        self.invalidate(zip(batch.row_column.tolist(), batch.row_feature.tolist()))

    def clear(self) -> None:
        self.generation += 1
        self.invalidations += len(self._rows)
        self._rows.clear()
        self._blocks.clear()
        self.bytes = 0

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses + self.in_flight_joins
        return {"rows": len(self._rows), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "in_flight_joins": self.in_flight_joins,
                "evictions": self.evictions, "invalidations": self.invalidations,
                "hit_rate": round(self.hits / lookups, 4) if lookups else 0.0,
                "join_rate": round(self.in_flight_joins / lookups, 4) if lookups else 0.0}


class _Flight:
    """One read of the fetcher: the keys it asked for, then the reply's rows (``rows`` is set,
    before ``future`` completes, only when the read succeeded). One future per read, not per key: a
    waiter awaits the read and takes its row from the reply; each row is built once per read."""

    __slots__ = ("ahead", "dropped", "future", "generation", "keys", "rows")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.keys: list[RowKey] = []
        #: keys a prefetch asked for first (a guess made ahead): a step that joined the read for one
        #: of them reads it again if the read fails (``RowFetcher.fetch``)
        self.ahead: set[RowKey] = set()
        self.rows: dict[RowKey, Row] | None = None
        #: the read failed and a session that prefetched it dropped it (counted once per read)
        self.dropped = False
        #: the cache's generation when the read started (None: not sent yet); a read that started
        #: before an invalidation is joined by no later lookup (invalidation rule)
        self.generation: int | None = None

    def row(self, key: RowKey) -> Row:
        """The row of ``key`` (empty if storage has none) as views into the reply; only once the
        read succeeded."""
        assert self.rows is not None
        return self.rows.get(key, _EMPTY)

    def failed(self) -> bool:
        """Whether the read completed with an error (not cancelled)."""
        fut = self.future
        return fut.done() and not fut.cancelled() and fut.exception() is not None


_EMPTY: Final = Row.empty()


class RowFetcher:
    """Cached, batched, single-flight row reads shared by all sessions of a node.

    Args:
        read: ``read(row_column, row_feature) -> RowBatch`` (absent rows left out), e.g.
            ``StorageClient.read_rows``.
        cache: the node's row cache.
    """

    def __init__(self, read: ReadRows, cache: RowCache) -> None:
        self._read = read
        self.cache = cache
        self._pending: dict[RowKey, _Flight] = {}
        self._queued: list[_Flight] = []  # reads asked for in this loop iteration, sent by _flush
        self.requests = 0
        self.rows_fetched = 0
        self.prefetched = 0
        #: prefetched reads that failed and were dropped: their rows are read when a step needs them
        self.prefetch_failures = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def get(self, key: RowKey) -> Row:
        """The row of ``key`` (an empty row if storage has none).

        Raises:
            ReadFailed / StorageRequestError: every replica failed.
        """
        row = self.cache.find(key)
        if row is not None:
            return row
        return await self.fetch(key)

    async def fetch(self, key: RowKey, *, count: bool = True) -> Row:
        """As :meth:`get` without looking in the cache (the caller just did); counts the lookup as a
        miss, or as a join when a read of ``key`` is already in flight (``count=False``: the caller
        counted it already). A joined read that a prefetch asked ``key`` for and that failed is not
        this lookup's: the row is read again (module docstring, "prefetch")."""
        if count and self._joinable(key) is not None:
            self.cache.in_flight_joins += 1
        elif count:
            self.cache.misses += 1
        flight = self._flight(key)
        while True:
            try:
                await asyncio.shield(flight.future)
            except Exception:
                if key not in flight.ahead:  # a read made for a step: its error is the step's
                    raise
                # it joined a prefetch (a guess made ahead, maybe another prompt's read-ahead) that
                # failed: read the row for this step, as without the prefetch (a Lookahead's rule)
                flight = self._flight(key)
                continue
            return flight.row(key)

    def prefetch(self, keys: Iterable[RowKey], joined: set[RowKey] | None = None) -> dict[RowKey, _Flight]:
        """Start fetching rows not cached (keys in flight join their read, and are added to
        ``joined``); never waits, never raises (a failure is raised by awaiting the read, or by
        ``get``; a :class:`Lookahead` drops a failed read and reads its rows when a step needs them).

        Returns:
            the read of every key not cached, for the caller to hold until it uses the row.
        """
        out: dict[RowKey, _Flight] = {}
        for key in keys:
            if key in out or key in self.cache:
                continue
            flight = self._joinable(key)
            if flight is None:
                self.prefetched += 1
                flight = self._flight(key)
                flight.ahead.add(key)
            elif joined is not None:
                joined.add(key)
            out[key] = flight
        return out

    def _joinable(self, key: RowKey) -> _Flight | None:
        """The read of ``key`` a lookup may join: one not sent yet, or sent since the last
        invalidation (one sent before may return the row as it was before a write this node made;
        a later lookup reads it again, the invalidation rule)."""
        flight = self._pending.get(key)
        if flight is None or flight.generation is None or flight.generation == self.cache.generation:
            return flight
        return None

    def _flight(self, key: RowKey) -> _Flight:
        flight = self._joinable(key)
        if flight is not None:
            return flight
        if not self._queued or len(self._queued[-1].keys) >= MAX_FETCH_ROWS:
            loop = asyncio.get_running_loop()
            flight = _Flight(loop.create_future())
            # a prefetch, or a waiter cancelled while its read ran, leaves nobody to read a failure
            flight.future.add_done_callback(_consume)
            if not self._queued:
                loop.call_soon(self._flush)
            self._queued.append(flight)
        flight = self._queued[-1]
        flight.keys.append(key)
        self._pending[key] = flight
        return flight

    def _flush(self) -> None:
        flights, self._queued = self._queued, []
        for flight in flights:
            task = asyncio.get_running_loop().create_task(self._fetch(flight))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fetch(self, flight: _Flight) -> None:
        flight.generation = generation = self.cache.generation
        keys = flight.keys
        pending = self._pending
        cols = np.fromiter((k[0] for k in keys), np.uint64, len(keys))
        feats = np.fromiter((k[1] for k in keys), np.uint64, len(keys))
        self.requests += 1
        try:
            batch = await self._read(cols, feats)
        except BaseException as exc:  # every waiter hears of it; nothing stays pending forever
            for key in keys:
                if pending.get(key) is flight:  # else a later read of it (an invalidation since)
                    del pending[key]
            if isinstance(exc, Exception):
                flight.future.set_exception(exc)
                return
            flight.future.cancel()
            raise
        # the reply's rows built once, as views; cached, they are views of one compact copy of the
        # reply (a view of the reply itself could pin a larger receive buffer), charged once
        cache = self.cache
        caching = cache.max_bytes > 0 and generation == cache.generation
        if caching:
            batch = _compact(batch)
        flight.rows = rows = _rows_of(batch)
        self.rows_fetched += len(rows)
        for key in keys:
            if pending.get(key) is flight:
                del pending[key]
        if caching:
            cache.put_reply(keys, rows, batch, generation)
        flight.future.set_result(None)


def _consume(fut: asyncio.Future[None]) -> None:
    """Mark a read's outcome retrieved, so a failure nobody awaits is not reported as unhandled."""
    if not fut.cancelled():
        fut.exception()


async def drive_session(session: LifSession, fetcher: RowFetcher,
                        lookahead: Sequence[RowKey] = (), prefetch_depth: int = DEFAULT_PREFETCH_DEPTH, *,
                        ahead: Lookahead | None = None) -> int:
    """Run ``session`` to its end, one fetched row per step; returns the steps run.

    ``lookahead``: the nodes the session will need in order (teacher forcing: its targets), so the
    next ``prefetch_depth`` rows are fetched while earlier steps run. ``ahead``: a
    :class:`Lookahead` made (and possibly started) by the caller instead (prompt read-ahead).
    """
    if ahead is None and lookahead and prefetch_depth:
        ahead = Lookahead(fetcher, lookahead, prefetch_depth)
    steps = 0
    while (key := session.needs_row()) is not None:
        if ahead is None:
            row = await fetcher.get(key)
        else:  # step k+1 needs the row of node k (teacher-forced: target k)
            k = session.steps_run
            ready = ahead.ready(k, key)  # no coroutine, no hand-off when the row is already here
            row = ready if ready is not None else await ahead.row(k, key)
        session.step(row)
        steps += 1
    return steps


class Lookahead:
    """The rows one session prefetched and holds until its steps take them (module docstring,
    "prefetch" and the invalidation rule).

    Args:
        fetcher: the node's fetcher.
        keys: the row each step will need, in order (``keys[k]`` at ``steps_run == k``).
        depth: the window: rows asked for ahead of the current step, refilled by halves.
    """

    def __init__(self, fetcher: RowFetcher, keys: Sequence[RowKey], depth: int) -> None:
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self._fetcher = fetcher
        self._keys = keys
        self._depth = depth
        self._refill_below = max(1, depth // 2)
        self._end = 0  # keys[:_end] were prefetched
        self._held: dict[RowKey, _Flight] = {}
        self._joined: set[RowKey] = set()  # held keys whose read was made for another lookup
        self._last_use: dict[RowKey, int] = {}  # the last index of the window that needs each held key
        self._generation = fetcher.cache.generation

    def fill(self, k: int) -> None:
        """Make sure the window from index ``k`` is asked for (refilled once fewer than half of it is
        left); drops what it holds first if the cache was invalidated since it was asked for."""
        fetcher = self._fetcher
        if fetcher.cache.generation != self._generation:  # an invalidation since: hold nothing older
            self._held.clear()
            self._joined.clear()
            self._last_use.clear()
            self._end = min(self._end, k)
            self._generation = fetcher.cache.generation
        if self._end - k < self._refill_below and self._end < len(self._keys):
            start = max(self._end, k)
            self._end = min(len(self._keys), k + self._depth)
            window = self._keys[start:self._end]
            joined: set[RowKey] = set()
            fetched = fetcher.prefetch(window, joined)
            joined.difference_update(self._held)  # in flight since this session's earlier window: its own read
            self._joined |= joined
            self._held.update(fetched)
            for i, w in enumerate(window, start):
                self._last_use[w] = i

    def ready(self, k: int, key: RowKey) -> Row | None:
        """The row of ``key`` (needed at index ``k``) if this session holds it already read; else
        None (then :meth:`row`). Refills the window first."""
        self.fill(k)
        flight = self._usable(key)
        if flight is None:  # cached when the window was asked for (or not the known token)
            return self._fetcher.cache.find(key)  # a None is counted by row()
        if flight.rows is None:
            return None
        self._take(k, key)
        return flight.row(key)

    async def row(self, k: int, key: RowKey) -> Row:
        """The row of ``key``, needed at index ``k``, once :meth:`ready` returned None for it."""
        self.fill(k)
        flight = self._usable(key)
        if flight is None:  # ready() looked in the cache already
            return await self._fetcher.fetch(key)
        self._take(k, key)
        try:
            await asyncio.shield(flight.future)
        except Exception:  # the prefetch failed: read the row now (the lookup is counted already)
            self._drop_failed(flight)
            return await self._fetcher.fetch(key, count=False)
        return flight.row(key)

    def close(self) -> None:
        """The session ended: let go of the rows it still holds (a teacher-forced session never takes
        its last token's row, and a held row pins its whole reply) and ask for nothing more (a
        read-ahead may still call :meth:`fill`)."""
        self._keys = ()
        self._end = 0
        self._held.clear()
        self._joined.clear()
        self._last_use.clear()

    def _usable(self, key: RowKey) -> _Flight | None:
        """The held read of ``key``, unless it failed: then every row held from it is dropped and
        None returned, so the step reads its row on demand (a prefetch is a guess made ahead; a
        transient error on it must not fail the prompt that later needs the row)."""
        flight = self._held.get(key)
        if flight is not None and flight.failed():
            self._drop_failed(flight)
            return None
        return flight

    def _drop_failed(self, flight: _Flight) -> None:
        """Let go of every row held from ``flight``, a failed read; counted and logged once per read."""
        for key in [key for key, held in self._held.items() if held is flight]:
            del self._held[key]
            self._last_use.pop(key, None)
            self._joined.discard(key)
        if not flight.dropped:
            flight.dropped = True
            self._fetcher.prefetch_failures += 1
            log.warning("prefetch failed, its rows are read when needed rows=%d error=%r",
                        len(flight.keys), flight.future.exception())

    def _take(self, k: int, key: RowKey) -> None:
        cache = self._fetcher.cache
        joined = self._joined
        if key in joined:  # another lookup's read (or this session's, for an earlier step)
            cache.in_flight_joins += 1
        else:  # read from storage for this lookup
            cache.misses += 1
        if self._last_use.get(key, k) <= k:
            del self._held[key]
            del self._last_use[key]
            joined.discard(key)
        else:  # a later step takes the same read again
            joined.add(key)


class PromptReadAhead:
    """Read-ahead across the prompts of one evaluation (module docstring, "read-ahead"): when a
    prompt's session starts, the first windows of the next ``prompts`` prompts are asked for,
    refilled by halves, so each refill is one request for several prompts and their rows arrive
    while earlier prompts step.

    Args:
        aheads: the :class:`Lookahead` of every prompt (None: nothing known ahead), in the order
            their sessions start.
        prompts: prompts read ahead of the latest one started (0: none).
    """

    def __init__(self, aheads: Sequence[Lookahead | None], prompts: int) -> None:
        if prompts < 0:
            raise ValueError("prompts must be >= 0")
        self._aheads = aheads
        self._prompts = prompts
        self._refill_below = max(1, prompts // 2)
        self._end = 0  # aheads[:_end] were started

    def started(self, i: int) -> None:
        """Prompt ``i``'s session starts, its own window already asked for: the read-ahead is asked
        for in the next loop iteration, so it travels in a request of its own after the one the
        running sessions wait for (the fetcher sends what was asked in one iteration together)."""
        if self._end - i <= self._refill_below:
            end = min(len(self._aheads), i + 1 + self._prompts)
            asyncio.get_running_loop().call_soon(self._fill, max(self._end, i + 1), end)
            self._end = max(self._end, end)

    def _fill(self, start: int, end: int) -> None:
        for ahead in self._aheads[start:end]:
            if ahead is not None:
                ahead.fill(0)


@dataclass
class EvalReport:
    """An evaluation's counts plus, per prompt, the prediction of every scored step."""

    result: EvalResult
    predictions: list[list[RowKey | None]] = field(default_factory=list)
    elapsed_s: float = 0.0


class Inference:
    """Many LIF sessions at once against one :class:`RowFetcher`.

    Args:
        fetcher: the node's shared fetcher.
        max_sessions: sessions stepping concurrently (more wait their turn).
        prefetch_depth: teacher-forced lookahead.
        readahead_prompts: prompts of an evaluation whose first window is read before their
            session starts (module docstring, "read-ahead"); 0 turns it off.
        device: where the sessions' activation state lives (module docstring, "Device").
        remember_bytes: what each session may spend remembering the long rows it fired
            (``LifSession``'s ``remember_bytes``, ``compute.infer-remember-bytes``).
    """

    def __init__(self, fetcher: RowFetcher, *, max_sessions: int = 64,
                 prefetch_depth: int = DEFAULT_PREFETCH_DEPTH, readahead_prompts: int = DEFAULT_READAHEAD_PROMPTS,
                 device: Device = "cpu", remember_bytes: int = REMEMBER_BYTES) -> None:
        if max_sessions < 1 or prefetch_depth < 0 or readahead_prompts < 0:
            raise ValueError("max_sessions must be >= 1, prefetch_depth and readahead_prompts >= 0")
        self.fetcher = fetcher
        self.prefetch_depth = prefetch_depth
        self.readahead_prompts = readahead_prompts
        self.max_sessions = max_sessions
        self._slots = asyncio.Semaphore(max_sessions)
        self.steps = 0
        self.sessions = 0
        self.device: Device = device
        self._new_session: Callable[..., LifSession] = functools.partial(make_session, device,
                                                                         remember_bytes=remember_bytes)

    async def _run(self, session: LifSession, ahead: Lookahead | None,
                   readahead: PromptReadAhead | None = None, i: int = 0) -> None:
        async with self._slots:
            self.sessions += 1
            if ahead is not None:
                ahead.fill(0)  # its own window first: the read-ahead goes in the request after
            if readahead is not None:
                readahead.started(i)
            try:
                steps = await drive_session(session, self.fetcher, ahead=ahead)
            finally:
                if ahead is not None:  # an evaluation keeps every prompt's lookahead to its end
                    ahead.close()
            self.steps += steps  # not `+= await`: that reads self.steps before the await

    def _lookahead(self, keys: Sequence[RowKey]) -> Lookahead | None:
        return Lookahead(self.fetcher, keys, self.prefetch_depth) if keys and self.prefetch_depth else None

    async def evaluate(self, sentences: Sequence[EncodedSentence], flags: DelimiterFlags, constants: LifConstants,
                       mode: Mode = "teacher", *, seed_tokens: int = SEED_TOKENS) -> EvalReport:
        """Top-1 accuracy (giaann-algorithm.md §7) of every prompt, ``max_sessions`` sessions at once
        in prompt order (the next prompts read ahead); the same counts as
        ``giaannd.model.evaluate.evaluate``."""
        if mode not in ("teacher", "free"):
            raise ValueError(f"mode must be 'teacher' or 'free', got {mode!r}")
        if seed_tokens < 1:  # as the core's: a session always seeds token 0, it would be scored as a miss
            raise ValueError(f"seed_tokens must be >= 1, got {seed_tokens}")
        t0 = time.perf_counter()
        result = EvalResult()
        kept = [s for s in sentences if len(s) >= seed_tokens + 1]
        result.skipped_short = len(sentences) - len(kept)
        prompts: list[tuple[LifSession, Lookahead | None]] = []
        for sent in kept:
            targets = list(zip(sent.column.tolist(), sent.feature.tolist()))
            session = self._new_session(targets, flags, constants, seed_tokens=seed_tokens,
                                        teacher_forced=(mode == "teacher"))
            # free running: only the seed tokens are known ahead
            prompts.append((session, self._lookahead(targets if mode == "teacher" else targets[:seed_tokens])))
        readahead = PromptReadAhead([ahead for _, ahead in prompts], self.readahead_prompts)
        order = iter(range(len(prompts)))

        async def worker() -> None:  # prompts start in order; a task per session slot, not per prompt
            for i in order:
                await self._run(*prompts[i], readahead, i)

        # a TaskGroup, not gather: one failed session cancels the others instead of orphaning them
        failure: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(self.max_sessions, len(prompts))):
                    group.create_task(worker())
        except ExceptionGroup as eg:  # callers handle the first failure as if a session raised it
            failure = eg.exceptions[0]
        if failure is not None:
            # raised outside the handler, so its context is not the group that holds it (a cycle)
            raise failure
        report = EvalReport(result)
        for sent, (session, _) in zip(kept, prompts):
            result.prompts += 1
            result.steps += session.steps_run
            preds: list[RowKey | None] = []
            for k in range(seed_tokens, len(sent)):
                pred = session.predictions.get(k)
                preds.append(pred)
                ok = (prediction_matches(pred, sent.target_word(k)) if sent.token_id is None
                      else token_matches(pred, int(sent.token_id[k])))
                result.prediction_tokens += 1
                result.matches += ok
                result.no_prediction += pred is None
            report.predictions.append(preds)
        report.elapsed_s = time.perf_counter() - t0
        return report

    async def generate(self, prompt: Sequence[RowKey], flags: DelimiterFlags, constants: LifConstants,
                       max_new_tokens: int) -> list[RowKey]:
        """Free-running continuation (as ``giaannd.model.evaluate.generate``): every prompt token
        seeds, then predictions drive; stops at the first step with no prediction."""
        session = generation_session(prompt, flags, constants, max_new_tokens, self._new_session)
        if session is None:
            return []
        await self._run(session, self._lookahead(list(prompt)))
        return continuation(session)
