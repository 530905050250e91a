"""The request fast paths of ``peers.transport.connection``: the caller-side deadline heap, and
writes that skip the lock/drain when the socket took everything (vs. the locked path under
contention). The conformance suite checks behaviour end to end; these pin the new mechanisms."""

import asyncio
import contextlib
import socket

import numpy as np
import pytest

from peers.errors import DeadlineExceeded
from peers.transport import Identity, Reply, make_transport
from peers.transport.connection import _DEADLINE_SLACK, _Deadlines, _Pending

from ._loopback import close_pair, connected_pair

KEY = [b"unit-fastpath-key-0123456789abcd"]


@pytest.mark.asyncio
async def test_deadlines_expire_live_ids_only_in_order():
    loop = asyncio.get_running_loop()
    pending: dict[int, object] = {i: object() for i in range(1, 5)}
    expired: list[int] = []
    deadlines = _Deadlines(loop, pending, expired.append)
    now = loop.time()
    deadlines.add(now + 0.20, 1, None)  # no token: live while the id is pending
    deadlines.add(now + 0.05, 2, pending[2])  # earlier than the armed timer: re-armed
    deadlines.add(now + 0.10, 3, None)
    deadlines.add(now + 0.10, 4, pending[4])
    del pending[3]  # answered before its deadline: must not expire
    pending[4] = object()  # the id was reused by a new request: the old deadline is not its own
    async with asyncio.timeout(2):
        while len(expired) < 2:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert expired == [2, 1]
    assert loop.time() - now >= 0.19
    deadlines.close()


@pytest.mark.asyncio
async def test_deadlines_heap_stays_bounded_by_in_flight():
    loop = asyncio.get_running_loop()
    pending: dict[int, object] = {}
    deadlines = _Deadlines(loop, pending, lambda _id: None)
    for req_id in range(5000):  # sequential requests: each answered before the next one
        pending[req_id] = token = object()
        deadlines.add(loop.time() + 60, req_id, token)
        del pending[req_id]
    assert len(deadlines._heap) <= 2 * len(pending) + _DEADLINE_SLACK + 1
    deadlines.close()


async def _handler(incoming):
    op = incoming.decode(object)
    if op == "sleep":
        await asyncio.sleep(30)
    if incoming.bulk:
        return Reply(op, [b * 2 for b in incoming.bulk])
    return Reply(op)


async def _pair():
    return await connected_pair(_handler, KEY)


async def _teardown(server, listener, client, conn):
    await close_pair(server, listener, client, conn)


