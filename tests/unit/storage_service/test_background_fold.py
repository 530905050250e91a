"""A storage node folds its delta runs into the base in a worker thread (background_fold.py): the
event loop is served meanwhile; reads, applies and a snapshot's freeze that arrive during the fold
wait for it and then see the rows the plain path (folds inside the commit) gives; a node stopped
during a fold waits for it and loses nothing."""

from __future__ import annotations

import asyncio
import itertools
import threading

import numpy as np
import pytest

import giaannd.rowengine.engine as engine_module
from giaannd.client.errors import RemoteUnavailable
from giaannd.model.ids import feature_id
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.deferred_applies import DeferredApplies
from giaannd.storage.replication import background_fold
from giaannd.storage.replication.background_fold import fold_scales
from tools.cluster_harness import Cluster, make_batch

CAPACITY = 1 << 30


class PausedFold:
    """``run.fold_into_base`` as the engine calls it; once ``armed``, each fold is held mid-move (its
    base an empty run: a read that did not wait would miss rows) until ``release`` (10 s at most);
    ``held`` records whether each was released in time, ``threads`` where each ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.inside = threading.Event()
        self.release = threading.Event()
        self.held: list[bool] = []
        self.threads: list[threading.Thread] = []
        real = engine_module.fold_into_base

        def fold(base, delta, grow=False):  # type: ignore[no-untyped-def]
            if self.armed:
                self.threads.append(threading.current_thread())
                self.inside.set()
                self.held.append(self.release.wait(10))
            return real(base, delta, grow)

        monkeypatch.setattr(engine_module, "fold_into_base", fold)

    async def entered(self) -> None:
        await self._until(self.inside.is_set)

    async def left(self) -> None:
        """Every held fold was let go (or timed out)."""
        await self._until(lambda: len(self.held) == len(self.threads))

    @staticmethod
    async def _until(cond) -> None:  # type: ignore[no-untyped-def]
        for _ in range(1500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")


def _rows(batch: RowBatch) -> dict:
    """Every row, as bytes (strengths bit for bit)."""
    out = {}
    for i in range(batch.num_rows):
        lo, hi = int(batch.offsets[i]), int(batch.offsets[i + 1])
        out[(int(batch.row_column[i]), int(batch.row_feature[i]))] = (
            batch.segment[lo:hi].tobytes(), batch.target_column[lo:hi].tobytes(),
            batch.target_feature[lo:hi].tobytes(), batch.strength[lo:hi].tobytes())
    return out


class Plain:
    """The reference: a column store whose commits fold inline, fed the same batches."""

    def __init__(self) -> None:
        self.store = ColumnStore(CAPACITY)
        self.seq = 0

    def apply(self, batch: RowBatch) -> None:
        self.seq += 1
        self.store.apply(BatchId(7, self.seq), batch)

    def rows(self) -> dict:
        return _rows(self.store.read_all())


async def _node_with_a_fold_due(tmp_path, monkeypatch, seed: int) -> tuple[Cluster, PausedFold, Plain, list]:
    """A one-node cluster whose last write made a fold due, held mid-fold; the plain reference."""
    paused = PausedFold(monkeypatch)
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=0.0)
    rng = np.random.default_rng(seed)
    plain = Plain()
    batches = [make_batch(rng, 400, 8)]  # the base (the first fold: into an empty base)
    await cluster.client.write(batches[0])
    plain.apply(batches[0])
    trigger = make_batch(rng, 200, 8)  # its new keys hold more than 1/4 of the base: a fold is due
    plain.apply(trigger)
    paused.armed = True
    written = asyncio.get_running_loop().create_task(cluster.client.write(trigger))
    await paused.entered()
    paused.armed = False  # (that fold is held; the reference's folds, on this thread, are not)
    return cluster, paused, plain, [*batches, trigger, written]


@pytest.mark.asyncio
async def test_a_due_fold_runs_off_the_event_loop(tmp_path, monkeypatch):
    # Before: the commit folded on the event loop, which stayed blocked until the fold was done (the
    # loop could not release it: 10 s, then False).
    cluster, paused, _, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, 0)
    try:
        paused.release.set()  # from the event loop: it runs while the fold is held
        await batches[-1]
        await paused.left()
        assert paused.held == [True]
        assert paused.threads[0] is not threading.main_thread()
    finally:
        paused.release.set()
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_reads_and_applies_during_a_fold_see_the_plain_rows(tmp_path, monkeypatch, seed):
    cluster, paused, plain, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, seed)
    try:
        await batches[-1]  # acknowledged: the commit is done; the fold is under way
        known = plain.rows()
        keys = np.array(list(known), np.uint64).reshape(-1, 2)
        rng = np.random.default_rng(seed + 100)
        pick = rng.choice(keys.shape[0], 50, replace=False)
        reads = [asyncio.create_task(cluster.client.read_rows(keys[pick[i:i + 10], 0], keys[pick[i:i + 10], 1]))
                 for i in range(0, 50, 10)]
        more = [make_batch(rng, 30, 4) for _ in range(3)]  # new rows: the reads above do not see them
        others = np.setdiff1d(np.arange(keys.shape[0]), pick)[:20]  # held rows the reads do not ask for
        more.append(RowBatch.from_entries(*_same_keys(make_batch(rng, 20, 4), keys[others])))
        more.append(RowBatch.from_entries(*_same_keys(make_batch(rng, 20, 4), keys[pick[:20]])))  # held rows
        # writes are logged and acknowledged during the fold, and applied when it ends
        # (deferred_applies.py; before, they waited for it too)
        await asyncio.wait_for(asyncio.gather(*(cluster.client.write(b) for b in more[:4])), 5.0)
        svc = cluster.services["s0"]
        assert svc.store is not None and len(svc.store.deferred) == 4 and paused.held == []
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in reads)  # reads wait for the fold (R = 1: no other replica)
        paused.release.set()
        got = await asyncio.gather(*reads)
        for i, batch in enumerate(got):
            want = {k: known[k] for k in map(tuple, keys[pick[i * 10:(i + 1) * 10]].tolist())}
            assert _rows(batch) == want
        await cluster.client.write(more[4])  # adds to held rows, after the fold
        for b in more:
            plain.apply(b)
        assert len(svc.store.deferred) == 0 and svc.store.deferred.applied == 4
        assert svc.folds is not None and svc.folds.folds >= 1
        assert _rows(svc.store.store.read_all()) == plain.rows()
    finally:
        paused.release.set()
        await cluster.close()


def _same_keys(batch: RowBatch, keys: np.ndarray) -> tuple:
    """``batch``'s entries moved onto the rows ``keys`` (one row each, in order), as from_entries'
    arguments: increments to rows the store holds."""
    lengths = np.diff(batch.offsets)
    return (np.repeat(keys[:, 0], lengths), np.repeat(keys[:, 1], lengths), batch.segment, batch.target_column,
            batch.target_feature, batch.strength)


@pytest.mark.asyncio
async def test_a_snapshot_during_a_fold_waits_and_holds_the_plain_rows(tmp_path, monkeypatch):
    cluster, paused, plain, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, 4)
    try:
        await batches[-1]
        svc = cluster.services["s0"]
        snap = asyncio.create_task(svc.snapshot())
        await asyncio.sleep(0.3)
        assert not snap.done() and svc.store.snapshot_seq < svc.store.log.last_seq  # no freeze mid-fold
        paused.release.set()
        await snap
        assert svc.store.snapshot_seq == svc.store.log.last_seq
        await cluster.kill("s0")  # restarts from that snapshot alone (nothing logged after it)
        svc = await cluster.restart_node("s0")
        assert svc is not None and svc.store.recovery.records_replayed == 0
        assert _rows(svc.store.store.read_all()) == plain.rows()
    finally:
        paused.release.set()
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("graceful", [True, False])
async def test_a_node_stopped_during_a_fold_waits_for_it_and_loses_nothing(tmp_path, monkeypatch, graceful):
    cluster, paused, plain, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, 5)
    try:
        await batches[-1]
        stopping = asyncio.create_task(cluster.stop_node("s0", graceful=graceful))
        await asyncio.sleep(0.3)
        assert not stopping.done()  # the fold's thread is still moving the runs: the stop waits
        paused.release.set()
        await stopping
        svc = await cluster.restart_node("s0")
        assert svc is not None and _rows(svc.store.store.read_all()) == plain.rows()
    finally:
        paused.release.set()
        await cluster.close()


async def _two_replicas_one_folding(tmp_path, monkeypatch) -> tuple[Cluster, PausedFold, Plain, asyncio.Task]:
    """Two nodes, R = 2: both hold every row; s0 is held mid-fold (an explicit fold of a delta run
    too small to be due anywhere), s1 folds nothing."""
    paused = PausedFold(monkeypatch)
    cluster = await Cluster(tmp_path, 2, replicas=2).start(heap_trim_interval_s=0.0)
    rng = np.random.default_rng(11)
    plain = Plain()
    for batch in (make_batch(rng, 600, 8), make_batch(rng, 40, 4)):  # a base, then new keys under 1/4 of it
        await cluster.client.write(batch)
        plain.apply(batch)
    for name in ("s0", "s1"):  # the first write's folds (into empty bases) are over
        await PausedFold._until(lambda n=name: not cluster.services[n].folds.running)  # type: ignore[union-attr]
    paused.armed = True
    folds = cluster.services["s0"].folds
    assert folds is not None
    fold = asyncio.get_running_loop().create_task(folds.fold())
    await paused.entered()
    paused.armed = False
    return cluster, paused, plain, fold


@pytest.mark.asyncio
async def test_reads_go_around_a_folding_replica(tmp_path, monkeypatch):
    # Before: every read of a row whose first replica was folding waited for the fold (here held:
    # the read would still be waiting when the 5 s below run out).
    cluster, paused, plain, fold = await _two_replicas_one_folding(tmp_path, monkeypatch)
    try:
        known = plain.rows()
        keys = np.array(list(known), np.uint64).reshape(-1, 2)
        got = await asyncio.wait_for(cluster.client.read_rows(keys[:, 0], keys[:, 1]), 5.0)
        assert not fold.done() and paused.held == []  # the fold is still held
        assert _rows(got) == known
        s0 = cluster.services["s0"]
        assert s0.core is not None and s0.core.counters.reads_redirected >= 1
        assert cluster.services["s1"].core.counters.reads_redirected == 0  # type: ignore[union-attr]
        # asked directly: refused at once with busy_ok, held without it
        with pytest.raises(RemoteUnavailable, match="folding"):
            await asyncio.wait_for(cluster.client.read_from("s0", keys[:5, 0], keys[:5, 1], busy_ok=True), 5.0)
        waiting = asyncio.create_task(cluster.client.read_from("s0", keys[:5, 0], keys[:5, 1]))
        cluster.client.read_around_folds = False  # every read waits for the node it asks
        plain_read = asyncio.create_task(cluster.client.read_rows(keys[:, 0], keys[:, 1]))
        await asyncio.sleep(0.3)
        assert not waiting.done() and not plain_read.done()
        paused.release.set()
        assert _rows(await plain_read) == known
        assert _rows(await waiting) == {k: known[k] for k in map(tuple, keys[:5].tolist())}
        await fold
    finally:
        paused.release.set()
        await cluster.close()


def test_fold_scales_spread_each_node_around_the_same_mean_point():
    a = list(itertools.islice(fold_scales("s0", 0.2), 2000))
    b = list(itertools.islice(fold_scales("s1", 0.2), 2000))
    assert a == list(itertools.islice(fold_scales("s0", 0.2), 2000))  # stable across restarts
    assert a[:5] != b[:5]  # each node its own
    for scales in (a, b):
        assert all(0.8 <= x < 1.2 for x in scales)
        assert abs(sum(scales) / len(scales) - 1) < 0.01  # the mean fold point is unchanged
    assert set(itertools.islice(fold_scales("s0", 0.0), 10)) == {1.0}
    with pytest.raises(ValueError):
        next(fold_scales("s0", 1.0))


def test_a_store_folds_at_its_scaled_point():
    """The delta runs are folded once they hold 1/4 of the base times the store's ``fold_scale``
    (before: at 1/4 whatever the scale)."""
    rng = np.random.default_rng(3)
    for scale, due_at in ((0.8, 0.2), (1.2, 0.3)):
        store = ColumnStore(CAPACITY)
        store.apply(BatchId(1, 1), make_batch(rng, 1000, 10))
        store.fold_deltas()
        due: list[int] = []
        store.on_fold_due = lambda: due.append(store.engine.delta_entries)  # noqa: B023
        store.fold_scale = scale
        base = store.engine.num_entries
        seq = 1
        while not due:
            seq += 1
            store.apply(BatchId(1, seq), make_batch(rng, 10, 10))  # 100 new keys each
        assert due_at * base <= due[0] < due_at * base + 100, (scale, due[0], base)


@pytest.mark.asyncio
async def test_a_node_draws_a_new_fold_point_after_each_fold(tmp_path):
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=0.0, fold_jitter=0.2)
    try:
        svc = cluster.services["s0"]
        assert svc.store is not None and svc.folds is not None
        want = fold_scales("s0", 0.2)
        assert svc.store.store.fold_scale == next(want)
        rng = np.random.default_rng(5)
        await cluster.client.write(make_batch(rng, 100, 4))  # new keys into an empty base: a fold
        await PausedFold._until(lambda: svc.folds.folds == 1 and not svc.folds.running)  # type: ignore[union-attr]
        assert svc.store.store.fold_scale == next(want)
    finally:
        await cluster.close()


async def _written_during_the_fold(cluster: Cluster, plain: Plain, seed: int, count: int) -> None:
    """``count`` batches of new rows written while the fold is held: all acknowledged within 5 s
    (logged and held, deferred_applies.py), and applied to the reference."""
    rng = np.random.default_rng(seed)
    more = [make_batch(rng, 30, 4) for _ in range(count)]
    await asyncio.wait_for(asyncio.gather(*(cluster.client.write(b) for b in more)), 5.0)
    for b in more:
        plain.apply(b)


@pytest.mark.asyncio
async def test_writes_acknowledged_during_a_fold_survive_a_crash(tmp_path, monkeypatch):
    """Batches logged and acknowledged during a fold (applied when it ends: deferred_applies.py) are
    in the log: a node killed before the fold ends restarts with them."""
    cluster, paused, plain, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, 6)
    try:
        await batches[-1]
        await _written_during_the_fold(cluster, plain, 60, 3)
        svc = cluster.services["s0"]
        assert svc.store is not None and len(svc.store.deferred) == 3
        stopping = asyncio.create_task(cluster.kill("s0"))  # no final snapshot: the restart replays the log
        await asyncio.sleep(0.2)
        paused.release.set()  # (an in-process node's stop waits for the fold's thread)
        await stopping
        svc = await cluster.restart_node("s0")
        assert svc is not None and svc.store is not None and svc.store.recovery.records_replayed >= 3
        assert _rows(svc.store.store.read_all()) == plain.rows()
    finally:
        paused.release.set()
        await cluster.close()


@pytest.mark.asyncio
async def test_many_writes_held_during_a_fold_are_applied_off_the_event_loop(tmp_path, monkeypatch):
    """Past ``APPLY_ON_LOOP_BYTES`` the writes held during a fold are applied in a worker thread
    (before: all of them on the event loop when the fold ended), and the rows end as the plain path
    leaves them."""
    monkeypatch.setattr(background_fold, "APPLY_ON_LOOP_BYTES", 0)
    threads: list[threading.Thread] = []
    real = DeferredApplies.apply_ops

    def apply_ops(self, ops):  # type: ignore[no-untyped-def]
        told = real(self, ops)
        if told:
            threads.append(threading.current_thread())
        return told

    monkeypatch.setattr(DeferredApplies, "apply_ops", apply_ops)
    cluster, paused, plain, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, 8)
    try:
        await batches[-1]
        await _written_during_the_fold(cluster, plain, 80, 5)
        paused.release.set()
        svc = cluster.services["s0"]
        assert svc.folds is not None
        await PausedFold._until(lambda: not svc.folds.running)  # type: ignore[union-attr]
        assert threads and all(t is not threading.main_thread() for t in threads)
        assert svc.store is not None and svc.store.deferred.applied == 5 and svc.store.deferred.held_bytes == 0
        assert _rows(svc.store.store.read_all()) == plain.rows()
    finally:
        paused.release.set()
        await cluster.close()


@pytest.mark.asyncio
async def test_vocabulary_and_registers_are_served_during_a_fold(tmp_path, monkeypatch):
    """Requests that never touch the rows (vocabulary, registers) are not held by a fold (before:
    every request waited for it, so a training job's vocabulary writes and a cluster job's register
    rounds stalled for the fold's length)."""
    cluster, paused, _, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, 9)
    try:
        await batches[-1]
        client = cluster.client
        fid = feature_id("lantern")
        await asyncio.wait_for(client.put_vocab([(1, fid, "lantern")]), 5.0)
        assert await asyncio.wait_for(client.get_vocab([(1, fid)]), 5.0) == {(1, fid): "lantern"}
        # a read settled by compare-and-set (prepare and accept rounds), then a quorum read
        assert (await asyncio.wait_for(client.registers.cas("job/x", None), 5.0)).ok
        assert (await asyncio.wait_for(client.registers.read("job/x"), 5.0)).value == b""
        assert cluster.services["s0"].folds.running  # type: ignore[union-attr]  # all during the fold
    finally:
        paused.release.set()
        await cluster.close()


