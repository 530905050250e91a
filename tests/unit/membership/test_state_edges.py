"""The core at the edges a review found (Dec 1): packet message count, address claims against
later accusations, a leaving node's own Alive.

Sans-IO only: time is the ``now`` argument, randomness a seeded ``random.Random``.
"""

import random

import pytest

from peers.membership.config import MembershipConfig
from peers.membership.events import (
    Emit,
    Leave,
    MemberJoined,
    Received,
    Send,
    SetTimer,
    Start,
    TimerFired,
    UpdateMeta,
)
from peers.membership.messages import (
    MAX_MESSAGES_PER_PACKET,
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

ME = ("10.0.0.100", 1)
OLD = ("10.0.0.1", 1)
NEW = ("10.0.0.99", 7)
OTHER = ("10.9.9.9", 1)


def make(n_peers=4, **cfg):
    core = Membership(MembershipConfig(**cfg), name="me", node_id="id-me", addr=ME,
                      rng=random.Random(7))
    core.restore([MemberState(f"p{i}", f"id-p{i}", (f"10.{i // 250}.{i % 250}.1", 1), 1,
                              MemberStatus.ALIVE) for i in range(n_peers)])
    core.handle(0.0, Start())
    return core


def sends(actions):
    return [a for a in actions if isinstance(a, Send)]


def emitted(actions, kind=object):
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, kind)]


# -- a compound packet never holds more messages than a receiver decodes ---------------------------

def test_packets_never_hold_more_messages_than_the_decoder_accepts():
    # jumbo frames (max-packet-bytes up to 65000 is allowed) and a burst of small broadcasts:
    # 400 deaths fit 9000 bytes, but every receiver drops a compound of more than 255 messages
    core = make(n_peers=600, max_packet_bytes=9000)
    for start in range(0, 400, 200):
        core.handle(1.0, Received(OTHER, [Dead(1, f"p{i}", "x") for i in range(start, start + 200)]))
    assert core.pending_broadcasts() == 400
    out = core.handle(2.0, TimerFired("gossip"))  # a gossip round
    out += core.handle(3.0, Received(OTHER, [Ping(1, "me", "x")]))  # an Ack with piggy-back
    assert sends(out)
    for send in sends(out):
        assert len(send.messages) <= MAX_MESSAGES_PER_PACKET
        assert decode_compound(encode_compound(send.messages)) == send.messages
        assert len(encode_compound(send.messages)) == send.size


# -- an address claim does not outrank a later accusation at its own incarnation ---------------------

@pytest.mark.parametrize(("accusation", "status"), [
    (Dead(2, "p0", "p0"), MemberStatus.LEFT),      # left gracefully while the claim waited
    (Dead(2, "p0", "p1"), MemberStatus.DEAD),
    (Suspect(2, "p0", "p1"), MemberStatus.SUSPECT),
])
def test_address_claim_acked_after_an_accusation_at_its_incarnation_changes_nothing(accusation, status):
    # p0 restarted on a new port (Alive 2 at NEW, held as a claim), then left (or was declared
    # dead / suspected) at incarnation 2 before NEW answered the confirming ping. alive < suspect <
    # dead at the same incarnation: the late Ack must not bring p0 back at incarnation 2.
    core = make()
    out = core.handle(1.0, Received(NEW, [Alive(2, "p0", "id-p0", NEW)]))
    (ping,) = [m for s in sends(out) if s.addr == NEW for m in s.messages if isinstance(m, Ping)]
    core.handle(1.05, Received(OTHER, [accusation]))
    assert core.member("p0").status == status
    out = core.handle(1.1, Received(NEW, [Ack(ping.seq)]))
    member = core.member("p0")
    assert (member.status, member.incarnation) == (status, 2)
    assert not emitted(out, MemberJoined)


def test_address_claim_still_adopted_when_nothing_newer_came():
    core = make()
    out = core.handle(1.0, Received(NEW, [Alive(2, "p0", "id-p0", NEW)]))
    (ping,) = [m for s in sends(out) if s.addr == NEW for m in s.messages if isinstance(m, Ping)]
    core.handle(1.05, Received(OTHER, [Suspect(1, "p0", "p1")]))  # about the old incarnation
    core.handle(1.1, Received(NEW, [Ack(ping.seq)]))
    member = core.member("p0")
    assert (member.status, member.incarnation, member.addr) == (MemberStatus.ALIVE, 2, NEW)


# -- a leaving node keeps gossiping its leave ----------------------------------------------------

def _gossiped(core, now):
    return [m for s in sends(core.handle(now, TimerFired("gossip"))) for m in s.messages]


@pytest.mark.parametrize("stimulus", [
    Received(OLD, [Alive(5, "me", "id-me", ME)]),         # a view of us from a previous run
    Received(OLD, [Alive(0, "me", "id-me", ME, b"x")]),   # same incarnation, other metadata
    UpdateMeta(b"full"),                                  # the daemon gossips a change meanwhile
])
def test_leaving_node_never_announces_itself_alive_again(stimulus):
    # Its own Alive would replace the leave (one queued broadcast per member) and, at a higher
    # incarnation, bring it back ALIVE everywhere: it then dies as a failure, not a leave.
    core = make()
    core.handle(1.0, Leave())
    core.handle(1.1, stimulus)
    gossiped = _gossiped(core, 2.0)
    assert Dead(0, "me", "me") in gossiped
    assert not [m for m in gossiped if isinstance(m, Alive) and m.name == "me"]
    assert core.local.status == MemberStatus.LEFT



# -- the core's clock never goes back --------------------------------------------------------------

def test_now_going_back_never_shortens_a_suspicion():
    # N = 10: a lone accuser gives p0 the maximum, 24 s, counted from the latest time seen (100)
    core = make(n_peers=9)
    core.handle(100.0, Received(OTHER, [Ping(1, "me", "x")]))
    out = core.handle(50.0, Received(OTHER, [Suspect(1, "p0", "p1")]))  # a clock stepped back
    (timer,) = [a for a in out if isinstance(a, SetTimer) and a.key == ("suspicion", "p0")]
    assert timer.at >= 124.0
    assert core.handle(100.5, TimerFired(timer.key)) == []  # not yet: p0 may still refute
    assert core.member("p0").status == MemberStatus.SUSPECT


# -- our own Alive always fits one packet ------------------------------------------------------------

def test_metadata_whose_alive_fits_no_packet_is_refused():
    # 450 bytes are under MAX_META_BYTES, but with max-packet-bytes 512 our Alive fits no
    # packet: it was never gossiped and stayed queued for good
    core = make(max_packet_bytes=512)
    with pytest.raises(ValueError, match="max-packet-bytes"):
        core.handle(0.5, UpdateMeta(b"x" * 450))
    with pytest.raises(ValueError, match="max-packet-bytes"):
        Membership(MembershipConfig(max_packet_bytes=512), name="me", node_id="id-me", addr=ME,
                   rng=random.Random(7), meta=b"x" * 450)
    core.handle(0.6, UpdateMeta(b"x" * 200))  # one that fits is gossiped
    sent = [m for s in sends(core.handle(1.0, TimerFired("gossip"))) for m in s.messages]
    assert [m.meta for m in sent if isinstance(m, Alive)][0] == b"x" * 200
    assert core.pending_broadcasts() == 1 and core.local.meta == b"x" * 200
