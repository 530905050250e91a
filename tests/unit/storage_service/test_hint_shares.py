"""A holder that gets a second, different share of one batch id for one target keeps the union."""

import asyncio

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.replication.hint_delivery import HintDelivery
from giaannd.storage.replication.hints import HintStore
from peers.placement import Member, Placement
from tools.cluster_harness import make_batch

E1 = Placement(tuple(Member(n) for n in ("a", "b", "c")), 2).epoch
E2 = Placement(tuple(Member(n) for n in ("a", "b", "c", "d")), 2).epoch


def _rows(batch, keys):
    """The rows of ``batch`` whose (column, feature) is in ``keys``."""
    want = set(keys)
    return batch.select_rows(np.array([k in want for k in zip(batch.row_column.tolist(),
                                                              batch.row_feature.tolist())], bool))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def _shares(seed=3):
    """A batch of 6 rows and two overlapping shares of it: rows 0-3 and rows 2-5."""
    full = make_batch(np.random.default_rng(seed), 6)
    keys = list(zip(full.row_column.tolist(), full.row_feature.tolist()))
    return full, _rows(full, keys[:4]), _rows(full, keys[2:])


def test_hints_second_share_of_a_batch_id_is_held_as_the_union(tmp_path):
    """Before, the second share was answered "already held" (False, nothing written): its rows
    5 and 6 were acknowledged by the holder and never delivered."""
    full, first, second = _shares()
    assert full.num_rows == 6 and first.num_rows == second.num_rows == 4
    bid = BatchId(7, 1)
    hs = HintStore.open(tmp_path)
    assert hs.add("t", bid, first, E1)
    hs.add("t", BatchId(7, 2), make_batch(np.random.default_rng(9), 2), E1)  # another id, after
    other_bytes = hs.held_bytes - first.nbytes
    assert hs.add("t", bid, second, E2)  # more rows: held
    (held, _) = hs.pending("t")
    assert held.batch_id == bid and _same(held.batch, full)  # the union, canonical, in arrival order
    held.batch.validate()
    assert held.epoch == E1  # the held share's epoch (hints.py, "A second share")
    assert hs.held_bytes == full.nbytes + other_bytes and hs.held == 2
    assert not hs.add("t", bid, second, E2)  # an identical re-send: nothing written
    assert not hs.add("t", bid, full, E1)
    assert hs.held_bytes == full.nbytes + other_bytes
    hs.sync("t")
    hs.close()
    again = HintStore.open(tmp_path)  # the later record of the id supersedes the earlier one
    got = again.pending("t")
    assert [h.batch_id for h in got] == [bid, BatchId(7, 2)]
    assert _same(got[0].batch, full) and got[0].epoch == E1
    assert again.held_bytes == full.nbytes + other_bytes
    again.delivered("t", bid)
    again.delivered("t", BatchId(7, 2))
    assert again.held == 0 and again.held_bytes == 0 and list(tmp_path.iterdir()) == []


def test_hints_union_counts_against_the_budget(tmp_path):
    full, first, second = _shares()
    hs = HintStore.open(tmp_path, max_bytes=first.nbytes)
    assert hs.add("t", BatchId(7, 1), first)
    from giaannd.storage.replication.hints import HintSpaceFull

    with pytest.raises(HintSpaceFull):
        hs.add("t", BatchId(7, 1), second)
    assert hs.held_bytes == first.nbytes and _same(hs.pending("t")[0].batch, first)


class _GatedClient:
    """A stand-in StorageClient whose first ApplyBatch waits for ``gate``."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.asked = asyncio.Event()
        self.sent: list[RowBatch] = []

    async def apply_to(self, node, batch_id, batch, **kwargs):
        self.sent.append(batch)
        if len(self.sent) == 1:
            self.asked.set()
            await self.gate.wait()
        return p.ApplyAck(durable=True, applied=True)


@pytest.mark.asyncio
async def test_hint_delivery_keeps_a_union_that_arrived_while_the_first_share_was_sent(tmp_path):
    """The second share arrives while the first is being delivered: delivery forgets only what it
    delivered, and sends the union next round, so rows 5 and 6 still reach the target."""
    full, first, second = _shares()
    bid = BatchId(7, 1)
    hs = HintStore.open(tmp_path)
    hs.add("t", bid, first)
    client = _GatedClient()
    delivery = HintDelivery(hs, client, topology=None)  # type: ignore[arg-type]
    task = asyncio.ensure_future(delivery.deliver_to("t"))
    await client.asked.wait()
    assert hs.add("t", bid, second)
    client.gate.set()
    assert await task == 0 and _same(hs.pending("t")[0].batch, full)  # not forgotten
    assert await delivery.deliver_to("t") == 1
    assert _same(client.sent[-1], full) and hs.held == 0 and hs.held_bytes == 0
