"""Planner (rebalance/plan.py): which columns move, from whom, and what is lost."""

import numpy as np
import pytest

from giaannd.storage.rebalance.plan import choose_source, plan_transfers
from peers.placement import Member, Placement


def _placement(names, r=3):
    return Placement(tuple(Member(n) for n in names), r)


COLS = np.random.default_rng(7).integers(1, 2**63, 20_000, dtype=np.uint64)


def test_plan_join_moves_about_one_over_n_plus_one():
    old, new = _placement(["a", "b", "c", "d"]), _placement(["a", "b", "c", "d", "e"])
    plan = plan_transfers(old, new, COLS, live=["a", "b", "c", "d", "e"])
    # with R=3 of 5 nodes, a column gains e with probability 3/5 (e enters its top 3)
    assert plan.moved_fraction == pytest.approx(3 / 5, abs=0.02)
    assert {t.target for t in plan.transfers} == {"e"}
    assert plan.lost.size == 0
    moved = np.concatenate([t.columns for t in plan.transfers])
    assert np.unique(moved).size == moved.size == plan.columns_moved
    # every source is an old owner of each column it sends
    for t in plan.transfers:
        for c in t.columns[:50].tolist():
            assert t.source in old.owners(c) and "e" in new.owners(c)
    # released: exactly one old owner per moved column gives it up (R stays 3)
    assert sum(v.size for v in plan.released.values()) == plan.columns_moved


def test_plan_join_with_r1_moves_one_over_n_plus_one():
    old, new = _placement(["a", "b", "c", "d"], 1), _placement(["a", "b", "c", "d", "e"], 1)
    plan = plan_transfers(old, new, COLS, live=["a", "b", "c", "d", "e"])
    assert plan.moved_fraction == pytest.approx(1 / 5, abs=0.02)


def test_plan_spreads_sources_over_old_owners():
    old, new = _placement(["a", "b", "c", "d"]), _placement(["a", "b", "c", "d", "e"])
    plan = plan_transfers(old, new, COLS, live=["a", "b", "c", "d", "e"])
    sizes = {t.source: t.columns.size for t in plan.transfers}
    assert set(sizes) == {"a", "b", "c", "d"}
    assert max(sizes.values()) / min(sizes.values()) < 1.3


def test_plan_decommission_and_removenode():
    old, new = _placement(["a", "b", "c", "d"]), _placement(["a", "b", "c"])
    dec = plan_transfers(old, new, COLS, live=["a", "b", "c", "d"])
    assert all(t.target != "d" for t in dec.transfers)
    assert set(dec.released) == {"d"}
    rm = plan_transfers(old, new, COLS, live=["a", "b", "c"])
    assert all(t.source != "d" for t in rm.transfers) and rm.lost.size == 0
    assert rm.columns_moved == dec.columns_moved


def test_plan_reports_lost_columns_when_no_live_owner():
    old, new = _placement(["a", "b", "c"], 1), _placement(["a", "b"], 1)
    plan = plan_transfers(old, new, COLS[:1000], live=["a", "b"])
    gone = [c for c in COLS[:1000].tolist() if old.owners(c) == ("c",)]
    assert sorted(plan.lost.tolist()) == sorted(gone) and gone
    assert not plan.transfers


def test_plan_no_change_is_empty_and_deterministic():
    p = _placement(["a", "b", "c"])
    assert not plan_transfers(p, p, COLS, live=["a", "b", "c"]).transfers
    old, new = _placement(["a", "b", "c"]), _placement(["c", "b", "a", "x"])
    one = plan_transfers(old, new, COLS[::-1], live=["c", "a", "b"])
    two = plan_transfers(old, new, COLS, live=["a", "b", "c"])
    assert one.transfers == two.transfers


def test_plan_avoid_sources_only_as_last_resort():
    old, new = _placement(["a", "b", "c", "d"]), _placement(["a", "b", "c", "d", "e"])
    plan = plan_transfers(old, new, COLS, live=["a", "b", "c", "d"], avoid_sources=["a"])
    assert "a" not in {t.source for t in plan.transfers}
    old1, new1 = _placement(["a", "b"], 1), _placement(["a", "b", "e"], 1)
    plan1 = plan_transfers(old1, new1, COLS, live=["a", "b"], avoid_sources=["a"])
    assert "a" in {t.source for t in plan1.transfers}  # a is the only holder of some columns


def test_choose_source_is_order_independent():
    assert choose_source(5, "t", ["x", "y", "z"]) == choose_source(5, "t", ["z", "y", "x"])
    with pytest.raises(ValueError):
        choose_source(5, "t", [])
