"""The core against forged gossip from a key holder (issue 16): incarnations near the wire's limit
(item 3) and an Alive that moves a live member to a wrong address (item 4)."""

import random

import pytest

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
    MemberState,
    MemberStatus,
    Ping,
    Suspect,
    decode_compound,
    encode_compound,
)
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
