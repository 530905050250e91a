"""Requests that time out while their peer does not read (its loop stalled, a stopped process:
the connection stays up, the socket fills): what the caller's side keeps must not grow with them.

Before (Nov 30): every timed-out request started a task to send its ``Cancel``, also a request
that never left (it waited for the write lock behind a frame the full socket held): those tasks
queued for the lock until the peer read again, one per timed-out request, and then wrote
``Cancel``s for ids the peer never saw, each holding up the requests behind it."""

import asyncio

import numpy as np
import pytest

from peers.errors import DeadlineExceeded
from peers.transport import Reply

from ._loopback import close_pair, connected_pair

KEY = [b"unit-leak-cancels-key-0123456789a"]
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
ROUNDS, PER_ROUND = 6, 100


async def _answer(incoming):
    return Reply("ok")


async def test_leak_timed_out_requests_to_a_peer_that_stopped_reading():
    server, listener, client, conn = await connected_pair(_answer, KEY)
    assert (await conn.request("before", timeout_s=10)).decode(str) == "ok"
    filler = None
    try:
        for link in listener._links:  # the server stops reading: its socket and then ours fill up
            link._transport.pause_reading()
        filler = asyncio.ensure_future(conn.request("large", [np.zeros(32 * 2**20, np.uint8)]))
        async with asyncio.timeout(10):
            while conn.link.flushed:  # the large frame no longer fits: it waits in our buffer
                await asyncio.sleep(0.01)
        tasks = []
        for _ in range(ROUNDS):
            outcomes = await asyncio.gather(*(conn.request("stuck", timeout_s=0.02) for _ in range(PER_ROUND)),
                                            return_exceptions=True)
            assert all(isinstance(o, DeadlineExceeded) for o in outcomes), outcomes[:3]
            await asyncio.sleep(0)
            tasks.append(len(asyncio.all_tasks()))
        assert tasks[-1] <= tasks[0], f"tasks after each round of {PER_ROUND} timed-out requests: {tasks}"
    finally:
        for link in listener._links:  # the server reads again: the large request and new ones get through
            link._transport.resume_reading()
    async with asyncio.timeout(10):
        assert (await filler).decode(str) == "ok"
        assert (await conn.request("after", timeout_s=10)).decode(str) == "ok"
    await close_pair(server, listener, client, conn)
