"""A seed that names this node under another spelling (``localhost`` for 127.0.0.1, a host name
for its address) answers the join push-pull itself. That answer is not a cluster: it must not
count as a seed that answered, or the node "joins" only itself while the real seeds are down."""

import asyncio
import random
import socket

import msgspec
import pytest

from peers.keyring import Keyring
from peers.membership.config import MembershipConfig
from peers.membership.events import (
    Join,
    JoinFinished,
    OpenStream,
    ReplyStream,
    StreamReply,
    StreamRequest,
)
from peers.membership.node import JoinError, MembershipNode
from peers.membership.state import Membership

SELF = ("10.0.0.100", 1)
ALIAS = ("me.example", 1)  # this node, spelled another way
OTHER = ("10.0.0.2", 1)


def _core():
    return Membership(MembershipConfig(), name="me", node_id="id-me", addr=SELF, rng=random.Random(1))


def _answer_self(core, stream, now):
    """Deliver ``stream`` to ``core`` itself (the alias reaches this node) and its reply back."""
    (reply,) = [a for a in core.handle(now, StreamRequest(SELF, 99, stream.message))
                if isinstance(a, ReplyStream) and a.token == 99]
    return core.handle(now, StreamReply(stream.token, reply.message))


def test_join_answer_from_self_does_not_count_as_contacted():
    core = _core()
    streams = [a for a in core.handle(0.0, Join((ALIAS, OTHER))) if isinstance(a, OpenStream)]
    assert [s.addr for s in streams] == [ALIAS, OTHER]
    _answer_self(core, streams[0], 0.1)
    out = core.handle(0.2, StreamReply(streams[1].token, None))  # the other seed is down
    assert [a for a in out if isinstance(a, JoinFinished)] == [JoinFinished(0, None, selves=1)]


def test_join_through_only_self_reports_every_seed_was_self():
    core = _core()
    (stream,) = [a for a in core.handle(0.0, Join((ALIAS,))) if isinstance(a, OpenStream)]
    out = _answer_self(core, stream, 0.1)
    assert [a for a in out if isinstance(a, JoinFinished)] == [JoinFinished(0, None, selves=1)]


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(scenario):
    async def main():
        cfg = msgspec.structs.replace(MembershipConfig.loopback(), join_attempts=2)
        key = Keyring.generate()
        nodes = [MembershipNode(name=f"n{i}", bind=("127.0.0.1", 0), cluster="t", keyring=key, config=cfg)
                 for i in range(2)]
        for node in nodes:
            await node.start()
        try:
            async with asyncio.timeout(20):
                await scenario(*nodes)
        finally:
            for node in nodes:
                await node.stop()
    asyncio.run(main())


def test_join_through_self_alias_and_a_down_seed_fails_like_listing_self():
    """Before: the node's own answer made the join succeed at once, a cluster of one."""
    async def scenario(n0, n1):
        with pytest.raises(JoinError):
            await n0.join([("localhost", n0.addr[1]), ("127.0.0.1", _closed_port())])
    _run(scenario)


def test_join_through_self_alias_and_a_live_seed_joins_its_cluster():
    async def scenario(n0, n1):
        assert await n0.join([("localhost", n0.addr[1]), n1.addr]) == 1
        assert {m.name for m in n0.members()} == {"n0", "n1"}
    _run(scenario)


def test_join_through_only_self_alias_starts_alone():
    """As a node listing itself (the first of a cluster): no error, no other member."""
    async def scenario(n0, n1):
        assert await n0.join([("localhost", n0.addr[1])]) == 0
        assert {m.name for m in n0.members()} == {"n0"}
    _run(scenario)
