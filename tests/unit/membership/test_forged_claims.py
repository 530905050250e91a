"""The core against forged gossip from a key holder (issue 16): incarnations near the wire's limit
(item 3) and an Alive that moves a live member to a wrong address (item 4)."""

import asyncio
import gc
import ipaddress
import random
import socket

import msgspec
import pytest

from peers.keyring import Keyring
from peers.membership.config import MembershipConfig
from peers.membership.events import (
    Emit,
    MemberJoined,
    MemberUpdated,
    OpenStream,
    Received,
    Send,
    Start,
    StreamReply,
    TimerFired,
    UpdateMeta,
)
from peers.membership.messages import (
    MAX_INCARNATION,
    Ack,
    Alive,
    Dead,
    IndirectPing,
    MemberState,
    MemberStatus,
    Nack,
    Ping,
    Suspect,
    decode_compound,
    encode_compound,
)
from peers.membership.node import JoinError, MembershipNode
from peers.membership.state import Membership

STEP = MembershipConfig().max_incarnation_step
OLD = ("10.0.0.1", 1)
NEW = ("10.0.0.99", 7)
ATTACKER = ("10.66.6.6", 1)


def make(incarnation=0, p0_incarnation=1, **cfg):
    core = Membership(MembershipConfig(**cfg), name="me", node_id="id-me", addr=("10.0.0.100", 1),
                      rng=random.Random(7), incarnation=incarnation)
    core.restore([MemberState(f"p{i}", f"id-p{i}", (f"10.0.0.{i + 1}", 1), p0_incarnation if i == 0 else 1,
                              MemberStatus.ALIVE) for i in range(4)])
    core.handle(0.0, Start())
    return core


def gossip(core, now):
    """What the next gossip round sends (the timer armed by Start is due by ``now``)."""
    return sends(core.handle(now, TimerFired("gossip")))


def recv(core, now, *messages, addr=ATTACKER):
    return core.handle(now, Received(addr, list(messages)))


def sends(actions):
    return [a for a in actions if isinstance(a, Send)]


def emitted(actions, kind=object):
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, kind)]


def assert_wire_valid(core, actions):
    """Everything the core sends (and still has queued) decodes on the receiving side."""
    for i in range(3):
        actions = [*actions, *gossip(core, 100.0 + i)]
    for send in sends(actions):
        decode_compound(encode_compound(send.messages))


# -- item 3: incarnations ------------------------------------------------------------------------

@pytest.mark.parametrize("own", [0, 5, STEP, MAX_INCARNATION - STEP, MAX_INCARNATION - 1, MAX_INCARNATION])
@pytest.mark.parametrize("accused", [0, 7, STEP + 3, 2**62, MAX_INCARNATION - 1, MAX_INCARNATION])
@pytest.mark.parametrize("kind", [Suspect, Dead, Alive])
def test_refutation_never_leaves_the_wire_range(own, accused, kind):
    core = make(incarnation=own)
    message = (Alive(accused, "me", "id-me", ("10.6.6.6", 9)) if kind is Alive
               else kind(accused, "me", "p1"))
    out = recv(core, 1.0, message)
    local = core.local.incarnation
    assert own <= local <= MAX_INCARNATION
    assert local <= own + STEP + (2 if kind is Alive else 1)  # a bounded step, never to the limit
    assert_wire_valid(core, out)


def test_accusation_at_the_wire_limit_is_clamped_to_a_bounded_step():
    core = make(incarnation=3)
    recv(core, 1.0, Suspect(MAX_INCARNATION, "me", "p1"))
    assert core.local.incarnation == 3 + STEP + 1  # refuted just past the clamped accusation
    assert core.counters["incarnations_clamped"] == 1


@pytest.mark.parametrize("kind", [Suspect, Dead])
def test_accusation_about_a_peer_is_clamped(kind):
    core = make()
    out = recv(core, 1.0, kind(MAX_INCARNATION, "p0", "p1"))
    assert core.member("p0").incarnation == 1 + STEP
    gossiped = [m for s in gossip(core, 2.0) for m in s.messages if isinstance(m, kind)]
    assert gossiped and all(m.incarnation == 1 + STEP for m in gossiped)
    assert_wire_valid(core, out)


def test_alive_jump_is_clamped_and_a_fresh_restart_outranks_it():
    core = make()
    recv(core, 1.0, Alive(MAX_INCARNATION, "p0", "id-p0", OLD))
    assert core.member("p0").incarnation == 1 + STEP + 1
    # p0 restarts with fresh state and refutes what the cluster holds (+1): taken back
    recv(core, 2.0, Dead(core.member("p0").incarnation, "p0", "p1"))
    assert core.member("p0").status == MemberStatus.DEAD
    out = recv(core, 3.0, Alive(2 + STEP + 1, "p0", "id-p0", OLD), addr=OLD)
    assert core.member("p0").status == MemberStatus.ALIVE and emitted(out, MemberJoined)


