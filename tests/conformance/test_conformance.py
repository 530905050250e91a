"""One suite, every backend (dask's ``check_*`` idea): the same test bodies run over mem, tcp and ucx.

Every wait is bounded (``asyncio.timeout``); leak checks count sockets/endpoints and pool leases.
"""

import asyncio

import msgspec
import numpy as np
import pytest
import xxhash

from peers import framing, wire
from peers.errors import (
    DeadlineExceeded,
    HandshakeRejected,
    LocalProtocolError,
    PeerDead,
    RemoteError,
    RemoteProtocolError,
    TransportClosed,
)
from peers.transport import Connection, Reply, connect

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


class Service:
    """A test service: the payload names the operation."""

    def __init__(self):
        self.cancelled = 0
        self.started = asyncio.Event()
        self.calls = 0
        self.sink_digest = None

    async def __call__(self, incoming):
        self.calls += 1
        op = incoming.decode(object)
        if isinstance(op, list):
            op, arg = op
        if op == "echo":
            return Reply(["echo", incoming.peer], incoming.bulk)
        if op == "double":
            return Reply("ok", [a * 2 for a in incoming.bulk])
        if op == "sized":
            return Reply("ok", [np.arange(arg, dtype=np.int64)])
        if op == "sink":
            self.sink_digest = [xxhash.xxh3_64_intdigest(a) for a in incoming.bulk]
            return Reply("ok")
        if op == "sleep":
            self.started.set()
            try:
                await asyncio.sleep(arg)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return Reply("slept")
        if op == "fail":
            raise ValueError("handler failed on purpose")
        return Reply(op)


async def _pair(harness, service=None, **kw):
    service = service or Service()
    server = harness.transport("server")
    listener = await server.listen(harness.address(), service)
    client = harness.transport("client", **kw)
    conn = await connect(client, listener.address, timeout_s=10)
    return server, listener, client, conn, service


async def _teardown(server, listener, client, conn):
    await conn.close()
    await listener.close()
    async with asyncio.timeout(5):
        while client.open_resources or server.open_resources:
            await asyncio.sleep(0.01)
    assert server.pool.leased == 0


async def test_conformance_request_response_in_order(harness):
    server, listener, client, conn, _ = await _pair(harness)
    for i in range(20):
        assert (await conn.request(i, timeout_s=5)).decode(int) == i
    assert (await conn.request("echo", timeout_s=5)).decode(list) == ["echo", "client"]
    await _teardown(server, listener, client, conn)


async def test_conformance_many_in_flight(harness):
    server, listener, client, conn, _ = await _pair(harness)
    arrays = [np.full(1000 + i, i, np.int32) for i in range(200)]
    results = await asyncio.gather(*(conn.request("double", [a], timeout_s=20) for a in arrays))
    for a, r in zip(arrays, results):
        np.testing.assert_array_equal(r.bulk[0], a * 2)
    assert server.metrics.requests_served == 200
    await _teardown(server, listener, client, conn)


async def test_conformance_bulk_dtypes_and_recv_into(harness):
    server, listener, client, conn, _ = await _pair(harness)
    bufs = [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.int64),
            np.array([1, 0, 1], np.uint8), np.zeros(0, np.float64), np.arange(7, dtype=np.float16)]
    dests = [np.empty_like(b) for b in bufs]
    result = await conn.request("echo", bufs, recv_into=dests, timeout_s=10)
    for b, d, r in zip(bufs, dests, result.bulk):
        np.testing.assert_array_equal(d, b)
        assert r.shape == b.shape and r.dtype == b.dtype
        assert d.size == 0 or np.shares_memory(r, d)  # received in place, no copy
    await _teardown(server, listener, client, conn)


async def test_conformance_recv_into_torch_tensor(harness):
    torch = pytest.importorskip("torch")
    server, listener, client, conn, _ = await _pair(harness)
    src = torch.arange(1000, dtype=torch.float32)
    dest = torch.zeros(1000, dtype=torch.float32)
    await conn.request("double", [src], recv_into=[dest], timeout_s=10)
    assert torch.equal(dest, src * 2)
    await _teardown(server, listener, client, conn)


