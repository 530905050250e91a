"""Bulk buffers received straight into CUDA tensors over the ucx path. Skipped without CUDA.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu``.
"""

import asyncio

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KEYRING = [b"gpu-test-key-0123456789abcdef012"]


async def _pair(handler):
    from peers.transport import Identity, connect
    from peers.transport.ucx import UcxTransport

    server = UcxTransport(Identity("server", "gpu", KEYRING))
    listener = await server.listen("ucx://127.0.0.1:0", handler)
    client = UcxTransport(Identity("client", "gpu", KEYRING))
    return listener, await connect(client, listener.address, timeout_s=10)


async def test_gpu_response_lands_in_cuda_tensor():
    from peers.transport import Reply

    src = torch.arange(4 * 2**20, dtype=torch.float32)

    async def handle(incoming):
        return Reply("rows", [src])

    listener, conn = await _pair(handle)
    dest = torch.zeros(src.numel(), dtype=torch.float32, device="cuda")
    result = await conn.request("read", recv_into=[dest], timeout_s=30)
    assert result.bulk[0] is dest
    torch.cuda.synchronize()
    assert torch.equal(dest.cpu(), src)
    await conn.close()
    await listener.close()


async def test_gpu_send_from_cuda_tensor():
    from peers.transport import Reply

    got = asyncio.get_running_loop().create_future()

    async def handle(incoming):
        got.set_result(incoming.bulk[0].copy())
        return Reply("ok")

    listener, conn = await _pair(handle)
    src = torch.arange(2**20, dtype=torch.int64, device="cuda")
    await conn.request("write", [src], timeout_s=30)
    assert (torch.from_numpy(await got) == src.cpu()).all()
    await conn.close()
    await listener.close()


async def test_gpu_send_from_cuda_tensor_to_another_process():
    """A device buffer sent to a peer in another process (a compute node's deltas to a storage
    node): the bytes that arrive are the tensor's."""
    import subprocess
    import sys

    import msgspec
    import xxhash

    from peers.transport import Identity, connect
    from peers.transport.ucx import UcxTransport

    peer = subprocess.Popen([sys.executable, "-m", "tests.gpu.ucx_peer"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = await asyncio.wait_for(asyncio.to_thread(peer.stdout.readline), 60)
        conn = await connect(UcxTransport(Identity("client", "gpu", KEYRING)), address.strip(), timeout_s=30)
        src = torch.arange(2**20, dtype=torch.int64, device="cuda")
        result = await conn.request("write", [src], timeout_s=30)
        got = msgspec.msgpack.decode(result.payload)
        assert got == {"digest": xxhash.xxh3_64_intdigest(src.cpu().numpy().tobytes()), "nbytes": src.numel() * 8}
        await conn.close()
    finally:
        peer.stdin.close()
        peer.wait(timeout=30)
        peer.stdout.close()


async def test_gpu_recv_into_cuda_over_tcp_is_a_clear_error():
    from peers.errors import LocalProtocolError
    from peers.transport import Identity, Reply, connect
    from peers.transport.tcp import TcpTransport

    async def handle(incoming):
        return Reply("rows", [torch.ones(10)])

    server = TcpTransport(Identity("server", "gpu", KEYRING))
    listener = await server.listen("tcp://127.0.0.1:0", handle)
    conn = await connect(TcpTransport(Identity("client", "gpu", KEYRING)), listener.address, timeout_s=10)
    with pytest.raises(LocalProtocolError):
        await conn.request("read", recv_into=[torch.zeros(10, device="cuda")], timeout_s=10)
    await conn.close()
    await listener.close()
