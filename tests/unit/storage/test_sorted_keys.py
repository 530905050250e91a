"""The store's keys in (column, feature) order (storage/engine/sorted_keys.py): equal to a sort of
every key after any mix of appends and drops, windows and column listings equal to slices of it,
and a scan page of a store that gains rows costs no sort of the store."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage.engine import sorted_keys
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.sorted_keys import SortedKeys
from tools.cluster_harness import make_batch


def _count_sorts(monkeypatch):
    """The lengths of the key lists every ``np.lexsort`` from now on sorts."""
    sorts = []
    real = np.lexsort

    def counted(keys, *args, **kw):
        sorts.append(len(keys[0]))
        return real(keys, *args, **kw)

    monkeypatch.setattr(np, "lexsort", counted)
    return sorts


def _reference(a, b):
    order = np.lexsort((b, a))
    return a[order], b[order], order


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_sorted_keys_equal_a_sort_after_appends_and_drops(seed, apart, monkeypatch):
    monkeypatch.setattr(sorted_keys, "MIN_TAIL", 8)  # (merges into main happen at this size)
    rng = np.random.default_rng(seed)
    a = np.zeros(0, np.uint64)
    b = np.zeros(0, np.uint64)
    keys, drops = SortedKeys(), 0
    pending = None  # a merge "in another thread": its source, installed some steps later
    if apart:
        keys.merge_apart = 16
    for _ in range(40):
        if apart and pending is None and (source := keys.merge_source()) is not None:
            pending = source
        elif pending is not None and rng.random() < 0.5:
            keys.install_merge(sorted_keys.merge_runs(pending[0], pending[1]), pending[0], pending[2], pending[3])
            pending = None
        step = rng.integers(0, 4)
        if step == 0 and a.size > 10:  # a drop: rows renumbered (followed, or left to a rebuild)
            keep = rng.random(a.size) < 0.7
            if rng.random() < 0.6:
                keys.refresh(a, b, a.size, drops)
                keys.drop(keep, drops + 1)
            a, b, drops = a[keep], b[keep], drops + 1
        else:  # new rows (columns shared with old ones, both extremes of uint64 included)
            k = int(rng.integers(1, 60))
            na = rng.choice(np.array([0, 1, 5, 2**63, 2**64 - 1], np.uint64), k)
            nb = rng.integers(0, 2**64 - 1, k, dtype=np.uint64, endpoint=True)
            seen = set(zip(a.tolist(), b.tolist()))
            fresh = [i for i, key in enumerate(zip(na.tolist(), nb.tolist())) if key not in seen]
            na, nb = na[fresh], nb[fresh]
            _, first = np.unique(np.stack([na, nb]), axis=1, return_index=True)
            a, b = np.append(a, na[np.sort(first)]), np.append(b, nb[np.sort(first)])
        keys.refresh(a, b, a.size, drops)
        if rng.random() < 0.5:  # a window from a cursor (present, absent or none)
            full = _reference(a, b)
            at = int(rng.integers(0, a.size + 1))
            after = None if rng.random() < 0.2 or at == a.size else (int(full[0][at]), int(full[1][at]) + int(
                rng.integers(0, 2)) if int(full[1][at]) < 2**64 - 1 else int(full[1][at]))
            count = int(rng.integers(1, 30))
            (wc, wf, wi), more = keys.window(after, count)
            start = 0 if after is None else next(
                (i for i in range(a.size) if (int(full[0][i]), int(full[1][i])) >= after), a.size)
            assert wc.tolist() == full[0][start:start + count].tolist()
            assert wf.tolist() == full[1][start:start + count].tolist()
            assert wi.tolist() == full[2][start:start + count].tolist()
            assert more == (start + count < a.size)
        elif rng.random() < 0.5:  # the rows of some columns (held or not)
            wanted = np.unique(rng.choice(np.array([0, 1, 2, 5, 2**63, 2**64 - 1], np.uint64), 3))
            full = _reference(a, b)
            hit = np.isin(full[0], wanted)
            got = keys.of_columns(wanted)
            assert all(x.tolist() == y[hit].tolist() for x, y in zip(got, full))
        elif rng.random() < 0.5:
            got = keys.full()
            want = _reference(a, b)
            assert all(x.tolist() == y.tolist() for x, y in zip(got, want))
        else:  # the distinct columns (main's kept between calls)
            assert keys.columns().tolist() == np.unique(a).tolist()


def test_a_scan_of_a_store_that_gains_rows_sorts_no_more(monkeypatch):
    """Before, every scan page after a row was created sorted every key of the store again."""
    store = ColumnStore(1 << 30)
    rng = np.random.default_rng(3)
    store.apply(BatchId(1, 1), make_batch(rng, 5_000, 2, rng.integers(1, 400, 5_000).astype(np.uint64)))
    sorts = _count_sorts(monkeypatch)
    page = store.scan(None, 100, 1 << 20, 1_000)
    for seq in range(2, 12):  # training creates rows between pages
        store.apply(BatchId(1, seq), make_batch(rng, 10, 2, rng.integers(1, 400, 10).astype(np.uint64)))
        page = store.scan(page.next_key, 100, 1 << 20, 1_000)
        assert not page.done
    big = [n for n in sorts if n >= 1_000]
    assert len(big) == 1  # the first listing only
    # the scan still sees every row in key order
    cols, feats = store.key_arrays()
    rows, after = [], None
    while True:
        res = store.scan(after, 700, 1 << 20, 900)
        rows += list(zip(res.batch.row_column.tolist(), res.batch.row_feature.tolist()))
        if res.done:
            break
        after = res.next_key
    assert rows == list(zip(cols.tolist(), feats.tolist()))


def test_a_drop_of_columns_sorts_no_key_again(monkeypatch):
    """Before, a drop left the sorted keys to be rebuilt: the next listing (a scan page, the next
    release's ``held_columns``) sorted every key of the store again, on the event loop."""
    store = ColumnStore(1 << 30)
    rng = np.random.default_rng(5)
    store.apply(BatchId(1, 1), make_batch(rng, 5_000, 2, rng.integers(1, 400, 5_000).astype(np.uint64)))
    held = store.held_columns()
    store.apply(BatchId(1, 2), make_batch(rng, 50, 2, rng.integers(1, 400, 50).astype(np.uint64)))  # rows since
    real = np.lexsort
    sorts = _count_sorts(monkeypatch)
    result = store.drop_columns(held[::3])
    assert result.rows > 0
    after = store.held_columns()
    assert [n for n in sorts if n >= 1_000] == []
    n = store.engine.num_rows
    a, b = (k[:n] for k in store.engine.keys())
    order = real((b, a))
    listed = store._sorted_keys()  # noqa: SLF001 (the index itself: keys and the renumbered ids)
    assert listed[0].tolist() == a[order].tolist() and listed[1].tolist() == b[order].tolist()
    assert listed[2].tolist() == order.tolist()
    assert not np.isin(after, held[::3]).any() and np.isin(held[::3], after).sum() == 0
    assert after.tolist() == np.unique(a).tolist()


def test_held_columns_cost_the_columns_not_the_rows(monkeypatch):
    """Before, listing the held columns merged the tail into main and walked every key (a
    topology operation's ``ListColumns`` and each ``SourceStart``, on the event loop); now main's
    distinct columns are kept, and a listing after new rows walks the tail only."""
    monkeypatch.setattr(sorted_keys, "MIN_TAIL", 1 << 30)  # (the tail is never merged into main here)
    store = ColumnStore(1 << 30)
    rng = np.random.default_rng(7)
    store.apply(BatchId(1, 1), make_batch(rng, 5_000, 2, rng.integers(1, 400, 5_000).astype(np.uint64)))
    store.held_columns()
    walked = []
    real = getattr(sorted_keys, "_distinct", None)

    def counted(cols):
        walked.append(cols.shape[0])
        return real(cols)

    monkeypatch.setattr(sorted_keys, "_distinct", counted, raising=False)
    merges = []
    real_merge = sorted_keys.SortedKeys._fold
    monkeypatch.setattr(sorted_keys.SortedKeys, "_fold", lambda self: merges.append(1) or real_merge(self))
    for seq in range(2, 6):
        store.apply(BatchId(1, seq), make_batch(rng, 20, 2, rng.integers(1, 600, 20).astype(np.uint64)))
        got = store.held_columns()
        a = store.engine.keys()[0][: store.engine.num_rows]
        assert got.tolist() == np.unique(a).tolist()
    assert merges == [] and walked and max(walked) < 200  # the tail's keys, never main's 5,000
