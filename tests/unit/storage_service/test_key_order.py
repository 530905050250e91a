"""A storage node sorts its key order once after the start, in a worker thread (service.py
``sort_key_order``, sorted_keys.py ``sorted_rows``/``install``): the first listing after a start
no longer sorts every key on the event loop; an order sorted apart is refused when a drop came
meanwhile or a listing built one first; rows created while it was sorted are taken in by the next
refresh."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.sorted_keys import SortedKeys, sorted_rows
from giaannd.storage.replication import service as service_module
from tools.cluster_harness import Cluster, make_batch


def _reference(store: ColumnStore) -> list[tuple[int, int, int]]:
    n = store.engine.num_rows
    a, b = (k[:n] for k in store.engine.keys())
    order = np.lexsort((b, a))
    return list(zip(a[order].tolist(), b[order].tolist(), order.tolist()))


def _threads_calling(monkeypatch, name: str) -> list[threading.Thread]:  # type: ignore[no-untyped-def]
    """The threads that call the service's ``name`` (a sorted_keys function it runs apart), noted."""
    threads: list[threading.Thread] = []
    real = getattr(service_module, name)

    def noting(*args):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(service_module, name, noting)
    return threads


def test_an_order_sorted_apart_takes_in_the_rows_created_meanwhile_and_yields_to_drops():
    rng = np.random.default_rng(3)
    store = ColumnStore(1 << 30)
    store.apply(BatchId(1, 1), make_batch(rng, 400, 2, rng.integers(1, 90, 400).astype(np.uint64)))
    source = store.key_order_source()
    assert source is not None
    a, b, rows, drops = source
    main = sorted_rows(a, b, rows)  # (as a worker thread would, while rows are created)
    store.apply(BatchId(1, 2), make_batch(rng, 50, 2, rng.integers(60, 200, 50).astype(np.uint64)))
    assert store.install_key_order(main, rows, drops)
    got = store._sorted_keys()  # noqa: SLF001 (the index itself)
    assert list(zip(*(x.tolist() for x in got))) == _reference(store)
    assert store.key_order_source() is None  # current now: nothing to sort apart
    assert not store.install_key_order(main, rows, drops)  # (and a second order is refused)

    later = ColumnStore(1 << 30)
    later.apply(BatchId(1, 1), make_batch(rng, 300, 2, rng.integers(1, 90, 300).astype(np.uint64)))
    a, b, rows, drops = later.key_order_source()
    main = sorted_rows(a, b, rows)
    later.drop_columns(later.engine.keys()[0][:5])  # a drop while it was sorted: the rows renumbered
    assert not later.install_key_order(main, rows, drops)
    got = later._sorted_keys()  # noqa: SLF001
    assert list(zip(*(x.tolist() for x in got))) == _reference(later)

    keys = SortedKeys()  # built by a listing first: the order sorted apart is not taken
    keys.refresh(a, b, rows, 0)
    assert not keys.install(main, rows, 0)


