"""Inference over the storage cluster: LIF sessions fed by a shared, batched, cached row fetcher.

Theory of operation
-------------------
A :class:`~giaannd.model.infer.LifSession` (the core's sans-IO session) asks for one row per step
(``needs_row()``: the current node's outgoing synapses, giaann-algorithm.md §4.4). Here an asyncio
task per session awaits that row from a :class:`RowFetcher` shared by every session of the node:

* **cache**: a byte-bounded LRU :class:`RowCache` (rows are read-only during inference, §4.4).
  Absent rows are cached too (as empty rows): an unknown node is asked for once.
* **batching and single flight**: keys asked for in the same event-loop tick — by any number of
  sessions — become one ``StorageClient.read_rows`` call (which sends one ReadRows per live owner);
  a key already in flight is awaited, never fetched twice. So each token costs at most one row
  fetch, and 8 concurrent sessions share round trips.
* **prefetch**: in teacher-forced evaluation the rows the session will need are the prompt's own
  tokens, known in advance; each step prefetches the next ``prefetch_depth`` of them, so the fetch
  overlaps the steps in between. Free-running generation has no such lookahead: the next row is
  the one the step just chose (the choice is made the moment the row arrives), so prefetching "top
  candidates" would only ride in the same request as the real fetch; we do not do it.

**Invalidation rule** (the cache must never serve a row older than a write this node made): a
training job on this node calls :meth:`RowCache.invalidate_batch` with every batch once a quorum
acknowledged it; a fetch that was in flight across an invalidation is not cached (generation
check). Writes made by *other* compute nodes are not seen by this cache: call ``clear()`` (the
service does at the start of every eval) — documented in docs/compute.md.

The activation state stays where ``LifSession`` keeps it (host numpy). There is no GPU path.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd.model.evaluate import EvalResult, Mode, continuation, generation_session, prediction_matches, token_matches
from giaannd.model.infer import SEED_TOKENS, DelimiterFlags, LifConstants, LifSession
from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.model.sentence import EncodedSentence

__all__ = ["DEFAULT_PREFETCH_DEPTH", "Inference", "RowCache", "RowFetcher", "drive_session"]

#: Rows prefetched ahead of a teacher-forced session's current step.
DEFAULT_PREFETCH_DEPTH: Final = 8
#: Bytes charged per cached row on top of its arrays (dict + Row object); bounds empty rows too.
ROW_OVERHEAD_BYTES: Final = 160
#: Largest single read the fetcher issues (the client splits further per owner and MAX_READ_ROWS).
MAX_FETCH_ROWS: Final = 16_384

ReadRows = Callable[[NDArray[np.uint64], NDArray[np.uint64]], Awaitable[RowBatch]]


def _own(row: Row) -> Row:
    """A compact copy (a fetched row is a view into a whole reply's buffers)."""
    return Row(row.segment.copy(), row.target_column.copy(), row.target_feature.copy(), row.strength.copy())


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
        self._rows: OrderedDict[RowKey, Row] = OrderedDict()

    def get(self, key: RowKey) -> Row | None:
        row = self._rows.get(key)
        if row is None:
            self.misses += 1
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
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes + ROW_OVERHEAD_BYTES
        self._rows[key] = row
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._rows.popitem(last=False)
            self.bytes -= dropped.nbytes + ROW_OVERHEAD_BYTES
            self.evictions += 1

    def invalidate(self, keys: Iterable[RowKey]) -> None:
        self.generation += 1
        for key in keys:
            row = self._rows.pop(key, None)
            if row is not None:
                self.bytes -= row.nbytes + ROW_OVERHEAD_BYTES
                self.invalidations += 1

    def invalidate_batch(self, batch: RowBatch) -> None:
        """Drop every row ``batch`` wrote (called after a local training write is acknowledged)."""
        self.invalidate(zip(batch.row_column.tolist(), batch.row_feature.tolist()))

    def clear(self) -> None:
        self.generation += 1
        self.invalidations += len(self._rows)
        self._rows.clear()
        self.bytes = 0

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {"rows": len(self._rows), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "invalidations": self.invalidations,
                "hit_rate": round(self.hits / lookups, 4) if lookups else 0.0}


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
        self._pending: dict[RowKey, asyncio.Future[Row]] = {}
        self._queued: list[RowKey] = []
        self._scheduled = False
        self.requests = 0
        self.rows_fetched = 0
        self.prefetched = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def get(self, key: RowKey) -> Row:
        """The row of ``key`` (an empty row if storage has none).

        Raises:
            ReadFailed / StorageRequestError: every replica failed.
        """
        row = self.cache.get(key)
        if row is not None:
            return row
        return await asyncio.shield(self._future(key))

    def prefetch(self, keys: Iterable[RowKey]) -> None:
        """Start fetching rows not cached nor in flight; never waits, never raises."""
        for key in keys:
            if key not in self.cache and key not in self._pending:
                self.prefetched += 1
                self._future(key)

    def _future(self, key: RowKey) -> asyncio.Future[Row]:
        fut = self._pending.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._pending[key] = loop.create_future()
            # a prefetch, or a waiter cancelled while its fetch ran, leaves nobody to read a failure
            fut.add_done_callback(_consume)
            self._queued.append(key)
            if not self._scheduled:
                self._scheduled = True
                loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        keys, self._queued = self._queued, []
        for i in range(0, len(keys), MAX_FETCH_ROWS):
            task = asyncio.get_running_loop().create_task(self._fetch(keys[i:i + MAX_FETCH_ROWS]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fetch(self, keys: list[RowKey]) -> None:
        generation = self.cache.generation
        cols = np.fromiter((k[0] for k in keys), np.uint64, len(keys))
        feats = np.fromiter((k[1] for k in keys), np.uint64, len(keys))
        self.requests += 1
        try:
            batch = await self._read(cols, feats)
        except BaseException as exc:  # every waiter hears of it; nothing stays pending forever
            for key in keys:
                fut = self._pending.pop(key)
                if fut.done():
                    continue
                if isinstance(exc, Exception):
                    fut.set_exception(exc)
                else:
                    fut.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        got = {batch.key(i): _own(batch.row(i)) for i in range(batch.num_rows)}
        self.rows_fetched += len(got)
        for key in keys:
            found = got.get(key)
            row = Row.empty() if found is None else found
            self.cache.put(key, row, generation)
            fut = self._pending.pop(key)
            if not fut.done():
                fut.set_result(row)


def _consume(fut: asyncio.Future[Row]) -> None:
    """Mark a fetch's outcome retrieved, so a failure nobody awaits is not reported as unhandled."""
    if not fut.cancelled():
        fut.exception()


async def drive_session(session: LifSession, fetcher: RowFetcher,
                        lookahead: Sequence[RowKey] = (), prefetch_depth: int = DEFAULT_PREFETCH_DEPTH) -> int:
    """Run ``session`` to its end, one fetched row per step; returns the steps run.

    ``lookahead``: the nodes the session will need in order (teacher forcing: its targets), so the
    next ``prefetch_depth`` rows are fetched while earlier steps run.
    """
    steps = 0
    while (key := session.needs_row()) is not None:
        if lookahead and prefetch_depth:
            k = session.steps_run  # step k+1 needs the row of node k (teacher-forced: target k)
            fetcher.prefetch(lookahead[k + 1:k + 1 + prefetch_depth])
        session.step(await fetcher.get(key))
        steps += 1
    return steps


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
    """

    def __init__(self, fetcher: RowFetcher, *, max_sessions: int = 64,
                 prefetch_depth: int = DEFAULT_PREFETCH_DEPTH) -> None:
        if max_sessions < 1 or prefetch_depth < 0:
            raise ValueError("max_sessions must be >= 1 and prefetch_depth >= 0")
        self.fetcher = fetcher
        self.prefetch_depth = prefetch_depth
        self._slots = asyncio.Semaphore(max_sessions)
        self.steps = 0
        self.sessions = 0

    async def _run(self, session: LifSession, lookahead: Sequence[RowKey]) -> LifSession:
        async with self._slots:
            self.sessions += 1
            steps = await drive_session(session, self.fetcher, lookahead, self.prefetch_depth)
            self.steps += steps  # not `+= await`: that reads self.steps before the await
        return session

    async def evaluate(self, sentences: Sequence[EncodedSentence], flags: DelimiterFlags, constants: LifConstants,
                       mode: Mode = "teacher", *, seed_tokens: int = SEED_TOKENS) -> EvalReport:
        """Top-1 accuracy (giaann-algorithm.md §7) of every prompt, all prompts concurrently;
        the same counts as ``giaannd.model.evaluate.evaluate``."""
        if mode not in ("teacher", "free"):
            raise ValueError(f"mode must be 'teacher' or 'free', got {mode!r}")
        t0 = time.perf_counter()
        result = EvalResult()
        kept = [s for s in sentences if len(s) >= seed_tokens + 1]
        result.skipped_short = len(sentences) - len(kept)
        runs = []
        for sent in kept:
            targets = list(zip(sent.column.tolist(), sent.feature.tolist()))
            session = LifSession(targets, flags, constants, seed_tokens=seed_tokens,
                                 teacher_forced=(mode == "teacher"))
            runs.append(self._run(session, targets if mode == "teacher" else ()))
        # a TaskGroup, not gather: one failed session cancels the others instead of orphaning them
        failure: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(run) for run in runs]
        except ExceptionGroup as eg:  # callers handle the first failure as if a session raised it
            failure = eg.exceptions[0]
        if failure is not None:
            # raised outside the handler, so its context is not the group that holds it (a cycle)
            raise failure
        sessions = [t.result() for t in tasks]
        report = EvalReport(result)
        for sent, session in zip(kept, sessions):
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
        session = generation_session(prompt, flags, constants, max_new_tokens)
        if session is None:
            return []
        await self._run(session, list(prompt))
        return continuation(session)
