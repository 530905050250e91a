"""Override leases (giaannd/services/override_lease.py): a placement override set by a topology
operation's coordinator is dropped once that operation is known to have ended without clearing
it (the coordinator dead, restarted, or its operation failed), and kept while it runs or cannot be
asked. Also the wire side: ``SetOverride.lease``, ``OperationGet`` / ``OperationState``, and the
operation id a lease names staying fixed while the operation's own view switches."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from giaannd import protocol as p
from giaannd.cluster.ring import Ring
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.runtime.ring import NodeRing
from giaannd.services import override_lease
from giaannd.services.override_lease import OverrideLeaseWatch, lease_verdict
from giaannd.storage.rebalance.operations import Rebalance
from peers.membership.meta import NodeMeta

NEW = [StorageNode("a", "tcp://a:1"), StorageNode("b", "tcp://b:1"), StorageNode("j", "tcp://j:1")]
LEASE = p.OverrideLease("j", "join:aaaa->bbbb")


@pytest.mark.parametrize(("status", "state", "dropped"), [
    ("dead", "cutover", False),  # membership wrong (an overloaded coordinator): it answered
    ("dead", "", True),
    ("alive", "streaming", False),
    ("alive", "cutover", False),
    ("suspect", "cutover", False),
    ("alive", "failing", False),  # its clean-up clears the override itself
    ("alive", "done", False),  # the committed ring is on its way (ring sync)
    ("alive", None, False),  # no answer from a live coordinator: keep
    ("suspect", None, False),
    ("alive", "", True),  # restarted, or another operation since
    ("alive", "failed", True),
    ("alive", "cancelled", True),
    ("dead", None, True),
    ("left", None, True),
    (None, None, True),  # reaped: membership forgot it
])
def test_lease_verdict_table(status: str | None, state: str | None, dropped: bool) -> None:
    reason = lease_verdict(status, state)
    assert (reason is not None) == dropped, reason


@dataclass
class _Info:
    name: str
    status: str
    meta: bytes


class _Node:
    def __init__(self, **status: str) -> None:
        self.status = status

    def members(self) -> list[_Info]:
        meta = NodeMeta(roles=("storage",), transports={"tcp": "tcp://127.0.0.1:1"}).encode()
        return [_Info(name, s, meta) for name, s in self.status.items()]


class _Runtime:
    def __init__(self) -> None:
        async def flush() -> None:
            return None

        self.node_name = "c"
        self.topology = ClusterView(local="c", replicas=2, schemes=("tcp",))
        self.topology.set_ring(Ring().with_active("a").with_active("b"))
        self.rings = NodeRing(self.topology, lambda: None, flush)
        self.transports: dict[str, Any] = {"tcp": object()}
        self.identity = None


class _Asker:
    """Stands in for ``get_operation_state``: answers in turn (a callable is called, an exception raised)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    async def __call__(self, transports: Any, identity: Any, address: str, op_id: str, *, timeout_s: float) -> str:
        self.asked.append(op_id)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return str(answer() if callable(answer) else answer)


def _watch(monkeypatch: pytest.MonkeyPatch, node: _Node, *answers: Any) -> tuple[_Runtime, OverrideLeaseWatch, _Asker]:
    rt = _Runtime()
    asker = _Asker(*answers)
    monkeypatch.setattr(override_lease, "get_operation_state", asker)
    return rt, OverrideLeaseWatch(rt, node), asker  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_an_override_whose_coordinator_died_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, watch, asker = _watch(monkeypatch, _Node(a="alive", b="alive", c="alive", j="dead"),
                              ConnectionRefusedError("nobody listens"))
    ring_epoch = rt.topology.epoch
    rt.rings.set_override(NEW, LEASE)
    assert rt.topology.override is not None and rt.topology.epoch != ring_epoch
    reason = await watch.check()
    assert reason is not None and "dead" in reason
    assert rt.topology.override is None and rt.topology.epoch == ring_epoch
    assert rt.rings.lease is None and asker.asked == [LEASE.op_id]  # asked: it did not answer
    assert watch.health()["dropped"] == 1 and "join:aaaa->bbbb" in watch.health()["last_drop"]


