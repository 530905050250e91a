"""ColumnStore.scan and the ScanRows request: paging, cursors, limits, the ownership filter."""

import asyncio

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.errors import ReadFailed, RemoteUnavailable, raise_for_reply
from giaannd.client.scan import scan_cluster
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests


def _batch(keys, per_row=3, seed=0):
    rng = np.random.default_rng(seed)
    cols = np.repeat(np.array([k[0] for k in keys], np.uint64), per_row)
    feats = np.repeat(np.array([k[1] for k in keys], np.uint64), per_row)
    n = cols.size
    return RowBatch.from_entries(cols, feats, np.zeros(n, np.uint8), rng.integers(1, 1 << 40, n, dtype=np.uint64),
                                 np.tile(np.arange(per_row, dtype=np.uint64), len(keys)), np.ones(n, np.float32))


def _store(keys, per_row=3):
    s = ColumnStore(1 << 26)
    s.apply((1, 1), _batch(keys, per_row))
    return s


def _drain(store, limit_rows, limit_entries=10**9, max_examine=10**9, keep=None):
    after, pages, seen = None, 0, []
    while True:
        res = store.scan(after, limit_rows, limit_entries, max_examine, keep)
        pages += 1
        seen += [k for k, _ in res.batch]
        res.batch.validate()
        if res.done:
            return seen, pages
        after = res.next_key
        assert pages < 10_000


def test_scan_pages_every_row_once_in_key_order():
    rng = np.random.default_rng(1)
    keys = sorted({(int(c), int(f)) for c, f in zip(rng.integers(1, 50, 500), rng.integers(0, 20, 500))})
    s = _store(keys)
    for limit in (1, 7, 64, 10_000):
        seen, pages = _drain(s, limit)
        assert seen == keys
        assert pages >= len(keys) // limit
    assert s.scan(None, 10, 1000, 10).examined == 10
    assert s.scan(None, 10, 10, 10).examined == 3  # 3 rows of 3 entries fit 10 entries


def test_scan_entry_limit_and_one_big_row_alone():
    s = _store([(1, 0), (2, 0), (3, 0)], per_row=5)
    res = s.scan(None, 100, 12, 100)
    assert [k for k, _ in res.batch] == [(1, 0), (2, 0)] and not res.done and res.next_key == (2, 0)
    res = s.scan(None, 100, 2, 100)  # a row over the entry limit still goes, alone
    assert [k for k, _ in res.batch] == [(1, 0)] and res.next_key == (1, 0)
    res = s.scan((3, 0), 100, 100, 100)
    assert res.batch.num_rows == 0 and res.done


def test_scan_filter_and_examine_bound_move_the_cursor_over_rejected_rows():
    keys = [(c, 0) for c in range(1, 101)]
    s = _store(keys)
    even = lambda cols: cols % 2 == 0  # noqa: E731
    seen, _ = _drain(s, 10, keep=even)
    assert seen == [k for k in keys if k[0] % 2 == 0]
    res = s.scan(None, 10, 1000, 5, lambda cols: np.zeros(cols.shape, bool))
    assert res.batch.num_rows == 0 and not res.done and res.next_key == (5, 0) and res.examined == 5


def test_scan_sees_rows_added_ahead_of_the_cursor():
    s = _store([(1, 0), (5, 0)])
    res = s.scan(None, 1, 100, 100)
    assert [k for k, _ in res.batch] == [(1, 0)]
    s.apply((1, 2), _batch([(3, 0), (0, 9)]))  # (0, 9) is behind the cursor, (3, 0) ahead
    seen = [k for k, _ in s.scan(res.next_key, 100, 100, 100).batch]
    assert seen == [(3, 0), (5, 0)]