def test_unknown_member_incarnation_is_measured_from_zero():
    core = make()
    recv(core, 1.0, Alive(MAX_INCARNATION, "x", "id-x", ("10.0.0.50", 1)))
    assert core.member("x").incarnation == STEP + 1


def test_meta_update_at_the_limit_does_not_overflow():
    core = make(incarnation=MAX_INCARNATION)
    out = core.handle(1.0, UpdateMeta(b"m"))
    assert core.local.incarnation == MAX_INCARNATION
    assert_wire_valid(core, out)


# -- item 4: a live member's address changes only once the new address answers as that member ----

def _claim(core, now=1.0, incarnation=2, addr=NEW):
    out = recv(core, now, Alive(incarnation, "p0", "id-p0", addr))
    pings = [(s, m) for s in sends(out) for m in s.messages if isinstance(m, Ping) and s.addr == addr]
    return out, pings


def test_claimed_address_is_probed_and_kept_aside_until_acked():
    core = make()
    out, pings = _claim(core)
    assert core.member("p0").addr == OLD and core.member("p0").incarnation == 1
    assert not emitted(out, MemberUpdated)
    ((_, ping),) = pings
    assert ping.target == "p0"  # only p0 itself acks it (a different member at NEW does not)
    streams = [a for a in out if isinstance(a, OpenStream) and a.addr == NEW]
    assert streams and streams[0].message.target == "p0"  # also over TCP: a lost datagram is not fatal
    # the member at its current address hears of the claim: a forged one gets refuted
    forwarded = [m for s in sends(out) if s.addr == OLD for m in s.messages if isinstance(m, Alive)]
    assert forwarded and forwarded[0].addr == NEW
    out = recv(core, 1.1, Ack(ping.seq), addr=NEW)
    member = core.member("p0")
    assert (member.addr, member.incarnation) == (NEW, 2)
    assert [e.cause for e in emitted(out, MemberUpdated)] == ["meta"]


def test_claimed_address_acked_over_tcp_is_adopted():
    core = make()
    out, _ = _claim(core)
    (stream,) = [a for a in out if isinstance(a, OpenStream) and a.addr == NEW]
    core.handle(1.2, StreamReply(stream.token, Ack(stream.message.seq)))
    assert core.member("p0").addr == NEW


def test_unconfirmed_claim_expires_and_a_late_ack_changes_nothing():
    core = make()
    out, ((_, ping),) = _claim(core)
    (timer,) = [a for a in out if getattr(a, "key", None) == ("claim", ping.seq)]
    core.handle(timer.at, TimerFired(timer.key))
    recv(core, timer.at + 1, Ack(ping.seq), addr=NEW)
    assert core.member("p0").addr == OLD
    assert core.counters["address_claims_expired"] == 1


def test_refutation_from_the_real_member_supersedes_a_pending_claim():
    core = make()
    _, ((_, ping),) = _claim(core)
    recv(core, 1.05, Alive(3, "p0", "id-p0", OLD), addr=OLD)  # p0 heard the claim and refuted it
    recv(core, 1.1, Ack(ping.seq), addr=NEW)  # an impostor at NEW answers: too late
    member = core.member("p0")
    assert (member.addr, member.incarnation, member.status) == (OLD, 3, MemberStatus.ALIVE)


def test_claim_is_not_restarted_for_the_same_or_older_incarnation():
    core = make()
    _claim(core)
    _, pings = _claim(core, now=1.05)
    assert pings == []


def test_dead_member_on_a_new_address_is_adopted_at_once():
    core = make()
    recv(core, 1.0, Dead(1, "p0", "p1"))
    out = recv(core, 2.0, Alive(2, "p0", "id-p0", NEW), addr=NEW)
    assert core.member("p0").addr == NEW and emitted(out, MemberJoined)  # a restart on a new port


# -- the glue against member addresses the socket layer refuses ------------------------------------
# A member's host travels in gossip as any string up to 255 characters. One the resolver cannot
# take (NUL, a non-ASCII name IDNA cannot encode, an empty or over-long label) must cost a failed
# send to that member only: never the node's UDP socket, never the other actions of the stimulus,
# never a connect task that dies without reporting back to the core.

UNSENDABLE = ["bücher..de", "x\x00y", "a..b", "a" * 64]


def _loop_factory(kind):
    if kind == "uvloop":
        return pytest.importorskip("uvloop").new_event_loop
    return asyncio.SelectorEventLoop


