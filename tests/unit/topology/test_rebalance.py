"""Planner (rebalance/plan.py): which columns move, from whom, and what is lost."""

import numpy as np
import pytest

from giaannd.storage.rebalance.plan import _highest_hash, plan_transfers
from peers.placement import Member, Placement
from tools.bench.plan import choose_source_per_column, plan_per_column, same_plan
from tools.bench.plan import main as plan_bench


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


def test_source_choice_is_independent_of_candidate_order():
    """The hash choice among several candidates does not depend on the order the owners come in,
    and is the rule as written per column (tools/bench/plan.py) for each pair."""
    names = ["a", "b", "c", "t"]
    cols = np.array([5, 6, 2**63 + 7], np.uint64)
    targets = np.full(3, 3, np.intp)
    every = np.ones((3, 3), bool)
    forward = _highest_hash(cols, targets, np.array([[0, 1, 2]] * 3, np.intp), every, names)
    backward = _highest_hash(cols, targets, np.array([[2, 1, 0]] * 3, np.intp), every, names)
    assert forward.tolist() == backward.tolist()
    assert [names[i] for i in forward] == [choose_source_per_column(int(c), "t", ["a", "b", "c"]) for c in cols]
    some = np.array([[True, False, True]] * 3)  # only "a" and "c" are candidates
    assert [names[i] for i in _highest_hash(cols, targets, np.array([[0, 1, 2]] * 3, np.intp), some, names)] == [
        choose_source_per_column(int(c), "t", ["a", "c"]) for c in cols]


def _random_change(rng):
    """Two placements around a random topology change, with live and avoided members."""
    names = [f"n{i}" for i in range(int(rng.integers(1, 8)))]
    weighted = bool(rng.integers(0, 2))
    weights = {n: float(rng.uniform(0.5, 3)) if weighted else 1.0 for n in names + ["x", "y"]}
    r = int(rng.integers(1, 5))
    kind = rng.choice(["join", "decommission", "removenode", "replace", "reweigh", "same"])
    after = list(names)
    if kind == "join" or not after:
        after.append("x")
    elif kind in ("decommission", "removenode"):
        after.remove(str(rng.choice(after)))
        after = after or ["y"]
    elif kind == "replace":
        after[int(rng.integers(0, len(after)))] = "y"
    elif kind == "reweigh":
        weights[str(rng.choice(after))] *= 2.5
    pins = {}
    if rng.integers(0, 3) == 0:  # pinned columns, a name repeated among them
        for key in (5, 6, 7):
            pins[key] = tuple(str(n) for n in rng.choice(names + after, size=int(rng.integers(1, 4))))
    strategy = "weighted" if weighted else "hash"
    old = Placement(tuple(Member(n, weights[n]) for n in names or ["y"]), r, strategy, pins)
    new = Placement(tuple(Member(n, weights[n]) for n in after), r, strategy, pins)
    everyone = sorted(set(old.names) | set(new.names))
    live = [n for n in everyone if rng.random() < 0.8]
    avoid = [n for n in everyone if rng.random() < 0.2]
    return old, new, live, avoid




@pytest.mark.parametrize("seed", range(60))
def test_plan_equals_the_per_column_reference(seed):
    """Whole-array planning gives the plan the per-column loop gave, for every kind of change, live
    and avoided members, weights, pins (a name pinned twice), duplicate columns; and the transfer
    rule claims exactly the columns of each transfer."""
    from giaannd.storage.rebalance.plan import TransferRule

    rng = np.random.default_rng(seed)
    old, new, live, avoid = _random_change(rng)
    columns = np.concatenate([rng.integers(0, 2**63, 400, dtype=np.uint64), np.arange(10, dtype=np.uint64),
                              np.array([5, 5, 6], np.uint64)])
    got = plan_transfers(old, new, columns, live, avoid)
    assert same_plan(got, plan_per_column(old, new, columns, live, avoid))
    rule = TransferRule(old, new, frozenset(live), frozenset(avoid))
    cols = np.unique(columns)
    everyone = sorted(set(old.names) | set(new.names))
    for source in everyone:
        for target in everyone:
            carried = next((t.columns for t in got.transfers if (t.source, t.target) == (source, target)),
                           np.zeros(0, np.uint64))
            assert cols[rule.claims(source, target, cols)].tolist() == carried.tolist()


@pytest.mark.parametrize("seed", range(120))
def test_the_rules_pairs_hold_every_pair_a_column_can_be_given(seed):
    """``TransferRule.pairs`` is what an operation opens a stream for, so that a column created while
    it runs has one: every pair the plan of many columns (most pairs of each change kind, pinned
    keys among them) gives is in it, for every kind of change, replicas changed included."""
    from giaannd.storage.rebalance.plan import TransferRule

    rng = np.random.default_rng(1000 + seed)
    old, new, live, avoid = _random_change(rng)
    if seed % 5 == 0:  # the replica count changed too
        new = Placement(new.members, max(1, new.replicas + int(rng.choice([-1, 1]))), new.strategy, new.pins)
    columns = np.concatenate([rng.integers(0, 2**63, 20_000, dtype=np.uint64), np.array([5, 6, 7], np.uint64)])
    got = {(t.source, t.target) for t in plan_transfers(old, new, columns, live, avoid).transfers}
    assert got <= TransferRule(old, new, frozenset(live), frozenset(avoid)).pairs()


def test_the_rules_pairs_are_the_leavers_or_the_newcomers_when_only_those_change():
    """A join streams only to the newcomers, a decommission of live members only from the leavers
    (not every live member to every other: N^2 streams); a member removed while down, or a replace,
    may give any member a column from any live old member."""
    from giaannd.storage.rebalance.plan import TransferRule

    five = tuple(Member(f"n{i}") for i in range(5))
    names = {m.name for m in five}
    old = Placement(five, 3)
    joined = Placement((*five, Member("x")), 3)
    assert TransferRule(old, joined, frozenset(names)).pairs() == {(n, "x") for n in names}
    assert TransferRule(old, joined, frozenset(names - {"n1"})).pairs() == {(n, "x") for n in names - {"n1"}}
    left = Placement(five[1:], 3)
    assert TransferRule(old, left, frozenset(names)).pairs() == {("n0", t) for t in names - {"n0"}}
    survivors = names - {"n0"}
    everyone = {(s, t) for s in survivors for t in survivors if s != t}
    assert TransferRule(old, left, frozenset(survivors)).pairs() == everyone  # removenode
    assert TransferRule(old, left, frozenset(names), frozenset({"n0"})).pairs() == {
        (s, t) for s in names for t in survivors if s != t}  # the leaver avoided: any live source
    replaced = Placement((*five[1:], Member("x")), 3)
    assert TransferRule(old, replaced, frozenset(survivors)).pairs() == {
        (s, t) for s in survivors for t in survivors | {"x"} if s != t}


def test_plan_bench_runs_small_and_prints_each_figure(capsys):
    """tools.bench.plan at a small size: both planners agree (it exits otherwise), one JSON object
    per figure."""
    import json

    assert plan_bench(["--columns", "2000", "--rounds", "1", "--json"]) == 0
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {f["figure"] for f in figures} >= {"plan join, before / now", "plan removenode, before / now"}
    assert all(set(f) == {"figure", "value", "target"} and f["value"] > 0 for f in figures)