@pytest.fixture
def cluster_cores(tmp_path):
    """Three request cores sharing one topology, each holding the rows it owns (R = 2)."""
    names = ["a", "b", "c"]
    topo = ClusterView(local=None, replicas=2)
    topo.set_members([StorageNode(n, f"mem://{n}") for n in names])
    keys = [(c, f) for c in range(1, 301) for f in (0, 1)]
    batch = _batch(keys)
    owners = topo.placement.owner_indices(batch.row_column)
    cores = {}
    for i, n in enumerate(names):
        store = DurableStore.open(tmp_path / n / "store", 1 << 26)
        hints = HintStore.open(tmp_path / n / "hints")
        core = StorageRequests(store, hints, n, lambda: topo)
        share = batch.select_rows((owners == i).any(axis=1))
        core.handle(p.encode(p.ApplyBatch(1, 1)), share.buffers())
        cores[n] = core
    yield topo, cores, keys
    for c in cores.values():
        c.store.close()
        c.hints.close()


def _scan(core, **kw):
    got, after = [], None
    while True:
        msg = p.ScanRows(*(after or (0, 0)), after is not None, 50, **kw)
        ans = core.handle(p.encode(msg), [])
        assert isinstance(ans, Answer) and isinstance(ans.reply, p.ScanPage), ans
        got += [k for k, _ in p.check_batch(ans.bulk)]
        if ans.reply.done:
            return got
        after = (ans.reply.next_column, ans.reply.next_feature)


def test_owned_scan_partitions_rows_between_replicas(cluster_cores):
    topo, cores, keys = cluster_cores
    ep = topo.placement.epoch
    parts = {n: _scan(c, owned=True, placement_epoch=ep) for n, c in cores.items()}
    flat = [k for part in parts.values() for k in part]
    assert sorted(flat) == keys  # every row exactly once
    # unfiltered, each node has about 2/3 of the rows (R = 2 of 3)
    assert sum(len(_scan(c)) for c in cores.values()) == 2 * len(keys)
    # node "a" down: skipping it, b and c cover everything once
    parts = {n: _scan(c, owned=True, skip=["a"], placement_epoch=ep) for n, c in cores.items() if n != "a"}
    assert sorted(k for part in parts.values() for k in part) == keys
    # failover for "a" (via): b and c give exactly a's first-owner share
    via = sorted(k for n in ("b", "c") for k in _scan(cores[n], owned=True, via=["a"], placement_epoch=ep))
    first_a = sorted(_scan(cores["a"], owned=True, placement_epoch=ep))
    assert via == first_a and first_a


def test_owned_scan_refuses_another_epoch_and_unknown_nodes(cluster_cores):
    topo, cores, _ = cluster_cores
    ans = cores["a"].handle(p.encode(p.ScanRows(owned=True, placement_epoch="other")), [])
    assert isinstance(ans.reply, p.NotOwner)
    ans = cores["a"].handle(p.encode(p.ScanRows(owned=True, skip=["zz"], placement_epoch=topo.placement.epoch)), [])
    assert isinstance(ans.reply, p.NotOwner)
    ans = cores["a"].handle(b"\x81\xa4type\xa4nope", [])
    assert isinstance(ans.reply, p.BadRequest)
    ans = cores["a"].handle(p.encode(p.ScanRows(limit=0)), [])
    assert isinstance(ans.reply, p.BadRequest)


def _scan_all(topo, cores, fail_after):
    """``scan_cluster`` over the request cores; a node in ``fail_after`` answers that many calls,
    then fails (a node dying mid-scan, not yet known down); a node the topology says is down
    fails every call. Returns the keys of every page, in order."""
    left = dict(fail_after)

    async def call(node, msg, bulk=(), timeout_s=None, *, recv_into=None):
        if not topo.is_live(node) or left.get(node, 1) <= 0:
            raise RemoteUnavailable("down for the test", node)
        if node in left:
            left[node] -= 1
        ans = cores[node].handle(p.encode(msg), list(bulk))
        raise_for_reply(node, ans.reply)
        return ans.reply, list(ans.bulk)

    async def run():
        return [k for page in [pg async for pg in scan_cluster(topo, call, page_rows=20)] for k, _ in page]

    return asyncio.run(run())