async def test_conformance_large_buffer_256mib(harness):
    server, listener, client, conn, service = await _pair(harness)
    big = np.random.default_rng(0).integers(0, 255, 256 * 2**20, dtype=np.uint8)
    assert (await conn.request("sink", [big], timeout_s=50)).decode(str) == "ok"
    assert service.sink_digest == [xxhash.xxh3_64_intdigest(big)]
    del big
    # and a large response received into a caller's buffer
    dest = np.empty(32 * 2**20, np.int64)
    await conn.request(["sized", dest.size], recv_into=[dest], timeout_s=50)
    assert dest[0] == 0 and dest[-1] == dest.size - 1
    await _teardown(server, listener, client, conn)


async def test_conformance_response_that_does_not_fit_fails_typed(harness):
    server, listener, client, conn, _ = await _pair(harness)
    with pytest.raises(LocalProtocolError):
        await conn.request(["sized", 100], recv_into=[np.empty(10, np.int64)], timeout_s=5)
    # the stream stayed in sync: the connection is still usable
    assert (await conn.request(["sized", 3], timeout_s=5)).bulk[0].tolist() == [0, 1, 2]
    await _teardown(server, listener, client, conn)


async def test_conformance_handler_error_is_remote_error(harness):
    server, listener, client, conn, _ = await _pair(harness)
    with pytest.raises(RemoteError) as info:
        await conn.request("fail", timeout_s=5)
    assert info.value.remote_type == "ValueError" and "on purpose" in str(info.value)
    assert (await conn.request(1, timeout_s=5)).decode(int) == 1
    await _teardown(server, listener, client, conn)


async def test_conformance_deadline_cancels_remote_handler(harness):
    server, listener, client, conn, service = await _pair(harness)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded):
        await conn.request(["sleep", 30], timeout_s=0.2)
    assert loop.time() - t0 < 2
    async with asyncio.timeout(5):
        while service.cancelled < 1:
            await asyncio.sleep(0.01)
    assert conn.in_flight == 0
    assert (await conn.request(2, timeout_s=5)).decode(int) == 2
    await _teardown(server, listener, client, conn)


async def test_conformance_caller_cancellation_propagates(harness):
    server, listener, client, conn, service = await _pair(harness)
    task = asyncio.ensure_future(conn.request(["sleep", 30], timeout_s=30))
    async with asyncio.timeout(5):
        await service.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(5):
        while service.cancelled < 1:
            await asyncio.sleep(0.01)
    assert conn.in_flight == 0
    await _teardown(server, listener, client, conn)


async def test_conformance_fail_peer_fails_pending_at_once(harness):
    server, listener, client, conn, service = await _pair(harness)
    pending = [asyncio.ensure_future(conn.request(["sleep", 30], timeout_s=30)) for _ in range(5)]
    async with asyncio.timeout(5):
        await service.started.wait()
    conn.fail(PeerDead("membership declared server dead"))
    async with asyncio.timeout(1):
        results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, PeerDead) for r in results)
    with pytest.raises(TransportClosed):
        await conn.request(1, timeout_s=1)
    await _teardown(server, listener, client, conn)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(keyring=[b"another-key-0123456789abcdef0000"]), "bad_key"),
    (dict(cluster="someone-else"), "wrong_cluster"),
    (dict(versions=(7, 9)), "version"),
])
async def test_conformance_handshake_rejection(harness, kwargs, reason):
    server = harness.transport("server")
    listener = await server.listen(harness.address(), Service())
    client = harness.transport("intruder", **kwargs)
    with pytest.raises(HandshakeRejected) as info:
        await connect(client, listener.address, timeout_s=5)
    assert info.value.reason == reason
    async with asyncio.timeout(5):
        while server.metrics.handshake_rejections.get(reason, 0) < 1 or client.open_resources or server.open_resources:
            await asyncio.sleep(0.01)
    assert listener.connections == []
    await listener.close()


