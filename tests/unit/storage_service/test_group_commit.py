"""giaannd.storage.replication.group_commit: one fsync per generation of concurrent appends."""

import asyncio
import threading

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.protocol import BatchId
from giaannd.storage.replication.group_commit import GroupCommit
from peers.transport.base import Incoming
from tools.cluster_harness import Cluster, make_batch


class FakeLog:
    def __init__(self):
        self.appended = 0
        self.syncs = 0
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def append(self):
        self.appended += 1
        return self.appended

    def sync(self):
        target = self.appended  # as UpdateLog.sync: what was appended before the fsync started
        self.started.set()
        self.gate.wait(5)
        if self.fail:
            raise OSError("disk on fire")
        self.syncs += 1
        return target


@pytest.mark.asyncio
async def test_group_commit_many_waiters_share_one_sync():
    log = FakeLog()
    gc = GroupCommit(log.sync)
    seqs = [log.append() for _ in range(50)]
    await asyncio.gather(*(gc.wait_durable(s) for s in seqs))
    assert log.syncs == 1 and gc.syncs == 1 and gc.durable_seq == 50
    await gc.wait_durable(50)  # already durable: no sync
    assert log.syncs == 1


@pytest.mark.asyncio
async def test_group_commit_appends_during_a_sync_wait_for_the_next():
    log = FakeLog()
    gc = GroupCommit(log.sync)
    log.gate.clear()
    first = asyncio.ensure_future(gc.wait_durable(log.append()))
    assert await asyncio.to_thread(log.started.wait, 5)  # the sync is running, blocked in its thread
    later = [log.append() for _ in range(5)]
    waiting = asyncio.ensure_future(asyncio.gather(*(gc.wait_durable(s) for s in later)))
    log.gate.set()
    await asyncio.wait_for(asyncio.gather(first, waiting), 5)
    assert log.syncs == 2 and gc.durable_seq == 6


@pytest.mark.asyncio
async def test_group_commit_failure_reaches_every_waiter_and_cancel_is_isolated():
    log = FakeLog()
    gc = GroupCommit(log.sync)
    log.gate.clear()
    log.fail = True
    waiters = [asyncio.ensure_future(gc.wait_durable(log.append())) for _ in range(3)]
    assert await asyncio.to_thread(log.started.wait, 5)
    waiters[0].cancel()
    log.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5)
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(isinstance(r, OSError) for r in results[1:])
    log.fail = False
    await gc.wait_durable(3)
    assert gc.durable_seq == 3


class RoundsLog(FakeLog):
    """FakeLog whose syncs each wait for a gate of their own (``gates[i]``: the i-th sync)."""

    def __init__(self, rounds):
        super().__init__()
        self.gates = [threading.Event() for _ in range(rounds)]
        self.ended = [threading.Event() for _ in range(rounds)]

    def sync(self):
        target, i = self.appended, self.syncs
        self.started.set()
        assert self.gates[i].wait(5)
        self.syncs += 1
        self.ended[i].set()
        return target


def _block_loop_until(event):
    """Hold the event loop (a long synchronous handler, as a receiver's applies are) until
    ``event`` is set in another thread, at most 5 s; whether it was."""
    return event.wait(5)


@pytest.mark.asyncio
async def test_group_commit_syncs_again_without_waiting_for_a_busy_loop():
    """Records appended during a sync are synced by the next one as soon as it ends, in the
    sync's thread: before, the next sync started only once the event loop had seen the first end,
    which a loop busy with applies saw 22-33 ms late (a stream receiver, docs/topology.md)."""
    log = RoundsLog(2)
    gc = GroupCommit(log.sync, appended=lambda: log.appended)
    first = asyncio.ensure_future(gc.wait_durable(log.append()))
    assert await asyncio.to_thread(log.started.wait, 5)  # sync 1 runs (covers seq 1), held
    later = asyncio.ensure_future(asyncio.gather(*(gc.wait_durable(log.append()) for _ in range(5))))
    await asyncio.sleep(0)
    log.gates[0].set()
    log.gates[1].set()
    # the loop is held: only the sync's own thread can start the second sync
    assert _block_loop_until(log.ended[1]), "the second sync waited for the event loop"
    await asyncio.wait_for(asyncio.gather(first, later), 5)
    assert log.syncs == 2 and gc.syncs == 2 and gc.durable_seq == 6


@pytest.mark.asyncio
async def test_group_commit_releases_a_waiter_at_its_own_sync_while_the_next_runs():
    log = RoundsLog(2)
    gc = GroupCommit(log.sync, appended=lambda: log.appended)
    first = asyncio.ensure_future(gc.wait_durable(log.append()))
    assert await asyncio.to_thread(log.started.wait, 5)
    later = asyncio.ensure_future(gc.wait_durable(log.append()))
    await asyncio.sleep(0)
    log.gates[0].set()  # sync 1 ends; sync 2 (seq 2) starts in the thread and is held
    await asyncio.wait_for(first, 5)
    assert gc.durable_seq == 1 and not later.done()
    log.gates[1].set()
    await asyncio.wait_for(later, 5)
    assert gc.durable_seq == 2 and log.syncs == 2


@pytest.mark.asyncio
async def test_group_commit_error_other_than_oserror_reaches_the_waiters_once():
    """A closed log's ValueError fails the waiters (and does not start sync after sync)."""
    calls = []

    def sync():
        calls.append(1)
        raise ValueError("update log is closed")

    gc = GroupCommit(sync, appended=lambda: 1)
    with pytest.raises(ValueError):
        await asyncio.wait_for(gc.wait_durable(1), 5)
    assert calls == [1]


@pytest.mark.asyncio
async def test_batches_applied_says_yes_only_once_the_batch_is_durable(tmp_path):
    """``BatchesApplied`` yes settles a hinted seq in the writer's floor (docs/replication.md,
    "Writer floors"), as a durable ack does: the writer's floor then passes it, and a node that
    lost the batch's unsynced record in a crash would learn that floor and ignore the hint's
    re-delivery. So the answer waits, like an ack, for the log to be synced through what it saw
    applied (before, it answered from the rows in RAM while the batch's sync was still running)."""
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    svc = cluster.services["s0"]
    started, release = threading.Event(), threading.Event()
    sync = svc.store.sync

    def held_sync():  # the group commit's fsync, held in its thread
        started.set()
        release.wait(10)
        return sync()

    try:
        svc.store.sync = held_sync
        applying = asyncio.ensure_future(cluster.client.apply_to("s0", BatchId(7, 1), make_batch(
            np.random.default_rng(4), 8)))
        assert await asyncio.to_thread(started.wait, 10)  # logged and applied, its sync under way
        seq = svc.store.log.last_seq
        query = Incoming(memoryview(p.encode(p.BatchesApplied(7, [1]))), [], None, "test")
        answering = asyncio.ensure_future(svc.handle(query))
        for _ in range(20):
            await asyncio.sleep(0)
        if answering.done():  # answered before the sync ended: only a "no" may be
            reply = p.decode_reply(answering.result().payload)
            assert not (isinstance(reply, p.AppliedMask) and reply.applied[0]) \
                or svc.store.log.durable_seq >= seq, "BatchesApplied said yes before the batch was durable"
        release.set()
        reply = p.decode_reply((await asyncio.wait_for(answering, 10)).payload)
        assert isinstance(reply, p.AppliedMask) and reply.applied == [True]
        assert (await asyncio.wait_for(applying, 10)).durable
    finally:
        release.set()
        await cluster.close()
