"""Fast paths of a small replicated read (client/reads.py, tools/bench/readpath.py) against the
general code they skip: the replica order with nobody down, local or ramping, and a lone job awaited
without gather (same results, same errors, same failover)."""

import asyncio

import numpy as np
import pytest

from giaannd.client.errors import ReadFailed, RemoteUnavailable
from giaannd.client.reads import read_replicated, replica_order
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.ramp import RampTracker


def _general_order(owners, down, local, demote=None):
    """replica_order's ranking with no shortcut (the code before the fast path)."""
    r = owners.shape[1]
    rank = down[owners] * (4 * r) + (~local[owners]) * r + np.arange(r)[None, :]
    if demote is not None:
        rank += (demote & ~local[owners]) * (2 * r)
    return np.take_along_axis(owners, np.argsort(rank, axis=1, kind="stable"), axis=1)


@pytest.mark.parametrize("seed", range(20))
def test_replica_order_fast_path_agrees_with_ranking(seed):
    rng = np.random.default_rng(seed)
    n, r = int(rng.integers(1, 7)), int(rng.integers(1, 4))
    r = min(r, n)
    owners = np.stack([rng.permutation(n)[:r] for _ in range(int(rng.integers(0, 30)))]).astype(np.intp) \
        if seed % 5 else np.empty((0, r), np.intp)
    for down, local in [(np.zeros(n, bool), np.zeros(n, bool)), (rng.random(n) < 0.3, np.zeros(n, bool)),
                        (np.zeros(n, bool), np.eye(1, n, int(rng.integers(0, n)), dtype=bool)[0])]:
        assert np.array_equal(replica_order(owners, down, local), _general_order(owners, down, local))
        demote = rng.random(owners.shape) < 0.5
        assert np.array_equal(replica_order(owners, down, local, demote),
                              _general_order(owners, down, local, demote))


def _rows(cols):
    cols = np.sort(np.asarray(cols, np.uint64))
    n = cols.size
    return RowBatch(cols, np.zeros(n, np.uint64), np.arange(n + 1, dtype=np.int64), np.zeros(n, np.uint8),
                    np.arange(n, dtype=np.uint64), np.ones(n, np.uint64), np.ones(n, np.float32))


def _view(n=3, replicas=3):
    t = ClusterView(replicas=replicas)
    t.set_members([StorageNode(f"n{i}", f"mem://n{i}") for i in range(n)])
    return t


def _keys_on_one_node(t, count):
    """``count`` columns whose first owner is the same node (a read that makes one job)."""
    cols = np.arange(1, 5000, dtype=np.uint64)
    first = t.placement.owner_indices(cols)[:, 0]
    return cols[first == first[0]][:count], t.names[int(first[0])]


@pytest.mark.asyncio
@pytest.mark.parametrize("one_job", [True, False])
async def test_read_replicated_lone_job_fails_over_like_gather(one_job):
    """A failing first node hands its rows to the next owner, a non-request error propagates, and
    the rows read are the same, whether the round had one job (awaited alone) or several."""
    t = _view()
    cols, first = _keys_on_one_node(t, 5) if one_job else (np.arange(1, 40, dtype=np.uint64), None)
    feats = np.zeros(cols.size, np.uint64)
    calls = []

    async def read_from(node, c, f, timeout_s, busy_ok=False):
        calls.append(node)
        if node == (first or t.names[0]):
            raise RemoteUnavailable("busy", node)
        return _rows(c)

    got = await read_replicated(t, read_from, RampTracker(0.0), lambda: 0.0, cols, feats)
    assert np.array_equal(got.row_column, np.sort(cols))
    assert (first or t.names[0]) in calls

    async def broken(node, c, f, timeout_s, busy_ok=False):
        raise ZeroDivisionError("a bug, not a failed request")

    with pytest.raises(ZeroDivisionError):
        await read_replicated(t, broken, RampTracker(0.0), lambda: 0.0, cols, feats)

    async def down(node, c, f, timeout_s, busy_ok=False):
        raise RemoteUnavailable("down", node)

    with pytest.raises(ReadFailed):
        await read_replicated(t, down, RampTracker(0.0), lambda: 0.0, cols, feats)


@pytest.mark.asyncio
async def test_read_replicated_lone_job_cancellation_propagates():
    t = _view()
    cols, _ = _keys_on_one_node(t, 3)
    started = asyncio.Event()

    async def slow(node, c, f, timeout_s, busy_ok=False):
        started.set()
        await asyncio.sleep(30)
        return _rows(c)

    task = asyncio.ensure_future(read_replicated(t, slow, RampTracker(0.0), lambda: 0.0, cols,
                                                 np.zeros(cols.size, np.uint64)))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


