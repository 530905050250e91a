"""A caller that gave up on a request (deadline, cancellation) gets its ``recv_into`` buffers back
untouched: the rest of a response already arriving into them goes elsewhere.

Before: the decoder kept writing the response's bulk into the caller's buffers after
``request()`` had raised, so a caller that reused its buffers (a retry of a row's part to another
replica into the same rows, ``client/row_parts.py``) found them overwritten by the late reply."""

import asyncio

import numpy as np
import pytest

from peers.errors import DeadlineExceeded
from peers.transport import Identity, Reply
from peers.transport.memory import MemLink, MemoryNetwork, MemoryTransport

from ._loopback import close_served, served_pair, ucx_available

KEY = [b"unit-abandoned-bulk-key-0123456789"]
NBYTES = 1 << 20


class _HeldBack:
    """Cuts the next frame of at least ``NBYTES`` written by ``link`` in two: the first half is
    delivered at once, the second when ``release()`` is called."""

    def __init__(self, link: MemLink) -> None:
        self.link, self.rest = link, None
        self._write = link.write
        link.write = self.write  # type: ignore[method-assign]

    def write(self, parts):
        data = b"".join(parts)
        if self.rest is None and len(data) >= NBYTES:
            self._write([data[: len(data) // 2]])
            self.rest = data[len(data) // 2:]
            return
        self._write([data])

    def release(self) -> None:
        self._write([self.rest])


async def _pair(network):
    async def handler(incoming):
        if incoming.decode(object) == "big":
            return Reply("ok", [np.full(NBYTES, 7, np.uint8)])
        return Reply("pong")

    server = MemoryTransport(Identity("server", "unit", KEY), network=network)
    client = MemoryTransport(Identity("client", "unit", KEY), network=network)
    await server.listen("mem://abandoned", handler)
    conn = await client.connect_once("mem://abandoned", timeout_s=10)
    return conn


def _server_link(network: MemoryNetwork) -> MemLink:
    (server_end,) = [link for link in network.links if link.session is not None and link.session._server is not None]
    return server_end


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_an_abandoned_requests_late_bulk_does_not_land_in_its_buffers(how):
    network = MemoryNetwork()
    conn = await _pair(network)
    held = _HeldBack(_server_link(network))
    dest = np.zeros(NBYTES, np.uint8)
    if how == "deadline":
        with pytest.raises(DeadlineExceeded):
            await conn.request("big", recv_into=[dest], timeout_s=0.2)
    else:
        task = asyncio.ensure_future(conn.request("big", recv_into=[dest], timeout_s=30))
        async with asyncio.timeout(10):
            while held.rest is None or not dest[0]:  # the first half has landed in place
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert held.rest is not None and dest[0] == 7  # the reply was half in when the caller gave up
    dest[:] = 1  # the caller uses its buffer again
    held.release()
    async with asyncio.timeout(10):  # in order on the link: the late reply is consumed first
        assert (await conn.request("ping", timeout_s=10)).decode(object) == "pong"
    assert not conn.is_closed
    assert (dest == 1).all()
    # and the connection still delivers bulk where it is asked to
    again = np.zeros(NBYTES, np.uint8)
    await conn.request("big", recv_into=[again], timeout_s=10)
    assert (again == 7).all()
    await conn.close()



@pytest.mark.asyncio
@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
async def test_ucx_a_caller_that_gave_up_is_told_only_once_its_out_of_band_bulk_is_in():
    """A posted UCX receive cannot be taken back: the caller waits for it before it is told."""
    async def handler(incoming):
        if incoming.decode(object) == "big":
            return Reply("ok", [np.full(NBYTES, 7, np.uint8)])
        return Reply("pong")

    server, listener, conn = await served_pair(handler, KEY, "ucx")
    try:
        assert conn._bulk is not None, "no ucx bulk channel on loopback"
        real, entered, go = conn._bulk.recv, asyncio.Event(), asyncio.Event()

        async def held(tag, dest):
            entered.set()
            await go.wait()
            await real(tag, dest)

        conn._bulk.recv = held
        dest = np.zeros(NBYTES, np.uint8)
        task = asyncio.ensure_future(conn.request("big", recv_into=[dest], timeout_s=0.2))
        async with asyncio.timeout(10):
            await entered.wait()
        await asyncio.sleep(0.5)  # well past the deadline
        assert not task.done()  # its buffer may still be written: not told yet
        go.set()
        with pytest.raises(DeadlineExceeded):
            async with asyncio.timeout(10):
                await task
        # (what landed is unspecified: the server's handler was cancelled by the caller's Cancel,
        # its reply's send with it; the promise is only that nothing lands from now on)
        dest[:] = 1
        async with asyncio.timeout(10):
            assert (await conn.request("ping", timeout_s=10)).decode(object) == "pong"
        assert (dest == 1).all()
    finally:
        await close_served(listener, conn)
