"""Pipelined streams (streaming/stream.py, "Pipelining"): a window of several items on the wire, the
receiver applying them in order and acknowledging each once durable (items share fsyncs); a
receiver killed with a full window in flight resumes exactly (no item lost, none applied twice);
the operator throttle still bounds the rate with a window."""

import asyncio
import contextlib
import time

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage.streaming.sender import StreamRunner, Throttle
from giaannd.storage.streaming.stream import stream_writer
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]

COLUMNS = np.arange(1, 9, dtype=np.uint64)
WINDOW = 4
CHUNK = 1000


async def _cluster(tmp_path, batches):
    """s0 holds rows of COLUMNS (and of other columns); s1 is empty."""
    cluster = await Cluster(tmp_path, 2, replicas=1).start()
    store = cluster.services["s0"].store
    rng = np.random.default_rng(7)
    for seq in range(1, batches + 1):
        store.apply(BatchId(3, seq), make_batch(rng, 30, 7, rng.choice(np.arange(1, 15, dtype=np.uint64), 30)))
    return cluster


def _runner(cluster, stream_id, **kw):
    return StreamRunner(cluster.services["s0"], cluster.ops_transport, cluster.stream_addresses["s1"],
                        COLUMNS, stream_id, chunk_bytes=CHUNK, window=WINDOW, **kw)


def _same_rows(cluster):
    src, dst = cluster.services["s0"].store.store, cluster.services["s1"].store.store
    keys = [k for k in src.keys() if k[0] in set(COLUMNS.tolist())]
    assert keys and keys == dst.keys()
    a = src.read_rows([k[0] for k in keys], [k[1] for k in keys])
    b = dst.read_rows([k[0] for k in keys], [k[1] for k in keys])
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def _slow_receiver(cluster, runner, ahead):
    """Every item takes a little longer on s1 (a remote receiver's latency), so the window fills;
    records how many items were unacknowledged when each arrived."""
    endpoint = cluster.endpoints["s1"]
    serve = endpoint._data

    async def data(msg, bulk):
        ahead.append(runner.sender.sent_upto - runner.sender.acked)
        await asyncio.sleep(0.002)
        return await serve(msg, bulk)

    endpoint._data = data


async def test_window_in_flight_receiver_killed_resumes_exactly(tmp_path):
    cluster = await _cluster(tmp_path, 40)
    try:
        runner = _runner(cluster, 0x61)
        ahead = []
        _slow_receiver(cluster, runner, ahead)
        commit = cluster.services["s1"]._commit
        syncs_before = commit.syncs
        task = asyncio.create_task(runner.run())
        async with asyncio.timeout(30):
            while runner.sender.acked < 12 or runner.sender.in_flight < 2:
                await asyncio.sleep(0.0005)
        assert max(ahead) == WINDOW  # the window filled: several items on the wire at once
        applied = runner.sender.acked
        syncs = commit.syncs - syncs_before
        assert syncs < applied  # items applied together shared fsyncs (group commit)
        in_flight = runner.sender.in_flight
        await cluster.kill("s1")  # with items in flight: sent, maybe applied, not acknowledged
        await asyncio.sleep(0.1)
        await cluster.restart_node("s1")
        async with asyncio.timeout(30):
            await runner.caught_up.wait()
        assert runner.state == "caught-up", runner.error  # verified: the same digests on both ends
        assert runner.reconnects >= 1
        assert 0 < in_flight <= WINDOW and runner.resent_items <= WINDOW  # at most the window again
        assert runner.sender.acked >= applied
        # no item lost, none applied twice: the floor is every item, the rows are bit-identical
        floor = cluster.services["s1"].store.store.applied.floor(stream_writer(0x61))
        assert floor == runner.sender.next_index > 12
        assert _same_rows(cluster)
        runner.close()
        await asyncio.wait_for(task, 10)
        assert runner.state == "done"
    finally:
        await cluster.close()


async def test_window_keeps_the_throttle(tmp_path):
    cluster = await _cluster(tmp_path, 12)
    try:
        rate = 40_000.0
        runner = _runner(cluster, 0x62, throttle=Throttle(rate))
        ahead = []
        _slow_receiver(cluster, runner, ahead)
        start = time.monotonic()
        task = asyncio.create_task(runner.run())
        async with asyncio.timeout(30):
            await runner.caught_up.wait()
        elapsed = time.monotonic() - start
        assert runner.state == "caught-up", runner.error
        sent = runner.sender.bytes_acked
        assert sent > 3 * CHUNK and runner.sender.acked > WINDOW
        # no burst: every item's bytes are paid for before it is sent, whatever the window
        assert sent <= rate * elapsed + 2 * CHUNK
        runner.close()
        await asyncio.wait_for(task, 10)
        assert _same_rows(cluster)
    finally:
        await cluster.close()