@pytest.mark.parametrize("seed", range(15))
def test_fewest_nodes_picks_live_owners_and_keeps_failover_order(seed):
    from giaannd.client.reads import fewest_nodes

    rng = np.random.default_rng(seed)
    n, r = int(rng.integers(2, 8)), 3
    r = min(r, n)
    cand = np.stack([rng.permutation(n)[:r] for _ in range(40)]).astype(np.intp)
    down = rng.random(n) < 0.25
    local = np.zeros(n, bool)
    if seed % 3 == 0:
        local[int(rng.integers(0, n))] = True
    cand = replica_order(cand, down, local)
    got = fewest_nodes(cand, down, local)
    for before, after in zip(cand.tolist(), got.tolist()):
        assert sorted(before) == sorted(after)  # the same owners
        assert [m for m in before if m != after[0]] == after[1:]  # the rest keep their order
        if local[before[0]] or down[before].all():
            assert after == before  # a local first candidate, or no live owner: untouched
        else:
            assert not down[after[0]]


def test_fewest_nodes_one_node_when_every_node_owns_every_row():
    from giaannd.client.reads import fewest_nodes

    rng = np.random.default_rng(1)
    cand = np.stack([rng.permutation(3) for _ in range(16)]).astype(np.intp)
    got = fewest_nodes(cand, np.zeros(3, bool), np.zeros(3, bool))
    assert len(set(got[:, 0].tolist())) == 1
    # the tie goes to the node that is first owner of most rows (reads keep spreading by row)
    assert got[0, 0] == np.bincount(cand[:, 0], minlength=3).argmax()
    down = np.array([True, False, False])
    got = fewest_nodes(replica_order(cand, down, np.zeros(3, bool)), down, np.zeros(3, bool))
    assert len(set(got[:, 0].tolist())) == 1 and got[0, 0] != 0


@pytest.mark.asyncio
async def test_read_replicated_fewest_one_request_then_failover():
    t = _view()
    cols = np.arange(1, 17, dtype=np.uint64)
    feats = np.zeros(cols.size, np.uint64)
    calls = []

    async def read_from(node, c, f, timeout_s, busy_ok=False):
        calls.append((node, c.size))
        return _rows(c)

    got = await read_replicated(t, read_from, RampTracker(0.0), lambda: 0.0, cols, feats, fewest=True)
    assert np.array_equal(got.row_column, cols) and len(calls) == 1 and calls[0][1] == 16
    calls.clear()
    await read_replicated(t, read_from, RampTracker(0.0), lambda: 0.0, cols, feats)  # default: spread
    assert len(calls) > 1  # each row to its own first owner
    calls.clear()

    async def one_fails(node, c, f, timeout_s, busy_ok=False):
        calls.append((node, c.size))
        if len(calls) == 1:
            raise RemoteUnavailable("busy", node)
        return _rows(c)

    got = await read_replicated(t, one_fails, RampTracker(0.0), lambda: 0.0, cols, feats, fewest=True)
    assert np.array_equal(got.row_column, cols)
    assert len(calls) > 1 and calls[0][1] == 16  # the chosen node failed: its rows went on
    assert all(node != calls[0][0] for node, _ in calls[1:])


def test_fewest_nodes_spreads_reads_when_every_node_owns_every_row():
    from giaannd.client.reads import fewest_nodes

    t = _view()
    rng = np.random.default_rng(5)
    chosen = set()
    for _ in range(60):
        cols = rng.integers(1, 1 << 40, 16).astype(np.uint64)
        cand = replica_order(t.placement.owner_indices(cols), np.zeros(3, bool), np.zeros(3, bool))
        got = fewest_nodes(cand, np.zeros(3, bool), np.zeros(3, bool))
        assert len(set(got[:, 0].tolist())) == 1
        chosen.add(int(got[0, 0]))
    assert chosen == {0, 1, 2}