def test_scan_failover_fails_when_a_failed_node_was_the_last_live_owner_of_columns(cluster_cores):
    topo, cores, keys = cluster_cores
    # a failing mid-scan with every node up (R = 2): b and c take the rest of its share over
    assert _scan_all(topo, cores, {"a": 2}) == keys
    # with c down, the columns owned by a and c have a as their only live owner: when a fails
    # mid-scan no node is left to answer for them, so the scan must fail, not end without them
    # (it returned 436 of the 600 rows)
    topo.mark_down("c")
    with pytest.raises(ReadFailed, match="no other live owner"):
        _scan_all(topo, cores, {"a": 2})
    assert sorted(_scan_all(topo, cores, {})) == keys  # (without a failure: every row, from a and b)


def test_new_messages_round_trip_with_their_fixed_tags():
    tags = {p.ScanRows: 6, p.PutVocab: 7, p.GetVocab: 8, p.ScanPage: 69, p.VocabAck: 70, p.VocabReply: 71,
            p.VocabConflict: 132}
    for cls, tag in tags.items():
        assert cls.__struct_config__.tag == tag
    for msg in (p.ScanRows(3, 4, True, 10, True, ["a"], ["b"], "e"), p.PutVocab([(0, 5, "x")]),
                p.GetVocab([1], [9])):
        assert p.decode_request(p.encode(msg)) == msg
    for rep in (p.ScanPage(1, 2, False, 7), p.VocabAck(1, 2), p.VocabReply([(1, 2, "y")]),
                p.VocabConflict(0, 1, "a", "b")):
        assert p.decode_reply(p.encode(rep)) == rep


def test_owned_scan_of_a_standby_node_is_refused(tmp_path):
    """A node decommissioned (ring mode: alive, no longer in the ring) owns no columns: an owned
    scan of it, under the placement that still named it, is refused (``NotOwner``, so the client
    restarts its scan on the new placement), as its reads are. It answered every row it held,
    unfiltered, and skipped the epoch check: the client kept the share the old placement gave it,
    from a node that no longer gets the writes for it (or had released it: rows silently missing)."""
    from giaannd.cluster.ring import Ring

    ring = Ring().with_active("a", 1.0).with_active("b", 1.0).with_active("c", 1.0)
    topo = ClusterView(local=None, replicas=2)
    topo.set_ring(ring)
    old_epoch = topo.epoch
    store = DurableStore.open(tmp_path / "store", 1 << 26)
    hints = HintStore.open(tmp_path / "hints")
    try:
        core = StorageRequests(store, hints, "a", lambda: topo)
        keys = [(c, 0) for c in range(1, 41)]
        owned = topo.placement.owner_indices(np.array([k[0] for k in keys], np.uint64))
        share = _batch([k for k, o in zip(keys, owned) if (o == 0).any()])
        assert share.num_rows
        core.handle(p.encode(p.ApplyBatch(1, 1)), share.buffers())
        topo.set_ring(ring.with_removed("a"))  # decommissioned: standby
        assert "a" not in topo and topo.epoch != old_epoch
        for epoch in (old_epoch, topo.epoch):
            ans = core.handle(p.encode(p.ScanRows(owned=True, placement_epoch=epoch)), [])
            assert isinstance(ans.reply, p.NotOwner), (epoch, ans.reply)
            assert ans.reply.epoch == topo.epoch
        # its reads are refused the same way; a scan that is not owned still answers what it holds
        ans = core.handle(p.encode(p.ReadRows()), [share.row_column, share.row_feature])
        assert isinstance(ans.reply, p.NotOwner)
        ans = core.handle(p.encode(p.ScanRows()), [])
        assert isinstance(ans.reply, p.ScanPage) and p.check_batch(ans.bulk).num_rows == share.num_rows
    finally:
        store.close()
        hints.close()
