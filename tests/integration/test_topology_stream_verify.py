"""Stream verification (streaming.sender.StreamRunner._verify): the combined digest passes an exact copy,
catches one differing row on the receiver and counts it, and a receiver that answers per-row
digests (no ``combined``) or hashes digest version 1 only (a receiver of the previous version)
still verifies."""

import asyncio

import msgspec
import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.rebalance.endpoint import StreamEndpoint
from giaannd.storage.streaming.sender import StreamRunner
from giaannd.storage.streaming.stream import StreamReply, StreamVerify, VerifyReply
from peers.transport import connect
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

COLUMNS = np.arange(1, 9, dtype=np.uint64)


async def _cluster(tmp_path):
    """s0 holds rows of COLUMNS (and of other columns); s1 is empty."""
    cluster = await Cluster(tmp_path, 2, replicas=1).start()
    store = cluster.services["s0"].store
    rng = np.random.default_rng(5)
    for seq in range(1, 7):
        store.apply(BatchId(3, seq), make_batch(rng, 30, 7, rng.choice(np.arange(1, 15, dtype=np.uint64), 30)))
    return cluster


def _runner(cluster, stream_id, **kw):
    return StreamRunner(cluster.services["s0"], cluster.ops_transport, cluster.stream_addresses["s1"],
                        COLUMNS, stream_id, chunk_bytes=4000, **kw)


def _same_rows(cluster):
    src, dst = cluster.services["s0"].store.store, cluster.services["s1"].store.store
    keys = [k for k in src.keys() if k[0] in set(COLUMNS.tolist())]
    assert keys and keys == dst.keys()
    a = src.read_rows([k[0] for k in keys], [k[1] for k in keys])
    b = dst.read_rows([k[0] for k in keys], [k[1] for k in keys])
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


async def test_exact_copy_verifies_with_one_combined_digest(tmp_path):
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x51, window=1)  # (prefetch is for a window of one item)
        runner.prefetch = True  # (opt-in) read the next chunk while one is on the wire
        asked = []
        endpoint = cluster.endpoints["s1"]
        serve = endpoint._verify

        def spy(msg, bulk):
            asked.append(msg)
            return serve(msg, bulk)

        endpoint._verify = spy
        serve_data, ahead = endpoint._data, []

        async def data(msg, bulk):
            ahead.append(runner.sender.next_index - msg.index)  # items made when this one arrives
            return await serve_data(msg, bulk)

        endpoint._data = data
        task = asyncio.create_task(runner.run())
        await runner.caught_up.wait()
        assert runner.state == "caught-up", runner.error
        assert asked and all(m.combined and m.digest_version == 2 for m in asked)
        assert runner.sender.acked > 3  # several chunks
        # the next chunk was read while each was on the wire, never more than one ahead
        assert max(ahead) == 2 and ahead[-1] == 1
        assert _same_rows(cluster)
        # the reply's shape: presence per key, one digest
        conn = await connect(cluster.ops_transport, cluster.stream_addresses["s1"], timeout_s=2)
        cols, feats, _ = cluster.services["s0"].store.store.rows_of_columns(COLUMNS)
        res = await conn.request(msgspec.msgpack.encode(StreamVerify(0x51, combined=True)), [cols, feats],
                                 timeout_s=5)
        assert isinstance(msgspec.msgpack.decode(res.payload, type=StreamReply), VerifyReply)
        assert res.bulk[0].tolist() == [1] * cols.size and res.bulk[1].shape == (1,)
        assert int(res.bulk[1][0]) == cluster.services["s0"].store.store.rows_digest(cols, feats)[1]
        # asked for version 2 (row_digest.py), it answers in 2, over the field arrays
        res = await conn.request(msgspec.msgpack.encode(StreamVerify(0x51, combined=True, digest_version=2)),
                                 [cols, feats], timeout_s=5)
        reply = msgspec.msgpack.decode(res.payload, type=StreamReply)
        assert isinstance(reply, VerifyReply) and reply.digest_version == 2
        assert int(res.bulk[1][0]) == cluster.services["s0"].store.store.rows_digest(cols, feats, 2)[1]
        await conn.close()
        runner.close()
        await task
        assert runner.state == "done"
    finally:
        await cluster.close()


async def test_one_differing_row_fails_verification_and_is_counted(tmp_path):
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x52)
        endpoint: StreamEndpoint = cluster.endpoints["s1"]
        serve, tampered = endpoint._data, []

        async def data_then_tamper(msg, bulk):
            reply = await serve(msg, bulk)
            dst = cluster.services["s1"].store
            if not tampered and len(dst.store):
                key = dst.store.keys()[0]
                row = dst.store.row(key)
                one = RowBatch.from_entries(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64),
                                            row.segment[:1].copy(), row.target_column[:1].copy(),
                                            row.target_feature[:1].copy(), np.array([0.5], np.float32))
                dst.apply(BatchId(12345, 1), one)  # a write the source never saw
                tampered.append(key)
            return reply

        endpoint._data = data_then_tamper
        await runner.run()
        assert tampered and runner.state == "failed"
        assert runner.error is not None and "verify: 1 of" in runner.error and "differ" in runner.error
    finally:
        await cluster.close()


async def test_receiver_answering_per_row_digests_still_verifies(tmp_path):
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x53)
        endpoint = cluster.endpoints["s1"]
        serve = endpoint._verify
        endpoint._verify = lambda msg, bulk: serve(StreamVerify(msg.stream_id), bulk)  # ignores `combined`
        task = asyncio.create_task(runner.run())
        await runner.caught_up.wait()
        assert runner.state == "caught-up", runner.error
        assert runner._per_row_verify  # it switched to per-row verification
        assert _same_rows(cluster)
        runner.close()
        await task
    finally:
        await cluster.close()


