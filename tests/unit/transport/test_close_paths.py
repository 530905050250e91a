"""Closing a connection from the paths where it is easiest to get wrong: while the link is corked
(the replies of one read are held), and from a request handler's first step (run inside the read
callback, before it has a Task: ``eager.py``).

Before (Nov 30): ``close()`` wrote its ``Goodbye`` into the cork and then aborted the link, which
drops what a cork holds: the peer saw its connection lost (EOF), not a goodbye, and lost the replies
held with it. And a handler that closed or failed its own connection in its first step had its
request's pooled receive buffers given back by the shutdown while it still read them: the next
request on any connection of the transport was received into the same memory. And a reply's UCX
send left posted by a failure (``ep.abort`` does not end it) had its pooled buffer lent again (or,
once forgotten but not kept, freed): a late receive of its peer read the new bytes (or aborted)."""

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from peers.errors import PeerDead, TransportClosed
from peers.transport import Identity, Reply, connect, make_transport
from peers.transport.ucx import UcxBulk, UcxTransport  # imports no ucxx

from ._loopback import close_pair, connected_pair, ucx_available

KEY = [b"unit-close-paths-key-0123456789ab"]
pytestmark = pytest.mark.timeout(60)
_REPO = Path(__file__).resolve().parents[3]


async def _pipelined(conn, payloads):
    """Send ``payloads`` as requests in one write (the client's link corked while they are
    written), so the server reads them in one read and corks its replies while it serves them."""
    conn.link.cork()
    try:
        tasks = [asyncio.ensure_future(conn.request(p, timeout_s=10)) for p in payloads]
        async with asyncio.timeout(5):
            while conn.in_flight < len(payloads):  # each task has written its request (held)
                await asyncio.sleep(0)
    finally:
        conn.link.uncork()
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)


@pytest.mark.asyncio
async def test_close_while_replies_are_held_still_says_goodbye_after_them():
    served = []

    async def handler(incoming):
        n = incoming.decode(int)
        if n == 3:  # mid-batch: the replies to 0..2 are held by the cork
            await served[0].close("handler closes")
        return Reply(n)

    server, listener, client, conn = await connected_pair(handler, KEY)
    try:
        served.extend(listener.connections)
        results = await _pipelined(conn, range(6))
        assert [r if isinstance(r, BaseException) else r.decode(int) for r in results[:3]] == [0, 1, 2]
        for result in results[3:]:
            assert isinstance(result, TransportClosed) and "said goodbye: handler closes" in str(result), result
    finally:
        await close_pair(server, listener, client, conn)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["fail", "close"])
async def test_a_handler_that_closes_its_connection_in_its_first_step_keeps_its_buffers(how):
    first: list = []
    go = asyncio.Event()
    seen = []

    async def handler(incoming):
        if incoming.decode(str) == "hold":
            array = incoming.bulk[0]
            if how == "fail":
                first[0].fail(PeerDead("membership: declared dead"))
            else:
                await first[0].close("handler closes")  # no await suspends: still the first step
            try:
                await asyncio.shield(go.wait())  # meanwhile another connection's request arrives
            except asyncio.CancelledError:  # its connection closed: a handler that still finishes
                await go.wait()  # its work, reading its request's bulk
            seen.append(np.unique(array).tolist())
        return Reply("ok")

    server, listener, client, conn = await connected_pair(handler, KEY)
    other_client = make_transport("tcp", Identity("other", "unit", KEY))
    other = None
    try:
        first.extend(listener.connections)
        nbytes = 100 << 10
        with pytest.raises(TransportClosed):
            await conn.request("hold", [np.full(nbytes, 1, np.uint8)], timeout_s=10)
        other = await connect(other_client, listener.address, timeout_s=10)
        assert (await other.request("fill", [np.full(nbytes, 2, np.uint8)], timeout_s=10)).decode(str) == "ok"
        go.set()
        async with asyncio.timeout(5):
            while not seen:
                await asyncio.sleep(0.01)
        assert seen == [[1]], f"the handler's request bulk was overwritten by another request's: {seen}"
    finally:
        go.set()
        if other is not None:
            await other.close()
        await close_pair(server, listener, client, conn)
        async with asyncio.timeout(5):
            while other_client.open_resources:
                await asyncio.sleep(0.01)


