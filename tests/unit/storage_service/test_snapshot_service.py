"""The storage service's snapshots: writes go on while one is written (issue 14 item 3), the timer
is spread by a phase and jitter per node (snapshot_timer.py), and a failed one is counted and the
node keeps serving."""

from __future__ import annotations

import asyncio
import errno
import statistics
import sys
import threading

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import giaannd.storage.engine.snapshot as snapshot_module
from giaannd.storage.engine.snapshot import list_snapshots, list_temporaries, read_snapshot
from giaannd.storage.replication.snapshot_timer import snapshot_due, snapshot_waits
from tests.unit.storage._gen import cached_pages, direct_io_supported
from tools.cluster_harness import Cluster, make_batch

BIG = 1 << 40


def _snapshot_metrics(cluster: Cluster, name: str) -> tuple[float, float]:
    """(giaannd_storage_snapshot_running, giaannd_storage_snapshot_duration_seconds_count) of a node."""
    got = {s.name: s.value for fam in text_string_to_metric_families(cluster.nodes[name].metrics.render().decode())
           for s in fam.samples}
    return got["giaannd_storage_snapshot_running"], got["giaannd_storage_snapshot_duration_seconds_count"]


@pytest.mark.asyncio
async def test_storage_snapshot_writes_go_on_while_it_is_written(tmp_path, monkeypatch):
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    svc = cluster.services["s0"]
    release, writing = threading.Event(), threading.Event()
    write = snapshot_module._HashingWriter.write
    calls = 0

    def paused_write(self, buf):  # the snapshot thread stops part-way through its file
        nonlocal calls
        calls += 1
        if calls == 2:
            writing.set()
            release.wait(10)
        write(self, buf)

    try:
        rng = np.random.default_rng(1)
        before = make_batch(rng, 40)
        await cluster.client.write(before)
        monkeypatch.setattr(snapshot_module._HashingWriter, "write", paused_write)
        assert _snapshot_metrics(cluster, "s0") == (0.0, 0.0)
        task = asyncio.create_task(svc.snapshot())
        assert await asyncio.to_thread(writing.wait, 10)
        assert _snapshot_metrics(cluster, "s0") == (1.0, 0.0)  # running, not yet written
        # Before: the snapshot held the writes' lock while the file was written, so this waited for it.
        during = make_batch(rng, 40)
        await asyncio.wait_for(cluster.client.write(during), 5)
        release.set()
        path = await asyncio.wait_for(task, 10)
        assert _snapshot_metrics(cluster, "s0") == (0.0, 1.0)
        snap_seq = list_snapshots(path.parent)[-1][0]
        assert snap_seq < svc.store.log.last_seq  # the write during it is after its seq, in the log
        snap, _ = read_snapshot(path, BIG)
        assert snap.read_all().num_rows == before.num_rows
        assert svc.store.store.read_all().num_rows == before.num_rows + during.num_rows
    finally:
        release.set()
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_snapshot_cancelled_waits_for_its_thread(tmp_path, monkeypatch):
    """Cancelled (the service stopping) while its thread writes: the snapshot keeps its lock until
    the thread is done, so the final snapshot never runs beside it, and releases its view."""
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    svc = cluster.services["s0"]
    release, writing = threading.Event(), threading.Event()
    write = snapshot_module._HashingWriter.write

    def paused_write(self, buf):
        writing.set()
        release.wait(10)
        write(self, buf)

    try:
        await cluster.client.write(make_batch(np.random.default_rng(3), 10))
        monkeypatch.setattr(snapshot_module._HashingWriter, "write", paused_write)
        task = asyncio.create_task(svc.snapshot())
        assert await asyncio.to_thread(writing.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done() and svc._snapshot_running.locked()  # noqa: SLF001
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert not svc._snapshot_running.locked()
        monkeypatch.undo()
        await svc.snapshot()
    finally:
        release.set()
        await cluster.close()


async def _until(predicate, timeout_s=10.0):
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_storage_failed_snapshot_counted_retried_node_keeps_serving(tmp_path, monkeypatch):
    """The timer's snapshot fails (a write error; ENOSPC also makes the node refuse writes until
    space returns: test_disk_full.py): counted, its temporary gone, writes go on; retried later."""
    cluster = await Cluster(tmp_path, 1, replicas=1).start(snapshot_interval_s=0.05, retry_base_s=0.05,
                                                           retry_cap_s=0.1)
    svc = cluster.services["s0"]
    stopping = asyncio.Event()
    broken = True
    write = snapshot_module._HashingWriter.write

    def failing(self, buf):
        if broken:
            raise OSError(errno.EIO, "Input/output error")
        write(self, buf)

    monkeypatch.setattr(snapshot_module._HashingWriter, "write", failing)
    loop_task = asyncio.create_task(svc.run_snapshots(stopping))
    try:
        rng = np.random.default_rng(2)
        await cluster.client.write(make_batch(rng, 20))
        await _until(lambda: svc.disk.snapshot_failures >= 2)  # failed, and retried
        assert not list_temporaries(svc.store.directory) and not list_snapshots(svc.store.directory)
        await asyncio.wait_for(cluster.client.write(make_batch(rng, 20)), 5)  # still serving writes
        broken = False
        await _until(lambda: svc.disk.snapshot_failures == 0)  # the next retry worked
        assert list_snapshots(svc.store.directory)
    finally:
        stopping.set()
        await asyncio.wait_for(loop_task, 5)
        await cluster.close()


def test_snapshot_waits_phase_and_jitter_per_node():
    first = {name: next(snapshot_waits(name, 100.0, 0.2)) for name in (f"storage-{i}" for i in range(64))}
    assert all(50 <= w < 150 for w in first.values())
    assert statistics.pstdev(first.values()) > 20  # nodes started together are spread over the interval
    assert next(snapshot_waits("storage-1", 100.0, 0.2)) == first["storage-1"]  # the same at every start
    waits = snapshot_waits("storage-1", 100.0, 0.2)
    next(waits)
    later = [next(waits) for _ in range(2000)]
    assert all(80 <= w <= 120 for w in later) and abs(statistics.mean(later) - 100) < 2
    other = snapshot_waits("storage-2", 100.0, 0.2)
    next(other)
    assert later[:10] != [next(other) for _ in range(10)]  # close phases drift apart
    exact = snapshot_waits("storage-1", 100.0, 0.0)
    next(exact)
    assert [next(exact) for _ in range(3)] == [100.0] * 3
    for bad in ((0.0, 0.2), (100.0, 1.0), (100.0, -0.1)):
        with pytest.raises(ValueError):
            next(snapshot_waits("x", *bad))


@pytest.mark.asyncio
async def test_storage_restart_reports_its_recovery_by_phase(tmp_path):
    """giaannd_storage_recovery_{duration_seconds,cpu_seconds,bytes}{phase}: what a restart's recovery read and
    how long it took (the store's part of a restart, tools/bench/scale_cluster.py)."""
    cluster = await Cluster(tmp_path, 1, replicas=1).start()
    try:
        await cluster.client.write(make_batch(np.random.default_rng(3), 40))
        await cluster.kill("s0")  # no final snapshot: the restart replays the log
        await cluster.restart_node("s0")
        got = {(s.name, s.labels.get("phase")): s.value
               for fam in text_string_to_metric_families(cluster.nodes["s0"].metrics.render().decode())
               for s in fam.samples}
        store = cluster.services["s0"].store
        assert got[("giaannd_storage_recovery_bytes", "log_replay")] == store.recovery.log_bytes > 0
        assert got[("giaannd_storage_recovery_bytes", "snapshot_load")] == 0.0  # no snapshot was written
        assert got[("giaannd_storage_recovery_duration_seconds", "log_replay")] == store.recovery.replay_s > 0
        assert ("giaannd_storage_recovery_duration_seconds", "snapshot_load") in got
        assert got[("giaannd_storage_recovery_cpu_seconds", "log_replay")] == store.recovery.replay_cpu_s > 0
        assert ("giaannd_storage_recovery_cpu_seconds", "snapshot_load") in got
    finally:
        await cluster.close()


def _gauge(cluster: Cluster, name: str, metric: str) -> float:
    return next(s.value for fam in text_string_to_metric_families(cluster.nodes[name].metrics.render().decode())
                for s in fam.samples if s.name == metric)


@pytest.mark.asyncio
async def test_timer_snapshot_waits_until_the_log_is_a_share_of_the_store(tmp_path):
    """storage.snapshot-min-log-ratio: a timer snapshot is written only once the log since the last
    one is that share of the store's size, so a large store is not rewritten every interval for a
    little logged (before, any record logged made every interval's snapshot)."""
    cluster = await Cluster(tmp_path, 1, replicas=1).start(snapshot_interval_s=0.05, snapshot_min_log_ratio=0.25)
    svc = cluster.services["s0"]  # (its own timer loop runs: service.start spawns run_snapshots)
    try:
        rng = np.random.default_rng(5)
        await cluster.client.write(make_batch(rng, 400))  # the first write: the whole store is log
        await _until(lambda: _snapshot_metrics(cluster, "s0")[1] == 1.0)
        store = svc.store
        assert store.logged_since_snapshot < store.log.appended_bytes
        await cluster.client.write(make_batch(rng, 10))  # far below a quarter of the store
        small = store.logged_since_snapshot
        assert 0 < small < 0.25 * store.store.used_bytes
        assert _gauge(cluster, "s0", "giaannd_storage_log_since_snapshot_bytes") == small
        await asyncio.sleep(0.5)  # ten intervals: none due
        assert _snapshot_metrics(cluster, "s0")[1] == 1.0 and not svc.snapshot_due()
        while store.logged_since_snapshot < 0.25 * store.store.used_bytes:
            await cluster.client.write(make_batch(rng, 100))
        await _until(lambda: _snapshot_metrics(cluster, "s0")[1] == 2.0)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_timer_snapshot_every_interval_with_a_ratio_of_zero(tmp_path):
    cluster = await Cluster(tmp_path, 1, replicas=1).start(snapshot_interval_s=3600, snapshot_min_log_ratio=0.0)
    svc = cluster.services["s0"]
    try:
        rng = np.random.default_rng(6)
        await cluster.client.write(make_batch(rng, 400))
        assert svc.snapshot_due()
        await svc.snapshot()
        assert not svc.snapshot_due()  # nothing logged since
        await cluster.client.write(make_batch(rng, 1))
        assert svc.snapshot_due()
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_snapshot_syncs_the_log_before_it_holds_writes_off(tmp_path, monkeypatch):
    """The service makes the log durable before it takes the writes' lock, so the rotation under the
    lock (an fsync) finds little to sync: that rotation was most of what a snapshot's writes wait for
    once the freeze stopped copying (docs/storage.md "Copies made after the freeze")."""
    cluster = await Cluster(tmp_path, 1, replicas=1).start(snapshot_interval_s=3600, snapshot_min_log_ratio=0.0)
    svc = cluster.services["s0"]
    try:
        await cluster.client.write(make_batch(np.random.default_rng(7), 200))
        store = svc.store
        events: list[tuple[str, bool]] = []
        real_sync, real_begin = store.sync, store.begin_snapshot

        def sync():
            events.append(("sync", svc._snapshot_lock.locked()))  # noqa: SLF001 - the property under test
            return real_sync()

        def begin(*args, **kwargs):
            events.append(("begin", svc._snapshot_lock.locked()))  # noqa: SLF001
            return real_begin(*args, **kwargs)

        monkeypatch.setattr(store, "sync", sync)
        monkeypatch.setattr(store, "begin_snapshot", begin)
        await svc.snapshot()
        begun = events.index(("begin", True))
        assert ("sync", False) in events[:begun]  # a sync with writes going on, before the freeze
    finally:
        await cluster.close()


def test_snapshot_due_needs_a_log_that_is_a_share_of_the_store():
    assert not snapshot_due(False, 0, 1000, 0.0)  # nothing logged: never
    assert snapshot_due(True, 1, 1000, 0.0)  # ratio 0: anything logged
    assert not snapshot_due(True, 99, 1000, 0.1) and snapshot_due(True, 100, 1000, 0.1)
    assert snapshot_due(True, 10, 0, 0.1)  # an empty store with a log


@pytest.mark.asyncio
@pytest.mark.skipif(sys.platform != "linux", reason="Linux page cache")
@pytest.mark.parametrize("settings", [{"snapshot_direct_io": True}, {"snapshot_drop_cache": True}])
async def test_a_timers_snapshot_leaves_the_page_cache_the_final_one_stays(tmp_path, settings):
    """With ``storage.snapshot-direct-io`` or ``storage.snapshot-drop-cache`` on, the
    timer's snapshot leaves no page in the page cache (read only after a crash); the stop's final
    snapshot stays cached, since the next start maps it. (Before: both stayed, each snapshot
    growing the cache by its size.)"""
    if "snapshot_direct_io" in settings and not direct_io_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    cluster = await Cluster(tmp_path, 1, replicas=1).start(snapshot_interval_s=3600, **settings)
    svc = cluster.services["s0"]
    directory = svc.store.directory
    try:
        await cluster.client.write(make_batch(np.random.default_rng(8), 3000))
        timer = await svc.snapshot()
        cached, pages = cached_pages(timer)
        await cluster.client.write(make_batch(np.random.default_rng(9), 3000))
        await cluster.stop_node("s0")
        (_, final), = list_snapshots(directory)
        kept, final_pages = cached_pages(final)
    finally:
        await cluster.close()
    if kept < final_pages // 2:
        pytest.skip("this filesystem does not keep written pages cached")
    assert pages > 4 and cached == 0
