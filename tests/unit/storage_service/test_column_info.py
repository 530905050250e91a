"""ColumnInfo (issue 7): the storage core's per-column counts and digests, paged, without I/O."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.column_info import column_report
from giaannd.model.rows import RowBatch
from giaannd.storage.engine.column_store import ENTRY_BYTES, ROW_OVERHEAD_BYTES
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.row_digest import fold_row_digests_v2
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests, fold_row_digest
from peers.placement import Member, Placement

U64_MAX = (1 << 64) - 1
#: (column, features): a column before, the one under test, one after, and the id-space edges.
LAYOUT = {0: [0, 3], 4: [1, 2], 5: [0, 1, 7, 9, 11], 6: [0], U64_MAX: [0, U64_MAX]}


def _rows(layout: dict[int, list[int]], seed: int = 0) -> RowBatch:
    """Each (column, feature) row gets 1..4 entries with random targets and strengths."""
    rng = np.random.default_rng(seed)
    sc, sf, tc, tf = [], [], [], []
    for col, feats in layout.items():
        for f in feats:
            n = int(rng.integers(1, 5))
            sc += [col] * n
            sf += [f] * n
            tc += rng.integers(1, 1000, n).tolist()
            tf += list(range(n))
    m = len(sc)
    return RowBatch.from_entries(np.array(sc, np.uint64), np.array(sf, np.uint64), np.zeros(m, np.uint8),
                                 np.array(tc, np.uint64), np.array(tf, np.uint64),
                                 rng.random(m, dtype=np.float32) + 0.5)


def _open(path: Path) -> StorageRequests:
    return StorageRequests(DurableStore.open(path / "store", 1 << 22), HintStore.open(path / "hints"), "",
                           lambda: None)


@pytest.fixture
def core(tmp_path: Path) -> Iterator[StorageRequests]:
    c = _open(tmp_path)
    yield c
    c.store.close()
    c.hints.close()


def _apply(core: StorageRequests, batch: RowBatch, seq: int) -> None:
    core.handle(p.encode(p.ApplyBatch(1, seq)), batch.buffers())


def _pages(core: StorageRequests, column: int, limit: int = p.MAX_COLUMN_INFO_ROWS, version: int = 1
           ) -> list[p.ColumnInfoPage]:
    pages: list[p.ColumnInfoPage] = []
    msg = p.ColumnInfo(column, limit=limit, digest_version=version)
    for _ in range(100):
        step = core.handle(p.encode(msg), [])
        assert isinstance(step, Answer) and isinstance(step.reply, p.ColumnInfoPage), step
        pages.append(step.reply)
        if step.reply.done:
            return pages
        msg = p.ColumnInfo(column, step.reply.next_feature, True, limit, version)
    raise AssertionError("column info did not finish in 100 pages")


def _total(pages: list[p.ColumnInfoPage]) -> tuple[int, int, int, int, int, int]:
    return (sum(x.rows for x in pages), sum(x.entries for x in pages), sum(x.bytes for x in pages),
            sum(x.keys_digest for x in pages) % (1 << 64), sum(x.strength_digest for x in pages) % (1 << 64),
            sum(x.batches for x in pages))


def _expected(core: StorageRequests, column: int, version: int = 1) -> tuple[int, int, int, int, int, int]:
    """What the pages must add up to, row by row: version 1 with the per-row ``digest`` and
    ``fold_row_digest``; version 2 with ``row_digests`` and ``fold_row_digests_v2`` of one row at
    a time (the sum is order-free, so pages of any size give it)."""
    store = core.store.store
    keys = [k for k in store.keys() if k[0] == column]  # noqa: SIM118 (the sorted key list)
    entries = sum(len(row) for k in keys if (row := store.row(k)) is not None)
    digests = [(k, store.digest(k)) for k in keys]
    if version == 1:
        kd = sum(fold_row_digest(*k, d.keys) for k, d in digests if d) % (1 << 64)
        sd = sum(fold_row_digest(*k, d.strength) for k, d in digests if d) % (1 << 64)
    else:
        kd = sd = 0
        for k in keys:
            c, f = np.array([k[0]], np.uint64), np.array([k[1]], np.uint64)
            _, one_k, one_s = store.row_digests(c, f, 2)
            kd = (kd + fold_row_digests_v2(c, f, one_k)) % (1 << 64)
            sd = (sd + fold_row_digests_v2(c, f, one_s)) % (1 << 64)
    return (len(keys), entries, entries * ENTRY_BYTES + len(keys) * ROW_OVERHEAD_BYTES, kd, sd,
            sum(d.batches for _, d in digests if d))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("limit", [1, 2, 3, p.MAX_COLUMN_INFO_ROWS])
def test_column_info_counts_only_that_column_in_any_page_size(core: StorageRequests, limit: int, version: int) -> None:
    _apply(core, _rows(LAYOUT), 1)
    for column, feats in LAYOUT.items():
        pages = _pages(core, column, limit, version)
        assert {x.digest_version for x in pages} == {version}
        got = _total(pages)
        assert got == _expected(core, column, version)
        assert got[0] == len(feats)
    pages = _pages(core, 5, 2)
    assert len(pages) == 3 and [x.rows for x in pages] == [2, 2, 1]


def test_column_info_absent_column_is_empty_and_done(core: StorageRequests) -> None:
    _apply(core, _rows(LAYOUT), 1)
    for column in (1, 3, 5 + 1000, U64_MAX - 1):
        (page,) = _pages(core, column)
        assert (page.rows, page.entries, page.bytes, page.keys_digest, page.batches) == (0, 0, 0, 0, 0)


def test_column_info_digest_agrees_across_batch_splits_and_detects_difference(tmp_path: Path) -> None:
    """Two replicas that applied the same rows in different batches agree on the keys digest (the
    batch counts differ, and say so); a replica missing a row, or holding other targets, differs."""
    a, b, c = (_open(tmp_path / n) for n in "abc")
    try:
        whole = _rows(LAYOUT, seed=1)
        _apply(a, whole, 1)
        cols = np.asarray(whole.row_column)
        _apply(b, whole.select_rows(cols < 5), 1)
        _apply(b, whole.select_rows(cols >= 5), 2)
        _apply(c, _rows({k: v for k, v in LAYOUT.items() if k != 5} | {5: [0, 1, 7, 9]}, seed=1), 1)
        for version in (1, 2):
            assert _total(_pages(a, 5, 2, version))[:5] == _total(_pages(b, 5, 3, version))[:5]
            assert _total(_pages(c, 5, version=version))[3] != _total(_pages(a, 5, version=version))[3]
            assert _total(_pages(c, 4, version=version))[3] == _total(_pages(a, 4, version=version))[3]
        # the versions differ (never compared with each other: client/column_info.py)
        assert _total(_pages(a, 5, version=1))[3] != _total(_pages(a, 5, version=2))[3]
    finally:
        for x in (a, b, c):
            x.store.close()
            x.hints.close()


def test_column_info_bad_requests_are_typed(core: StorageRequests) -> None:
    for payload in (b"\x92\x09", p.encode(p.ColumnInfo(5))[:-1]):
        step = core.handle(payload, [])
        assert isinstance(step, Answer) and isinstance(step.reply, p.BadRequest)
    raw = bytearray(p.encode(p.ColumnInfo(5, limit=7)))
    raw[raw.rindex(7)] = 0  # limit 0
    step = core.handle(bytes(raw), [])
    assert isinstance(step, Answer) and isinstance(step.reply, p.BadRequest)
    assert "limit" in step.reply.message or ">= 1" in step.reply.message


def test_column_info_answers_a_newer_asker_in_the_newest_version_it_knows(core: StorageRequests) -> None:
    _apply(core, _rows(LAYOUT), 1)
    (page,) = _pages(core, 5, version=200)
    assert page.digest_version == p.ROW_DIGEST_VERSIONS[-1]
    assert (page.keys_digest, page.strength_digest) == _expected(core, 5, 2)[3:5]


class _View:
    """The slice of ClusterView that ``column_report`` reads: every owner live."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def is_live(self, name: str) -> bool:
        return True


