"""A share no node holds (refused without a hint, or no hint holder) is sent again by the writer,
and its seq settles only once its owner has it (writes.py, "Stranded shares")."""

import asyncio
from collections import defaultdict

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.errors import QuorumNotReached, RemoteStoreFull, RemoteUnavailable
from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.protocol import BatchId
from tools.cluster_harness import make_batch


class _Nodes:
    """Three storage nodes as the writer sees them (R = 3, W = 2: every node owns every row)."""

    def __init__(self, client: StorageClient) -> None:
        self.client = client
        self.applied: dict[str, set[tuple[int, int]]] = defaultdict(set)
        self.hints: dict[str, list[tuple[str, tuple[int, int]]]] = defaultdict(list)
        self.refuse: dict[str, Exception] = {}  # node -> what it answers to a direct ApplyBatch
        self.hint_space_full: set[str] = set()
        self.gates: dict[str, asyncio.Event] = {}  # a node's direct applies wait for its gate
        self.direct: list[str] = []  # nodes asked to apply directly, in order
        w = client._writes
        w._send_reserved, w._apply_to, w._call = self.send_reserved, self.apply_to, self.call

    async def _apply(self, node, bid, hint_for):
        if hint_for is not None:
            if node in self.hint_space_full:
                raise RemoteUnavailable("hint space full", node)
            self.hints[node].append((hint_for, tuple(bid)))
            return p.ApplyAck(durable=True, applied=True, hinted=True)
        self.direct.append(node)
        if node in self.gates:
            await self.gates[node].wait()
        if node in self.refuse:
            raise self.refuse[node]
        self.applied[node].add(tuple(bid))
        return p.ApplyAck(durable=True, applied=True)

    async def send_reserved(self, node, bid, batch, writer_floor, hint_for, timeout_s, epoch=None):
        try:
            return await self._apply(node, bid, hint_for)
        finally:
            await self.client._budget(node).release(batch.nbytes)

    async def apply_to(self, node, bid, batch, *, writer_floor=0, hint_for=None, timeout_s=None, epoch=None):
        return await self._apply(node, bid, hint_for)

    async def call(self, node, msg, bulk=(), timeout_s=None, **kwargs):
        assert isinstance(msg, p.BatchesApplied)
        return p.AppliedMask([(msg.writer, s) in self.applied[node] for s in msg.seqs]), []


def _cluster():
    t = ClusterView(replicas=3)
    t.set_members([StorageNode(f"n{i}", f"mem://n{i}") for i in range(3)])
    c = StorageClient(t, writer_id=7)
    return t, c, _Nodes(c)


@pytest.mark.asyncio
async def test_writer_floor_passes_a_seq_a_slow_owner_refused_after_w_once_the_owner_has_it():
    """Two writes reach W on n0 and n1; the slow n2 then answers StoreFull (no hint: it would be
    refused the same way). Before, nothing ever sent n2 those shares again nor asked it, so the
    writer's floor stayed below them for the client's lifetime."""
    t, c, nodes = _cluster()
    full = RemoteStoreFull("n2", p.StoreFull(100, 1000, 1000))
    nodes.gates["n2"], nodes.refuse["n2"] = asyncio.Event(), full
    rng = np.random.default_rng(1)
    res = [await c.write(make_batch(rng, 5)) for _ in range(2)]
    assert [sorted(r.acked) for r in res] == [["n0", "n1"]] * 2  # W reached; n2 still answering
    nodes.gates["n2"].set()
    await c.flush()  # n2 refused both
    assert c.writer_floor == 0  # not settled: n2 lacks them, and the floor must not pass them
    nodes.direct.clear()
    await c.confirm_hints()  # n2 still full: one attempt, then it stops (bounded)
    assert nodes.direct == ["n2"] and c.writer_floor == 0
    del nodes.refuse["n2"]  # space made on n2
    await c.confirm_hints()
    assert nodes.applied["n2"] == {(7, 1), (7, 2)}
    assert c.writer_floor == 2 and not c._floors.unsettled


@pytest.mark.parametrize("back", ["holder_has_space", "target_is_up"])
@pytest.mark.asyncio
async def test_writer_floor_passes_a_seq_whose_hint_found_no_holder_once_the_owner_has_it(back):
    """n2 is down and both other nodes refuse to hold its hint: the write reached W, the share is
    held nowhere. Before, it was dropped (logged) and the seq stayed unsettled for good. Now the
    writer keeps it, and sends it again on each confirmation round: as a hint once a holder has
    space, or to n2 itself once it is up; the seq settles when n2 reports it applied."""
    t, c, nodes = _cluster()
    t.mark_down("n2")
    nodes.hint_space_full = {"n0", "n1"}
    res = await c.write(make_batch(np.random.default_rng(2), 5))
    await c.flush()
    assert sorted(res.acked) == ["n0", "n1"] and not any(nodes.hints.values())
    assert c.writer_floor == 0
    await c.confirm_hints()  # nothing changed: still no holder, n2 still down
    assert c.writer_floor == 0 and not any(nodes.hints.values())
    if back == "holder_has_space":
        nodes.hint_space_full.clear()
        await c.confirm_hints()
        ((holder, held),) = [(n, h) for n, h in nodes.hints.items() if h]
        assert held == [("n2", (7, 1))] and holder != "n2"
        assert c.writer_floor == 0  # held, not delivered: still unsettled
        nodes.applied["n2"].add((7, 1))  # the holder delivers it when n2 is back
        t.mark_up("n2")
        await c.confirm_hints()
        assert nodes.direct.count("n2") == 0  # (sent once, by the holder)
    else:
        t.mark_up("n2")
        await c.confirm_hints()
        assert nodes.direct.count("n2") == 1 and (7, 1) in nodes.applied["n2"]
    assert c.writer_floor == 1 and not c._floors.unsettled


@pytest.mark.asyncio
async def test_writer_abandon_drops_a_stranded_share():
    """A failed write the caller gives up on: its stranded share is neither kept nor sent again."""
    t, c, nodes = _cluster()
    t.mark_down("n1")
    t.mark_down("n2")
    nodes.hint_space_full = {"n0"}
    with pytest.raises(QuorumNotReached):
        await c.write(make_batch(np.random.default_rng(3), 4))  # 1 of W = 2: QuorumNotReached
    await c.flush()
    assert c._writes._stranded_bytes > 0 and c.writer_floor == 0
    c.abandon(BatchId(7, 1))
    assert c._writes._stranded_bytes == 0 and not c._writes._stranded and c.writer_floor == 1
    t.mark_up("n1")
    t.mark_up("n2")
    nodes.direct.clear()
    await c.confirm_hints()
    assert nodes.direct == []
