"""A handler that raises ``OSError`` (a full disk, EIO) is answered with an error like any other
handler failure. Before (Nov 30): ``_serve`` took every ``OSError`` for its own connection going
away and sent nothing, so the caller waited for its deadline and saw the peer as unreachable (a
stream's sender then retried for an hour)."""

import asyncio
import errno
import os

import pytest

from peers.errors import RemoteError, TransportClosed
from peers.transport import Reply

from ._loopback import close_pair, connected_pair

KEY = [b"unit-handler-os-errors-key-012345"]
pytestmark = pytest.mark.timeout(30)


@pytest.mark.asyncio
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("waits", [False, True])
async def test_a_handlers_os_error_is_answered(code, waits):
    async def handler(incoming):
        if waits:  # in a Task, not in the read callback
            await asyncio.sleep(0)
        if incoming.decode(str) == "fail":
            raise OSError(code, os.strerror(code))
        return Reply("ok")

    server, listener, client, conn = await connected_pair(handler, KEY)
    try:
        with pytest.raises(RemoteError) as info:
            await conn.request("fail", timeout_s=10)
        assert os.strerror(code) in str(info.value)
        assert (await conn.request("next", timeout_s=10)).decode(str) == "ok"  # the connection lives
    finally:
        await close_pair(server, listener, client, conn)


@pytest.mark.asyncio
async def test_a_handler_failing_as_its_own_connection_closes_sends_nothing():
    """What the ``except`` was for: the connection itself went away (nothing can be sent)."""
    served = []

    async def handler(incoming):
        served[0].fail(TransportClosed("gone"))
        raise OSError(errno.EPIPE, "broken pipe")

    server, listener, client, conn = await connected_pair(handler, KEY)
    try:
        served.extend(listener.connections)
        with pytest.raises(TransportClosed):
            await conn.request("x", timeout_s=10)
    finally:
        await close_pair(server, listener, client, conn)
