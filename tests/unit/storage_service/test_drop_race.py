"""A drop of columns behind the fold gate racing writes into them (background_fold.py ``drop``)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.background_fold import BackgroundFold
from tools.cluster_harness import make_batch


@pytest.mark.asyncio
async def test_a_write_deferred_while_a_drop_lists_its_columns_is_applied_in_log_order(tmp_path):
    """``BackgroundFold.drop`` lists the held columns in a worker thread, behind the gate, before it
    logs the drop record: a write deferred meanwhile is logged *before* the drop record, so replay
    applies it and then drops its column. The live rows must be the same (before, the write was
    applied after the drop, and the column came back only until the next restart)."""
    durable = DurableStore.open(tmp_path, 1 << 24)
    rng = np.random.default_rng(6)
    durable.apply(BatchId(1, 1), make_batch(rng, 4))
    column = int(durable.store.held_columns(None)[0])
    folds = BackgroundFold(durable, asyncio.Lock())
    listing, go_on = threading.Event(), threading.Event()
    held_columns = durable.store.held_columns

    def slow_held_columns(columns):  # the drop's listing, held in its thread
        listing.set()
        go_on.wait(10)
        return held_columns(columns)
    durable.store.held_columns = slow_held_columns
    try:
        dropping = asyncio.ensure_future(folds.drop(durable, lambda held: held[held == column],
                                                    lambda: np.array([column], np.uint64)))
        assert await asyncio.to_thread(listing.wait, 10)
        assert folds.running
        write = RowBatch.from_entries(np.array([column], np.uint64), np.array([99], np.uint64),
                                      np.zeros(1, np.uint8), np.array([5], np.uint64), np.array([6], np.uint64),
                                      np.ones(1, np.float32))
        assert durable.defer(BatchId(2, 1), write) is not None  # logged now, applied when the gate opens
        go_on.set()
        await asyncio.wait_for(dropping, 10)
    finally:
        go_on.set()
        durable.store.held_columns = held_columns
    live = durable.store.read_all()
    durable.sync()
    durable.close()
    again = DurableStore.open(tmp_path, 1 << 24)
    replayed = again.store.read_all()
    again.close()
    assert [b.tobytes() for b in live.buffers()] == [b.tobytes() for b in replayed.buffers()], \
        "the live rows differ from the log's replay after a drop raced a deferred write"