def _metrics(cluster: Cluster, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(cluster.nodes[name].metrics.render().decode())
            for s in fam.samples}


@pytest.mark.asyncio
async def test_a_fold_shows_in_the_metrics(tmp_path, monkeypatch):
    cluster, paused, plain, batches = await _node_with_a_fold_due(tmp_path, monkeypatch, 10)
    try:
        await batches[-1]
        before = _metrics(cluster, "s0")
        assert before["giaannd_storage_fold_running"] == 1.0
        await _written_during_the_fold(cluster, plain, 100, 2)
        held = _metrics(cluster, "s0")["giaannd_storage_fold_held_write_bytes"]
        health = cluster.services["s0"].health()
        assert held > 0 and health["folding"] is True and health["fold_held_write_bytes"] == held
        paused.release.set()
        svc = cluster.services["s0"]
        await PausedFold._until(lambda: not svc.folds.running)  # type: ignore[union-attr]
        after = _metrics(cluster, "s0")
        assert after["giaannd_storage_fold_running"] == 0.0 and after["giaannd_storage_fold_held_write_bytes"] == 0
        assert (after["giaannd_storage_fold_duration_seconds_count"]
                > before["giaannd_storage_fold_duration_seconds_count"])
        assert after["giaannd_storage_applies_deferred_total"] == 2
    finally:
        paused.release.set()
        await cluster.close()


