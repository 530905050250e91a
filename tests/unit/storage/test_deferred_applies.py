"""Writes logged during a fold and applied when it ends (storage/engine/deferred_applies.py): the
rows, the applied set and the acknowledgements are what serving each request live gives, in the
same order, and a restart from the log at any point gives the same again."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import StorageRequests, WaitDurable
from giaannd.storage.streaming.sender import AppliedTee

COLUMNS = np.arange(1, 40, dtype=np.uint64)


def _batch(rng: np.random.Generator) -> RowBatch:
    """A canonical batch over a few columns (small integer strengths: exact sums either way)."""
    rows = int(rng.integers(1, 6))
    cols = rng.choice(COLUMNS, rows, replace=False)
    per = rng.integers(1, 5, rows)
    n = int(per.sum())
    return RowBatch.from_entries(np.repeat(cols, per), np.repeat(rng.integers(0, 3, rows).astype(np.uint64), per),
                                 rng.integers(0, 2, n).astype(np.uint8), rng.integers(1, 6, n, dtype=np.uint64),
                                 rng.integers(0, 6, n, dtype=np.uint64), rng.integers(1, 4, n).astype(np.float32))


def _requests(rng: np.random.Generator, count: int) -> list[tuple[p.ApplyBatch, RowBatch]]:
    """ApplyBatch requests of two writers, seqs in order with retries of earlier ones, floors that
    move now and then (never past an unacknowledged seq of their writer: seqs are served in
    order here, so a floor up to the seq itself)."""
    out: list[tuple[p.ApplyBatch, RowBatch]] = []
    seq = {1: 0, 2: 0}
    floor = {1: 0, 2: 0}
    for _ in range(count):
        writer = int(rng.integers(1, 3))
        if out and rng.random() < 0.2:  # a retry of an earlier request, as it was
            out.append(out[int(rng.integers(0, len(out)))])
            continue
        seq[writer] += 1
        if rng.random() < 0.4:
            floor[writer] = int(rng.integers(floor[writer], seq[writer]))
        out.append((p.ApplyBatch(writer, seq[writer], floor[writer]), _batch(rng)))
    return out


def _core(path, capacity: int = 1 << 24) -> StorageRequests:
    store = DurableStore.open(path / "store", capacity)
    return StorageRequests(store, HintStore.open(path / "hints"), "", lambda: None, lambda k, n: None)


def _state(store: DurableStore, columns: bool = True) -> tuple:
    """The rows (bit for bit) and the applied set; ``columns``: with its per-column record of
    tracked writers, which promises (not logged) shape, so a restart does not rebuild it alike."""
    rows = store.store.read_all()
    applied = store.store.applied
    return (tuple(b.tobytes() for b in rows.buffers()), tuple(a.tobytes() for a in applied.to_arrays()),
            tuple(a.tobytes() for a in applied.column_arrays()) if columns else ())


def _close(core: StorageRequests) -> None:
    core.store.close()
    assert core.hints is not None
    core.hints.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 30), start=st.integers(0, 30),
       length=st.integers(0, 30))
def test_deferred_applies_end_as_live_ones_and_replay_to_them(tmp_path_factory, seed, count, start, length):
    rng = np.random.default_rng(seed)
    reqs = _requests(rng, count)
    live = _core(tmp_path_factory.mktemp("live"))
    fold = _core(tmp_path_factory.mktemp("fold"))
    path = fold.store.directory.parent
    acks_live, acks_fold = [], []
    deferred = fold.store.deferred
    taken = None  # a part handed to a worker thread (take), applied later (apply_ops, settle)
    for i, (msg, batch) in enumerate(reqs):
        step = live.serve(msg, batch.buffers())
        assert isinstance(step, WaitDurable)
        acks_live.append((step.seq, step.ack.applied))
        during = start <= i < start + length  # these arrive while a fold moves the rows
        if during and taken is None and rng.random() < 0.3:
            taken = deferred.take()  # the fold ended; its writes go to a worker while more come
        elif taken is not None and rng.random() < 0.5:
            deferred.settle(taken, deferred.apply_ops(taken))
            taken = None
        got = fold.serve_during_fold(msg, batch.buffers()) if during else None
        if got is None:  # not deferred (or no fold): served live, after the deferred ones
            if taken is not None:
                deferred.settle(taken, deferred.apply_ops(taken))
                taken = None
            fold.store.apply_deferred()
            got = fold.serve(msg, batch.buffers())
        assert isinstance(got, WaitDurable)
        acks_fold.append((got.seq, got.ack.applied))
        if during and i == start + length // 2:  # a crash mid-fold: the log holds what was acknowledged
            fold.store.log.sync()
            shutil.copytree(path / "store", path / "crashed")
            crashed = DurableStore.open(path / "crashed", 1 << 24)
            try:
                assert _state(crashed, False) == _state(live.store, False)
            finally:
                crashed.close()
    assert [a for _, a in acks_fold] == [a for _, a in acks_live]  # applied / duplicate, request by request
    if taken is not None:
        deferred.settle(taken, deferred.apply_ops(taken))
    fold.store.log.sync()
    replayed = DurableStore.open(path / "store", 1 << 24)  # the log as it stands, deferred ones not applied yet
    fold.store.apply_deferred()
    try:
        assert _state(fold.store) == _state(live.store)
        assert _state(replayed, False) == _state(live.store, False)
    finally:
        replayed.close()
        _close(live)
        _close(fold)


def test_a_batch_that_cannot_be_deferred_waits(tmp_path):
    rng = np.random.default_rng(1)
    core = _core(tmp_path, capacity=200_000)
    try:
        b = _batch(rng)
        first = core.serve_during_fold(p.ApplyBatch(1, 1), b.buffers())
        assert isinstance(first, WaitDurable) and first.ack.applied and len(core.store.deferred) == 1
        # the same id again while it is deferred: not deferred (served after the fold: a duplicate)
        assert core.serve_during_fold(p.ApplyBatch(1, 1), b.buffers()) is None
        # a batch whose largest growth would pass the capacity: waits for the fold
        n = 20_000
        big = RowBatch.from_entries(np.full(n, 3, np.uint64), np.zeros(n, np.uint64), np.zeros(n, np.uint8),
                                    np.arange(n, dtype=np.uint64), np.zeros(n, np.uint64), np.ones(n, np.float32))
        assert core.serve_during_fold(p.ApplyBatch(1, 2), big.buffers()) is None
        core.store.deferred.max_bytes = b.nbytes  # past the deferred bytes: waits too
        assert core.serve_during_fold(p.ApplyBatch(2, 1), _batch(rng).buffers()) is None
        assert len(core.store.deferred) == 1 and core.store.apply_deferred() == 1
        again = core.serve(p.ApplyBatch(1, 1), b.buffers())
        assert isinstance(again, WaitDurable) and not again.ack.applied
    finally:
        _close(core)


@pytest.mark.parametrize("logged", [True, False])
def test_a_floor_after_a_deferred_batch_does_not_cut_it_out(tmp_path, logged):
    """Seq 1 deferred, then seq 2 whose floor covers seq 1 (the writer had its ack): seq 1 is still
    applied when the fold ends (the floor change comes after it, in log order)."""
    rng = np.random.default_rng(2)
    core, live = _core(tmp_path / "fold"), _core(tmp_path / "live")
    try:
        b1, b2 = _batch(rng), _batch(rng)
        floor = 1 if logged else 0
        for msg, b in ((p.ApplyBatch(1, 1), b1), (p.ApplyBatch(1, 2, floor), b2)):
            assert isinstance(core.serve_during_fold(msg, b.buffers()), WaitDurable)
            live.serve(msg, b.buffers())
        assert core.store.apply_deferred() == 2
        assert _state(core.store) == _state(live.store)  # seq 1's rows too
    finally:
        _close(core)
        _close(live)


def test_a_stream_source_is_told_of_a_deferred_batch_when_it_is_applied(tmp_path):
    """A join's source forwards what its store applies (streaming/sender.py, ``AppliedTee``): a batch
    logged during a fold is told when it reaches the rows (before, it would never have been told:
    the tee saw only live applies), with the writer's epoch."""
    core = _core(tmp_path)
    try:
        tee = AppliedTee(core.store)
        core.store = tee  # type: ignore[assignment]
        told: list[tuple[BatchId, RowBatch, str]] = []
        tee.observers.append(lambda batch_id, batch, epoch: told.append((batch_id, batch, epoch)))
        b = _batch(np.random.default_rng(3))
        step = core.serve_during_fold(p.ApplyBatch(4, 1, placement_epoch="e7"), b.buffers())
        assert isinstance(step, WaitDurable) and step.ack.applied and told == []  # logged, not applied yet
        assert tee.apply_deferred() == 1
        assert [(i, e) for i, _, e in told] == [(BatchId(4, 1), "e7")]
        assert all(np.array_equal(x, y) for x, y in zip(told[0][1].buffers(), b.buffers()))
    finally:
        _close(core)
