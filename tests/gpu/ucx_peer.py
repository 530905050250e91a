"""A ucx data-plane server in its own process, for tests/gpu: it answers a ``write`` with the
xxh3-64 digest and length of the bulk bytes it received (host memory), so a test can send from
device memory to another process, as a compute node sends deltas to a storage node.

    python -m tests.gpu.ucx_peer      # prints the listener's address on one line, serves until stdin closes
"""

from __future__ import annotations

import asyncio
import sys

import xxhash

from peers.transport import Identity, Reply
from peers.transport.ucx import UcxTransport

KEYRING = [b"gpu-test-key-0123456789abcdef012"]


async def serve() -> None:
    async def handle(incoming):  # type: ignore[no-untyped-def]
        data = b"".join(bytes(memoryview(b).cast("B")) for b in incoming.bulk)
        return Reply({"digest": xxhash.xxh3_64_intdigest(data), "nbytes": len(data)})

    listener = await UcxTransport(Identity("peer", "gpu", KEYRING)).listen("ucx://127.0.0.1:0", handle)
    print(listener.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    await listener.close()


if __name__ == "__main__":
    asyncio.run(serve())
