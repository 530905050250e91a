"""The stream endpoint under bad input: every kind gets a clear refusal and changes nothing."""

import msgspec
import numpy as np
import pytest

from giaannd.storage.streaming.stream import (
    ItemKind,
    StreamData,
    StreamHello,
    StreamPosition,
    StreamRefused,
    StreamReply,
    StreamVerify,
    VerifyReply,
    item_checksum,
)
from peers.transport import connect
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(30), pytest.mark.asyncio]

ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(StreamReply)


async def test_stream_endpoint_refuses_garbage_and_keeps_state(tmp_path):
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        conn = await connect(cluster.ops_transport, cluster.stream_addresses["s0"], timeout_s=2)
        store = cluster.services["s0"].store.store

        async def ask(payload, bulk=()):
            res = await conn.request(payload, list(bulk), timeout_s=5)
            return DEC.decode(res.payload), res.bulk

        reply, _ = await ask(b"\x81\xa3bad\x01")  # msgpack, but no stream message
        assert isinstance(reply, StreamRefused) and reply.fatal and "undecodable" in reply.reason
        cols = np.array([5, 6], np.uint64)
        for bad in ([], [cols.astype(np.float64)], [cols, cols], [cols.reshape(2, 1)]):
            reply, _ = await ask(ENC.encode(StreamHello(77, "t")), bad)
            assert isinstance(reply, StreamRefused) and reply.fatal and "hello" in reply.reason
        reply, _ = await ask(ENC.encode(StreamHello(77, "t")), [cols])
        assert reply == StreamPosition(77, 0)
        batch = make_batch(np.random.default_rng(1), 4, 2, np.array([5, 5, 6, 6], np.uint64))
        good = item_checksum(77, 0, ItemKind.CHUNK, batch)
        for msg, bulk, why in [
            (StreamData(77, 0, ItemKind.CHUNK, good ^ 1), batch.buffers(), "checksum"),
            (StreamData(77, 3, ItemKind.CHUNK, item_checksum(77, 3, ItemKind.CHUNK, batch)), batch.buffers(), "gap"),
            (StreamData(77, 0, 9, item_checksum(77, 0, 9, batch)), batch.buffers(), "kind"),
            (StreamData(77, 0, ItemKind.CHUNK, good), batch.buffers()[:3], "bad rows"),
        ]:
            reply, _ = await ask(ENC.encode(msg), bulk)
            assert isinstance(reply, StreamRefused) and reply.next_index == 0, why
            assert why.split()[0] in reply.reason or why == "bad rows"
        assert len(store) == 0  # nothing applied
        reply, _ = await ask(ENC.encode(StreamVerify(77)), [cols])
        assert isinstance(reply, StreamRefused)  # one key array only
        reply, _ = await ask(ENC.encode(StreamData(77, 0, ItemKind.CHUNK, good)), batch.buffers())
        assert reply == StreamPosition(77, 1)
        reply, bulk = await ask(ENC.encode(StreamVerify(77)), [batch.row_column, batch.row_feature])
        assert isinstance(reply, VerifyReply) and bulk[0].tolist() == [1] * batch.num_rows
        # a fresh stream to a node that already holds rows of its columns is refused, clearly
        reply, _ = await ask(ENC.encode(StreamHello(78, "t")), [cols])
        assert isinstance(reply, StreamRefused) and reply.fatal and "wipe" in reply.reason
        await conn.close()
    finally:
        await cluster.close()
