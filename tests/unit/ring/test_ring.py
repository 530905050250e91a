"""giaannd.cluster.ring: the CRDT laws (hypothesis), changes, digest, wire and file round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.cluster.ring import MAX_RING_ENTRIES, Ring, RingEntry
from giaannd.errors import CorruptFileError

_NAMES = st.sampled_from(["a", "b", "c", "d"])
_ENTRIES = st.builds(RingEntry, st.integers(0, 4), st.sampled_from(["active", "removed"]),
                     st.sampled_from([0.5, 1.0, 2.0]))
_RINGS = st.dictionaries(_NAMES, _ENTRIES, max_size=4).map(Ring)


def merged(*rings: Ring) -> Ring:
    out = Ring()
    for r in rings:
        out.merge(r)
    return out


@settings(max_examples=300, deadline=None)
@given(_RINGS, _RINGS)
def test_ring_merge_is_commutative(a: Ring, b: Ring) -> None:
    assert merged(a, b) == merged(b, a)
    assert merged(a, b).digest() == merged(b, a).digest()


@settings(max_examples=300, deadline=None)
@given(_RINGS, _RINGS, _RINGS)
def test_ring_merge_is_associative(a: Ring, b: Ring, c: Ring) -> None:
    left = merged(merged(a, b), c)
    right = merged(a, merged(b, c))
    assert left == right


@settings(max_examples=300, deadline=None)
@given(_RINGS, _RINGS)
def test_ring_merge_is_idempotent_and_reports_change(a: Ring, b: Ring) -> None:
    x = merged(a)
    changed = x.merge(b)
    assert changed == (x != a)
    assert x.merge(b) is False  # merging the same again changes nothing
    assert x.merge(x) is False and x.merge(a) is False  # x already includes a


def test_ring_changes_bump_stamps_and_removed_wins_ties() -> None:
    r = Ring().with_active("a").with_active("b", 2.0)
    assert r.active() == [("a", 1.0), ("b", 2.0)]
    assert r.with_active("a") is r  # nothing to change
    gone = r.with_removed("a")
    assert gone.get("a") == RingEntry(2, "removed", 1.0) and gone.active() == [("b", 2.0)]
    assert r.active() == [("a", 1.0), ("b", 2.0)]  # with_* returns a copy
    back = gone.with_active("a", 3.0)
    assert back.get("a") == RingEntry(3, "active", 3.0)
    # a concurrent add and remove of the same stamp: removed wins, on both sides
    add, rm = Ring({"x": RingEntry(4, "active", 1.0)}), Ring({"x": RingEntry(4, "removed", 1.0)})
    assert merged(add, rm).get("x").state == "removed" and merged(rm, add).get("x").state == "removed"
    # an old copy of the ring cannot bring a removed member back
    stale = Ring(r.entries)
    assert not (x := Ring(gone.entries)).merge(stale) and x.get("a").state == "removed"


def test_ring_digest_is_canonical() -> None:
    assert Ring().digest() == 0
    a = Ring().with_active("a").with_active("b")
    b = Ring().with_active("b").with_active("a")
    assert a.digest() == b.digest() != 0
    assert a.with_active("a", 2.0).digest() != a.digest()
    assert a.with_removed("b").digest() != a.digest()


def test_ring_wire_round_trip_and_validation() -> None:
    r = Ring().with_active("a", 2.0).with_removed("b")
    assert Ring.from_wire(r.to_wire()) == r
    assert r.to_wire() == [("a", 1, "active", 2.0), ("b", 1, "removed", 1.0)]
    with pytest.raises(ValueError, match="twice"):
        Ring.from_wire([("a", 1, "active", 1.0), ("a", 2, "active", 1.0)])
    with pytest.raises(ValueError, match="weight"):
        Ring.from_wire([("a", 1, "active", 0.0)])
    with pytest.raises(ValueError, match="weight"):
        RingEntry(1, "active", float("nan"))
    with pytest.raises(ValueError, match="state"):
        RingEntry(1, "gone", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        Ring().with_active("")
    big = Ring({f"n{i}": RingEntry(1, "active") for i in range(MAX_RING_ENTRIES)})
    with pytest.raises(ValueError, match="at most"):
        big.with_active("one-more")
    with pytest.raises(ValueError, match="at most"):
        big.merge(Ring({"x": RingEntry(1, "active")}))
    assert big.get("x") is None and len(big) == MAX_RING_ENTRIES  # unchanged


def test_ring_file_round_trip_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "ring.json"
    assert Ring.load(path) == Ring()
    r = Ring().with_active("a").with_active("b", 2.0).with_removed("a")
    r.save(path)
    assert Ring.load(path) == r
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["entries"]["a"] == {"stamp": 2, "state": "removed", "weight": 1.0}


@pytest.mark.parametrize("text", [
    "not json", '{"version": 1}', '{"version": 2, "entries": {}}',
    '{"version": 1, "entries": {"a": {"stamp": -1, "state": "active", "weight": 1}}}',
    '{"version": 1, "entries": {"a": {"stamp": 1, "state": "active", "weight": 0}}}',
    '{"version": 1, "entries": {"a": {"stamp": 1, "state": "active", "weight": 1, "x": 1}}}',
    # a stamp no wire message (msgpack u64) can carry: digest() and RingGet would fail on it
    '{"version": 1, "entries": {"a": {"stamp": 18446744073709551616, "state": "active", "weight": 1}}}',
])
def test_ring_corrupt_file_names_the_path_and_is_kept(tmp_path: Path, text: str) -> None:
    path = tmp_path / "ring.json"
    path.write_text(text)
    with pytest.raises(CorruptFileError) as info:
        Ring.load(path)
    assert str(path) in str(info.value)
    assert path.read_text() == text  # never overwritten


def test_ring_merge_equal_entries_have_one_digest() -> None:
    """A tombstone's weight -0.0 (from a peer's RingPush or an edited file) is merge-equal to 0.0:
    neither ring takes the other's entry, so two nodes holding them must have the same digest, or
    ring sync pulls between them forever."""
    zero = Ring({"x": RingEntry(2, "removed", 0.0)})
    neg = Ring.from_wire([("x", 2, "removed", -0.0)])
    assert zero == neg and not Ring(zero.entries).merge(neg) and not Ring(neg.entries).merge(zero)
    assert zero.digest() == neg.digest()
    assert Ring({"a": RingEntry(1, "active", 2)}).digest() == Ring().with_active("a", 2.0).digest()


def test_ring_stamp_past_u64_is_refused_not_left_undigestable() -> None:
    """A change past the largest encodable stamp is refused (ValueError): accepted, it made a ring
    whose digest(), RingGet reply and gossip all raise OverflowError."""
    top = Ring.from_wire([("a", 2**64 - 1, "active", 1.0)])
    assert top.digest() != 0
    with pytest.raises(ValueError, match="stamp"):
        top.with_removed("a")
    with pytest.raises(ValueError, match="stamp"):
        RingEntry(2**64, "active")
