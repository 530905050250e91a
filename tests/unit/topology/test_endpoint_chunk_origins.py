"""A chunk's origins on the receiver (rebalance/endpoint.py, streaming/dedupe.py "Chunks"): the F
markers of the batches a chunk names are applied before its rows, with the chunk's columns in the
stream's scope, so a later share of such a batch drops its rows there; a chunk sent again (a
resumed stream) marks nothing twice; an origin with a seq of 0 is refused for good."""

import asyncio

import msgspec
import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage.streaming.dedupe import filter_direct, marker_id
from giaannd.storage.streaming.stream import (
    ItemKind,
    StreamData,
    StreamHello,
    StreamPosition,
    StreamRefused,
    StreamReply,
    item_checksum,
)
from peers.transport import connect
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(StreamReply)


async def test_a_chunks_origins_are_marked_before_its_rows_once(tmp_path):
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        await cluster.add_node("s1")  # outside the placement: a joining node
        conn = await connect(cluster.ops_transport, cluster.stream_addresses["s1"], timeout_s=2)
        store = cluster.services["s1"].store.store

        async def ask(msg, bulk=()):
            res = await asyncio.wait_for(conn.request(ENC.encode(msg), list(bulk), timeout_s=5), 10)
            return DEC.decode(res.payload)

        cols = np.array([5, 6], np.uint64)
        assert await ask(StreamHello(81, "t"), [cols]) == StreamPosition(81, 0)
        rng = np.random.default_rng(3)
        chunk = make_batch(rng, 4, 2, np.repeat(cols, 2))
        origins = ((9, 4), (9, 7))
        data = StreamData(81, 0, ItemKind.CHUNK, item_checksum(81, 0, ItemKind.CHUNK, chunk), origins=origins)
        assert await ask(data, chunk.buffers()) == StreamPosition(81, 1)
        marks = [marker_id(BatchId(w, q), 81) for w, q in origins]
        assert all(m in store.applied for m in marks)
        share = make_batch(rng, 2, 2, np.array([5, 77], np.uint64))  # a re-split share of (9, 7)
        left = filter_direct(BatchId(9, 7), share, store.applied, cluster.endpoints["s1"].scopes)
        assert left is not None and left.row_column.tolist() == [77]  # its rows in column 5 dropped
        assert filter_direct(BatchId(9, 8), share, store.applied, cluster.endpoints["s1"].scopes) is None
        ids = len(store.applied)
        assert await ask(data, chunk.buffers()) == StreamPosition(81, 1)  # sent again: a duplicate
        assert len(store.applied) == ids
        bad = StreamData(81, 1, ItemKind.CHUNK, item_checksum(81, 1, ItemKind.CHUNK, chunk), origins=((9, 0),))
        reply = await ask(bad, chunk.buffers())
        assert isinstance(reply, StreamRefused) and reply.fatal and "origins" in reply.reason, reply
        await conn.close()
    finally:
        await cluster.close()
