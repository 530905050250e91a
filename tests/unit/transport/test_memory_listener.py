"""The in-process (``mem://``) transport's listener: closing it leaves no connection to it, not even
one whose handshake was still running (the in-process cluster harness restarts nodes at the same
address: a connection left to a stopped node's runtime answered for it after its restart)."""

from __future__ import annotations

import asyncio

import pytest

from peers.errors import PeersError
from peers.transport import Identity, Reply, make_transport
from peers.transport.memory import MemoryNetwork

KEY = [b"unit-memory-listener-key-0123456"]


async def _old(incoming):
    return Reply("old node")


async def _new(incoming):
    return Reply("new node")


@pytest.mark.asyncio
async def test_a_connection_whose_handshake_outlives_the_listener_is_closed_too():
    network = MemoryNetwork(delay_s=0.05)  # every frame 50 ms late: the handshake takes ~0.1-0.2 s
    server = make_transport("mem", Identity("server", "unit", KEY), network=network)
    client = make_transport("mem", Identity("client", "unit", KEY), network=network)
    listener = await server.listen("mem://node", _old)
    connecting = asyncio.create_task(client.connect_once("mem://node", timeout_s=5))
    await asyncio.sleep(0.06)  # the handshake is under way
    await listener.close()
    again = await make_transport("mem", Identity("server", "unit", KEY), network=network).listen("mem://node", _new)
    try:
        conn = await connecting
    except PeersError:
        conn = None  # refused: as good
    if conn is not None:
        with pytest.raises(PeersError):  # never an answer from the closed listener's handler
            await conn.request("hello", timeout_s=2)
    await again.close()
    async with asyncio.timeout(5):
        while client.open_resources or server.open_resources:
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_connect_cancelled_mid_handshake_leaves_no_link_open():
    network = MemoryNetwork()
    server = make_transport("mem", Identity("server", "unit", KEY), network=network)
    client = make_transport("mem", Identity("client", "unit", KEY), network=network)
    listener = await server.listen("mem://node", _old)
    connecting = asyncio.create_task(client.connect_once("mem://node", timeout_s=5))
    await asyncio.sleep(0)  # the links exist and the Hello is on its way
    connecting.cancel()  # a caller's deadline, a pool's fail_peer
    with pytest.raises(asyncio.CancelledError):
        await connecting
    async with asyncio.timeout(5):  # (tcp aborts its socket here; mem finished the handshake)
        while client.open_resources or server.open_resources:
            await asyncio.sleep(0.01)
    assert listener.connections == []
    await listener.close()