@pytest.mark.asyncio
async def test_column_report_compares_replicas_in_one_digest_version(tmp_path: Path) -> None:
    """Owners are asked for the newest digest version; one from before versions answers 1, so
    every owner is asked again in 1 and the digests compared are of one version."""
    a, b = _open(tmp_path / "a"), _open(tmp_path / "b")
    try:
        rows = _rows(LAYOUT, seed=2)
        _apply(a, rows, 1)
        _apply(b, rows, 1)
        cores = {"a": a, "b": b}
        asked: list[tuple[str, int]] = []
        old = {"b"}

        async def call(node, msg, bulk, timeout_s):  # type: ignore[no-untyped-def]
            asked.append((node, msg.digest_version))
            if node in old:  # a node from before versions: version 1 whatever is asked
                msg = msgspec.structs.replace(msg, digest_version=1)
            step = cores[node].handle(p.encode(msg), [])
            assert isinstance(step, Answer)
            return step.reply, []

        view = _View(Placement((Member("a"), Member("b")), replicas=2))
        report = await column_report(view, call, 5)  # type: ignore[arg-type]
        assert [r.digest_version for r in report.replicas] == [1, 1]
        assert report.keys_agree and report.strength_agree
        assert ("a", 2) in asked and ("a", 1) in asked
        old.clear()  # both of this version: one round, in version 2
        asked.clear()
        report = await column_report(view, call, 5)  # type: ignore[arg-type]
        assert [r.digest_version for r in report.replicas] == [2, 2] and report.keys_agree
        assert {v for _, v in asked} == {2}
    finally:
        for x in (a, b):
            x.store.close()
            x.hints.close()