def _run_on(kind, scenario):
    """Run ``scenario(node, errors)`` on a fresh loop of ``kind`` with one started node; ``errors``
    collects what reaches the loop's exception handler (unhandled callback and task errors)."""
    async def main():
        errors = []
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append((context.get("message"), context.get("exception"))))
        node = MembershipNode(name="n0", bind=("127.0.0.1", 0), cluster="t", keyring=Keyring.generate(),
                              config=msgspec.structs.replace(MembershipConfig.loopback(), join_attempts=1))
        await node.start()
        try:
            await scenario(node, errors)
        finally:
            await node.stop()
        gc.collect()  # a task that died unobserved reports itself when it is freed
        return errors

    loop = _loop_factory(kind)()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


async def _replies(node, sock, until):
    """Messages arriving at ``sock`` until ``until(messages)`` (bounded, not a timing threshold)."""
    got = []
    async with asyncio.timeout(10):
        while not until(got):
            got.extend(node.codec.open_packet(await asyncio.get_running_loop().sock_recv(sock, 65535)))
    return got


@pytest.mark.parametrize("host", UNSENDABLE)
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_relay_to_an_unsendable_address_keeps_the_node_serving(kind, host):
    """A sealed IndirectPing naming such a host: the relay's ping cannot go out, but the node still
    nacks the origin and answers pings. Before, asyncio's datagram transport closed itself on the
    socket's TypeError (the node went deaf: every probe of it failed) and uvloop's raised out of
    the packet's handling, dropping the relay's nack timer."""
    async def scenario(node, errors):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            sock.sendto(node.codec.seal_packet([IndirectPing(41, "x", (host, 9), True)]), node.addr)
            sock.sendto(node.codec.seal_packet([Ping(42, "n0", "x")]), node.addr)
            got = await _replies(node, sock, lambda got: Ack(42) in got and Nack(41) in got)
        assert Ack(42) in got and Nack(41) in got

    assert _run_on(kind, scenario) == []


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_forged_claim_to_an_unsendable_address_is_reported_back_to_the_core(kind):
    """A forged Alive that moves a live member to such a host: the claim's ping and TCP check fail
    (counted), the member still hears of the claim, and no task dies unobserved. Before, the
    connect task died of the resolver's UnicodeError ("Task exception was never retrieved") and
    never told the core (its stream stayed pending); on asyncio the UDP socket closed first."""
    async def scenario(node, errors):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            here = sock.getsockname()
            sock.sendto(node.codec.seal_packet([Alive(1, "p0", "id-p0", here)]), node.addr)
            sock.sendto(node.codec.seal_packet([Alive(2, "p0", "id-p0", ("bücher..de", 9))]), node.addr)
            # the member hears of the claim at its current address (sent after the claim's checks)
            await _replies(node, sock, lambda got: any(
                isinstance(m, Alive) and m.name == "p0" and m.incarnation == 2 for m in got))
            async with asyncio.timeout(10):
                while not (errors or node.counters().get("stream_errors")):
                    await asyncio.sleep(0.01)
                    gc.collect()
        assert node.counters().get("stream_errors") == 1
        assert {m.name: m.addr for m in node.members()}["p0"] == here

    assert _run_on(kind, scenario) == []


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_join_through_an_unresolvable_seed_fails_instead_of_hanging(kind):
    """join() with a seed whose host the resolver refuses ends with JoinError after its rounds.
    Before, the seed's connect task died of the UnicodeError, the round never finished, and join
    waited forever (the service's parse_seed keeps such seeds out since; the node did not)."""
    async def scenario(node, errors):
        async with asyncio.timeout(10):
            with pytest.raises(JoinError, match="none of the seeds"):
                await node.join([("bücher..de", 7946)])

    assert _run_on(kind, scenario) == []


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_node_advertised_by_name_is_probed_at_its_address(kind):
    """A node whose advertise host is a name advertises what the name resolves to, so a uvloop
    peer, whose sendto refuses host names, can probe it: the two nodes see each other alive.
    Before, it advertised the name itself: every uvloop datagram to it failed, and it was
    suspected and declared dead while running."""
    async def main():
        cfg = msgspec.structs.replace(MembershipConfig.loopback(), join_attempts=1)
        named = MembershipNode(name="named", bind=("127.0.0.1", 0), cluster="t", keyring=(key := Keyring.generate()),
                               config=cfg, advertise_host="localhost")
        other = MembershipNode(name="other", bind=("127.0.0.1", 0), cluster="t", keyring=key, config=cfg)
        await named.start()
        await other.start()
        try:
            ipaddress.ip_address(named.addr[0])  # an address, not the name
            await other.join([named.addr])
            async with asyncio.timeout(10):  # five probes of the named node (one member to probe)
                while other.counters().get("probes", 0) < 5:
                    await asyncio.sleep(0.05)
            assert not other.counters().get("udp_errors") and not other.counters().get("probes_failed")
            assert {m.name: m.status for m in other.members()}["named"] == "alive"
        finally:
            await other.stop()
            await named.stop()

    loop = _loop_factory(kind)()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
