"""Member-mode ClusterView and member weights placement cannot use (review, Nov 30).

A storage member gossiping ``weight = inf`` (``NodeMeta`` accepts it: only ``>= 0`` is checked) or
a test feeding ``add`` / ``set_members`` a weight of 0 / inf / NaN used to enter the placement set;
from then on every ``placement`` lookup raised ``ValueError`` (one member's metadata broke every
read and write of the view). The event now takes the default weight 1.0 (as one of 0 already did),
and ``add`` / ``set_members`` refuse the weight, leaving the view unchanged.
"""

from __future__ import annotations

import math

import pytest

from giaannd.cluster.view import ClusterView, StorageNode
from peers.membership.events import MemberJoined
from peers.membership.messages import MemberStatus
from peers.membership.meta import NodeMeta


def _joined(name: str, weight: float) -> MemberJoined:
    meta = NodeMeta(roles=("storage",), transports={"tcp": f"tcp://{name}:1"}, weight=weight).encode()
    return MemberJoined(name, f"id-{name}", ("127.0.0.1", 1), 1, MemberStatus.ALIVE, meta, "test")


def _view() -> ClusterView:
    view = ClusterView()
    view.set_members([StorageNode("a", "tcp://a:1"), StorageNode("b", "tcp://b:1")])
    return view


def test_member_gossiping_infinite_weight_does_not_break_placement() -> None:
    view = _view()
    view.apply_event(_joined("c", math.inf))
    assert view.placement.names == ("a", "b", "c")  # raised ValueError: weight must be finite
    assert len(view.placement.owners(7)) == 3


@pytest.mark.parametrize("weight", [0.0, -1.0, math.inf, math.nan])
def test_add_refuses_a_weight_placement_cannot_use(weight: float) -> None:
    view = _view()
    epoch = view.epoch
    with pytest.raises(ValueError):
        view.add(StorageNode("c", "tcp://c:1", weight))
    assert "c" not in view and view.epoch == epoch


@pytest.mark.parametrize("weight", [0.0, math.inf, math.nan])
def test_set_members_refuses_a_weight_placement_cannot_use(weight: float) -> None:
    view = _view()
    epoch = view.epoch
    with pytest.raises(ValueError):
        view.set_members([StorageNode("a", "tcp://a:1"), StorageNode("c", "tcp://c:1", weight)])
    assert view.names == ("a", "b") and view.epoch == epoch
