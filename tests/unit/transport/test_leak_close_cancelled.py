"""``Connection.close()`` cancelled while it waits (its ``Goodbye`` behind a full socket: a peer that
stopped reading) must still close: a caller's shutdown cancels, and nobody closes it later.

Before (Nov 30): the cancellation left ``close()`` before it shut the connection down and aborted
the link, so the socket stayed open (and its pending requests waiting) for as long as the peer kept
it open, one per connection closed that way."""

import asyncio

import numpy as np
import pytest

from peers.errors import TransportClosed
from peers.transport import Identity, Reply, make_transport

KEY = [b"unit-leak-close-key-0123456789abc"]
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
ROUNDS = 8


async def _answer(incoming):
    return Reply("ok")


async def test_leak_close_cancelled_while_the_peer_does_not_read():
    server = make_transport("tcp", Identity("server", "unit", KEY))
    listener = await server.listen("tcp://127.0.0.1:0", _answer)
    client = make_transport("tcp", Identity("client", "unit", KEY))
    large = np.zeros(32 * 2**20, np.uint8)
    fillers, kept = [], []
    try:
        for _ in range(ROUNDS):
            conn = await client.connect_once(listener.address, timeout_s=10)
            for link in listener._links:  # the server stops reading: our socket fills up
                link._transport.pause_reading()
            fillers.append(asyncio.ensure_future(conn.request("large", [large])))
            async with asyncio.timeout(10):
                while conn.link.flushed:
                    await asyncio.sleep(0.01)
            closing = asyncio.ensure_future(conn.close("done"))
            await asyncio.sleep(0.05)  # its Goodbye waits for the full socket
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            await asyncio.sleep(0)
            kept.append(client.open_resources)
        assert kept[-1] == 0, f"client sockets open after each cancelled close: {kept}"
        for filler in fillers:  # the requests of a closed connection fail at once
            with pytest.raises(TransportClosed):
                await asyncio.wait_for(filler, 5)
    finally:
        for link in listener._links:
            link._transport.resume_reading()
        await listener.close()
        await asyncio.gather(*fillers, return_exceptions=True)
