"""Placement: determinism, minimal disruption, balance, weights, pins, epoch, moved()."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peers.placement import Member, Placement, moved, owners

KEYS = np.random.default_rng(7).integers(0, 2**64, size=100_000, dtype=np.uint64)


def _members(n: int) -> tuple[Member, ...]:
    return tuple(Member(f"node-{i}") for i in range(n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 2**32), key=st.integers(0, 2**64 - 1))
def test_placement_same_owners_whatever_member_order(n: int, seed: int, key: int) -> None:
    ms = list(_members(n))
    a = Placement(tuple(ms), 3)
    random.Random(seed).shuffle(ms)
    b = Placement(tuple(ms), 3)
    assert a.owners(key) == b.owners(key)
    assert a.epoch == b.epoch
    assert len(a.owners(key)) == min(3, n)
    assert len(set(a.owners(key))) == len(a.owners(key))


def test_placement_scalar_agrees_with_vector() -> None:
    p = Placement(_members(7), 3)
    idx = p.owner_indices(KEYS[:200])
    for i, k in enumerate(KEYS[:200]):
        assert p.owners(int(k)) == tuple(p.names[j] for j in idx[i])


@pytest.mark.parametrize("n", [1, 2, 4, 9, 20])
def test_placement_join_moves_one_over_n_plus_one_and_nothing_else(n: int) -> None:
    old = Placement(_members(n), 3)
    new = Placement(_members(n + 1), 3)
    a, b = old.owner_indices(KEYS), new.owner_indices(KEYS)
    old_names, new_names = np.array(old.names), np.array(new.names)
    newcomer = f"node-{n}"
    pa, pb = old_names[a[:, 0]], new_names[b[:, 0]]
    changed = pa != pb
    assert np.all(pb[changed] == newcomer)  # primaries move only to the newcomer
    share = changed.mean()
    assert abs(share - 1 / (n + 1)) <= 0.10 / (n + 1)
    # Full owner lists: the new list is the old one with the newcomer inserted (old order kept).
    for i in range(0, len(KEYS), 997):
        o = list(old_names[a[i]])
        nw = [x for x in new_names[b[i]] if x != newcomer]
        assert nw == o[: len(nw)]


def test_placement_equal_weights_balance() -> None:
    p = Placement(_members(10), 3)
    counts = np.bincount(p.primary_indices(KEYS), minlength=10)
    assert counts.max() / counts.mean() <= 1.10
    all_counts = np.bincount(p.owner_indices(KEYS).ravel(), minlength=10)
    assert all_counts.max() / all_counts.mean() <= 1.10


def test_placement_weighted_shares_within_ten_percent() -> None:
    weights = [1.0, 2.0, 3.0, 4.0, 10.0]
    ms = tuple(Member(f"w{i}", w) for i, w in enumerate(weights))
    p = Placement(ms, 1, strategy="weighted")
    counts = np.bincount(p.primary_indices(KEYS), minlength=len(ms))
    expected = np.array([m.weight for m in p.members]) / sum(weights) * len(KEYS)
    assert np.all(np.abs(counts - expected) / expected <= 0.10)


def test_placement_hash_strategy_ignores_weights() -> None:
    ms = (Member("a", 1.0), Member("b", 50.0))
    p = Placement(ms, 1, strategy="hash")
    share = np.bincount(p.primary_indices(KEYS), minlength=2) / len(KEYS)
    assert abs(share[0] - 0.5) < 0.01
    assert p.epoch != Placement(ms, 1, strategy="weighted").epoch


def test_placement_pins_override_and_fill() -> None:
    ms = _members(5)
    key = 12345
    p = Placement(ms, 3, strategy="pinned", pins={key: ("node-4", "node-2")})
    got = p.owners(key)
    assert got[:2] == ("node-4", "node-2") and len(got) == 3
    # Dead pinned member: the live one first, then ordinary placement.
    q = Placement(ms[:4], 3, strategy="pinned", pins={key: ("node-4", "node-2")})
    assert q.owners(key)[0] == "node-2"
    # Unpinned keys are unaffected by pins.
    plain = Placement(ms, 3)
    assert p.owners(key + 1) == plain.owners(key + 1)
    assert p.epoch != Placement(ms, 3, strategy="pinned").epoch


def test_placement_replicas_capped_by_members() -> None:
    assert len(owners(5, _members(2), replicas=3)) == 2


def test_placement_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        Placement((), 3)
    with pytest.raises(ValueError):
        Placement((Member("a"), Member("a")), 3)
    with pytest.raises(ValueError):
        Member("a", 0.0)
    with pytest.raises(ValueError):
        Member("a", float("nan"))
    with pytest.raises(ValueError):
        Placement(_members(2), 0)
    with pytest.raises(ValueError):
        Placement(_members(2), 3, strategy="bogus")  # type: ignore[arg-type]


def test_placement_moved_lists_exactly_changed_keys() -> None:
    old = Placement(_members(5), 3)
    new = Placement(_members(5)[:4], 3)  # node-4 decommissioned
    keys = KEYS[:5000]
    moves = moved(old, new, keys)
    changed = {m.key for m in moves}
    for k in keys[:1000]:
        k = int(k)
        assert (old.owners(k) != new.owners(k)) == (k in changed)
    for m in moves:
        assert "node-4" in m.old and "node-4" not in m.new
    assert moved(old, old, keys) == []


def test_placement_epoch_changes_with_weight_and_replicas() -> None:
    ms = _members(3)
    base = Placement(ms, 3, strategy="weighted").epoch
    assert base != Placement(ms, 2, strategy="weighted").epoch
    heavier = (Member("node-0", 2.0),) + ms[1:]
    assert base != Placement(heavier, 3, strategy="weighted").epoch


@pytest.mark.parametrize("strategy", ["hash", "weighted"])
def test_placement_top_r_selection_matches_full_sort(strategy: str) -> None:
    ms = tuple(Member(f"m{i}", 1.0 + i % 5) for i in range(40))
    p = Placement(ms, 3, strategy=strategy)  # type: ignore[arg-type]
    full = Placement(ms, 40, strategy=strategy)  # type: ignore[arg-type]  # R = N: full argsort path
    assert np.array_equal(p.owner_indices(KEYS[:3000]), full.owner_indices(KEYS[:3000])[:, :3])


def test_placement_group_by_owner_covers_every_replica() -> None:
    p = Placement(_members(6), 3)
    keys = KEYS[:2000]
    groups = p.group_by_owner(keys)
    idx = p.owner_indices(keys)
    assert sum(len(v) for v in groups.values()) == idx.size
    for name, pos in groups.items():
        m = p.names.index(name)
        assert np.all((idx[pos] == m).any(axis=1))


def test_placement_equality_is_by_epoch() -> None:
    a = Placement(_members(3), 3)
    b = Placement(tuple(reversed(_members(3))), 3)
    assert a == b and hash(a) == hash(b) and a != Placement(_members(4), 3)


@pytest.mark.parametrize("strategy", ["hash", "weighted", "pinned"])
def test_placement_owner_cache_agrees_with_vector_path(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small calls answered from the owner cache (hits, misses, repeated keys, a cache that fills
    and is emptied) give exactly the rows of the uncached vector passes."""
    import peers.placement as placement_mod

    monkeypatch.setattr(placement_mod, "OWNER_CACHE_KEYS", 100)
    ms = tuple(Member(f"node-{i}", 1.0 + i) for i in range(7))
    keys = KEYS[:300]
    pl = Placement(ms, 3, strategy, {int(keys[5]): ("node-6", "node-2")})  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    for _ in range(200):
        ask = keys[rng.integers(0, keys.size, int(rng.integers(0, 20)))]
        got = pl.owner_indices(ask)
        want = pl._compute_owner_indices(ask)
        assert got.dtype == want.dtype and got.shape == (ask.size, 3)
        assert np.array_equal(got, want)
        got[:] = 0  # a caller's changes do not reach the cache
        assert np.array_equal(pl.owner_indices(ask), want)
    assert len(pl._owner_cache) <= 100
    big = keys[:200]  # over CACHED_CALL_KEYS: the vector path
    assert np.array_equal(pl.owner_indices(big), pl._compute_owner_indices(big))
    assert pl.owners(int(keys[5]))[:2] == ("node-6", "node-2")
