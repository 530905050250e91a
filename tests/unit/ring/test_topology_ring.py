"""giaannd.cluster.view in ring mode: placement from the ring, liveness from membership, standby,
the cutover override; and the start decision of ring sync (join_action)."""

from __future__ import annotations

import pytest

from giaannd.cluster.ring import Ring
from giaannd.cluster.view import ClusterView, StorageNode, ViewChange
from giaannd.services.ring_sync import join_action
from peers.membership.events import MemberFailed, MemberJoined, MemberLeft, MemberReaped, MemberUpdated
from peers.membership.meta import NodeMeta


def _event(cls, name, roles=("storage",), port=1, weight=1.0):
    meta = NodeMeta(roles=roles, transports={"tcp": f"tcp://{name}:{port}"}, weight=weight).encode()
    return cls(name, f"id-{name}", ("127.0.0.1", 1), 1, "alive", meta, "test")


def _ring(*names: str, **weights: float) -> Ring:
    r = Ring()
    for n in names:
        r = r.with_active(n, weights.get(n, 1.0))
    return r


def _topo(ring: Ring, *alive: str) -> tuple[ClusterView, list[ViewChange]]:
    t = ClusterView(local="a", replicas=2, schemes=("tcp",))
    changes: list[ViewChange] = []
    t.on_change(changes.append)
    t.set_ring(ring)
    for n in alive:
        t.apply_event(_event(MemberJoined, n))
    return t, changes


def test_topology_ring_mode_placement_is_the_ring_not_membership() -> None:
    t, changes = _topo(_ring("a", "b", "c"), "a", "b", "x")
    # c is in the ring but never seen: in the placement, down; x is alive but not in the ring: standby
    assert t.names == ("a", "b", "c") and t.live() == ["a", "b"]
    assert not t.is_live("c") and "c" in t
    with pytest.raises(KeyError):
        t.address("c")
    assert t.standby() == ["x"] and t.is_live("x") and t.address("x") == "tcp://x:1" and "x" not in t
    assert changes[-1].standby_changed and not changes[-1].placement_changed
    epoch = t.epoch
    # c appears: it comes up, the placement does not move
    t.apply_event(_event(MemberJoined, "c"))
    assert changes[-1] == ViewChange(came_up=frozenset({"c"}))
    # leaving or being reaped only marks a ring member down (never removes it)
    for cls in (MemberLeft, MemberReaped, MemberFailed):
        t.apply_event(_event(MemberJoined, "b"))
        t.apply_event(_event(cls, "b"))
        assert t.names == ("a", "b", "c") and not t.is_live("b") and t.epoch == epoch
    assert t.address("b") == "tcp://b:1"  # the last known address is kept
    # a restart with a new port updates the address without a placement change
    t.apply_event(_event(MemberUpdated, "b", port=9))
    assert t.is_live("b") and t.address("b") == "tcp://b:9" and t.epoch == epoch


def test_topology_ring_mode_follows_ring_changes_and_weights() -> None:
    t, changes = _topo(_ring("a", "b"), "a", "b", "c")
    epoch = t.epoch
    t.set_ring(_ring("a", "b", "c"))  # c activated (a join committed)
    assert t.names == ("a", "b", "c") and t.standby() == [] and t.epoch != epoch
    assert changes[-1].placement_changed and changes[-1].came_up == frozenset({"c"})
    t.set_ring(_ring("a", "b", "c").with_removed("a"))  # a decommissioned: standby now
    assert t.names == ("b", "c") and t.standby() == ["a"]
    assert changes[-1].went_down == frozenset({"a"})
    t.set_ring(_ring("b", "c", c=2.0))
    # (epoch: weights count under "weighted")
    assert t.placement.members[1].weight == 2.0 and changes[-1].placement_changed
    # a member that stops being a storage node is forgotten (address, liveness)
    t.apply_event(_event(MemberUpdated, "a", roles=("compute",)))
    assert t.standby() == [] and not t.is_live("a")


def test_topology_ring_mode_override_and_auto_clear() -> None:
    t, changes = _topo(_ring("a", "b"), "a", "b", "c")
    old = t.epoch
    new_members = [StorageNode("a", "tcp://a:1"), StorageNode("b", "tcp://b:1"), StorageNode("c", "tcp://c:7")]
    t.set_override(new_members)
    assert t.override is not None and t.names == ("a", "b", "c") and t.epoch != old
    assert t.address("c") == "tcp://c:1"  # membership's address wins over the override's
    assert changes[-1].placement_changed
    new = t.epoch
    t.set_ring(_ring("a", "b"))  # an unrelated ring refresh: the override stays
    assert t.override is not None and t.epoch == new
    t.set_ring(_ring("a", "b", "c"))  # the operation committed: equal sets end the override
    assert t.override is None and t.epoch == new
    # clearing by hand goes back to the ring
    t.set_override([StorageNode("a", "tcp://a:1")])
    assert t.names == ("a",)
    t.set_override(None)
    assert t.override is None and t.names == ("a", "b", "c")
    # an override equal to the ring is no override; weights count
    t.set_override(new_members)
    assert t.override is None
    t.set_override([StorageNode("a", "", 2.0), StorageNode("b", ""), StorageNode("c", "")])
    assert t.override is not None
    with pytest.raises(ValueError):
        t.set_override([])
    with pytest.raises(ValueError):
        t.set_override([StorageNode("a", ""), StorageNode("a", "")])


