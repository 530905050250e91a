"""A tcp:// server in its own process, for RSS checks: ``python -m tests.conformance._churn_server``.

Prints its listener address, then serves until stdin closes. The request ``"stats"`` answers
``[rss_bytes, open_links, protocol_errors, refused]`` so the test can read the server's own memory
(``/proc/self/statm``) without the test process's allocations in the figure. Runs under uvloop
when installed, as the daemon does.
"""

import asyncio
import os
import sys

from peers.transport import Identity, Reply, make_transport

KEYRING = [b"conformance-key-0123456789abcdef"]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE


async def main() -> None:
    transport = make_transport("tcp", Identity("server", "conformance", KEYRING))

    async def handle(incoming):
        op = incoming.decode(object)
        if op == "stats":
            metrics = transport.metrics
            refused = sum(metrics.connections_refused.values())
            return Reply([rss_bytes(), len(transport.links), sum(metrics.protocol_errors.values()), refused])
        return Reply(op, incoming.bulk)

    listener = await transport.listen("tcp://127.0.0.1:0", handle)
    print(listener.address, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # the test closes stdin to stop us
    await listener.close()


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(main())
    else:
        uvloop.run(main())
