"""The per-token fetch of cluster inference (issue 19 item 2): prefetched rows held per session,
known tokens batched into few requests, the invalidation rule kept for held rows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from giaannd.compute.infer import RowCache, RowFetcher, drive_session
from giaannd.model.rows import RowBatch


class ScriptSession:
    """A LifSession stand-in: needs ``keys[k]`` at step k (teacher forcing), records rows seen."""

    def __init__(self, keys):
        self.keys = keys
        self.steps_run = 0
        self.seen = []

    def needs_row(self):
        return self.keys[self.steps_run] if self.steps_run < len(self.keys) else None

    def step(self, row):
        self.seen.append(row)
        self.steps_run += 1


def stamped_reader(stamp):
    """A read that returns one entry per asked row, its strength ``stamp()`` at read time; logs calls."""
    calls = []

    async def read(cols, feats):
        calls.append(list(zip(cols.tolist(), feats.tolist())))
        await asyncio.sleep(0)
        order = np.lexsort((feats, cols))
        c, f = cols[order], feats[order]
        n = c.shape[0]
        return RowBatch(c, f, np.arange(n + 1, dtype=np.int64), np.zeros(n, np.uint8), np.ones(n, np.uint64),
                        np.ones(n, np.uint64), np.full(n, float(stamp()), np.float32))

    return read, calls


@pytest.mark.asyncio
async def test_prefetched_rows_are_used_without_a_cache():
    read, calls = stamped_reader(lambda: 1)
    keys = [(i, 0) for i in range(40)]
    session = ScriptSession(keys)
    steps = await asyncio.wait_for(drive_session(session, RowFetcher(read, RowCache(0)), keys, 8), 10)
    assert steps == 40 and all(len(r) == 1 for r in session.seen)
    fetched = [k for call in calls for k in call]
    assert sorted(fetched) == keys  # each row read once: a prefetched row is not dropped for want of a cache


@pytest.mark.asyncio
async def test_known_tokens_are_fetched_in_few_requests():
    read, calls = stamped_reader(lambda: 1)
    # a token repeated inside the window is read once
    keys = [(i, 0) for i in range(10)] + [(3, 0), (5, 0)] + [(i, 0) for i in range(10, 40)]
    session = ScriptSession(keys)
    await asyncio.wait_for(drive_session(session, RowFetcher(read, RowCache(0)), keys, 16), 10)
    # a window of 16 refilled by halves: the first request holds 16 keys, each later one 8
    assert len(calls) <= 1 + -(-(len(keys) - 16) // 8)
    assert len(calls[0]) == 14  # the first 16 keys, two of them repeats
    assert sum(len(c) for c in calls) == 40


@pytest.mark.asyncio
async def test_a_held_row_fetched_before_an_invalidation_is_not_used():
    cache = RowCache(1 << 20)
    read, calls = stamped_reader(lambda: cache.generation)
    keys = [(i, 0) for i in range(10)]

    class Invalidating(ScriptSession):
        def step(self, row):
            super().step(row)
            if self.steps_run == 3:  # a training write acknowledged mid-session
                cache.invalidate([(7, 0)])

    session = Invalidating(keys)
    await asyncio.wait_for(drive_session(session, RowFetcher(read, cache), keys, 32), 10)
    stamps = [float(r.strength[0]) for r in session.seen]
    assert stamps[:3] == [0.0] * 3 and stamps[7] == 1.0  # the written row is read again


@pytest.mark.asyncio
async def test_free_running_sessions_fetch_one_row_per_step():
    read, calls = stamped_reader(lambda: 1)
    keys = [(i, 0) for i in range(5)]
    session = ScriptSession(keys)
    await asyncio.wait_for(drive_session(session, RowFetcher(read, RowCache(0)), (), 8), 10)
    assert calls == [[k] for k in keys]


def gated_reader(cache, gate):
    """A read that sees storage as it was when the read started (one entry per asked row, its
    strength the cache's generation then) and answers once ``gate`` is set; logs calls."""
    calls = []

    async def read(cols, feats):
        stamp = float(cache.generation)
        calls.append(list(zip(cols.tolist(), feats.tolist())))
        await gate.wait()
        n = cols.shape[0]
        order = np.lexsort((feats, cols))
        return RowBatch(cols[order], feats[order], np.arange(n + 1, dtype=np.int64), np.zeros(n, np.uint8),
                        np.ones(n, np.uint64), np.ones(n, np.uint64), np.full(n, stamp, np.float32))

    return read, calls


@pytest.mark.asyncio
async def test_a_lookup_after_an_invalidation_does_not_join_a_read_started_before_it():
    """A read on the wire when a training write is acknowledged may return the row as it was before
    the write: it is not cached (generation check), and no lookup made after the invalidation may
    take its row either (it joined the read in flight and got the row the write changed)."""
    cache = RowCache(1 << 20)
    gate = asyncio.Event()
    read, calls = gated_reader(cache, gate)
    fetcher = RowFetcher(read, cache)
    before = asyncio.ensure_future(fetcher.get((7, 0)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert calls  # the read is on the wire
    cache.invalidate([(7, 0)])  # a training write of (7, 0) acknowledged meanwhile
    after = asyncio.ensure_future(fetcher.get((7, 0)))
    await asyncio.sleep(0)
    ahead = fetcher.prefetch([(7, 0)])  # a session's window asked for after it: joins the new read
    for _ in range(20):  # whatever the lookups after it ask for is on the wire
        await asyncio.sleep(0)
    gate.set()
    rows = await asyncio.wait_for(asyncio.gather(before, after, ahead[(7, 0)].future), 10)
    assert float(rows[0].strength[0]) == 0.0
    assert float(rows[1].strength[0]) == 1.0  # read again, after the write
    assert float(ahead[(7, 0)].row((7, 0)).strength[0]) == 1.0
    assert calls == [[(7, 0)], [(7, 0)]]
    assert (7, 0) in cache and float(cache.find((7, 0)).strength[0]) == 1.0  # the later read is cached
    assert (cache.misses, cache.in_flight_joins) == (2, 0)
    assert not fetcher._pending


@pytest.mark.asyncio
async def test_sessions_started_after_an_invalidation_do_not_take_rows_read_before_it():
    """The same through the sessions' windows: one session's window is on the wire when a write is
    acknowledged; a session whose window is asked for after it reads the row again."""
    cache = RowCache(1 << 20)
    gate = asyncio.Event()
    read, calls = gated_reader(cache, gate)
    fetcher = RowFetcher(read, cache)
    keys = [(i, 0) for i in range(10)]
    first = ScriptSession(keys)
    running = asyncio.ensure_future(drive_session(first, fetcher, keys, 32))
    for _ in range(20):
        await asyncio.sleep(0)
    assert calls
    cache.invalidate([(7, 0)])
    second = ScriptSession(keys)
    later = asyncio.ensure_future(drive_session(second, fetcher, keys, 32))
    for _ in range(20):  # whatever the lookups after it ask for is on the wire
        await asyncio.sleep(0)
    gate.set()
    await asyncio.wait_for(asyncio.gather(running, later), 10)
    assert [float(r.strength[0]) for r in second.seen] == [1.0] * 10
    assert len(calls) == 2


def failing_once_reader(fail_keys):
    """A read that fails the first read asking for any of ``fail_keys`` (a transient storage
    error) and answers every other one (one entry per asked row); logs calls."""
    calls = []
    failed = []

    async def read(cols, feats):
        keys = list(zip(cols.tolist(), feats.tolist()))
        calls.append(keys)
        await asyncio.sleep(0)
        if not failed and set(keys) & set(fail_keys):
            failed.append(keys)
            raise OSError("connection reset")
        n = cols.shape[0]
        order = np.lexsort((feats, cols))
        return RowBatch(cols[order], feats[order], np.arange(n + 1, dtype=np.int64), np.zeros(n, np.uint8),
                        np.ones(n, np.uint64), np.ones(n, np.uint64), np.ones(n, np.float32))

    return read, calls, failed


@pytest.mark.asyncio
@pytest.mark.parametrize("depth", [4, 32])
async def test_infer_a_failed_prefetch_is_dropped_and_the_row_read_when_needed(depth):
    """A prefetch is a guess made ahead: a transient error on it must not fail the step that later
    needs the row (it used to be held and raised there); the row is read again, on demand."""
    keys = [(i, 0) for i in range(12)]
    read, calls, failed = failing_once_reader(keys[6:])  # a later window (depth 4) or the whole one (32)
    fetcher = RowFetcher(read, RowCache(0))
    session = ScriptSession(keys)
    steps = await asyncio.wait_for(drive_session(session, fetcher, keys, depth), 10)
    assert failed and steps == len(keys) and all(len(r) == 1 for r in session.seen)
    assert fetcher.prefetch_failures == 1


@pytest.mark.asyncio
async def test_infer_a_failed_read_ahead_does_not_fail_the_later_prompt():
    """The read-ahead of a later prompt fails (one transient error) while the first prompt steps:
    the later prompt reads its rows when it runs."""
    from giaannd.compute.infer import Inference
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.infer import TRAIN_SET, NoDelimiters
    from giaannd.model.tokens import load_bundled_corpus

    a = ColumnAssigner()
    enc = [e for s in load_bundled_corpus(20) if (e := a.encode(s, update_flags=False)) is not None][:6]
    later = set(zip(enc[-1].column.tolist(), enc[-1].feature.tolist()))
    first = set(zip(enc[0].column.tolist(), enc[0].feature.tolist()))
    read, calls, failed = failing_once_reader(later - first)
    inference = Inference(RowFetcher(read, RowCache(0)), max_sessions=1, readahead_prompts=8)
    report = await asyncio.wait_for(inference.evaluate(enc, NoDelimiters(), TRAIN_SET), 10)
    assert failed and report.result.prompts == len(enc)
    assert len(calls[0]) == len(first)  # the first prompt's own window read first, untouched by the failure
    assert inference.fetcher.prefetch_failures == 1


@pytest.mark.asyncio
async def test_infer_an_on_demand_read_that_fails_still_fails_the_session():
    """Only the prefetch is forgiven: a row read for the step that needs it, failing, fails it."""
    keys = [(i, 0) for i in range(5)]
    read, calls, failed = failing_once_reader(keys)
    with pytest.raises(OSError, match="connection reset"):
        await asyncio.wait_for(drive_session(ScriptSession(keys), RowFetcher(read, RowCache(0)), (), 8), 10)
    assert failed