async def test_receiver_hashing_only_digest_version_1_still_verifies(tmp_path):
    """A receiver older than ``digest_version`` hashes version 1 and says so (the field's default):
    the sender verifies again in version 1, never comparing digests of two versions."""
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x54)
        endpoint = cluster.endpoints["s1"]
        serve, asked = endpoint._verify, []

        def old(msg, bulk):
            asked.append(msg.digest_version)
            return serve(StreamVerify(msg.stream_id, combined=msg.combined), bulk)  # ignores the version

        endpoint._verify = old
        task = asyncio.create_task(runner.run())
        await runner.caught_up.wait()
        assert runner.state == "caught-up", runner.error
        assert asked[0] == 2 and asked[-1] == 1 and runner._digest_version == 1
        assert _same_rows(cluster)
        runner.close()
        await task
    finally:
        await cluster.close()


async def test_receiver_reserves_room_for_the_stream_so_chunks_land_without_regrowing_its_base(tmp_path):
    """The hello says how many bytes are coming (``StreamHello.expected_bytes``): the receiver makes
    room for them once, and every chunk's fold appends into that one buffer; the copy is exact."""
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x53, window=3)
        engine = cluster.services["s1"].store.store.engine
        buffers = set()
        endpoint = cluster.endpoints["s1"]
        serve_data = endpoint._data

        async def data(msg, bulk):
            reply = await serve_data(msg, bulk)
            engine.compact()  # (fold now: each chunk lands in the base)
            buffers.add(id(engine._base.st.base))
            return reply

        endpoint._data = data
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(runner.caught_up.wait(), 30)
        assert runner.state == "caught-up", runner.error
        assert runner.sender.acked > 3
        assert len(buffers) == 1
        assert 0x53 not in endpoint._expected  # all the bytes announced arrived: nothing left to reserve for
        runner.close()
        await asyncio.wait_for(task, 30)
        assert endpoint._expected == {}
        assert _same_rows(cluster)
    finally:
        await cluster.close()


async def test_untouched_chunks_verify_from_their_pages_digests_without_reading_the_rows(tmp_path):
    """The source hashed each page as it sent it (sender.PageDigest); rows unchanged since (their
    touches, the store's drops) are not read again to verify: one verify request per chunk."""
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x56, window=4)
        src = cluster.services["s0"].store.store
        hashed = []
        real = src.rows_digest

        def spy(*args, **kw):
            hashed.append(args)
            return real(*args, **kw)

        src.rows_digest = spy
        task = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(runner.caught_up.wait(), 30)
            assert runner.state == "caught-up", runner.error
            assert hashed == []  # (before: one rows_digest of the source per verify slice)
            assert runner.sender.acked > 3 and _same_rows(cluster)
        finally:
            runner.abort("test done")
            await asyncio.wait_for(task, 10)
    finally:
        await cluster.close()


async def test_a_source_row_changed_behind_the_streams_back_still_fails_verification(tmp_path):
    """A page's digest stands for its rows only while their version is unchanged: a row changed at
    the source without the stream forwarding it (what verification is there to catch) is hashed
    afresh, and differs."""
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x57, window=4)
        src = cluster.services["s0"].store.store
        verify = runner._verify

        async def change_then_verify():
            key = src.rows_of_columns(COLUMNS)
            c, f = int(key[0][0]), int(key[1][0])
            row = src.row((c, f))
            one = RowBatch.from_entries(np.array([c], np.uint64), np.array([f], np.uint64),
                                        row.segment[:1].copy(), row.target_column[:1].copy(),
                                        row.target_feature[:1].copy(), np.array([0.25], np.float32))
            src.apply(BatchId(54321, 1), one)  # the engine only: no observer hears of it
            return await verify()

        runner._verify = change_then_verify
        await asyncio.wait_for(runner.run(), 30)
        assert runner.state == "failed"
        assert runner.error is not None and "verify: 1 of" in runner.error and "differ" in runner.error
    finally:
        await cluster.close()


async def test_rows_created_during_the_stream_are_verified_beside_the_kept_pages(tmp_path):
    """A row the source creates after the stream opened (forwarded as a delta) is hashed afresh in
    a slice of its own; the untouched chunks still verify from their pages' digests."""
    cluster = await _cluster(tmp_path)
    try:
        runner = _runner(cluster, 0x58, window=4)
        svc = cluster.services["s0"]
        src = svc.store.store
        endpoint = cluster.endpoints["s1"]
        serve, written = endpoint._data, []

        async def data_then_write(msg, bulk):
            reply = await serve(msg, bulk)
            if not written:
                one = RowBatch.from_entries(np.array([COLUMNS[0]], np.uint64), np.array([10**9], np.uint64),
                                            np.array([1], np.uint8), np.array([5], np.uint64),
                                            np.array([6], np.uint64), np.array([0.5], np.float32))
                svc.core.store.apply(BatchId(777, 1), one)  # through the tee: forwarded
                written.append(1)
            return reply

        endpoint._data = data_then_write
        hashed = []
        real = src.rows_digest

        def spy(cols, feats, version=1):
            hashed.append(np.asarray(cols).size)
            return real(cols, feats, version)

        src.rows_digest = spy
        task = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(runner.caught_up.wait(), 30)
            assert runner.state == "caught-up", runner.error
            assert written and runner.sender.deltas >= 1
            assert hashed == [1]  # only the new row's slice was hashed at verification
            assert _same_rows(cluster)
        finally:
            runner.abort("test done")
            await asyncio.wait_for(task, 10)
    finally:
        await cluster.close()
