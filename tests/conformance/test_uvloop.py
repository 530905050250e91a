"""The stream backends under uvloop (the daemon's loop). uvloop's transports are not
``asyncio.Transport`` subclasses — a difference that once broke connection setup — so the core
paths run here under ``uvloop.run`` as well as under the stdlib loop in test_conformance.py."""

import asyncio

import numpy as np
import pytest

from peers.errors import DeadlineExceeded, HandshakeRejected
from peers.transport import Reply, connect

uvloop = pytest.importorskip("uvloop")
pytestmark = pytest.mark.timeout(60)


async def _scenario(harness):
    async def handle(incoming):
        op = incoming.decode(object)
        if op == "sleep":
            await asyncio.sleep(30)
        return Reply(op, [a * 2 for a in incoming.bulk])

    server = harness.transport("server")
    listener = await server.listen(harness.address(), handle)
    client = harness.transport("client")
    conn = await connect(client, listener.address, timeout_s=10)
    src = np.arange(3 * 2**20, dtype=np.float32)
    dest = np.empty_like(src)
    result = await conn.request("x", [src], recv_into=[dest], timeout_s=20)
    assert result.decode(str) == "x" and np.array_equal(dest, src * 2)
    many = await asyncio.gather(*(conn.request(i, timeout_s=20) for i in range(100)))
    assert [r.decode(int) for r in many] == list(range(100))
    with pytest.raises(DeadlineExceeded):
        await conn.request("sleep", timeout_s=0.1)
    with pytest.raises(HandshakeRejected):
        await connect(harness.transport("x", cluster="other"), listener.address, timeout_s=5)
    await conn.close()
    await listener.close()
    async with asyncio.timeout(5):
        while client.open_resources or server.open_resources or server.pool.leased:
            await asyncio.sleep(0.01)


def test_uvloop_request_response_bulk_deadline_rejection(harness):
    if harness.scheme == "mem":
        pytest.skip("mem has no OS transport: nothing uvloop-specific")
    uvloop.run(_scenario(harness))
