"""A fold or tier merge that raises midway (out of memory at an allocation) must not leave an engine
whose reads silently miss entries: the runs it consumed are half moved, so every later read of the
runs raises instead (a review's test: failed before the fix)."""

import numpy as np
import pytest

from giaannd.rowengine import Entries, RowEngine
from giaannd.rowengine import engine as engine_module
from giaannd.rowengine import run as run_module
from tests.unit.rowengine.test_engine import DictReference, random_batch, same

ROWS = [(c, f) for c in range(1, 30) for f in range(3)]


def _batches(n: int, seed: int = 11):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    tc, tf = np.arange(1, 400, dtype=np.uint64), np.arange(5, dtype=np.uint64)
    return [random_batch(rng, ROWS, tc, tf, rows=40, per_row=40) for _ in range(n)]


def _commit(engine, batch):  # type: ignore[no-untyped-def]
    plan = engine.plan(batch.row_column, batch.row_feature, batch.offsets,
                       Entries(batch.segment, batch.target_column, batch.target_feature, batch.strength))
    engine.commit(plan, fold=False)


def _fails_at(monkeypatch, name: str, call: int) -> list[int]:
    """``run.<name>`` raises MemoryError at its ``call``-th call from now (1-based)."""
    real, calls = getattr(run_module, name), [0]

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == call:
            raise MemoryError(f"no room ({name}, call {call})")
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, name, failing)
    return calls


def _assert_every_read_right_or_refused(engine, reference) -> None:  # type: ignore[no-untyped-def]
    refused = 0
    for key in ROWS:
        rid = engine.row_id(*key)
        if rid < 0:
            continue
        try:
            got = engine.read(rid)
        except RuntimeError:
            refused += 1
            continue
        assert same(got, reference.row(key)), f"row {key} silently lost entries"
    if refused:  # all or nothing: an engine left half moved refuses every read
        assert refused == sum(engine.row_id(*k) >= 0 for k in ROWS)


@pytest.mark.parametrize(("name", "call"), [("_union_rows", 1), ("_union_rows", 2), ("_merged", 1),
                                            ("_merged", 2), ("_merged", 4), ("insertion_points", 1)])
@pytest.mark.parametrize("work", ["compact", "merge_tiers"])
def test_a_fold_or_merge_that_raises_midway_leaves_no_wrong_rows(work, name, call, monkeypatch):
    engine, reference = RowEngine(fanout=1, base_ratio=1), DictReference()
    batches = _batches(12)
    for batch in batches[:8]:  # a base, then delta runs of falling size (fanout 1: no merge among them)
        _commit(engine, batch)
        reference.apply(batch)
    engine.compact()
    for batch in batches[8:]:
        _commit(engine, batch)
        reference.apply(batch)
    if work == "merge_tiers":
        engine.fanout = 50  # every pair of delta runs out of tier now: merge_tiers has merges to do
        assert engine.merge_due()
    assert engine.num_deltas >= 2, "the test would prove nothing"
    calls = _fails_at(monkeypatch, name, call)
    try:
        getattr(engine, work)()
    except MemoryError:
        pass
    else:
        assert calls[0] < call, "the patched step failed but the engine did not raise"
        pytest.skip(f"{work} made {calls[0]} calls to {name}")
    monkeypatch.undo()
    _assert_every_read_right_or_refused(engine, reference)


def test_a_drop_that_raises_after_the_new_base_leaves_no_wrong_rows(monkeypatch):
    """``drop_rows`` out of memory rebuilding the key index, after the kept rows' new base is in:
    the rows are renumbered but the index is not, so a read gave another row's entries. Every read
    must be right (as before the drop) or refused."""
    engine, reference = RowEngine(fanout=2, base_ratio=2), DictReference()
    for batch in _batches(10):
        _commit(engine, batch)
        reference.apply(batch)
    keep = np.ones(engine.num_rows, bool)
    keep[::3] = False

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise MemoryError("no room for the key index")

    monkeypatch.setattr(engine_module.KeyIndex, "from_keys", failing)
    with pytest.raises(MemoryError):
        engine.drop_rows(keep)
    monkeypatch.undo()
    _assert_every_read_right_or_refused(engine, reference)


@pytest.mark.parametrize("call", [1, 2, 3, 4])
def test_new_rows_appended_to_the_base_that_raise_midway_leave_no_wrong_rows(call, monkeypatch):
    """``append_new_rows`` out of memory growing the base's field ``call`` (run.append_rows consumes
    the base field by field): every read must be right or refused, never a row of the base whose
    fields were dropped."""
    engine, reference = RowEngine(), DictReference()
    for batch in _batches(6):
        _commit(engine, batch)
        reference.apply(batch)
    engine.compact()
    _fails_at(monkeypatch, "_append_parts", call + 2)  # (the first two grow the row index)
    one = Entries(np.zeros(3, np.uint8), np.arange(3, dtype=np.uint64), np.zeros(3, np.uint64),
                  np.ones(3, np.float32))
    with pytest.raises(MemoryError):
        engine.append_new_rows(np.array([999], np.uint64), np.array([1], np.uint64), np.array([3]), [one])
    monkeypatch.undo()
    _assert_every_read_right_or_refused(engine, reference)
