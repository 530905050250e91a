"""A snapshot's row checks in several threads (snapshot.py ``_any_fault``, ``first_bad_row``'s
``threads``): shares of whole rows find a fault exactly where one pass does, wherever it lies
(first or last entry of a share, a share's last row), and never one across two rows."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.model.rows import NUM_SEGMENTS, Row
from giaannd.rowengine.canon import entries_fault
from giaannd.storage.engine import snapshot as snapshot_module
from giaannd.storage.engine.snapshot import first_bad_row


def _rows(rng: np.random.Generator, num_rows: int) -> tuple[Row, np.ndarray]:
    """Canonical rows of 1-40 entries (each row's keys ascending; row i+1 starts below row i's end,
    so pairs across rows are out of order, which is allowed)."""
    lengths = rng.integers(1, 41, num_rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    seg = np.empty(n, np.uint8)
    tc = np.empty(n, np.uint64)
    tf = np.empty(n, np.uint64)
    for i in range(num_rows):  # (a test's setup: a few thousand rows)
        a, z = offsets[i], offsets[i + 1]
        keys = np.unique(rng.integers(0, 9 * 50 * 50, 3 * (z - a)))[: z - a]
        while keys.shape[0] < z - a:
            keys = np.unique(np.concatenate([keys, rng.integers(0, 9 * 50 * 50, z - a)]))[: z - a]
        seg[a:z], rest = np.divmod(keys, 2500)
        tc[a:z], tf[a:z] = np.divmod(rest, 50)
    return Row(target_column=tc, target_feature=tf, strength=rng.random(n, dtype=np.float32), segment=seg), offsets


def _faults(rows: Row, offsets: np.ndarray, threads: int) -> bool:
    return snapshot_module._any_fault(rows, offsets, threads)


def _one_pass(rows: Row, offsets: np.ndarray) -> bool:
    return bool(entries_fault(offsets, rows.segment, rows.target_column, rows.target_feature, rows.strength,
                              NUM_SEGMENTS))


@pytest.fixture
def small_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_module, "CHECK_SHARE_MIN_ENTRIES", 64)


@pytest.mark.usefixtures("small_shares")
@pytest.mark.parametrize("seed", range(6))
def test_shares_find_a_fault_where_one_pass_does(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, offsets = _rows(rng, 400)
    n = int(offsets[-1])
    for threads in (1, 2, 3, 7):
        assert not _faults(rows, offsets, threads)
        assert first_bad_row(rows, offsets, threads) is None
    # share bounds for 7 threads lie at row starts; faults at their edges and anywhere else
    cuts = np.searchsorted(offsets, np.arange(1, 7) * (n // 7), "left")
    starts = offsets[cuts]
    places = sorted({0, n - 1, *starts.tolist(), *(starts - 1).tolist(), *rng.integers(0, n, 6).tolist()})
    for at in places:
        for kind in ("segment", "strength", "order"):
            bad = Row(target_column=rows.target_column.copy(), target_feature=rows.target_feature.copy(),
                      strength=rows.strength.copy(), segment=rows.segment.copy())
            if kind == "segment":
                bad.segment[at] = NUM_SEGMENTS
            elif kind == "strength":
                bad.strength[at] = np.nan
            else:  # the entry equal to the one before it, inside its row (skipped at a row's first entry)
                row = int(np.searchsorted(offsets, at, "right")) - 1
                if at == offsets[row]:
                    continue
                bad.segment[at] = bad.segment[at - 1]
                bad.target_column[at] = bad.target_column[at - 1]
                bad.target_feature[at] = bad.target_feature[at - 1]
            assert _one_pass(bad, offsets)
            expected = first_bad_row(bad, offsets, 1)
            assert expected is not None
            for threads in (2, 3, 7):
                assert _faults(bad, offsets, threads), (at, kind, threads)
                assert first_bad_row(bad, offsets, threads) == expected


@pytest.mark.usefixtures("small_shares")
def test_rows_out_of_order_with_each_other_are_no_fault() -> None:
    rows, offsets = _rows(np.random.default_rng(9), 300)
    # every row's first entry below the last entry of the row before it (allowed: rows are apart)
    n = int(offsets[-1])
    rows.segment[offsets[1:-1]] = 0
    rows.target_column[offsets[1:-1]] = 0
    rows.target_feature[offsets[1:-1]] = 0
    assert n > 8 * 64
    assert not _one_pass(rows, offsets)
    for threads in (1, 2, 5, 8):
        assert not _faults(rows, offsets, threads)


def test_one_thread_below_the_share_size() -> None:
    rows, offsets = _rows(np.random.default_rng(3), 50)
    assert int(offsets[-1]) < snapshot_module.CHECK_SHARE_MIN_ENTRIES
    assert not _faults(rows, offsets, 8)


def test_a_load_in_threads_is_the_load_in_one(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapped load copies its sections out, and checks its rows, in several threads: the same
    store as one thread's, mapped or read."""
    from giaannd.protocol import BatchId
    from giaannd.storage import DurableStore
    from giaannd.storage.engine.snapshot import read_snapshot
    from giaannd.storage.engine.snapshot_map import SnapshotMapping

    from ._gen import random_batch, same_state

    rng = np.random.default_rng(5)
    ds = DurableStore.open(tmp_path, 1 << 40)
    for i in range(30):
        ds.apply(BatchId(1, i + 1), random_batch(rng, entries=2000, columns=40, features=8))
    snap = ds.snapshot()
    ds.close()
    copies: list[int] = []
    real = snapshot_module._copy_out

    def counted(out: np.ndarray, src: np.ndarray, threads: int) -> None:
        copies.append(threads)
        real(out, src, threads)

    monkeypatch.setattr(snapshot_module, "COPY_SHARE_MIN_BYTES", 4096)
    monkeypatch.setattr(snapshot_module, "CHECK_SHARE_MIN_ENTRIES", 1000)
    monkeypatch.setattr(snapshot_module, "_copy_out", counted)
    one, _ = read_snapshot(snap, 1 << 40, threads=1)
    for threads in (2, 3, 8):
        mapped, _ = read_snapshot(snap, 1 << 40, mapping=SnapshotMapping.open(snap), threads=threads)
        read, _ = read_snapshot(snap, 1 << 40, threads=threads)
        assert same_state(mapped, one) and same_state(read, one)
    assert copies and set(copies) == {2, 3, 8}
