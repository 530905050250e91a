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


def ucx_available():
    """Whether ucxx imports here (the ucx backend's tests skip otherwise)."""
    try:
        import ucxx  # noqa: F401

        from peers.transport import ucx  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return False
    return True


async def served_pair(handler, key, scheme):
    """(server transport, listener, connection) of a fresh client to a fresh server of ``scheme`` on loopback,
    connected once (no retries); close with ``close_served``."""
    server = make_transport(scheme, Identity("server", "unit", key))
    listener = await server.listen(f"{scheme}://127.0.0.1:0", handler)
    client = make_transport(scheme, Identity("client", "unit", key))
    conn = await client.connect_once(listener.address, timeout_s=10)
    return server, listener, conn


async def close_served(listener, conn):
    await conn.close()
    await listener.close()
