"""A stream source whose store folds (storage/replication/background_fold.py) while the stream
verifies or closes: the writes the fold held (logged and acknowledged at once, applied to the rows
when it ends: storage/engine/deferred_applies.py) are forwarded as every other write is, and the
receiver ends with the source's rows. Each test holds a fold mid-move (``PausedFold``) and writes
one row through ``DurableStore.defer``, as the service's request path does during a fold."""

import asyncio

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.streaming.sender import StreamRunner
from tests.integration.test_topology_stream_verify import COLUMNS, _same_rows
from tests.unit.storage_service.test_background_fold import PausedFold
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]


async def _cluster(tmp_path):
    """s0 holds rows of COLUMNS (and of other columns) in its base and a delta run (for a fold to
    move); s1 is empty."""
    cluster = await Cluster(tmp_path, 2, replicas=1).start()
    svc = cluster.services["s0"]
    rng = np.random.default_rng(5)
    for seq in range(1, 7):
        svc.store.apply(BatchId(3, seq), make_batch(rng, 30, 7, rng.choice(np.arange(1, 15, dtype=np.uint64), 30)))
    await svc.folds.fold()
    svc.store.apply(BatchId(3, 7), make_batch(rng, 20, 7, COLUMNS[rng.integers(0, COLUMNS.size, 20)]))
    assert svc.store.store.engine.delta_entries
    return cluster


def _runner(cluster, stream_id):
    return StreamRunner(cluster.services["s0"], cluster.ops_transport, cluster.stream_addresses["s1"],
                        COLUMNS, stream_id, chunk_bytes=4000, window=4)


async def _hold_a_write(svc, paused):
    """Start a fold and hold it mid-move; write one entry of a streamed row (its chunk was sent)
    during it. Returns the fold's task and what ``defer`` did."""
    paused.armed = True
    fold = asyncio.create_task(svc.folds.fold())
    await paused.entered()
    paused.armed = False
    src = svc.store.store
    cols, feats, _ = src.rows_of_columns(COLUMNS)
    c, f = int(cols[-1]), int(feats[-1])
    row = src.row((c, f))
    one = RowBatch.from_entries(np.array([c], np.uint64), np.array([f], np.uint64), row.segment[:1].copy(),
                                row.target_column[:1].copy(), row.target_feature[:1].copy(),
                                np.array([0.25], np.float32))
    held = svc.store.defer(BatchId(888, 1), one)  # logged now, applied when the fold ends
    assert held is not None and held.applied
    asyncio.get_running_loop().call_later(0.1, paused.release.set)
    return fold




async def test_writes_held_by_a_fold_that_ends_while_verification_waits_are_sent_first(tmp_path, monkeypatch):
    """Verification waits for a fold under way (it must not read the rows mid-move); the writes
    the fold held become deltas when it ends, and they must reach the receiver before the digests
    are compared. Before, the source's digests were taken right after the wait, with those writes
    in its rows and not sent yet: a correct stream failed with "verify: 1 of N rows differ"."""
    cluster = await _cluster(tmp_path)
    try:
        svc = cluster.services["s0"]
        runner = _runner(cluster, 0x59)
        paused = PausedFold(monkeypatch)
        verify, folds = runner._verify, []

        async def fold_then_verify():
            if not folds:
                folds.append(await _hold_a_write(svc, paused))
            return await verify()

        runner._verify = fold_then_verify
        task = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(runner.caught_up.wait(), 30)
            await folds[0]
            assert runner.state == "caught-up", runner.error
            assert runner.sender.deltas == 1 and _same_rows(cluster)
        finally:
            runner.abort("test done")
            await asyncio.wait_for(task, 10)
    finally:
        await cluster.close()


async def test_a_stream_closed_during_a_fold_forwards_the_writes_it_held(tmp_path, monkeypatch):
    """A cutover closes the streams once the writers are drained: every write was acknowledged,
    but one the source's fold held is applied only when the fold ends. Closing waits for it and
    forwards it. Before, closing stopped listening at once: the write never reached the receiver
    (a joining node missed a row; the join test with a folding source saw it)."""
    cluster = await _cluster(tmp_path)
    try:
        svc = cluster.services["s0"]
        runner = _runner(cluster, 0x5A)
        paused = PausedFold(monkeypatch)
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(runner.caught_up.wait(), 30)
        assert runner.state == "caught-up", runner.error
        fold = await _hold_a_write(svc, paused)
        runner.close()
        await asyncio.wait_for(task, 30)
        await fold
        assert runner.state == "done", runner.error
        assert runner.sender.deltas == 1 and _same_rows(cluster)
    finally:
        await cluster.close()


async def test_a_reconnect_before_the_first_item_is_durable_resumes_the_stream(tmp_path, monkeypatch):
    """The receiver applied item 0 (its rows are in the store) but had not synced it when the
    connection dropped. The sender's reconnect hello must resume the stream (item 0 answered once
    durable), not be refused as "already holds rows ... from an earlier, abandoned stream": that
    check is for rows of no stream this receiver has applied items of. Before, it looked at the
    durable position only, and a transient drop in a stream's first milliseconds failed the join."""
    from giaannd.storage.rebalance import endpoint as endpoint_module

    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x5B)
        real = endpoint_module.wait_durable
        hold = asyncio.Event()
        held = []

        async def slow(service, seq):  # no item is acknowledged as durable until the drop below
            held.append(seq)
            await hold.wait()
            await real(service, seq)

        monkeypatch.setattr(endpoint_module, "wait_durable", slow)
        task = asyncio.create_task(runner.run())
        for _ in range(500):  # item 0 applied at the receiver, not durable
            if held:
                break
            await asyncio.sleep(0.01)
        assert held and cluster.services["s1"].store.store.rows_of_columns(COLUMNS)[0].size > 0
        await runner._conn.close()  # the connection drops: the sender reconnects and says hello
        await asyncio.sleep(0.3)
        hold.set()
        await asyncio.wait_for(runner.caught_up.wait(), 30)
        assert runner.state == "caught-up", runner.error
        assert runner.reconnects >= 1 and _same_rows(cluster)
        runner.abort("test done")
        await asyncio.wait_for(task, 10)
    finally:
        await cluster.close()