async def test_conformance_reconnect_after_server_restart(harness):
    address = harness.fixed_address()
    server = harness.transport("server")
    listener = await server.listen(address, Service())
    client = harness.transport("client")
    conn = await connect(client, listener.address, timeout_s=5)
    await listener.close()
    async with asyncio.timeout(5):
        await conn.closed.wait()
    with pytest.raises(TransportClosed):
        await conn.request(1, timeout_s=1)

    async def restart_later():
        await asyncio.sleep(0.3)
        return await harness.transport("server").listen(address, Service())

    restarter = asyncio.ensure_future(restart_later())
    conn2 = await connect(client, address, timeout_s=10)  # retries with backoff meanwhile
    listener2 = await restarter
    assert (await conn2.request(5, timeout_s=5)).decode(int) == 5
    await conn2.close()
    await listener2.close()


async def test_conformance_peer_crash_mid_transfer(harness):
    service = Service()
    server = harness.transport("server")
    listener = await server.listen(harness.address(), service)
    crash = await harness.crash_mid_upload(listener.address, 512)
    async with asyncio.timeout(30):  # wait until the upload's pooled buffer is leased
        while server.pool.leased == 0:
            await asyncio.sleep(0.001)
    await crash()
    async with asyncio.timeout(10):
        while server.pool.leased or server.open_resources or listener.connections:
            await asyncio.sleep(0.01)
    assert service.calls == 0  # the request never completed: the crash was mid-transfer
    # the listener survives and serves the next peer
    client = harness.transport("client")
    conn = await connect(client, listener.address, timeout_s=10)
    assert (await conn.request(3, timeout_s=5)).decode(int) == 3
    await _teardown(server, listener, client, conn)


async def test_conformance_garbage_from_peer_closes_only_that_connection(harness):
    server, listener, client, conn, _ = await _pair(harness)
    # inject garbage on the client's link: the server must count it and close that connection
    conn.link.write([b"NOT A FRAME AT ALL, JUST GARBAGE BYTES"])
    async with asyncio.timeout(5):
        await conn.closed.wait()
    assert sum(server.metrics.protocol_errors.values()) == 1
    client2 = harness.transport("client2")
    conn2 = await connect(client2, listener.address, timeout_s=5)
    assert (await conn2.request(4, timeout_s=5)).decode(int) == 4
    await _teardown(server, listener, client2, conn2)


async def test_conformance_idle_connection_is_quiet(harness):
    server, listener, client, conn, _ = await _pair(harness)
    before = (server.metrics.bytes_sent, client.metrics.bytes_sent)
    await asyncio.sleep(0.3)
    assert (server.metrics.bytes_sent, client.metrics.bytes_sent) == before
    await _teardown(server, listener, client, conn)


async def test_conformance_pool_reuse_fail_peer_revive(harness):
    from peers.transport import ConnectionPool

    service = Service()
    server = harness.transport("server")
    listener = await server.listen(harness.address(), service)
    client = harness.transport("client")
    pool = ConnectionPool(client, connect_timeout_s=5)
    a, b = await asyncio.gather(pool.get("server", listener.address), pool.get("server", listener.address))
    assert a is b  # single-flight, then reused
    pending = [asyncio.ensure_future(pool.request("server", listener.address, ["sleep", 30], timeout_s=30))
               for _ in range(3)]
    async with asyncio.timeout(5):
        await service.started.wait()
    assert pool.fail_peer("server", "membership: failed") == 3
    async with asyncio.timeout(1):
        results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, PeerDead) for r in results)
    with pytest.raises(PeerDead):
        await pool.get("server", listener.address)
    pool.revive("server")
    assert (await pool.request("server", listener.address, 6, timeout_s=5)).decode(int) == 6
    with pytest.raises(HandshakeRejected) as info:
        await pool.get("someone-else", listener.address)
    assert info.value.reason == "wrong_peer"
    await pool.close()
    await listener.close()
    async with asyncio.timeout(5):
        while client.open_resources or server.open_resources or server.pool.leased:
            await asyncio.sleep(0.01)


