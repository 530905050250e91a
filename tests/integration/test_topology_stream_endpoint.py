"""The stream endpoint under bad input: every kind gets a clear refusal and changes nothing."""

import asyncio

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


async def test_discard_drops_only_what_the_node_does_not_own_and_refuses_the_stream_after(tmp_path):
    """``DiscardStream`` (an operation abandoned before its cutover): the stream's rows go where the
    node does not own their columns and no other open stream brings them; owned columns stay; the
    stream is refused for good (resume or fresh start), durably; other streams go on."""
    from giaannd.storage.rebalance.source_control import DiscardStream, StreamDiscarded
    from giaannd.storage.streaming.dedupe import StreamScopes

    dec = msgspec.msgpack.Decoder(StreamReply | StreamDiscarded)
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        await cluster.add_node("s1")  # outside the placement: it owns nothing
        rng = np.random.default_rng(3)

        async def open_stream(node, sid, columns):
            conn = await connect(cluster.ops_transport, cluster.stream_addresses[node], timeout_s=2)

            async def ask(msg, bulk=()):
                res = await conn.request(ENC.encode(msg), list(bulk), timeout_s=5)
                return dec.decode(res.payload)

            cols = np.array(columns, np.uint64)
            assert await ask(StreamHello(sid, "t"), [cols]) == StreamPosition(sid, 0)
            batch = make_batch(rng, 2 * len(columns), 3, np.repeat(cols, 2))
            data = StreamData(sid, 0, ItemKind.CHUNK, item_checksum(sid, 0, ItemKind.CHUNK, batch))
            assert await ask(data, batch.buffers()) == StreamPosition(sid, 1)
            return ask, batch

        s1 = cluster.services["s1"].store.store
        ask, _ = await open_stream("s1", 77, [5, 6])
        _, kept = await open_stream("s1", 78, [9])
        assert len(s1) == 6
        assert await ask(DiscardStream(77)) == StreamDiscarded(77, 2, 4)
        assert len(s1) == 2 and set(s1.held_columns().tolist()) == {9}  # stream 78's rows stay
        assert await ask(DiscardStream(77)) == StreamDiscarded(77, 0, 0)  # again: nothing more to drop
        for msg in (StreamHello(77, "t", fresh=False), StreamData(77, 1, ItemKind.CHUNK, 0)):
            reply = await ask(msg, [np.array([5, 6], np.uint64)] if isinstance(msg, StreamHello) else [])
            assert isinstance(reply, StreamRefused) and reply.fatal and "discarded" in reply.reason
        # a new stream of the same columns is welcome: no stale rows are left
        await open_stream("s1", 79, [5, 6])
        # durable: a restart's scopes know the discarded stream and no longer count its columns
        scopes = StreamScopes.open(cluster.services["s1"].data_dir)
        assert scopes.is_discarded(77) and not scopes.is_discarded(78)
        assert dict(scopes.items()).keys() == {78, 79}

        # on the node that owns every column (the only member), nothing of a discarded stream goes
        ask0, _ = await open_stream("s0", 80, [11, 12])
        assert await ask0(DiscardStream(80)) == StreamDiscarded(80, 0, 0)
        assert set(cluster.services["s0"].store.store.held_columns().tolist()) == {11, 12}
    finally:
        await cluster.close()