@pytest.mark.asyncio
async def test_read_rows_fewest_per_call_overrides_the_clients_setting():
    """Inference asks for the grouping per call (compute.infer-read-fewest-nodes) while the
    client's own reads keep ``read_fewest_nodes``."""
    from giaannd.client.storage_client import StorageClient

    cols = np.arange(1, 17, dtype=np.uint64)
    feats = np.zeros(cols.size, np.uint64)
    for default in (False, True):
        client = StorageClient(_view(), read_fewest_nodes=default)
        calls = []

        async def read_from(node, c, f, timeout_s, busy_ok=False):
            calls.append(node)
            return _rows(c)

        client.read_from = read_from  # type: ignore[method-assign]
        got = await client.read_rows(cols, feats, fewest=True)
        assert np.array_equal(got.row_column, cols) and len(calls) == 1
        calls.clear()
        await client.read_rows(cols, feats, fewest=False)
        assert len(calls) > 1  # each row to its own first owner
        calls.clear()
        await client.read_rows(cols, feats)  # None: the client's setting
        assert (len(calls) == 1) == default


@pytest.mark.asyncio
@pytest.mark.parametrize("down_nodes", [(), ("n1",), ("n0", "n2")])
async def test_read_replicated_lets_a_folding_node_refuse_only_rows_with_a_live_replica_left(down_nodes):
    """``busy_ok`` ("Around folds") is set on a node's request exactly when every row in it has a
    live candidate after that node: the last live replica of a row is asked without it (and waits
    for a fold there), and with ``around_folds`` off no request carries it."""
    t = _view(4, 3)
    for name in down_nodes:
        t.mark_down(name)
    cols = np.arange(1, 300, dtype=np.uint64)
    feats = np.zeros(cols.size, np.uint64)
    down = np.array([not t.is_live(n) for n in t.names])
    asked: list[tuple[str, np.ndarray, bool]] = []

    async def folding(node, c, f, timeout_s, busy_ok=False):
        asked.append((node, c.copy(), busy_ok))
        if busy_ok:
            raise RemoteUnavailable("folding", node)
        return _rows(c)

    got = await read_replicated(t, folding, RampTracker(0.0), lambda: 0.0, cols, feats)
    assert np.array_equal(got.row_column, np.sort(cols))  # every row served, by a node that waited
    owners = t.placement.owner_indices(cols)
    for node, c, busy_ok in asked:
        m = t.names.index(node)
        rows = np.searchsorted(cols, c)
        # live candidates of each of these rows that come after this node in the row's order
        # (live before down; the view has no local node and no ramp: placement order otherwise)
        later_live = [any(not down[o] for o in owners[i][list(owners[i]).index(m) + 1:]) and not down[m]
                      for i in rows]
        assert busy_ok == all(later_live), (node, busy_ok)
    assert any(b for _, _, b in asked)  # some requests could be refused
    served = [c for _, c, b in asked if not b]
    assert np.array_equal(np.sort(np.concatenate(served)), cols)  # each row read once, without busy_ok

    asked.clear()
    got = await read_replicated(t, folding, RampTracker(0.0), lambda: 0.0, cols, feats, around_folds=False)
    assert np.array_equal(got.row_column, np.sort(cols))
    assert not any(b for _, _, b in asked)


def _fewest_reference(cand, down, local):
    """``fewest_nodes`` as numpy passes per node chosen (the code before the kernel)."""
    live = ~down[cand]
    left = ~local[cand[:, 0]] & live.any(axis=1)
    first = cand[:, 0].copy()
    n = down.shape[0]
    while left.any():
        k = int(left.sum())
        counts = np.bincount(cand[left][live[left]], minlength=n)
        firsts = np.bincount(cand[left, 0], minlength=n)
        lead = np.zeros(n, np.int64)
        lead[cand[int(left.argmax()), 0]] = 1
        m = int((counts * 2 * (k + 1) + firsts * 2 + lead).argmax())
        hit = left & ((cand == m) & live).any(axis=1)
        first[hit] = m
        left &= ~hit
    order = np.argsort(cand != first[:, None], axis=1, kind="stable")
    return np.take_along_axis(cand, order, axis=1)


@pytest.mark.parametrize("seed", range(40))
def test_fewest_nodes_equals_the_numpy_greedy_cover(seed):
    from giaannd.client.reads import fewest_nodes

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    r = int(rng.integers(1, n + 1))
    rows = int(rng.integers(0, 70))
    cand = np.stack([rng.permutation(n)[:r] for _ in range(rows)]).astype(np.intp) if rows else \
        np.empty((0, r), np.intp)
    down = rng.random(n) < 0.3
    local = np.zeros(n, bool)
    if seed % 4 == 0:
        local[int(rng.integers(0, n))] = True
    cand = replica_order(cand, down, local) if rows else cand
    got = fewest_nodes(cand, down, local)
    assert got.dtype == cand.dtype and got.tolist() == _fewest_reference(cand, down, local).tolist()
