"""giaannd.cluster.view: placement set vs live set, membership events, preference lists."""

import numpy as np
import pytest

from giaannd.cluster.view import ClusterView, StorageNode, ViewChange, pick_transport_address
from peers.membership.events import MemberFailed, MemberJoined, MemberLeft, MemberSuspected, MemberUpdated
from peers.membership.meta import NodeMeta


def _event(cls, name, roles=("storage",), transports=None, weight=1.0, meta=None):
    raw = meta if meta is not None else NodeMeta(
        roles=roles, transports=transports or {"tcp": f"tcp://{name}:1"}, weight=weight).encode()
    return cls(name, f"id-{name}", ("127.0.0.1", 1), 1, "alive", raw, "test")


def _topo():
    changes = []
    t = ClusterView(local="a", replicas=2)
    t.on_change(changes.append)
    t.set_members([StorageNode(n, f"mem://{n}") for n in "abc"])
    return t, changes


def test_topology_down_keeps_placement_up_notifies():
    t, changes = _topo()
    epoch = t.epoch
    assert changes[-1] == ViewChange(frozenset("abc"), frozenset(), True)
    t.mark_down("b")
    assert t.epoch == epoch and not t.is_live("b") and t.live() == ["a", "c"]
    assert changes[-1] == ViewChange(went_down=frozenset({"b"}))
    t.mark_down("b")  # idempotent: no second event
    assert len(changes) == 2
    t.mark_up("b")
    assert changes[-1] == ViewChange(came_up=frozenset({"b"})) and t.is_live("b")
    t.remove("b")
    assert t.epoch != epoch and "b" not in t and changes[-1].placement_changed


def test_topology_preference_starts_with_owners():
    t, _ = _topo()
    keys = np.arange(1, 200, dtype=np.uint64)
    pref = t.preference(keys)
    assert pref.shape == (199, 3)
    np.testing.assert_array_equal(pref[:, :2], t.placement.owner_indices(keys))
    assert all(sorted(row) == [0, 1, 2] for row in pref.tolist())


def test_topology_membership_events():
    t = ClusterView(replicas=3, schemes=("tcp",))
    t.apply_event(_event(MemberJoined, "x", transports={"tcp": "tcp://x:1", "ucx": "ucx://x:2"}))
    t.apply_event(_event(MemberJoined, "y", weight=2.0))
    t.apply_event(_event(MemberJoined, "z", roles=("compute",)))
    t.apply_event(_event(MemberJoined, "bad", meta=b"\xc1"))
    assert t.names == ("x", "y") and t.address("x") == "tcp://x:1"
    t.apply_event(_event(MemberSuspected, "x"))
    assert t.is_live("x")  # suspicion is not failure
    t.apply_event(_event(MemberFailed, "x"))
    assert not t.is_live("x") and "x" in t
    t.apply_event(_event(MemberJoined, "x"))
    assert t.is_live("x")
    t.apply_event(_event(MemberUpdated, "y", roles=("compute",)))  # no longer a storage node
    t.apply_event(_event(MemberLeft, "x"))
    with pytest.raises(LookupError):
        _ = t.placement


def test_pick_transport_address_prefers_ucx_when_spoken():
    meta = NodeMeta(transports={"tcp": "tcp://h:1", "ucx": "ucx://h:2"})
    assert pick_transport_address(meta, ["tcp", "ucx"]) == "ucx://h:2"
    assert pick_transport_address(meta, ["tcp"]) == "tcp://h:1"
    assert pick_transport_address(meta, ["mem"]) is None