@pytest.mark.asyncio
@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
async def test_ucx_a_reply_send_left_posted_by_a_failure_keeps_its_pooled_buffer():
    """The peer's reply carries the request's own pooled buffer (an echo). It fails the connection
    (membership declared us dead) while the reply's UCX send is posted and not yet matched: the
    send stays posted (``ep.abort`` does not take it back), and a receive that matches it later
    (ours was about to be posted: its announcement had arrived) reads the peer's memory then. The
    peer must not lend that buffer again. A second process: in one process the late receive is
    cancelled with the sender's endpoint."""
    nbytes = 8 << 20  # above the UCX rendezvous threshold: the receiver reads when it matches
    peer = subprocess.Popen([sys.executable, "-m", "tests.unit.transport._ucx_echo_peer"], cwd=_REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = UcxTransport(Identity("client", "unit", KEY))
    other = UcxTransport(Identity("other", "unit", KEY))
    conns, bulk, done = [], None, asyncio.Event()
    try:
        address = await asyncio.wait_for(asyncio.to_thread(peer.stdout.readline), 30)
        conn = await client.connect_once(address.strip(), timeout_s=10)
        conns.append(conn)
        conns.append(await other.connect_once(address.strip(), timeout_s=10))
        tags, announced = [], asyncio.Event()

        async def not_yet(tag, dest):  # the reply's header is in; the receive is not posted yet
            tags.append(tag)
            announced.set()
            await done.wait()

        conn._bulk.recv = not_yet
        bulk = conn._bulk
        bulk.close = lambda: None  # the receive is posted before this side notices the loss
        echo = asyncio.ensure_future(conn.request("echo", [np.full(nbytes, 7, np.uint8)], timeout_s=10))
        async with asyncio.timeout(10):
            await announced.wait()
        reused = (await conns[1].request({"reuse": nbytes}, timeout_s=10)).decode(object)
        with pytest.raises(TransportClosed):
            await asyncio.wait_for(echo, 10)
        late = np.zeros(nbytes, np.uint8)
        await asyncio.wait_for(client.runtime.ucxx.recv(late, tags[0]), 10)
        assert np.unique(late).tolist() == [7], "the posted send read a buffer the peer had lent again"
        assert reused == {"quarantined": 1}
    finally:
        done.set()
        if bulk is not None:
            UcxBulk.close(bulk)
        for c in conns:
            await c.close()
        peer.stdin.close()
        try:
            peer.wait(10)
        finally:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
            peer.stdout.close()


@pytest.mark.asyncio
async def test_a_send_still_posted_when_its_wait_ends_logs_no_unretrieved_error():
    """``_sent_elsewhere`` gives up on posted sends (a gather of them) when the connection closes
    and cancels the gather; a cancelled gather ends with its CancelledError *set* (Python 3.11), so
    unless someone retrieves it asyncio logs "_GatheringFuture exception was never retrieved" at
    ERROR, an alarm an operator cannot act on (seen in the UCX peer of the test above)."""
    import gc

    loop = asyncio.get_running_loop()
    reported = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    server, listener, client, conn = await connected_pair(lambda incoming: Reply(), KEY)
    try:
        posted = loop.create_future()  # a posted send: never ends by itself
        waiting = asyncio.ensure_future(conn._sent_elsewhere(asyncio.gather(posted)))
        await asyncio.sleep(0)
        conn.fail(PeerDead("gone"))  # the wait ends with the connection
        assert await asyncio.wait_for(waiting, 5) is False
        for _ in range(3):
            await asyncio.sleep(0)
        del waiting
        gc.collect()
        assert posted.cancelled()
        assert [c.get("message") for c in reported] == []
    finally:
        loop.set_exception_handler(previous)
        await close_pair(server, listener, client, conn)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["fail", "close"])
async def test_a_handler_that_closes_its_connection_in_its_first_step_is_cancelled(how):
    """As every handler of a closed connection is (``_shutdown``): one that closed it in its first
    step was not in ``_serving`` yet, so it ran on, holding its buffers, until it ended by itself."""
    first: list = []
    outcome: list = []

    async def handler(incoming):
        if how == "fail":
            first[0].fail(PeerDead("membership: declared dead"))
        else:
            await first[0].close("handler closes")
        try:
            await asyncio.sleep(30)
            outcome.append("ran on")
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return Reply("ok")

    server, listener, client, conn = await connected_pair(handler, KEY)
    try:
        first.extend(listener.connections)
        with pytest.raises(TransportClosed):
            await conn.request("x", [np.ones(1 << 10, np.uint8)], timeout_s=10)
        async with asyncio.timeout(5):
            while not outcome:
                await asyncio.sleep(0.01)
        assert outcome == ["cancelled"]
        assert first[0]._pool.leased == 0  # its buffers went back when it ended
    finally:
        await close_pair(server, listener, client, conn)
