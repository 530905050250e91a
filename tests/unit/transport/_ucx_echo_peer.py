"""A ucx server in its own process, for ``test_close_paths``: ``"echo"`` replies with the
request's own bulk (its pooled receive buffer); ``{"reuse": nbytes}`` fails every other connection
(as membership does when it declares a peer dead), waits until their handlers have ended, then
leases a pool buffer of ``nbytes`` and fills it with 9s, as the next request's bulk would.

    python -m tests.unit.transport._ucx_echo_peer   # prints the address; serves until stdin closes
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from peers.errors import PeerDead
from peers.transport import Identity, Reply
from peers.transport.ucx import UcxTransport

KEY = [b"unit-close-paths-key-0123456789ab"]


async def serve() -> None:
    transport = UcxTransport(Identity("echo-peer", "unit", KEY))
    kept = []

    async def handle(incoming):  # type: ignore[no-untyped-def]
        op = incoming.decode(object)
        if op == "echo":
            return Reply("echo", [incoming.bulk[0]])
        others = [c for c in listener.connections if c.peer != incoming.peer]
        for conn in others:
            conn.fail(PeerDead("membership: declared dead"))
        async with asyncio.timeout(10):
            while any(conn._serving for conn in others):
                await asyncio.sleep(0.01)
        lease = transport.pool.lease(op["reuse"])
        np.asarray(lease.view)[:] = 9
        kept.append(lease)
        return Reply({"quarantined": transport.pool.quarantined})

    listener = await transport.listen("ucx://127.0.0.1:0", handle)
    print(listener.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    await listener.close()


if __name__ == "__main__":
    asyncio.run(serve())