def _nested_request_frame(depth=5000):
    """A Request whose opaque payload is ``depth`` nested one-element arrays (msgspec skips a Raw
    payload recursively: past the interpreter's limit it raises RecursionError)."""
    body = b"\x96\x0a\x01" + b"\x91" * depth + b"\xc0" + b"\x90\xc0\x00"
    return framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, len(body), 0, 0, 0) + body


@pytest.mark.parametrize("blob,reason", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_magic"),
    (b"GP\x01\x00\xff\xff\xff\xff\x00\x00\x00\x00" + bytes(8), "oversize"),  # 4 GiB body announced
    (_nested_request_frame(), "bad_body"),  # 5 KB from a stranger: counted, not a loop-level fatal error
])
async def test_conformance_garbage_before_handshake_is_counted_and_closed(harness, blob, reason):
    if harness.scheme == "mem":
        pytest.skip("needs a raw socket")
    server = harness.transport("server")
    listener = await server.listen(harness.address(), Service())
    host, port = listener.address.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(blob)
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # the server closed on us
        while server.metrics.protocol_errors.get(reason, 0) < 1 or server.open_resources:
            await asyncio.sleep(0.01)
    writer.close()
    await listener.close()


async def test_conformance_deeply_nested_body_from_peer_is_a_protocol_error(harness):
    server, listener, client, conn, _ = await _pair(harness)
    conn.link.write([_nested_request_frame()])
    async with asyncio.timeout(5):  # mem: the receiving task died with the RecursionError, nothing closed
        await conn.closed.wait()
    assert server.metrics.protocol_errors == {"bad_body": 1}
    client2 = harness.transport("client2")
    conn2 = await connect(client2, listener.address, timeout_s=5)
    assert (await conn2.request(4, timeout_s=5)).decode(int) == 4
    await _teardown(server, listener, client2, conn2)


async def test_conformance_out_of_band_frame_on_an_inline_connection_is_refused(harness):
    if harness.scheme == "ucx":
        pytest.skip("a ucx connection has a bulk channel: out-of-band frames are its own")
    server, listener, client, conn, service = await _pair(harness)
    # a request whose 1 MiB of bulk is announced out of band, on a connection that agreed on inline
    # bulk: nothing will ever fill its buffers, so the request could never be served
    spec = wire.BufferSpec("|u1", (2**20,), 2**20)
    msg = wire.Request(1000, msgspec.Raw(msgspec.msgpack.encode("sink")), [spec], None, wire.BULK_UCX)
    conn.link.write(framing.encode_frame(msg, [memoryview(bytes(2**20))], out_of_band=True))
    with pytest.raises(TransportClosed):  # frames are handled in order: the connection is gone by then
        await conn.request(5, timeout_s=5)
    assert server.metrics.protocol_errors == {"bad_message": 1} and service.calls == 0
    async with asyncio.timeout(5):
        while server.open_resources or server.pool.leased:
            await asyncio.sleep(0.01)
    await listener.close()


async def test_conformance_request_id_reused_while_its_handler_runs_returns_every_lease(harness):
    """Two requests with bulk under one id, the first's handler still running: the second is
    refused (``bad_message``, the connection closed) and every pool buffer comes back. Before, the
    second's allocation overwrote the first's lease entry, so one lease was never returned."""
    server, listener, client, conn, service = await _pair(harness)
    spec = wire.BufferSpec("|u1", (4096,), 4096)
    bulk = [memoryview(bytes(4096))]
    first = wire.Request(1000, msgspec.Raw(msgspec.msgpack.encode(["sleep", 30])), [spec])
    conn.link.write(framing.encode_frame(first, bulk))
    async with asyncio.timeout(5):
        await service.started.wait()
    again = wire.Request(1000, msgspec.Raw(msgspec.msgpack.encode("sink")), [spec])
    conn.link.write(framing.encode_frame(again, bulk))
    async with asyncio.timeout(5):
        while server.open_resources:
            await asyncio.sleep(0.01)
    assert server.metrics.protocol_errors == {"bad_message": 1}
    assert server.pool.leased == 0
    await conn.close()
    await listener.close()


