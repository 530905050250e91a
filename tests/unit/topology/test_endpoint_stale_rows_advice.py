"""The refusal of a fresh stream to a node that already holds rows of its columns (an earlier
stream's, abandoned and not discarded: rebalance/endpoint.py ``_hello``) gives advice that fits
the node: a standby (joining) node holds nothing else and may be wiped and joined again; an active
member holds replicas of other columns, and wiping it, as the refusal used to advise everywhere,
would destroy them."""

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
    item_checksum,
)
from peers.transport import connect
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(StreamReply)


async def _abandon_then_restream(cluster, node, cols, sid):
    """Stream ``sid`` brings rows of ``cols`` to ``node`` and is left open (its coordinator gone);
    returns the reply to a new stream's fresh hello for the same columns."""
    conn = await connect(cluster.ops_transport, cluster.stream_addresses[node], timeout_s=2)
    try:
        async def ask(msg, bulk=()):
            res = await asyncio.wait_for(conn.request(ENC.encode(msg), list(bulk), timeout_s=5), 10)
            return DEC.decode(res.payload)

        assert await ask(StreamHello(sid, "t"), [cols]) == StreamPosition(sid, 0)
        batch = make_batch(np.random.default_rng(sid), 2 * cols.size, 2, np.repeat(cols, 2))
        data = StreamData(sid, 0, ItemKind.CHUNK, item_checksum(sid, 0, ItemKind.CHUNK, batch))
        assert await ask(data, batch.buffers()) == StreamPosition(sid, 1)
        return await ask(StreamHello(sid + 1, "t"), [cols])
    finally:
        await conn.close()


async def test_stale_rows_refusal_tells_an_active_member_not_to_wipe_and_a_standby_it_may(tmp_path):
    cluster = await Cluster(tmp_path, 2, replicas=1).start()
    try:
        await cluster.add_node("s2")  # outside the placement: a standby (joining) node
        column = next(c for c in range(1, 1000) if cluster.owners(c) == ("s0",))
        cols = np.array([column], np.uint64)  # a column s1 does not own: it holds no rows of it

        active = await _abandon_then_restream(cluster, "s1", cols, 70)
        assert isinstance(active, StreamRefused) and active.fatal, active
        assert "already holds" in active.reason
        assert "wipe this node's data directory and join it again" not in active.reason, active.reason
        assert "do not wipe" in active.reason and "idle-stream sweep" in active.reason, active.reason

        standby = await _abandon_then_restream(cluster, "s2", cols, 80)
        assert isinstance(standby, StreamRefused) and standby.fatal, standby
        assert "wipe this node's data directory and join it again" in standby.reason, standby.reason
    finally:
        await cluster.close()
