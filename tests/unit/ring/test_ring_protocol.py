"""The ring's wire messages (giaannd.protocol runtime requests) and its gossiped digest (NodeMeta.ring)."""

from __future__ import annotations

import pytest

from giaannd import protocol as p
from giaannd.cluster.ring import Ring
from peers.membership.messages import MAX_META_BYTES
from peers.membership.meta import NodeMeta


def test_runtime_request_peeks_only_runtime_tags() -> None:
    ring = Ring().with_active("a").with_removed("b")
    assert p.runtime_request(p.encode(p.RingGet())) == p.RingGet()
    assert p.runtime_request(p.encode(p.RingPush(ring.to_wire()))) == p.RingPush(ring.to_wire())
    msg = p.SetOverride([("a", "tcp://a:1", 1.0)], True, 5.0)
    assert p.runtime_request(p.encode(msg)) == msg
    assert p.runtime_request(p.encode(p.SetOverride())) == p.SetOverride(None, False)
    # role requests and garbage are left to the role handler
    for payload in (p.encode(p.GetUsage()), p.encode(p.ApplyBatch(1, 1)), b"", b"\xc1", b"\x92\x01\x02"):
        assert p.runtime_request(payload) is None


@pytest.mark.parametrize("msg", [
    p.RingPush([("a", 1, "gone", 1.0)]),  # type: ignore[list-item]
    p.RingPush([("", 1, "active", 1.0)]),
    p.RingPush([("a", -1, "active", 1.0)]),
    p.SetOverride([("a", "tcp://a:1", 0.0)]),
    p.SetOverride(None, True, 0.0),
    p.SetOverride(None, True, p.MAX_FLUSH_TIMEOUT_S + 1),
])
def test_runtime_request_bad_bodies_are_protocol_violations(msg) -> None:
    with pytest.raises(p.ProtocolViolation):
        p.runtime_request(p.encode(msg))


def test_ring_replies_decode() -> None:
    ring = Ring().with_active("a", 2.0)
    reply = p.decode_reply(p.encode(p.RingState(ring.to_wire())))
    assert isinstance(reply, p.RingState) and Ring.from_wire(reply.entries) == ring
    assert p.decode_reply(p.encode(p.OverrideSet("e" * 32, True))) == p.OverrideSet("e" * 32, True)


def test_node_meta_carries_the_ring_digest_within_the_size_limit() -> None:
    digest = Ring().with_active("storage-1").digest()
    assert NodeMeta.decode(NodeMeta(ring=digest).encode()).ring == digest
    assert NodeMeta.decode(NodeMeta().encode()).ring == 0  # absent (an older node): none
    # a realistic worst case: both roles, ucx + tcp + stream endpoints on long host names
    host = "storage-node-0042.rack-17.datacenter-eu-west.example.internal"
    meta = NodeMeta(roles=("storage", "compute"),
                    transports={"ucx": f"ucx://{host}:7401", "tcp": f"tcp://{host}:7400",
                                "stream": f"tcp://{host}:7402"},
                    capacity_bytes=2**40, weight=1.5, full=True, ring=2**64 - 1)
    assert len(meta.encode()) < MAX_META_BYTES
    assert NodeMeta.decode(meta.encode()) == meta