def test_topology_ring_mode_refuses_member_mode_inputs() -> None:
    t, _ = _topo(_ring("a"), "a")
    for call in (lambda: t.set_members([StorageNode("b", "")]), lambda: t.add(StorageNode("b", "")),
                 lambda: t.remove("a")):
        with pytest.raises(RuntimeError, match="ring mode"):
            call()
    with pytest.raises(RuntimeError, match="ring mode"):
        ClusterView().set_override(None)
    # mark_down / mark_up act on liveness
    t.mark_down("a")
    assert not t.is_live("a") and t.live() == []
    t.mark_up("a")
    assert t.is_live("a")
    t.mark_up("never-seen")
    assert not t.is_live("never-seen")


def test_topology_ring_mode_empty_ring_has_no_placement() -> None:
    t, _ = _topo(Ring(), "a")
    assert t.standby() == ["a"] and t.epoch == ""
    with pytest.raises(LookupError):
        _ = t.placement


@pytest.mark.parametrize(("mode", "ring", "action"), [
    ("auto", _ring("me", "b"), "active"),
    ("bootstrap", _ring("me"), "active"),
    ("manual", _ring("me"), "active"),
    ("auto", _ring("me").with_removed("me"), "standby"),
    ("bootstrap", _ring("me", "b").with_removed("me"), "standby"),
    ("auto", Ring(), "bootstrap"),
    ("auto", _ring("b").with_removed("b"), "bootstrap"),
    ("bootstrap", Ring(), "bootstrap"),
    ("manual", Ring(), "standby"),
    ("auto", _ring("b"), "join"),
    ("bootstrap", _ring("b"), "bootstrap"),
    ("manual", _ring("b"), "standby"),
])
def test_join_action_table(mode, ring, action) -> None:
    assert join_action(mode, ring, "me") == action


def _masks_by_name(t: ClusterView) -> tuple[list[bool], list[bool]]:
    return [not t.is_live(n) for n in t.names], [n == t.local for n in t.names]


def test_view_masks_follow_every_change_and_are_kept_while_nothing_changes() -> None:
    """``masks()`` (what a read orders owners by) equals is_live/local member by member after each
    change, in ring mode and member mode, and is the same arrays while nothing changed."""
    t, _ = _topo(_ring("a", "b", "c"), "a", "b")
    down, local = t.masks()
    assert (down.tolist(), local.tolist()) == _masks_by_name(t) == ([False, False, True], [True, False, False])
    assert t.masks()[0] is down and not down.flags.writeable
    for step in (lambda: t.apply_event(_event(MemberJoined, "c")), lambda: t.mark_down("b"),
                 lambda: t.mark_up("b"), lambda: t.set_ring(_ring("a", "b", "c", "d"))):
        step()
        got = t.masks()
        assert (got[0].tolist(), got[1].tolist()) == _masks_by_name(t)
    t.local = "c"
    assert t.masks()[1].tolist() == _masks_by_name(t)[1]
    m = ClusterView(local="n1", replicas=2)
    m.set_members([StorageNode(f"n{i}", f"mem://n{i}") for i in range(4)])
    for step in (lambda: m.mark_down("n2"), lambda: m.add(StorageNode("n5", "mem://n5")), lambda: m.mark_up("n2"),
                 lambda: m.remove("n0"), lambda: m.mark_down("n3")):
        step()
        got = m.masks()
        assert (got[0].tolist(), got[1].tolist()) == _masks_by_name(m)


def test_topology_ring_mode_override_with_a_bad_weight_is_refused_unchanged() -> None:
    """SetOverride's wire check lets an infinite weight through (gt=0); the view must refuse it
    before taking it, or every later placement lookup on the node raises."""
    t, _ = _topo(_ring("a", "b"), "a", "b")
    epoch = t.epoch
    for bad in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError):
            t.set_override([StorageNode("a", "", 1.0), StorageNode("c", "", bad)])
        assert t.override is None and t.epoch == epoch and t.names == ("a", "b")


@pytest.mark.asyncio
async def test_node_ring_refuses_an_override_with_an_infinite_weight() -> None:
    from giaannd import protocol as p
    from giaannd.runtime.ring import NodeRing

    async def flush() -> None:
        return None

    t, _ = _topo(_ring("a", "b"), "a", "b")
    epoch = t.epoch
    rings = NodeRing(t, lambda: None, flush)
    msg = p.runtime_request(p.encode(p.SetOverride([("a", "tcp://a:1", 1.0), ("c", "tcp://c:1", float("inf"))])))
    assert isinstance(msg, p.SetOverride)  # the wire check lets it through
    reply = await rings.serve(msg)
    assert isinstance(reply, p.BadRequest)
    assert t.override is None and t.epoch == epoch
