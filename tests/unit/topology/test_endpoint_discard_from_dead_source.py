"""A removenode (or replace) of a dead member discards, on the receivers, the open streams whose
source was that member (rebalance/endpoint.py ``DiscardStreamsFrom``): a decommissioning node
killed mid-stream for good left them open, and their rows made every receiver refuse the
removenode's streams of the same columns until the idle-stream sweep, 2 h later
(docs/topology.md, "Abandoned operations clean up")."""

import asyncio

import msgspec
import numpy as np
import pytest

from giaannd.storage.rebalance.operations import Rebalance, members_after
from giaannd.storage.rebalance.source_control import DiscardStreamsFrom, StreamDiscarded, StreamsDiscarded
from giaannd.storage.streaming.dedupe import StreamScopes
from giaannd.storage.streaming.stream import (
    ItemKind,
    StreamData,
    StreamHello,
    StreamPosition,
    StreamRefused,
    StreamReply,
    item_checksum,
)
from peers.placement import Member, Placement
from peers.transport import connect
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]

ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(StreamReply | StreamDiscarded | StreamsDiscarded)


class _Peer:
    """One connection to a node's stream endpoint, as a source (or a coordinator) would open."""

    def __init__(self, conn):
        self.conn = conn

    async def ask(self, msg, bulk=()):
        res = await asyncio.wait_for(self.conn.request(ENC.encode(msg), list(bulk), timeout_s=5), 10)
        return DEC.decode(res.payload)

    async def open_stream(self, sid, cols, source_node, rng):
        """Stream ``sid`` from ``source_node`` brings one chunk of rows of ``cols`` and stays open."""
        assert await self.ask(StreamHello(sid, "t", source_node=source_node), [cols]) == StreamPosition(sid, 0)
        batch = make_batch(rng, 2 * cols.size, 2, np.repeat(cols, 2))
        data = StreamData(sid, 0, ItemKind.CHUNK, item_checksum(sid, 0, ItemKind.CHUNK, batch))
        assert await self.ask(data, batch.buffers()) == StreamPosition(sid, 1)


async def _peer(cluster, node):
    return _Peer(await connect(cluster.ops_transport, cluster.stream_addresses[node], timeout_s=2))


async def test_discard_streams_from_drops_only_a_dead_sources_open_streams_durably(tmp_path):
    cluster = await Cluster(tmp_path, 2, replicas=1).start()
    peer = None
    try:
        rng = np.random.default_rng(5)
        theirs = [c for c in range(1, 1000) if cluster.owners(c) == ("s0",)][:3]  # s1 owns none of them
        gone, live, legacy = (np.array([c], np.uint64) for c in theirs)
        peer = await _peer(cluster, "s1")
        await peer.open_stream(70, gone, "s9", rng)  # s9: a member that died (not live here)
        await peer.open_stream(71, live, "s0", rng)  # s0: live
        await peer.open_stream(72, legacy, "", rng)  # a sender older than the field: source unknown
        s1 = cluster.services["s1"].store.store
        held, from_s9 = len(s1), int(s1.rows_of_columns(gone)[0].size)
        assert from_s9 > 0 and set(s1.held_columns().tolist()) == set(theirs)

        # the source is recorded durably: a restart's scopes know it
        scopes = StreamScopes.open(cluster.services["s1"].data_dir)
        assert (scopes.source_of(70), scopes.source_of(71), scopes.source_of(72)) == ("s9", "s0", None)

        # a live source's streams are never discarded
        refused = await peer.ask(DiscardStreamsFrom("s0"))
        assert isinstance(refused, StreamRefused) and refused.fatal and "live" in refused.reason, refused
        assert len(s1) == held

        assert await peer.ask(DiscardStreamsFrom("s9")) == StreamsDiscarded("s9", 1, from_s9)
        assert set(s1.held_columns().tolist()) == {theirs[1], theirs[2]}  # only s9's rows went
        assert await peer.ask(DiscardStreamsFrom("s9")) == StreamsDiscarded("s9", 0, 0)  # nothing more
        assert sorted(cluster.endpoints["s1"].scopes.open_streams()) == [71, 72]
        reply = await peer.ask(StreamHello(70, "t", fresh=False, source_node="s9"), [gone])
        assert isinstance(reply, StreamRefused) and "discarded" in reply.reason, reply  # as DiscardStream
        # a new stream of the dead source's columns is welcome: no stale rows are left
        assert await peer.ask(StreamHello(73, "t", source_node="s0"), [gone]) == StreamPosition(73, 0)
        # while a stream of the live source's columns is still refused, as before
        reply = await peer.ask(StreamHello(74, "t", source_node="s0"), [live])
        assert isinstance(reply, StreamRefused) and "already holds" in reply.reason, reply
    finally:
        if peer is not None:
            await peer.conn.close()
        await cluster.close()


async def test_removenode_of_a_dead_decommissioning_node_discards_its_open_streams_first(tmp_path):
    """s2 was decommissioning and died mid-stream for good: the rows its stream brought to a
    survivor stay there, and the removenode of s2 used to be refused by that survivor ("already
    holds ... rows"). It now completes, and every column has exact copies. A stream from a node
    that is down but not removed by this operation stays open."""
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    peer = None
    try:
        rng = np.random.default_rng(6)
        columns = np.random.default_rng(0).integers(1, 2**63, 60, dtype=np.uint64)
        await cluster.write_many(rng, 30, columns)
        new = members_after(cluster.client_topology, remove=["s2"])
        view = cluster.client_topology
        after = Placement(tuple(Member(n.name, n.weight) for n in new), view.replicas, view.strategy)
        # a column s2 held whose new owner does not hold it yet: the dead decommission streamed it there
        held = {n: set(cluster.services[n].store.store.held_columns().tolist()) for n in ("s0", "s1")}
        col, target = next((c, t) for c in held["s0"] | held["s1"] for t in after.owners(c)
                           if "s2" in cluster.owners(c) and c not in held[t])
        peer = await _peer(cluster, target)
        await peer.open_stream(90, np.array([col], np.uint64), "s2", rng)
        # s9: down, but not removed by this operation; a column the target keeps (no stream brings it)
        kept = next(c for c in range(2**40, 2**40 + 1000) if target in cluster.owners(c) and target in after.owners(c))
        await peer.open_stream(91, np.array([kept], np.uint64), "s9", rng)
        await cluster.kill("s2")
        progress = await Rebalance(cluster.control(), "removenode", new).run()
        assert progress["state"] == "done", progress
        scopes = cluster.endpoints[target].scopes
        assert scopes.is_discarded(90) and scopes.open_streams() == [91]
        await cluster.client.flush()
        assert cluster.mismatches() == []
    finally:
        if peer is not None:
            await peer.conn.close()
        await cluster.close()