@pytest.mark.asyncio
async def test_a_coordinator_membership_calls_dead_but_that_answers_keeps_its_override(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An overloaded coordinator may be declared dead while its cutover goes on: its answer wins.
    (The first version dropped on membership's word alone: writes under the old placement after
    the streams closed reached an owner that forwarded them nowhere.)"""
    rt, watch, asker = _watch(monkeypatch, _Node(a="alive", b="alive", c="alive", j="dead"), "cutover")
    rt.rings.set_override(NEW, LEASE)
    assert await watch.check() is None
    assert rt.topology.override is not None and asker.asked == [LEASE.op_id]


@pytest.mark.asyncio
async def test_an_override_stays_while_its_operation_runs_and_goes_once_it_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt, watch, asker = _watch(monkeypatch, _Node(a="alive", b="alive", c="alive", j="alive"),
                              "cutover", ConnectionResetError("no answer"), "done", "")
    rt.rings.set_override(NEW, LEASE)
    for _ in range(3):  # running; unreachable (kept: membership has it alive); done (ring on its way)
        assert await watch.check() is None
        assert rt.topology.override is not None
    assert watch.ask_errors == 1
    reason = await watch.check()  # the coordinator restarted: it runs no such operation
    assert reason is not None and "no such operation" in reason
    assert rt.topology.override is None
    assert asker.asked == [LEASE.op_id] * 4


@pytest.mark.asyncio
async def test_an_override_without_a_lease_or_replaced_while_asked_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    newer = p.OverrideLease("a", "decommission:bbbb->cccc")
    rt: _Runtime

    def replaced() -> str:  # another operation's override arrives while the answer is on its way
        rt.rings.set_override(NEW[:2] + [StorageNode("k", "tcp://k:1")], newer)
        return ""

    rt, watch, asker = _watch(monkeypatch, _Node(a="alive", b="alive", c="alive", j="alive"), replaced)
    rt.rings.set_override(NEW)  # a coordinator that predates leases
    assert await watch.check() is None and asker.asked == [] and rt.topology.override is not None
    rt.rings.set_override(NEW, LEASE)
    assert await watch.check() is None
    assert rt.rings.lease == newer and rt.topology.override is not None


@pytest.mark.asyncio
async def test_a_lease_this_node_coordinates_is_checked_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, watch, asker = _watch(monkeypatch, _Node(a="alive", b="alive"))
    states = {"join:aaaa->bbbb": "cutover"}
    rt.rings.operation_state = lambda op_id: states.get(op_id, "")
    rt.rings.set_override(NEW, p.OverrideLease("c", "join:aaaa->bbbb"))
    assert await watch.check() is None and rt.topology.override is not None
    states.clear()
    assert await watch.check() is not None and rt.topology.override is None
    assert asker.asked == []


@pytest.mark.asyncio
async def test_the_watch_loop_drops_an_orphaned_override_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, watch, _ = _watch(monkeypatch, _Node(a="alive", b="alive", c="alive"))  # j: not a member any more
    watch.interval_s = 0.01
    rt.rings.set_override(NEW, LEASE)
    watch.start()
    try:
        async with asyncio.timeout(5):
            while rt.topology.override is not None:
                await asyncio.sleep(0.01)
    finally:
        await watch.stop()
    assert watch.dropped == 1


# -- the wire and the node's ring ---------------------------------------------------------------
def test_set_override_with_and_without_a_lease_on_the_wire() -> None:
    class OldSetOverride(msgspec.Struct, frozen=True, tag=12):  # the message before Dec 2
        members: list[tuple[str, str, float]] | None = None
        flush: bool = False
        flush_timeout_s: float = 30.0

    old = p.runtime_request(msgspec.msgpack.encode(OldSetOverride([("a", "tcp://a:1", 1.0)], True)))
    assert isinstance(old, p.SetOverride) and old.lease is None and old.flush
    new = p.runtime_request(p.encode(p.SetOverride([("a", "tcp://a:1", 1.0)], lease=LEASE)))
    assert isinstance(new, p.SetOverride) and new.lease == LEASE
    get = p.runtime_request(p.encode(p.OperationGet(LEASE.op_id)))
    assert get == p.OperationGet(LEASE.op_id)
    assert p.decode_reply(p.encode(p.OperationState("cutover"))) == p.OperationState("cutover")
    with pytest.raises(p.ProtocolViolation):
        p.runtime_request(msgspec.msgpack.encode({"type": 19, "op_id": ""}))


@pytest.mark.asyncio
async def test_node_ring_keeps_the_lease_beside_the_override_and_answers_operation_get() -> None:
    rt = _Runtime()
    rings = rt.rings
    assert await rings.serve(p.OperationGet("x")) == p.OperationState("")
    rings.operation_state = lambda op_id: "cutover" if op_id == "x" else ""
    assert await rings.serve(p.OperationGet("x")) == p.OperationState("cutover")
    wire = [(m.name, m.address, m.weight) for m in NEW]
    reply = await rings.serve(p.SetOverride(wire, lease=LEASE))
    assert isinstance(reply, p.OverrideSet) and reply.override and rings.lease == LEASE
    await rings.serve(p.SetOverride(None, lease=LEASE))
    assert rt.topology.override is None and rings.lease is None
    await rings.serve(p.SetOverride(wire, lease=LEASE))
    rt.topology.set_ring(Ring().with_active("a").with_active("b").with_active("j"))  # the ring caught up
    assert rt.topology.override is None and rings.lease is None


def test_an_operations_id_stays_while_its_view_switches() -> None:
    """The id a lease names is the one the coordinator answers for during its whole cutover.
    Before, ``op_id`` was computed from the view at each use: once the coordinator switched itself,
    it answered "" for its own running operation, and every leased node would have dropped its
    override in the middle of the cutover."""
    view = ClusterView(local="a", replicas=2, schemes=("tcp",))
    view.set_ring(Ring().with_active("a").with_active("b"))
    after = NEW

    class _Control:
        def view(self) -> ClusterView:
            return view

    op = Rebalance(_Control(), "join", after)  # type: ignore[arg-type]
    first = op.op_id
    view.set_override(after)  # the cutover's first switch (a join's coordinator is its target)
    assert op.op_id == first