@pytest.mark.asyncio
async def test_small_requests_interleave_with_large_ones_intact():
    """Large frames fill the socket (locked path, drain awaited) while small ones arrive: every
    frame must stay whole and every response must match its request."""
    server, listener, client, conn = await _pair()
    big = [np.full(2 * 2**20, i, np.int32) for i in range(4)]  # 8 MiB each
    small = [np.arange(100 + i, dtype=np.int64) for i in range(64)]
    results = await asyncio.wait_for(asyncio.gather(
        *(conn.request(i, [b], timeout_s=30) for i, b in enumerate(big)),
        *(conn.request(100 + i, [s], timeout_s=30) for i, s in enumerate(small))), 60)
    for i, (b, r) in enumerate(zip(big, results[:4])):
        assert r.decode(int) == i
        np.testing.assert_array_equal(r.bulk[0], b * 2)
    for i, (s, r) in enumerate(zip(small, results[4:])):
        assert r.decode(int) == 100 + i
        np.testing.assert_array_equal(r.bulk[0], s * 2)
    assert conn.in_flight == 0
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_many_sequential_deadlines_do_not_accumulate_and_expiry_still_fires():
    server, listener, client, conn = await _pair()
    for i in range(300):
        assert (await conn.request(i, timeout_s=30)).decode(int) == i
    assert len(conn._deadlines._heap) <= _DEADLINE_SLACK + 1
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded):
        await conn.request("sleep", timeout_s=0.2)  # earlier than every 30 s entry: re-armed
    assert 0.15 <= loop.time() - t0 < 2
    assert conn.in_flight == 0
    assert client.metrics.deadlines == 1
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_server_budget_cancels_handler_with_a_deadline_error():
    """The server enforces the request's budget itself (its heap, not the caller's timer): send a
    request whose budget (0.1 s) is far shorter than how long the caller will wait."""
    server, listener, client, conn = await _pair()
    req_id = next(conn._ids)
    entry = _Pending(asyncio.get_running_loop().create_future(), None)
    conn._pending[req_id] = entry
    sending = conn._send_message(req_id, "sleep", (), response=False, budget_s=0.1)
    if sending is not None:
        await sending
    with pytest.raises(DeadlineExceeded, match="peer gave up"):
        await asyncio.wait_for(entry.future, 5)
    conn._pending.pop(req_id)
    async with asyncio.timeout(5):
        while any(c._serving for c in listener.connections):
            await asyncio.sleep(0.01)
    assert (await conn.request(7, timeout_s=5)).decode(int) == 7
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_connect_cancelled_during_the_handshake_closes_its_socket():
    """A caller cancelled while the handshake is in flight (its request's deadline, a shutdown)
    must not leave the socket open: it leaked, and its ``ready`` future failed later with nobody
    to read it ("connection lost during handshake", then a ResourceWarning on GC)."""
    accepted: list[asyncio.StreamWriter] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # accepts and never answers the handshake

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = make_transport("tcp", Identity("cancel-test", "unit", KEY))
    task = asyncio.create_task(transport.connect_once(f"tcp://127.0.0.1:{port}", timeout_s=30))
    async with asyncio.timeout(5):
        while not transport.links:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(5):
        while transport.links:  # the link reports itself lost once its socket is closed
            await asyncio.sleep(0.01)
    for writer in accepted:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_listener_close_closes_sockets_still_in_the_handshake():
    """Closing a listener closed the connections that had finished their handshake but left the
    sockets still in it open (the server's close does not close accepted sockets): they leaked,
    and their ResourceWarning surfaced in whichever test ran the next garbage collection."""
    server = make_transport("tcp", Identity("server", "unit", KEY))

    async def handler(conn, msg, bulk):
        return Reply(msg)

    listener = await server.listen("tcp://127.0.0.1:0", handler)
    port = int(listener.address.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # connects, never says hello
    async with asyncio.timeout(5):
        while not server.links:
            await asyncio.sleep(0.01)
    await listener.close()
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # the server's side was closed: EOF here
    assert not server.links
    writer.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("ticks", range(8))
async def test_listener_close_closes_sockets_accepted_while_it_closes(ticks):
    """A socket the server had accepted but not yet handed to its protocol (asyncio makes the
    protocol one loop tick after the accept and calls ``connection_made`` one tick later) escaped
    the listener's close: the close aborted a link with no transport yet (a no-op) or never saw
    the link at all, so the socket stayed open with nobody to close it. Found as the accepted
    socket leaked by tests/integration/test_compute_cluster.py."""
    server = make_transport("tcp", Identity("server", "unit", KEY))

    async def handler(conn, msg, bulk):
        return Reply(msg)

    listener = await server.listen("tcp://127.0.0.1:0", handler)
    port = int(listener.address.rsplit(":", 1)[1])
    clients = []
    try:
        for _ in range(3):  # kernel-level connects: queued for accept, never say hello
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            clients.append(s)
        for _ in range(ticks):  # close at each stage of the accept: queued, accepted, made, started
            await asyncio.sleep(0)
        await listener.close()
        async with asyncio.timeout(2):  # the clients stay open: only the server can end these links
            while server.links:
                await asyncio.sleep(0.01)
    finally:
        for s in clients:
            s.close()
