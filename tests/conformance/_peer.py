"""A peer in its own process, for crash tests: ``python -m tests.conformance._peer SCHEME ADDRESS MiB``.

Connects to ADDRESS and sends one request carrying MiB mebibytes of bulk, then waits to be killed.
"""

import asyncio
import sys

import numpy as np

from peers.transport import Identity, connect, make_transport

KEYRING = [b"conformance-key-0123456789abcdef"]


async def main(scheme: str, address: str, mib: int) -> None:
    transport = make_transport(scheme, Identity("crasher", "conformance", KEYRING))
    conn = await connect(transport, address, timeout_s=20)
    payload = np.ones(mib * 2**20, np.uint8)
    print("connected", flush=True)
    await conn.request("sink", [payload], timeout_s=600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
