"""A storage node after a failed update-log fsync ("fsyncgate"): no batch whose fsync failed is
acknowledged, not even through a writer's retry that the next, "successful", fsync would cover."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.storage.engine import update_log as ul
from peers.transport.base import Incoming
from tools.cluster_harness import Cluster, make_batch


async def _apply(svc, writer: int, seq: int, batch) -> p.Reply:
    msg = Incoming(memoryview(p.encode(p.ApplyBatch(writer, seq))), batch.buffers(), None, "test")
    return p.decode_reply((await svc.handle(msg)).payload)


@pytest.mark.asyncio
async def test_a_retry_of_a_batch_whose_fsync_failed_is_not_acknowledged(tmp_path, monkeypatch):
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    svc = cluster.services["s0"]
    try:
        batch = make_batch(np.random.default_rng(3), 6)
        real = ul.os.fdatasync
        calls: list[int] = []

        def fdatasync(fd: int) -> None:  # the first fails; the kernel then says "fine" (pages dropped)
            calls.append(fd)
            if len(calls) == 1:
                raise OSError(errno.EIO, "Input/output error")
            real(fd)
        monkeypatch.setattr(ul.os, "fdatasync", fdatasync)
        first = await _apply(svc, 11, 1, batch)
        assert isinstance(first, p.Unavailable), first
        retry = await _apply(svc, 11, 1, batch)  # the writer's retry: a duplicate here
        assert not isinstance(retry, p.ApplyAck), "a batch whose fsync failed was acknowledged on its retry"
        other = await _apply(svc, 11, 2, make_batch(np.random.default_rng(4), 3))
        assert not isinstance(other, p.ApplyAck), "a write was acknowledged after the log's fsync failed"

        await svc.snapshot()  # covers what the failed fsync left in doubt: writes resume
        assert isinstance(await _apply(svc, 11, 1, batch), p.ApplyAck)
        assert isinstance(await _apply(svc, 11, 2, make_batch(np.random.default_rng(4), 3)), p.ApplyAck)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_the_snapshot_timer_is_due_after_a_failed_fsync(tmp_path, monkeypatch):
    """Writes wait for a snapshot after a failed fsync: the timer's next turn writes one whatever
    was logged since the last (``storage.snapshot-min-log-ratio`` would hold it back)."""
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    svc = cluster.services["s0"]
    try:
        svc.settings = type(svc.settings)(**{**{f: getattr(svc.settings, f) for f in svc.settings.__struct_fields__},
                                             "snapshot_min_log_ratio": 1e9})
        real = ul.os.fdatasync
        calls: list[int] = []

        def fdatasync(fd: int) -> None:
            calls.append(fd)
            if len(calls) == 1:
                raise OSError(errno.EIO, "Input/output error")
            real(fd)
        monkeypatch.setattr(ul.os, "fdatasync", fdatasync)
        assert isinstance(await _apply(svc, 12, 1, make_batch(np.random.default_rng(5), 4)), p.Unavailable)
        assert svc.snapshot_due()
    finally:
        await cluster.close()

