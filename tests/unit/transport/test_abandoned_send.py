"""A caller that gave up on a request (deadline, cancellation) is told only once nothing more is
read from its request's bulk buffers, so it may reuse them at once (``request(bulk=...)``: "keep
them unchanged until request() returns").

Before: on a deadline during the send of out-of-band (UCX) bulk, the posted UCX send (which cannot
be taken back) went on reading the caller's buffer after ``request()`` had raised; a caller that
refilled its buffer (a streaming sender's next batch) had the new bytes delivered as the old
request's bulk, and the peer's handler ran on them."""

import asyncio

import numpy as np
import pytest

from peers.errors import DeadlineExceeded
from peers.transport import Reply

from ._loopback import close_served, served_pair, ucx_available

KEY = [b"unit-abandoned-send-key-0123456789"]
NBYTES = 8 << 20  # well above the UCX rendezvous threshold: the bytes are read when the receive is posted


async def _deadline_passed(task):
    """Until the request's deadline has fired (its timeout cancels the task), plus a few loop
    iterations for the task to act on it."""
    while not (task.cancelling() or task.done()):
        await asyncio.sleep(0.01)
    for _ in range(5):
        await asyncio.sleep(0)



@pytest.mark.asyncio
@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
async def test_ucx_a_caller_that_gave_up_is_told_only_once_its_out_of_band_bulk_is_out():
    seen = []
    handled = asyncio.Event()

    async def handler(incoming):
        if incoming.bulk:
            seen.append(np.unique(incoming.bulk[0]).tolist())
            handled.set()
        return Reply("ok")

    server, listener, conn = await served_pair(handler, KEY, "ucx")
    try:
        async with asyncio.timeout(10):
            while not listener.connections:
                await asyncio.sleep(0.01)
        (served,) = listener.connections
        assert conn._bulk is not None and served._bulk is not None, "no ucx bulk channel on loopback"
        real, entered, go = served._bulk.recv, asyncio.Event(), asyncio.Event()

        async def held(tag, dest):  # the server posts its receive only when the test says so
            entered.set()
            await go.wait()
            await real(tag, dest)

        served._bulk.recv = held
        data = np.full(NBYTES, 7, np.uint8)
        task = asyncio.ensure_future(conn.request("put", [data], timeout_s=0.2))
        async with asyncio.timeout(10):
            await entered.wait()  # the header is in; the bulk's send is posted, not yet read
            await _deadline_passed(task)
        told_early = task.done()
        if told_early:  # the caller uses its buffer again, as it may once told
            data[:] = 1
        go.set()
        with pytest.raises(DeadlineExceeded):
            async with asyncio.timeout(10):
                await task
        data[:] = 1
        async with asyncio.timeout(10):
            await handled.wait()
        assert seen == [[7]], f"the peer's handler got {seen}: bytes written after the caller was told"
        async with asyncio.timeout(10):
            assert (await conn.request("ping", timeout_s=10)).decode(object) == "ok"
    finally:
        await close_served(listener, conn)


async def _tcp_scenario():
    """TCP under uvloop: a large frame that the socket did not take at once stays in uvloop's
    write buffer as *views* of the caller's memory (uvloop copies nothing), sent as the peer
    reads. The server stops reading until the caller's deadline has passed."""
    seen = []
    handled = asyncio.Event()

    async def handler(incoming):
        if incoming.bulk:
            seen.append(np.unique(incoming.bulk[0]).tolist())
            handled.set()
        return Reply("ok")

    server, listener, conn = await served_pair(handler, KEY, "tcp")
    try:
        async with asyncio.timeout(10):
            while not listener.connections:
                await asyncio.sleep(0.01)
        (served,) = listener.connections
        served.link._transport.pause_reading()
        data = np.full(64 << 20, 7, np.uint8)  # far more than the socket buffers hold
        task = asyncio.ensure_future(conn.request("put", [data], timeout_s=0.2))
        async with asyncio.timeout(10):
            await _deadline_passed(task)
        told_early = task.done()
        if told_early:  # the caller uses its buffer again, as it may once told
            data[:] = 1
        served.link._transport.resume_reading()
        with pytest.raises(DeadlineExceeded):
            async with asyncio.timeout(10):
                await task
        data[:] = 1
        async with asyncio.timeout(10):
            await handled.wait()
        assert seen == [[7]], f"the peer's handler got {seen}: bytes written after the caller was told"
        async with asyncio.timeout(10):
            assert (await conn.request("ping", timeout_s=10)).decode(object) == "ok"
    finally:
        await close_served(listener, conn)
    assert server.pool.leased == 0


@pytest.mark.timeout(60)
def test_tcp_uvloop_a_caller_that_gave_up_is_told_only_once_its_bulk_left_its_buffers():
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(_tcp_scenario())


@pytest.mark.asyncio
async def test_tcp_a_caller_that_gave_up_is_told_only_once_its_bulk_left_its_buffers():
    await _tcp_scenario()  # the stdlib loop copies what the socket did not take: passes either way
