"""A connected client/server pair of our transports on loopback, and its teardown (shared by the
transport unit tests)."""

from __future__ import annotations

import asyncio

from peers.transport import Identity, connect, make_transport


async def connected_pair(handler, key, scheme="tcp"):
    """(server transport, listener, client transport, connection) with ``handler`` serving."""
    server = make_transport(scheme, Identity("server", "unit", key))
    listener = await server.listen(f"{scheme}://127.0.0.1:0", handler)
    client = make_transport(scheme, Identity("client", "unit", key))
    conn = await connect(client, listener.address, timeout_s=10)
    return server, listener, client, conn


async def close_pair(server, listener, client, conn):
    """Close the pair, wait for every resource to go, and check no pooled buffer is still leased
    (a kept receive buffer goes back with its connection)."""
    await conn.close()
    await listener.close()
    async with asyncio.timeout(5):
        while client.open_resources or server.open_resources:
            await asyncio.sleep(0.01)
    assert server.pool.leased == 0