@pytest.mark.asyncio
async def test_a_node_sorts_its_key_order_in_a_worker_thread_after_the_start(tmp_path, monkeypatch):
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        rng = np.random.default_rng(5)
        for _ in range(3):
            await cluster.client.write(make_batch(rng, 300, 4))
        threads = _threads_calling(monkeypatch, "sorted_rows")
        await cluster.kill("s0")
        svc = await cluster.restart_node("s0")
        for _ in range(500):  # the start's task
            if threads and svc.store.store.key_order_source() is None:
                break
            await asyncio.sleep(0.01)
        assert threads and all(t is not threading.main_thread() for t in threads)
        sorts: list[int] = []
        real_lexsort = np.lexsort
        monkeypatch.setattr(np, "lexsort",
                            lambda keys, *a, **k: sorts.append(len(keys[0])) or real_lexsort(keys, *a, **k))
        svc.store.store.held_columns()  # the first listing after the start: nothing to sort
        assert [n for n in sorts if n > 100] == []
        got = svc.store.store._sorted_keys()  # noqa: SLF001
        monkeypatch.setattr(np, "lexsort", real_lexsort)
        assert list(zip(*(x.tolist() for x in got))) == _reference(svc.store.store)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_a_large_merge_of_the_key_order_runs_in_a_worker_thread(tmp_path, monkeypatch):
    """Before Nov 30 the listing that found the tail over its share merged it into the main run
    itself, on the event loop (O(store)); past ``MERGE_APART_KEYS`` a storage node now merges in a
    worker thread and installs the result, the rows created meanwhile kept in the tail."""
    from giaannd.storage.engine import column_store as column_store_module
    from giaannd.storage.engine import sorted_keys as sorted_keys_module

    monkeypatch.setattr(column_store_module, "MERGE_APART_KEYS", 64)
    monkeypatch.setattr(sorted_keys_module, "MIN_TAIL", 16)
    threads = _threads_calling(monkeypatch, "merge_runs")
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        rng = np.random.default_rng(8)
        svc = cluster.services["s0"]
        await cluster.client.write(make_batch(rng, 600, 4))
        svc.store.store.held_columns()  # the main run
        for _ in range(6):  # rows created between listings: the tail outgrows its share of main
            await cluster.client.write(make_batch(rng, 200, 4))
            svc.store.store.held_columns()
            await asyncio.sleep(0)
        for _ in range(500):
            if threads and (svc._key_tasks.get("merge") is None or svc._key_tasks["merge"].done()):  # noqa: SLF001
                break
            await asyncio.sleep(0.01)
        assert threads and all(t is not threading.main_thread() for t in threads)
        got = svc.store.store._sorted_keys()  # noqa: SLF001
        assert list(zip(*(x.tolist() for x in got))) == _reference(svc.store.store)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_a_merge_found_due_by_a_listing_in_a_worker_thread_is_handed_to_the_loop(tmp_path, monkeypatch):
    """A drop's or a repair's listing runs in a worker thread behind the fold gate; when it finds
    a merge of the key order due, the merge task is started on the event loop (before, starting it
    from the thread raised "no running event loop", which failed the drop)."""
    from giaannd.storage.engine import column_store as column_store_module
    from giaannd.storage.engine import sorted_keys as sorted_keys_module

    monkeypatch.setattr(column_store_module, "MERGE_APART_KEYS", 64)
    monkeypatch.setattr(sorted_keys_module, "MIN_TAIL", 16)
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        rng = np.random.default_rng(9)
        svc = cluster.services["s0"]
        await cluster.client.write(make_batch(rng, 600, 4))
        for _ in range(50):  # the start's sort of the key order, then the main run
            if svc.store.store.key_order_source() is None:
                break
            await asyncio.sleep(0.01)
        svc.store.store.held_columns()
        for _ in range(3):  # rows created, not listed: the tail outgrows its share of main
            await cluster.client.write(make_batch(rng, 200, 4))
        held = await svc.folds.whole_store(svc.store.store.held_columns)  # the listing, in a thread
        for _ in range(500):
            if svc._key_tasks.get("merge") is not None and svc._key_tasks["merge"].done():  # noqa: SLF001
                break
            await asyncio.sleep(0.01)
        assert svc._key_tasks.get("merge") is not None and svc._key_tasks["merge"].result()  # noqa: SLF001
        assert held.tolist() == sorted({int(c) for c, _, _ in _reference(svc.store.store)})
        got = svc.store.store._sorted_keys()  # noqa: SLF001
        assert list(zip(*(x.tolist() for x in got))) == _reference(svc.store.store)
    finally:
        await cluster.close()


def _keys_of(store: ColumnStore) -> list[tuple[int, int, int]]:
    got = store._sorted_keys()  # noqa: SLF001 (the index itself)
    return list(zip(*(x.tolist() for x in got)))