@pytest.mark.asyncio
async def test_writes_held_during_an_idle_fold_that_make_a_fold_due_are_all_applied(tmp_path, monkeypatch):
    """An idle node's fold (``fold_when_idle``: ``BackgroundFold.fold`` called, no fold task of
    ``due``) holds writes that make a fold due again when they are applied, in a worker thread
    (``APPLY_ON_LOOP_BYTES``): a commit there reports it (``on_fold_due``) off the event loop.
    Before, that report asked for the running loop in the worker thread and raised: the held
    batches after it never reached the rows (acknowledged writes missing until a restart, the
    gate open) and the fold failed."""
    monkeypatch.setattr(background_fold, "APPLY_ON_LOOP_BYTES", 0)
    paused = PausedFold(monkeypatch)
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=0.0)
    try:
        svc = cluster.services["s0"]
        folds = svc.folds
        assert svc.store is not None and folds is not None
        rng = np.random.default_rng(12)
        plain = Plain()
        for batch in (make_batch(rng, 400, 8), make_batch(rng, 40, 4)):  # a base, then new keys under 1/4 of it
            await cluster.client.write(batch)
            plain.apply(batch)
        await PausedFold._until(lambda: not folds.running and (folds._task is None or folds._task.done()))
        done = folds.folds
        paused.armed = True
        fold = asyncio.get_running_loop().create_task(folds.fold())  # as fold_when_idle does
        await paused.entered()
        paused.armed = False
        known = np.array(list(plain.rows()), np.uint64).reshape(-1, 2)
        more = [RowBatch.from_entries(*_same_keys(make_batch(rng, 100, 8),
                                                   known[rng.choice(known.shape[0], 100, replace=False)]))
                for _ in range(4)]  # new entries in held rows: delta runs of more than 1/4 of the base
        await asyncio.wait_for(asyncio.gather(*(cluster.client.write(b) for b in more)), 5.0)
        for b in more:
            plain.apply(b)
        assert len(svc.store.deferred) == len(more)
        paused.release.set()
        assert await asyncio.wait_for(fold, 10.0) > 0
        # the fold they made due runs next, started from the event loop
        await PausedFold._until(lambda: folds.folds == done + 2 and not folds.running)
        assert svc.store.deferred.applied == len(more) and svc.store.deferred.held_bytes == 0
        assert _rows(svc.store.store.read_all()) == plain.rows()
    finally:
        paused.release.set()
        await cluster.close()
