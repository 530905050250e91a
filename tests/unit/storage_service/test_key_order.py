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
        threads: list[threading.Thread] = []
        real = sorted_rows

        def noting(*args):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread())
            return real(*args)

        monkeypatch.setattr(service_module, "sorted_rows", noting, raising=False)
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
    threads: list[threading.Thread] = []
    real = sorted_keys_module.merge_runs

    def noting(*args):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(service_module, "merge_runs", noting, raising=False)
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
            if threads and (svc._key_merge is None or svc._key_merge.done()):  # noqa: SLF001
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
            if svc._key_merge is not None and svc._key_merge.done():  # noqa: SLF001
                break
            await asyncio.sleep(0.01)
        assert svc._key_merge is not None and svc._key_merge.result()  # noqa: SLF001
        assert held.tolist() == sorted({int(c) for c, _, _ in _reference(svc.store.store)})
        got = svc.store.store._sorted_keys()  # noqa: SLF001
        assert list(zip(*(x.tolist() for x in got))) == _reference(svc.store.store)
    finally:
        await cluster.close()
