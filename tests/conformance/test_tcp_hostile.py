"""tcp:// against a hostile or careless client (issue 16 item 1): reconnect churn, header-only
connections, connection caps. Memory is the server's own RSS, read in its own process."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from peers import framing
from peers.errors import DeadlineExceeded, TransportClosed
from peers.transport import Identity, Reply, TransportLimits, connect, make_transport

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
KEYRING = [b"conformance-key-0123456789abcdef"]
MIB = 2**20
#: A frame header announcing the largest body the framing allows, and nothing after it.
BIG_HEADER = framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, framing.MAX_BODY_BYTES, 0, 0, 0)


def _identity(name):
    return Identity(name, "conformance", KEYRING)


async def _echo(incoming):
    return Reply(incoming.decode(object))


async def _stats(conn):
    return (await conn.request("stats", timeout_s=10)).decode(list)


async def _churn(address, n, *, concurrency=8):
    client = make_transport("tcp", _identity("churner"))
    todo = iter(range(n))

    async def worker():
        for i in todo:
            conn = await connect(client, address, timeout_s=10)
            assert (await conn.request(i, timeout_s=10)).decode(int) == i
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _header_only(host, port, n, *, concurrency=8):
    todo = iter(range(n))

    async def worker():
        for _ in todo:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(BIG_HEADER)
            await writer.drain()
            await asyncio.sleep(0.005)  # let the server read the header before we hang up
            writer.close()
            await writer.wait_closed()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def test_tcp_rss_flat_under_reconnect_churn_and_header_only_connections():
    proc = subprocess.Popen([sys.executable, "-m", "tests.conformance._churn_server"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        address = address.strip()
        host, port = address.split("://")[1].rsplit(":", 1)
        watcher_transport = make_transport("tcp", _identity("watcher"))
        watcher = await connect(watcher_transport, address, timeout_s=10)
        await _churn(address, 50)  # warm up allocator arenas and code paths
        rss0, *_ = await _stats(watcher)

        await _churn(address, 1000)
        await _header_only(host, int(port), 200)

        deadline = asyncio.get_running_loop().time() + 20
        while (stats := await _stats(watcher))[1] > 1 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)  # until only the watcher's link is left
        rss1, links, errors, _refused = stats
        growth_mib = (rss1 - rss0) / MIB
        print(f"server RSS {rss0 / MIB:.1f} MiB -> {rss1 / MIB:.1f} MiB (+{growth_mib:.1f} MiB), links={links}")
        assert links == 1
        assert errors >= 200  # every header-only connection was refused as oversize
        assert growth_mib < 32
        await watcher.close()
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


async def _wait_closed_by_server(reader):
    async with asyncio.timeout(5):
        assert await reader.read() == b""


async def test_tcp_links_are_dropped_when_lost():
    server = make_transport("tcp", _identity("server"))
    listener = await server.listen("tcp://127.0.0.1:0", _echo)
    client = make_transport("tcp", _identity("client"))
    for i in range(20):
        conn = await connect(client, listener.address, timeout_s=10)
        assert (await conn.request(i, timeout_s=10)).decode(int) == i
        await conn.close()
    async with asyncio.timeout(5):
        while server.links or client.links:  # nothing prunes them but the loss of the socket
            await asyncio.sleep(0.01)
    await listener.close()


async def test_tcp_stranger_body_over_handshake_limit_is_refused_at_once():
    server = make_transport("tcp", _identity("server"))
    listener = await server.listen("tcp://127.0.0.1:0", _echo)
    host, port = listener.address.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    # 1 MiB is a legal body for a peer, but not for one that has not authenticated
    writer.write(framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, MIB, 0, 0, 0))
    await _wait_closed_by_server(reader)
    assert server.metrics.protocol_errors == {"oversize": 1}
    writer.close()
    await listener.close()


async def test_tcp_pending_handshake_cap():
    server = make_transport("tcp", _identity("server"), limits=TransportLimits(max_pending_handshakes=3))
    listener = await server.listen("tcp://127.0.0.1:0", _echo)
    host, port = listener.address.split("://")[1].rsplit(":", 1)
    silent = [await asyncio.open_connection(host, int(port)) for _ in range(3)]  # never say Hello
    reader, writer = await asyncio.open_connection(host, int(port))
    await _wait_closed_by_server(reader)  # the fourth stranger is closed on accept
    assert server.metrics.connections_refused == {"pending_handshakes": 1}
    with pytest.raises((ConnectionError, TransportClosed, DeadlineExceeded)):
        await make_transport("tcp", _identity("c")).connect_once(listener.address, timeout_s=5)
    for _, w in silent:
        w.close()
    client = make_transport("tcp", _identity("client"))
    async with asyncio.timeout(5):  # the silent ones are gone: real peers get in again
        while True:
            try:
                conn = await client.connect_once(listener.address, timeout_s=5)
                break
            except TransportClosed:
                await asyncio.sleep(0.01)
    assert (await conn.request(1, timeout_s=5)).decode(int) == 1
    await conn.close()
    writer.close()
    await listener.close()


async def test_tcp_handshake_timeout_is_configurable():
    server = make_transport("tcp", _identity("server"), limits=TransportLimits(handshake_timeout_s=0.2))
    listener = await server.listen("tcp://127.0.0.1:0", _echo)
    host, port = listener.address.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await _wait_closed_by_server(reader)
    assert server.metrics.handshake_rejections == {"timeout": 1}
    writer.close()
    await listener.close()


async def test_tcp_connections_per_host_cap():
    server = make_transport("tcp", _identity("server"), limits=TransportLimits(max_connections_per_host=2))
    listener = await server.listen("tcp://127.0.0.1:0", _echo)
    client = make_transport("tcp", _identity("client"))
    conns = [await client.connect_once(listener.address, timeout_s=5) for _ in range(2)]
    with pytest.raises(TransportClosed):
        await client.connect_once(listener.address, timeout_s=5)
    assert server.metrics.connections_refused == {"per_host": 1}
    await conns.pop().close()
    async with asyncio.timeout(5):  # a slot is free again once the server saw the close
        while True:
            try:
                conns.append(await client.connect_once(listener.address, timeout_s=5))
                break
            except TransportClosed:
                await asyncio.sleep(0.01)
    assert [(await c.request(i, timeout_s=5)).decode(int) for i, c in enumerate(conns)] == [0, 1]
    for c in conns:
        await c.close()
    await listener.close()
