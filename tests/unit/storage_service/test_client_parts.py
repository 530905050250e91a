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


@pytest.mark.parametrize("seed", range(10))
def test_hint_holders_equal_the_member_by_member_rule(seed):
    """hint_holders' usable members (from the view's kept masks) are the live ones that are neither
    the target nor excluded, as the per-member rule it replaced said; names outside the view ignored."""
    from giaannd.client.writes import hint_holders

    rng = np.random.default_rng(seed)
    t, _ = _client(n=int(rng.integers(3, 9)))
    names = t.names
    for n in names:
        if rng.random() < 0.3:
            t.mark_down(n)
    target = str(rng.choice([*names, "elsewhere"]))
    exclude = {str(n) for n in rng.choice([*names, "gone"], int(rng.integers(0, 3)))}
    keys = np.arange(1, 200, dtype=np.uint64)
    usable = np.array([t.is_live(n) and n != target and n not in exclude for n in names])
    pref = t.preference(keys)
    cand = usable[pref]
    beyond = cand.copy()
    beyond[:, : t.placement.effective_replicas] = False
    pick = np.where(beyond.any(axis=1), beyond.argmax(axis=1), cand.argmax(axis=1))
    want = np.where(cand.any(axis=1), pref[np.arange(pref.shape[0]), pick], -1)
    assert hint_holders(t, target, keys, exclude).tolist() == want.tolist()


@pytest.mark.asyncio
async def test_client_concurrent_confirm_hints_settle_once_and_do_not_raise():
    """Two ``confirm_hints`` at once (the one ``write`` starts in the background, and a caller's):
    the one answered second found the target's seqs settled and removed by the first. Before, it
    raised KeyError (``hinted[target]``), from the caller's call or as a background task's error."""
    from giaannd import protocol as p

    _, c = _client()
    bid = c.next_batch_id()
    c._floors.track(bid, ["n1"])
    c._floors.hinted_for("n1", bid)
    gate = asyncio.Event()

    async def call(node, msg, bulk=(), **kwargs):
        await gate.wait()
        return p.AppliedMask([True] * len(msg.seqs)), []

    c._writes._call = call
    first = asyncio.ensure_future(c.confirm_hints())
    second = asyncio.ensure_future(c.confirm_hints())
    await asyncio.sleep(0)  # both asked and wait for their replies
    gate.set()
    assert sorted(await asyncio.gather(first, second)) == [0, 1]  # settled once
    assert c.writer_floor == 1 and not c._floors.hinted


@pytest.mark.parametrize(("joiner", "seed"), [("z9", 2), ("a0", 1), ("n15", 1), ("a0", 0)])
@pytest.mark.asyncio
async def test_client_hint_holder_after_the_placement_changed_during_a_refusal(joiner, seed):
    """The first hint holder refuses, and the placement grows meanwhile: the next holder is the one
    ``hint_holders`` names in the current view. Before, its index was read in the names of the
    placement the loop started with: IndexError (the hint task died, the share was held nowhere),
    or the refusing holder again, or the down target itself."""
    from giaannd import protocol as p
    from giaannd.client.errors import RemoteUnavailable
    from giaannd.client.writes import hint_holders
    from giaannd.cluster.view import StorageNode
    from tools.cluster_harness import make_batch

    t, c = _client()
    target = "n2"
    t.mark_down(target)
    share = make_batch(np.random.default_rng(seed), 3)
    asked = []

    async def apply_to(node, bid, batch, **kwargs):
        asked.append(node)
        if len(asked) == 1:
            t.add(StorageNode(joiner, f"mem://{joiner}"))
            raise RemoteUnavailable("busy", node)
        return p.ApplyAck(durable=True, applied=True, hinted=True)

    c._writes._apply_to = apply_to
    hinted = {}
    await c._writes._hint(target, c.next_batch_id(), share, 0, hinted, t.epoch)
    picks = hint_holders(t, target, share.row_column, {asked[0]})
    want = t.names[int(np.bincount(picks[picks >= 0]).argmax())]
    assert asked == [asked[0], want] and want not in (asked[0], target)
    assert hinted == {target: [want]}
