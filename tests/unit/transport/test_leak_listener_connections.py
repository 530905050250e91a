"""A listener's set of connections under connection churn: a connection that closes in the very
read that completed its handshake (the client's ``Auth`` and its ``Goodbye``, or a frame that breaks
the protocol, arrive together) must not stay in it.

Before (Nov 30): the listener added the connection once its handshake's ``ready`` future ran its
callbacks, a loop iteration after the rest of the read had closed it, so the close's removal came
first and the closed connection (its link, session and decoder) stayed in the set for the listener's
whole life, one per such client."""

import asyncio

import pytest

from peers import framing, wire
from peers.errors import PeersError
from peers.transport import Identity, Reply, make_transport
from peers.transport.session import Session

KEY = [b"unit-leak-listener-key-0123456789"]
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
ROUNDS = 40


async def _answer(incoming):
    return Reply("ok")


@pytest.mark.parametrize("scheme", ["tcp", "mem"])
async def test_leak_listener_connections_closed_in_their_handshake_read(monkeypatch, scheme):
    send = Session._send

    def auth_then_goodbye(self, message):
        if not isinstance(message, wire.Auth):
            return send(self, message)
        # one write: the server reads the Auth and the Goodbye together
        self.link.write([*framing.encode_frame(message), *framing.encode_frame(wire.Goodbye("bye"))])

    server = make_transport(scheme, Identity("server", "unit", KEY))
    listener = await server.listen(f"{scheme}://127.0.0.1:0", _answer)
    client = make_transport(scheme, Identity("client", "unit", KEY))
    kept = []
    try:
        for _ in range(ROUNDS):
            with monkeypatch.context() as patch:
                patch.setattr(Session, "_send", auth_then_goodbye)
                try:
                    conn = await client.connect_once(listener.address, timeout_s=10)
                except (OSError, PeersError):
                    pass  # the server's abort may come before its Ready
                else:
                    await conn.close()
            async with asyncio.timeout(10):
                while server.open_resources or client.open_resources:
                    await asyncio.sleep(0.01)
            kept.append(len(listener._conns))
        assert server.metrics.connections_opened == ROUNDS  # every handshake completed
        assert kept[-1] <= 1, f"connections kept by the listener after each client: {kept}"
        assert listener.connections == []
    finally:
        await listener.close()