def _damage_once(cluster, index):
    """Item ``index`` arrives at s1 with a damaged byte, once (its checksum fails: refused, not
    fatal); every item takes a little longer, so the window fills. Returns the list of damaged
    indexes."""
    endpoint = cluster.endpoints["s1"]
    serve = endpoint._data
    damaged = []

    async def data(msg, bulk):
        await asyncio.sleep(0.001)
        if msg.index == index and not damaged:
            damaged.append(msg.index)
            bulk[6][0] += np.float32(1)  # strength of the first entry
        return await serve(msg, bulk)

    endpoint._data = data
    return damaged


@contextlib.asynccontextmanager
async def _caught_up_with_one_page_damaged(cluster, stream_id, index):
    """Run a stream from s0 to s1 with item ``index`` damaged once in transit until it caught up
    (the page refused and resent), yield its runner, then check the rows and close it."""
    runner = _runner(cluster, stream_id)
    damaged = _damage_once(cluster, index)
    task = asyncio.create_task(runner.run())
    async with asyncio.timeout(30):
        await runner.caught_up.wait()
    assert runner.state == "caught-up", runner.error
    assert damaged and runner.resent_items >= 1
    yield runner
    assert _same_rows(cluster)
    runner.close()
    await asyncio.wait_for(task, 10)
    assert runner.state == "done"


async def test_a_page_refused_inside_a_full_window_is_resent_and_the_stream_goes_on(tmp_path):
    """The refusal of item 6 carries the receiver's durable position when it refused (4, say);
    the replies to items 4 and 5 leave later (once durable) but are handled first: the sender must
    resend from what they acknowledged, not fail the stream as "state lost" (it did)."""
    cluster = await _cluster(tmp_path, 40)
    try:
        async with _caught_up_with_one_page_damaged(cluster, 0x63, 6):
            pass
    finally:
        await cluster.close()


async def test_pages_reuse_their_buffers_once_acknowledged_and_a_refused_page_is_resent_intact(tmp_path):
    """A source reads its chunks into the page pool's buffers (streaming/pages.py) and takes them
    back only once the receiver acknowledged the page: with the window full and one page refused
    (its bytes damaged in transit), the page is sent again from buffers nothing overwrote, and the
    receiver ends with the source's rows bit for bit, verified; the pool holds at most the window
    and the chunk read ahead."""
    cluster = await _cluster(tmp_path, 40)
    try:
        async with _caught_up_with_one_page_damaged(cluster, 0x64, 9) as runner:
            pool = runner.page_pool
            assert runner.sender.acked > 3 * (WINDOW + 1)
            assert pool.reused > 2 * (WINDOW + 1) and pool.allocations <= WINDOW + 1
    finally:
        await cluster.close()


async def test_each_item_of_the_window_goes_on_the_wire_before_the_next_chunk_is_read(tmp_path):
    """Filling the window read every chunk (a synchronous gather each) before the first item's
    request ran: nothing went out until the whole window was read, and the receiver idled
    meanwhile. Each item's request now starts before the next chunk is read."""
    cluster = await _cluster(tmp_path, 40)
    try:
        runner = _runner(cluster, 0x64)
        events = []
        read_page = runner._read_page

        def read(cols, feats):
            events.append("read")
            return read_page(cols, feats)

        runner._read_page = read
        connect = runner._connect

        async def connect_and_watch():
            await connect()
            conn = runner._conn
            request = conn.request

            async def watched(payload, bulk=(), **kw):
                if bulk:  # (a data item; the hello went out inside connect, before this wrapper)
                    events.append("send")
                return await request(payload, bulk, **kw)

            conn.request = watched

        runner._connect = connect_and_watch
        task = asyncio.create_task(runner.run())
        async with asyncio.timeout(30):
            await runner.caught_up.wait()
        assert runner.state == "caught-up", runner.error
        sends = [i for i, e in enumerate(events) if e == "send"]
        reads = [i for i, e in enumerate(events) if e == "read"]
        assert len(reads) > WINDOW
        # the first item was handed to the connection before the second chunk was read
        assert sends and sends[0] < reads[1], events[:12]
        runner.close()
        await asyncio.wait_for(task, 10)
        assert _same_rows(cluster)
    finally:
        await cluster.close()
