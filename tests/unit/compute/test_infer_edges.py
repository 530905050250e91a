"""Lookups that join a read made for another lookup (single flight) and the guesses made ahead:
a prefetch's transient failure fails no step that joined it, whatever the read-ahead."""

from __future__ import annotations

import asyncio

import pytest

from giaannd.compute.infer import Lookahead, RowCache, RowFetcher, drive_session

from .test_infer_fetch import ScriptSession, failing_once_reader


@pytest.mark.asyncio
async def test_infer_a_step_that_joined_a_failed_prefetch_reads_its_row_again():
    """A free-running step (or one whose row left the cache) asks for a row that a later prompt's
    read-ahead has on the wire, and joins that read; the read-ahead fails once. The step reads the
    row itself, as it would have with no read-ahead, instead of failing its prompt (and the whole
    evaluation) with the guess's error; the later prompt reads its rows when it runs."""
    read, calls, failed = failing_once_reader([(7, 0)])
    fetcher = RowFetcher(read, RowCache(0))
    later = Lookahead(fetcher, [(7, 0), (8, 0)], 8)
    later.fill(0)  # the read-ahead of a later prompt, asked for before the running step
    running = ScriptSession([(7, 0)])  # free running: its step's row is asked for on demand
    assert await asyncio.wait_for(drive_session(running, fetcher), 10) == 1
    assert failed and [len(r) for r in running.seen] == [1]
    assert calls == [[(7, 0), (8, 0)], [(7, 0)]]  # the guess, then the step's own read
    assert (fetcher.cache.misses, fetcher.cache.in_flight_joins) == (0, 1)  # one lookup, counted once
    following = ScriptSession([(7, 0), (8, 0)])
    assert await asyncio.wait_for(drive_session(following, fetcher, ahead=later), 10) == 2
    assert [len(r) for r in following.seen] == [1, 1] and fetcher.prefetch_failures == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("seed_tokens", [0, -1])
async def test_infer_evaluate_refuses_a_seed_under_one_as_the_core_does(seed_tokens):
    """The core's ``evaluate`` refuses ``seed_tokens`` < 1 (a session always seeds token 0, which
    would be scored as a miss); the cluster's scored every prompt's token 0 as a miss instead."""
    from giaannd.compute.infer import Inference
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.evaluate import evaluate
    from giaannd.model.infer import TRAIN_SET, NoDelimiters
    from giaannd.model.rowstore import RowStore
    from giaannd.model.tokens import load_bundled_corpus

    a = ColumnAssigner()
    enc = [e for s in load_bundled_corpus(5) if (e := a.encode(s, update_flags=False)) is not None]
    with pytest.raises(ValueError, match="seed_tokens"):
        evaluate(enc, RowStore(), NoDelimiters(), TRAIN_SET, seed_tokens=seed_tokens)
    read, _, _ = failing_once_reader([])
    inference = Inference(RowFetcher(read, RowCache(0)))
    with pytest.raises(ValueError, match="seed_tokens"):
        await asyncio.wait_for(inference.evaluate(enc, NoDelimiters(), TRAIN_SET, seed_tokens=seed_tokens), 10)
