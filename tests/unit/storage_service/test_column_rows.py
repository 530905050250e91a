"""Reading one column from one replica (``StorageClient.read_column``, client/column_rows.py, issue
21): start just before the column, page by bytes (big rows in pieces), stop once past it, cut at
``max_entries``, fail over to the next live owner. Real storage request cores behind a fake call."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.column_rows import cut_entries, read_column, read_column_from
from giaannd.client.errors import ReadFailed, RemoteUnavailable
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests

U64_MAX = (1 << 64) - 1
#: (column, {feature: entries}): the column under test (5) between neighbours, a big row (feature
#: 7) that takes several pages, and the id-space edges.
LAYOUT = {0: {0: 2}, 4: {1: 3, U64_MAX: 2}, 5: {0: 4, 1: 1, 7: 900, 9: 3}, 6: {0: 5}, U64_MAX: {0: 1}}


def _rows(layout: dict[int, dict[int, int]], seed: int = 0) -> RowBatch:
    rng = np.random.default_rng(seed)
    sc, sf, tc, tf = [], [], [], []
    for col, feats in layout.items():
        for f, n in feats.items():
            sc += [col] * n
            sf += [f] * n
            tc += rng.choice(10**6, n, replace=False).tolist()
            tf += rng.integers(0, 5, n).tolist()
    m = len(sc)
    return RowBatch.from_entries(np.array(sc, np.uint64), np.array(sf, np.uint64), np.zeros(m, np.uint8),
                                 np.array(tc, np.uint64), np.array(tf, np.uint64),
                                 rng.random(m, dtype=np.float32) + 0.5)


class Nodes:
    """Storage request cores by name behind a ``NodeCall``; ``fail`` names nodes whose calls raise
    after ``fail_after`` successful calls (a node failing mid-read)."""

    def __init__(self, root: Path, names: list[str], batch: RowBatch) -> None:
        self.cores = {}
        for n in names:
            core = StorageRequests(DurableStore.open(root / n / "store", 1 << 26), HintStore.open(root / n / "h"),
                                   n, lambda: None)
            core.handle(p.encode(p.ApplyBatch(1, 1)), batch.buffers())
            self.cores[n] = core
        self.calls: list[tuple[str, p.Request]] = []
        self.fail: dict[str, int] = {}

    async def call(self, node, msg, bulk=(), timeout_s=None, *, recv_into=None):
        self.calls.append((node, msg))
        if node in self.fail:
            if self.fail[node] <= 0:
                raise RemoteUnavailable("down for the test", node)
            self.fail[node] -= 1
        ans = self.cores[node].handle(p.encode(msg), list(bulk))
        assert isinstance(ans, Answer)
        return ans.reply, list(ans.bulk)

    def close(self) -> None:
        for core in self.cores.values():
            core.store.close()
            core.hints.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path, ["a", "b", "c"], _rows(LAYOUT))
    yield n
    n.close()


def _column(column: int) -> RowBatch:
    full = _rows(LAYOUT)
    return full.select_rows(full.row_column == np.uint64(column))


def _same(a: RowBatch, b: RowBatch) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


@pytest.mark.parametrize("page_bytes", [300, 4_000, 4 << 20])
def test_read_column_pages_from_just_before_the_column_and_stops_past_it(nodes: Nodes, page_bytes: int) -> None:
    got = asyncio.run(read_column_from(nodes.call, "a", 5, 10**6, page_bytes))
    assert _same(got.rows, _column(5)) and not got.truncated and got.total_entries == 908
    scans = [m for _, m in nodes.calls if isinstance(m, p.ScanRows)]
    first = scans[0]
    assert (first.after_column, first.after_feature, first.started, first.owned) == (4, U64_MAX, True, False)
    if page_bytes < 900 * p.SCAN_ENTRY_BYTES:
        assert len(scans) >= 900 * p.SCAN_ENTRY_BYTES // page_bytes  # the 900-entry row came in pieces
    else:
        assert len(scans) == 1  # one page holds the column and passes it: no page after it is asked


@pytest.mark.parametrize("column, entries", [(0, 2), (4, 5), (6, 5), (U64_MAX, 1), (3, 0), (7, 0)])
def test_read_column_edges_and_absent_columns(nodes: Nodes, column: int, entries: int) -> None:
    got = asyncio.run(read_column_from(nodes.call, "a", column, 10**6, 300))
    assert got.rows.num_entries == entries == got.total_entries
    assert _same(got.rows, _column(column))


def test_read_column_cuts_at_max_entries_and_counts_the_rest(nodes: Nodes) -> None:
    got = asyncio.run(read_column_from(nodes.call, "a", 5, 10, 300))
    assert got.truncated and got.total_entries == 908 and got.rows.num_entries == 10
    got.rows.validate()
    want = _column(5)
    assert got.rows.row_feature.tolist() == [0, 1, 7] and got.rows.offsets.tolist() == [0, 4, 5, 10]
    assert np.array_equal(got.rows.target_column, want.target_column[:10])
    # the read stopped soon after the limit: the big row was not paged through
    assert sum(isinstance(m, p.ScanRows) for _, m in nodes.calls) < 10
    exact = asyncio.run(read_column_from(nodes.call, "a", 5, 908, 4 << 20))
    assert not exact.truncated and exact.rows.num_entries == 908


def test_cut_entries_keeps_rows_in_order_and_cuts_the_last() -> None:
    batch = _column(5)
    assert cut_entries(batch, 10**6) is batch
    cut = cut_entries(batch, 4)
    assert cut.row_feature.tolist() == [0] and cut.offsets.tolist() == [0, 4]
    assert cut_entries(batch, 0).num_rows == 0


def test_read_column_fails_over_to_the_next_live_owner_and_fails_when_none_is_left(nodes: Nodes) -> None:
    topo = ClusterView(replicas=2)
    topo.set_members([StorageNode(n, f"mem://{n}") for n in ("a", "b", "c")])
    owners = [topo.placement.names[int(i)] for i in topo.placement.owner_indices(np.array([5], np.uint64))[0]]
    first, second = owners
    nodes.fail[first] = 2  # fails mid-read, after two pages
    got = asyncio.run(read_column(topo, nodes.call, 5, 10**6, 300))
    assert got.node == second and _same(got.rows, _column(5))  # the second owner's copy, read whole
    assert [n for n, _ in nodes.calls[:3]] == [first] * 3 and nodes.calls[3][0] == second
    scans = [m for n, m in nodes.calls if n == second]
    assert (scans[0].after_column, scans[0].after_feature) == (4, U64_MAX)  # read again from the start
    nodes.fail[second] = 0
    with pytest.raises(ReadFailed, match="every live owner failed"):
        asyncio.run(read_column(topo, nodes.call, 5, 10**6, 300))
    topo.mark_down(first)
    topo.mark_down(second)
    with pytest.raises(ReadFailed, match="no live owner"):
        asyncio.run(read_column(topo, nodes.call, 5, 10**6, 300))
