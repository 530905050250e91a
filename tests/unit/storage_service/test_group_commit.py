"""giaannd.storage.replication.group_commit: one fsync per generation of concurrent appends."""

import asyncio
import threading

import pytest

from giaannd.storage.replication.group_commit import GroupCommit


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
