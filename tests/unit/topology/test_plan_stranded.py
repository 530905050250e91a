"""``plan.stranded``: the columns a placement change leaves with no live owner (pure, tables)."""

import numpy as np
import pytest

from giaannd.storage.rebalance.plan import stranded
from peers.placement import Member, Placement

COLUMNS = np.random.default_rng(7).integers(1, 2**63, 400, dtype=np.uint64)


def placement(*names, replicas=2):
    return Placement(tuple(Member(n) for n in names), replicas)


@pytest.mark.parametrize(("old", "new", "live", "expected"), [
    # decommission of s0 while s1, the only other member, is down: every column
    (("s0", "s1"), ("s1",), {"s0"}, "all"),
    # the same with everyone up: none
    (("s0", "s1"), ("s1",), {"s0", "s1"}, "none"),
    # removenode of a dead member: survivors lose nothing
    (("s0", "s1", "s2"), ("s0", "s1"), {"s0", "s1"}, "none"),
    # owners down before and after, nothing live loses the column: not stranded
    (("s0", "s1", "s2"), ("s0", "s1", "s2", "s3"), {"s3"}, "none"),
])
def test_stranded_columns_by_change(old, new, live, expected):
    out = stranded(placement(*old), placement(*new), COLUMNS, live)
    assert out.tolist() == (sorted(set(COLUMNS.tolist())) if expected == "all" else [])


def test_stranded_is_exactly_the_columns_a_live_holder_gives_to_down_owners_only():
    old, new = placement("s0", "s1", "s2", "s3"), placement("s1", "s2", "s3")
    live = {"s0", "s1"}  # s2, s3 down; s0 decommissioned
    out = set(stranded(old, new, np.concatenate([COLUMNS, COLUMNS[:5]]), live).tolist())
    expected = {int(c) for c in COLUMNS if "s0" in old.owners(int(c)) and "s1" not in new.owners(int(c))}
    assert out == expected and out