async def test_idle_streams_are_discarded_after_the_idle_time_and_only_open_ones(tmp_path):
    """A stream whose coordinator died without discarding it: once it sent this node nothing for the
    idle time, ``discard_idle`` drops its rows (as ``DiscardStream`` does) and refuses it after;
    streams heard from within the idle time, and a closed (finished) one, are left alone."""
    import time

    from giaannd.storage.rebalance.endpoint import StreamEndpoint

    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        await cluster.add_node("s1")  # outside the placement: it owns nothing
        endpoint: StreamEndpoint = cluster.endpoints["s1"]
        store = cluster.services["s1"].store.store
        conn = await connect(cluster.ops_transport, cluster.stream_addresses["s1"], timeout_s=2)

        async def ask(msg, bulk=()):
            res = await conn.request(ENC.encode(msg), list(bulk), timeout_s=5)
            return DEC.decode(res.payload)

        rng = np.random.default_rng(4)
        for sid, col in ((90, 5), (91, 6), (92, 7)):
            cols = np.array([col], np.uint64)
            assert await ask(StreamHello(sid, "t"), [cols]) == StreamPosition(sid, 0)
            batch = make_batch(rng, 2, 3, np.repeat(cols, 2))
            data = StreamData(sid, 0, ItemKind.CHUNK, item_checksum(sid, 0, ItemKind.CHUNK, batch))
            assert await ask(data, batch.buffers()) == StreamPosition(sid, 1)
        assert await ask(StreamHello(92, "t", fresh=False, closing=True), [np.array([7], np.uint64)]) == \
            StreamPosition(92, 1)  # stream 92 finished
        assert await endpoint.discard_idle(60.0) == []  # every stream was heard from just now
        later = time.monotonic() + 61.0
        assert sorted(await endpoint.discard_idle(60.0, now=later)) == [90, 91]
        assert set(store.held_columns().tolist()) == {7}  # the finished stream's rows stay
        reply = await ask(StreamHello(90, "t", fresh=False), [np.array([5], np.uint64)])
        assert isinstance(reply, StreamRefused) and "discarded" in reply.reason
        assert endpoint.idle_discarded == 2 and await endpoint.discard_idle(60.0, now=later + 100) == []
        await conn.close()
    finally:
        await cluster.close()


async def test_an_item_waiting_behind_a_discard_is_refused_and_leaves_no_rows(tmp_path):
    """An item of a stream that reaches the receiver while its ``DiscardStream`` waits for the
    store (a fold or a snapshot holds the writes' lock) waits behind the discard on the stream's
    lock; it used to be applied once the discard had dropped the rows, leaving rows of a discarded
    stream that nothing drops any more (a later stream of those columns refused the node: "wipe")."""
    from giaannd.storage.rebalance.source_control import DiscardStream, StreamDiscarded

    dec = msgspec.msgpack.Decoder(StreamReply | StreamDiscarded)
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        await cluster.add_node("s1")  # outside the placement: it owns nothing
        endpoint = cluster.endpoints["s1"]
        service = cluster.services["s1"]
        store = service.store.store
        conns = [await connect(cluster.ops_transport, cluster.stream_addresses["s1"], timeout_s=2) for _ in range(2)]

        async def ask(conn, msg, bulk=()):
            res = await conn.request(ENC.encode(msg), list(bulk), timeout_s=5)
            return dec.decode(res.payload)

        rng = np.random.default_rng(5)
        cols = np.array([5, 6], np.uint64)
        assert await ask(conns[0], StreamHello(77, "t"), [cols]) == StreamPosition(77, 0)
        first = make_batch(rng, 4, 3, np.repeat(cols, 2))
        data = StreamData(77, 0, ItemKind.CHUNK, item_checksum(77, 0, ItemKind.CHUNK, first))
        assert await ask(conns[0], data, first.buffers()) == StreamPosition(77, 1)
        second = make_batch(rng, 4, 3, np.repeat(cols, 2))
        lock = endpoint._locks[77]
        async with service._snapshot_lock:  # a fold or a snapshot holds the store's writes
            discard = asyncio.create_task(ask(conns[0], DiscardStream(77)))
            async with asyncio.timeout(5):
                while not lock.locked():  # the discard holds the stream's lock, waiting for the store
                    await asyncio.sleep(0)
            item = asyncio.create_task(ask(conns[1], StreamData(
                77, 1, ItemKind.CHUNK, item_checksum(77, 1, ItemKind.CHUNK, second)), second.buffers()))
            async with asyncio.timeout(5):
                while not lock._waiters:  # the item waits behind it
                    await asyncio.sleep(0)
        dropped = await discard
        assert isinstance(dropped, StreamDiscarded) and dropped.rows == 4
        reply = await item
        assert isinstance(reply, StreamRefused) and reply.fatal and "discarded" in reply.reason
        assert len(store) == 0  # nothing of the discarded stream is left
        for conn in conns:
            await conn.close()
    finally:
        await cluster.close()