async def test_conformance_response_spec_numpy_cannot_represent_fails_the_request_typed(harness):
    server_conns = []

    async def handler(incoming):
        # answer request 1 with an empty buffer of shape (0, 2**63): self-consistent (nbytes 0) but
        # no array can have it
        spec = wire.BufferSpec("|u1", (0, 2**63), 0)
        reply = wire.Response(1, msgspec.Raw(msgspec.msgpack.encode("ok")), [spec])
        server_conns[0].link.write(framing.encode_frame(reply, [memoryview(b"")]))
        await asyncio.Event().wait()  # cancelled when the client drops the connection

    server = harness.transport("server")
    listener = await server.listen(harness.address(), handler)
    client = harness.transport("client")
    conn = await connect(client, listener.address, timeout_s=10)
    async with asyncio.timeout(5):
        while not listener.connections:
            await asyncio.sleep(0.01)
    server_conns.extend(listener.connections)
    with pytest.raises(RemoteProtocolError) as info:  # tcp: TransportClosed; mem: no answer at all
        await conn.request("x", timeout_s=5)
    assert info.value.reason == "bad_spec" and client.metrics.protocol_errors == {"bad_spec": 1}
    await _teardown(server, listener, client, conn)


async def test_conformance_pool_waiter_of_a_connect_cut_by_fail_peer_gets_peer_dead(harness):
    from peers.transport import ConnectionPool

    server = harness.transport("server")
    listener = await server.listen(harness.address(), Service())
    client = harness.transport("client")
    pool = ConnectionPool(client, connect_timeout_s=5)
    waiter = asyncio.ensure_future(pool.get("server", listener.address))
    async with asyncio.timeout(5):
        while "server" not in pool._connecting:  # the connect is under way
            await asyncio.sleep(0)
    pool.fail_peer("server", "membership: failed")
    # the caller was not cancelled: it must learn why it gets no connection (not CancelledError)
    with pytest.raises(PeerDead):
        await waiter
    await pool.close()
    await listener.close()
    async with asyncio.timeout(5):
        while client.open_resources or server.open_resources:
            await asyncio.sleep(0.01)


async def test_conformance_pool_stays_single_flight_after_fail_peer_and_revive(harness):
    from peers.transport import ConnectionPool

    server = harness.transport("server")
    listener = await server.listen(harness.address(), Service())
    client = harness.transport("client")
    pool = ConnectionPool(client, connect_timeout_s=5)
    first = asyncio.ensure_future(pool.get("server", listener.address))
    async with asyncio.timeout(5):
        while "server" not in pool._connecting:
            await asyncio.sleep(0)
    cut = pool._connecting["server"]
    pool.fail_peer("server", "membership: failed")
    pool.revive("server")  # alive again before the cut connect has even finished cancelling
    second = asyncio.ensure_future(pool.get("server", listener.address))
    await asyncio.wait([cut])  # the cut connect ends (and its done-callbacks run)
    third = asyncio.ensure_future(pool.get("server", listener.address))
    cut_off, a, b = await asyncio.gather(first, second, third, return_exceptions=True)
    assert isinstance(a, Connection) and a is b  # one connection: a second would outlive pool.close()
    assert isinstance(cut_off, TransportClosed)  # revived meanwhile: not PeerDead, not cancelled
    await pool.close()
    async with asyncio.timeout(5):
        while client.open_resources:
            await asyncio.sleep(0.01)
    await listener.close()
