"""Pure parts of the StorageClient: hint holder choice, write floors, byte budget."""

import asyncio

import numpy as np
import pytest

from giaannd.client.storage_client import ByteBudget, StorageClient
from giaannd.cluster.view import ClusterView, StorageNode


def _client(n=5, replicas=3):
    t = ClusterView(replicas=replicas)
    t.set_members([StorageNode(f"n{i}", f"mem://n{i}") for i in range(n)])
    return t, StorageClient(t, writer_id=7)


def test_client_hint_holder_is_first_live_non_owner():
    t, c = _client()
    keys = np.arange(1, 300, dtype=np.uint64)
    pref = t.preference(keys)
    names = t.names
    target = names[int(pref[0, 0])]
    t.mark_down(target)
    holders = c._hint_holders(target, keys, set())
    for row, h in zip(pref.tolist(), holders.tolist()):
        beyond = [i for i in row[3:] if names[i] != target]
        assert h == beyond[0]


def test_client_hint_holder_falls_back_to_an_owner_when_all_are_owners():
    t, c = _client(n=3)
    keys = np.arange(1, 50, dtype=np.uint64)
    t.mark_down("n1")
    holders = c._hint_holders("n1", keys, {"n0"})
    assert set(holders.tolist()) == {t.names.index("n2")}
    t.mark_down("n2")
    assert (c._hint_holders("n1", keys, {"n0"}) == -1).all()


def test_client_writer_floor_follows_unsettled_seqs():
    _, c = _client()
    assert c.writer_floor == 0
    ids = [c.next_batch_id() for _ in range(3)]
    assert ids[0].writer == 7 and [i.seq for i in ids] == [1, 2, 3]
    assert c.writer_floor == 0  # allocated, not yet written: unsettled
    c.abandon(ids[0])
    c.abandon(ids[2])
    assert c.writer_floor == 1
    c.abandon(ids[1])
    assert c.writer_floor == 3


@pytest.mark.asyncio
async def test_client_byte_budget_blocks_then_releases():
    budget = ByteBudget(100)
    await budget.acquire(60)
    blocked = asyncio.ensure_future(budget.acquire(60))
    await asyncio.sleep(0)
    assert not blocked.done()
    await budget.release(60)
    await asyncio.wait_for(blocked, 1)
    await budget.release(60)
    await budget.acquire(500)  # alone, an oversized request may go (no deadlock)
    assert budget.used == 500