def test_rows_sorted_in_apart_become_the_tail_unless_a_listing_or_a_drop_came_first(monkeypatch):
    """``take_keys_in_apart``: once enough rows wait, each commit says so; the rows sorted apart
    (``extended_tail``) are installed as the tail, refused when a listing took them in itself or a
    drop renumbered the rows meanwhile; rows created while they were sorted wait for the next
    refresh. After each step the keys equal a lexsort of every key."""
    from giaannd.storage.engine import column_store as column_store_module
    from giaannd.storage.engine.sorted_keys import extended_tail

    monkeypatch.setattr(column_store_module, "KEYS_BEHIND_APART_ROWS", 100)
    rng = np.random.default_rng(11)
    store = ColumnStore(1 << 30)
    calls: list[int] = []
    store.take_keys_in_apart(lambda: calls.append(store.engine.num_rows))
    store.apply(BatchId(1, 1), make_batch(rng, 300, 2))
    store.held_columns()  # the keys current: rows created from now on are "behind"
    assert calls == [] and store.key_tail_source() is None
    store.apply(BatchId(1, 2), make_batch(rng, 60, 2))
    assert calls == []  # 60 behind: under the bound
    store.apply(BatchId(1, 3), make_batch(rng, 60, 2))
    assert calls == [420]  # 120 behind: said after the commit

    a, b, source = store.key_tail_source()
    tail = extended_tail(a, b, *source[:3])  # (as a worker thread would, while rows are created)
    store.apply(BatchId(1, 4), make_batch(rng, 30, 2))
    assert store.install_key_tail(tail, source)
    assert store.key_tail_source()[2][1] == 420  # the rows created meanwhile still wait ...
    assert _keys_of(store) == _reference(store)  # ... and the next refresh takes them in
    assert store.key_tail_source() is None
    assert not store.install_key_tail(tail, source)  # (a second install is refused)

    store.apply(BatchId(1, 5), make_batch(rng, 150, 2))
    a, b, source = store.key_tail_source()
    tail = extended_tail(a, b, *source[:3])
    store.held_columns()  # a listing took them in first
    assert not store.install_key_tail(tail, source)
    assert _keys_of(store) == _reference(store)

    store.apply(BatchId(1, 6), make_batch(rng, 150, 2))
    a, b, source = store.key_tail_source()
    tail = extended_tail(a, b, *source[:3])
    store.drop_columns(store.engine.keys()[0][:7])  # a drop renumbered the rows meanwhile
    assert not store.install_key_tail(tail, source)
    assert _keys_of(store) == _reference(store)


@pytest.mark.asyncio
async def test_a_node_sorts_the_rows_created_since_its_last_listing_in_a_worker_thread(tmp_path, monkeypatch):
    """Before, the first listing after many writes sorted every row created since the last one
    on the event loop (~0.1 s per 10^6 rows: after hours of training, a stall of seconds). A node
    now sorts them in a worker thread once ``KEYS_BEHIND_APART_ROWS`` wait, and the listing sorts
    only the rows created since (none here)."""
    from giaannd.storage.engine import column_store as column_store_module
    from giaannd.storage.engine import sorted_keys as sorted_keys_module

    monkeypatch.setattr(column_store_module, "KEYS_BEHIND_APART_ROWS", 256)
    threads = _threads_calling(monkeypatch, "extended_tail")
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        rng = np.random.default_rng(12)
        svc = cluster.services["s0"]
        columns = svc.store.store
        for _ in range(500):  # the start's sort: the key order current
            if columns.key_order_source() is None:
                break
            await asyncio.sleep(0.01)
        for _ in range(4):  # 400 rows wait after the second and the fourth write: sorted apart
            await cluster.client.write(make_batch(rng, 200, 4))
            # each sort ends before the next write: rows created while one runs would wait, under
            # the bound, for the next listing (by design), and the listing below would sort them
            for _ in range(500):
                task = svc._key_tasks.get("tail")  # noqa: SLF001
                if task is None or task.done():
                    break
                await asyncio.sleep(0.01)
        assert columns.key_tail_source() is None and threads
        assert all(t is not threading.main_thread() for t in threads)
        sorts: list[int] = []
        real_sorted = sorted_keys_module._sorted  # noqa: SLF001

        def counting(c, f, ids):  # type: ignore[no-untyped-def]
            sorts.append(c.shape[0])
            return real_sorted(c, f, ids)

        monkeypatch.setattr(sorted_keys_module, "_sorted", counting)
        held = columns.held_columns()  # the first listing since the writes: nothing left to sort
        assert sorts == []
        assert _keys_of(columns) == _reference(columns)
        assert held.tolist() == sorted({c for c, _, _ in _reference(columns)})
    finally:
        await cluster.close()
