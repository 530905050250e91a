"""Merge-add against the plain concatenate + lexsort reference (rows.merge_rows)."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.model.rows import Row, merge_rows
from giaannd.storage.engine.row_merge import add_in_place, merge_into, plan_merge

from ._gen import random_row


def _merge(base: Row, delta: Row) -> Row:
    plan = plan_merge(base, delta)
    if plan.in_place and len(base):
        out = Row(base.segment.copy(), base.target_column.copy(), base.target_feature.copy(), base.strength.copy())
        add_in_place(out, delta, plan)
        return out
    n = len(base) + plan.new_count
    out = Row(np.empty(n, np.uint8), np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n, np.float32))
    merge_into(base, delta, plan, out)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_row_merge_matches_plain_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = random_row(rng, int(rng.integers(0, 400)), key_space=int(rng.integers(2, 60)))
    delta = random_row(rng, int(rng.integers(0, 100)), key_space=int(rng.integers(2, 60)))
    assert _merge(base, delta).equals(merge_rows(base, delta), rtol=1e-6)


def test_row_merge_all_found_is_in_place() -> None:
    rng = np.random.default_rng(1)
    base = random_row(rng, 300)
    pick = np.sort(rng.choice(len(base), 40, replace=False))
    delta = Row(base.segment[pick], base.target_column[pick], base.target_feature[pick], np.ones(40, np.float32))
    plan = plan_merge(base, delta)
    assert plan.in_place and plan.new_count == 0
    assert _merge(base, delta).equals(merge_rows(base, delta), rtol=1e-6)


def test_row_merge_extreme_keys_order() -> None:
    top = np.uint64(2**64 - 1)
    base = Row(np.array([0, 8], np.uint8), np.array([top, 0], np.uint64), np.array([top, 0], np.uint64),
               np.ones(2, np.float32))
    delta = Row(np.array([0, 0, 8], np.uint8), np.array([0, top, top], np.uint64),
                np.array([top, top, top], np.uint64), np.ones(3, np.float32))
    got = _merge(base, delta)
    assert got.equals(merge_rows(base, delta))
    assert got.strength.tolist() == [1.0, 2.0, 1.0, 1.0]
