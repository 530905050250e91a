"""The stream endpoint when its disk fails (rebalance/endpoint.py): a write error of the receiver
(ENOSPC, EIO from the update log, the streams' scope files, the stream-writers file) is answered with
a fatal ``StreamRefused`` that names the disk problem, not left to the transport (a generic remote
error, which the sender took for an unreachable receiver and retried until the stream timeout, an
hour), and the operation fails with that reason with nothing of its streams left on the receiver."""

import asyncio
import errno

import msgspec
import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.storage.rebalance import endpoint as endpoint_mod
from giaannd.storage.rebalance.operations import Rebalance, TopologyOpError, members_after
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
COLUMNS = np.random.default_rng(0).integers(1, 2**63, 60, dtype=np.uint64)


def _raise(err: int):
    def fail(*args, **kwargs):
        raise OSError(err, f"{errno.errorcode[err]} (injected)")
    return fail


async def test_endpoint_disk_errors_are_refused_naming_the_disk(tmp_path, monkeypatch):
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        await cluster.add_node("s1")  # outside the placement: a joining node
        conn = await connect(cluster.ops_transport, cluster.stream_addresses["s1"], timeout_s=2)
        service = cluster.services["s1"]
        store = service.store.store

        async def ask(msg, bulk=()):
            res = await asyncio.wait_for(conn.request(ENC.encode(msg), list(bulk), timeout_s=5), 10)
            return DEC.decode(res.payload)

        cols = np.array([5, 6], np.uint64)
        # hello: the stream-writers file cannot be written (disk full)
        with monkeypatch.context() as m:
            m.setattr(endpoint_mod, "record_stream_writer", _raise(errno.ENOSPC))
            reply = await ask(StreamHello(77, "t"), [cols])
        assert isinstance(reply, StreamRefused) and reply.fatal, reply
        assert "full" in reply.reason and "disk" in reply.reason, reply.reason
        # hello: the stream's scope file fails with EIO
        with monkeypatch.context() as m:
            m.setattr(cluster.endpoints["s1"].scopes, "add_columns", _raise(errno.EIO))
            reply = await ask(StreamHello(78, "t"), [cols])
        assert isinstance(reply, StreamRefused) and reply.fatal, reply
        assert "disk" in reply.reason and "EIO" in reply.reason, reply.reason
        # an item: the update log's append fails; nothing of it is applied
        assert await ask(StreamHello(79, "t"), [cols]) == StreamPosition(79, 0)
        batch = make_batch(np.random.default_rng(1), 4, 2, np.repeat(cols, 2))
        data = StreamData(79, 0, ItemKind.CHUNK, item_checksum(79, 0, ItemKind.CHUNK, batch))
        with monkeypatch.context() as m:
            m.setattr(service.store.log, "append_batch", _raise(errno.ENOSPC))
            reply = await ask(data, batch.buffers())
        assert isinstance(reply, StreamRefused) and reply.fatal and "full" in reply.reason, reply
        assert len(store) == 0
        await conn.close()
    finally:
        await cluster.close()


async def test_join_to_a_receiver_whose_disk_fills_fails_naming_it_and_drops_the_partial_rows(tmp_path):
    """The joining node's update log fails with ENOSPC after a few items: the join fails at once
    with the receiver's reason (it used to retry as "receiver unreachable" until the stream
    timeout), the old placement stays, and the items that did land are discarded."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(7)
        await cluster.write_many(rng, 60, COLUMNS, rows=16)
        await cluster.add_node("s3")
        before = cluster.client_topology.epoch
        log = cluster.services["s3"].store.log
        append = log.append_batch
        calls = [0]

        def append_batch(batch_id, batch):
            calls[0] += 1
            if calls[0] > 3:  # some items land first
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return append(batch_id, batch)

        log.append_batch = append_batch
        op = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]), chunk_bytes=1024)
        with pytest.raises(TopologyOpError, match="full") as info:
            await asyncio.wait_for(op.run(), 30)
        assert "s3" in str(info.value) and "disk" in str(info.value)
        assert op.state == "failed" and cluster.client_topology.epoch == before
        log.append_batch = append
        assert calls[0] > 3 and op.progress()["discard_errors"] == [] and op.progress()["discarded_rows"] > 0
        assert len(cluster.services["s3"].store.store) == 0  # nothing half-applied is left
    finally:
        await cluster.close()


async def test_source_control_disk_error_is_refused_naming_the_disk(tmp_path, monkeypatch):
    """A source-control request whose write fails (``DropHints``: the hint log) is refused, naming
    the disk; it used to get no reply at all, and the coordinator waited out its request timeout."""
    from giaannd.storage.rebalance import source_control as sc

    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        sources = cluster.endpoints["s0"].sources
        monkeypatch.setattr(sources, "drop_hints", _raise(errno.EIO))
        with pytest.raises(sc.SourceControlError, match="disk failed") as info:
            await asyncio.wait_for(sc.drop_hints(cluster.ops_transport, cluster.stream_addresses["s0"], "gone"), 10)
        assert "EIO" in str(info.value)
    finally:
        await cluster.close()
