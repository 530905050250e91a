"""Rows of any size through the real read path: storage services and the StorageClient over tcp://
(tools/cluster_harness), the row put into one node's store directly (no write batch is that big)."""

import asyncio

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.storage.engine.regions import new_region
from giaannd.storage.streaming.sender import StreamRunner
from tools.cluster_harness import Cluster

pytestmark = pytest.mark.timeout(120)

#: The per-reply entry cap that used to make a larger row unreadable (protocol.MAX_BATCH_ENTRIES).
OLD_CAP = 8 * 1_048_576


def put_row(cluster, column, feature, n):
    """One canonical row of ``n`` entries in the store of every node; returns it as a batch."""
    region, row = new_region(n)
    row.segment[:] = 0
    row.target_column[:] = np.arange(n, dtype=np.uint64)
    row.target_feature[:] = 5
    row.strength[:] = np.float32(0.25)
    for svc in cluster.services.values():
        svc.store.store.load_row((column, feature), region.copy(), 1)
    return RowBatch(np.array([column], np.uint64), np.array([feature], np.uint64), np.array([0, n], np.int64),
                    row.segment, row.target_column, row.target_feature, row.strength)


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


@pytest.mark.asyncio
async def test_big_rows_row_over_the_old_cap_is_readable(tmp_path):
    cluster = await Cluster(tmp_path, 1, scheme="tcp", replicas=1, capacity_bytes=1 << 30,
                            request_timeout_s=60.0).start()
    try:
        want = put_row(cluster, 11, 2, OLD_CAP + 1)
        got = await cluster.client.read_rows([11], [2])
        assert got.num_entries == OLD_CAP + 1
        assert same(got, want)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_big_rows_row_read_in_many_chunks_over_tcp(tmp_path):
    cluster = await Cluster(tmp_path, 1, scheme="tcp", replicas=1).start(read_chunk_bytes=4096)
    try:
        want = put_row(cluster, 11, 2, 50_000)  # 257 parts of 195 entries
        small = RowBatch.from_entries([3, 12], [0, 0], [0, 0], [1, 1], [0, 0], [1.0, 2.0])
        await cluster.client.write(small)
        svc = cluster.services["s0"]
        before = svc.counters.reads
        got = await cluster.client.read_rows([12, 11, 3], [0, 2, 0])
        assert same(got, RowBatch.concat([want, small]))
        assert svc.counters.reads - before >= 50_000 // 195
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_big_rows_stream_of_a_big_row_in_parts(tmp_path):
    """A rebalance stream (StreamRunner -> the receiver's endpoint, its update log and group commit)
    of a row 500x the stream chunk and 8x the slow-receiver limit: sent in parts, copied bit for bit."""
    cluster = await Cluster(tmp_path, 2, replicas=1, capacity_bytes=1 << 30).start()
    try:
        src = cluster.services["s0"]
        want = put_row_on(src, 11, 2, 100_000)  # 2.1 MB
        runner = StreamRunner(src, cluster.ops_transport, cluster.stream_addresses["s1"],
                              np.array([11], np.uint64), 0x77, chunk_bytes=4096)
        runner.sender.max_pending_bytes = 256 << 10
        task = asyncio.create_task(runner.run())
        async with asyncio.timeout(60):
            await runner.caught_up.wait()
        assert runner.state == "caught-up", runner.error
        assert runner.sender.parts >= 8
        got = cluster.services["s1"].store.store.read_rows([11], [2])
        assert same(got, want)
        runner.close()
        async with asyncio.timeout(30):
            await task
    finally:
        await cluster.close()


def put_row_on(svc, column, feature, n):
    region, row = new_region(n)
    row.segment[:] = 0
    row.target_column[:] = np.arange(n, dtype=np.uint64)
    row.target_feature[:] = 5
    row.strength[:] = np.linspace(0, 1, n, dtype=np.float32)
    svc.store.store.load_row((column, feature), region, 1)
    return RowBatch(np.array([column], np.uint64), np.array([feature], np.uint64), np.array([0, n], np.int64),
                    row.segment.copy(), row.target_column.copy(), row.target_feature.copy(), row.strength.copy())
