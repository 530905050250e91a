"""The membership core driven directly: no sockets, no sleeps; time is the ``now`` argument."""

import random

import pytest

from peers.membership.config import MembershipConfig
from peers.membership.events import (
    Emit,
    Join,
    JoinFinished,
    Leave,
    MemberFailed,
    MemberJoined,
    MemberLeft,
    MemberReaped,
    MemberSuspected,
    MemberUpdated,
    NameConflict,
    OpenStream,
    Received,
    ReplyStream,
    ReportUnreachable,
    Send,
    SetTimer,
    Start,
    StreamReply,
    StreamRequest,
    TimerFired,
    UpdateMeta,
)
from peers.membership.messages import (
    Ack,
    Alive,
    Dead,
    IndirectPing,
    MemberState,
    MemberStatus,
    Nack,
    Ping,
    PushPull,
    Suspect,
)
from peers.membership.state import Membership

A = ("10.0.0.1", 1)
B = ("10.0.0.2", 1)


def make(n_peers=4, **cfg):
    config = MembershipConfig(**cfg)
    core = Membership(config, name="me", node_id="id-me", addr=("10.0.0.100", 1),
                      rng=random.Random(7))
    core.restore([MemberState(f"p{i}", f"id-p{i}", (f"10.0.0.{i + 1}", 1), 1,
                              MemberStatus.ALIVE) for i in range(n_peers)])
    return core


def emitted(actions, kind=object):
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, kind)]


def sends(actions):
    return [a for a in actions if isinstance(a, Send)]


def fire(core, now, key):
    return core.handle(now, TimerFired(key))


def recv(core, now, *messages, addr=A):
    return core.handle(now, Received(addr, list(messages)))


@pytest.mark.parametrize(("incarnation", "meta", "direct", "accepted"), [
    (0, b"", False, False),   # lower incarnation: ignored
    (1, b"", False, False),   # equal, same meta: ignored
    (1, b"x", False, False),  # equal with changed meta, relayed: ignored
    (1, b"x", True, True),    # equal with changed meta from the node itself
    (2, b"", False, True),    # strictly higher
])
def test_alive_precedence(incarnation, meta, direct, accepted):
    core = make()
    addr = A if direct else B
    out = recv(core, 1.0, Alive(incarnation, "p0", "id-p0", A, meta), addr=addr)
    member = core.member("p0")
    if accepted:
        assert (member.incarnation, member.meta) == (incarnation, meta)
    else:
        assert (member.incarnation, member.meta) == (1, b"")
    assert bool(emitted(out, MemberUpdated)) == (accepted and meta == b"x")


@pytest.mark.parametrize(("incarnation", "suspected"), [(0, False), (1, True), (5, True)])
def test_suspect_precedence(incarnation, suspected):
    core = make()
    out = recv(core, 1.0, Suspect(incarnation, "p0", "p1"))
    assert bool(emitted(out, MemberSuspected)) == suspected
    assert (core.member("p0").status == MemberStatus.SUSPECT) == suspected


def test_suspect_then_alive_higher_refutes_and_cancels_timer():
    core = make()
    recv(core, 1.0, Suspect(1, "p0", "p1"))
    out = recv(core, 2.0, Alive(2, "p0", "id-p0", A))
    assert [e.cause for e in emitted(out, MemberUpdated)] == ["refuted"]
    assert core.member("p0").status == MemberStatus.ALIVE
    # the suspicion timer is now stale: firing it changes nothing
    assert emitted(fire(core, 1000.0, ("suspicion", "p0"))) == []


def test_suspicion_timeout_declares_dead_and_confirmations_shorten_it():
    core = make(n_peers=9)  # N = 10: min = 4 * 1 * 1 s, max = 24 s, k = 2
    out = recv(core, 0.0, Suspect(1, "p0", "p1"))
    timer = [a for a in out if isinstance(a, SetTimer) and a.key == ("suspicion", "p0")]
    assert timer[0].at == pytest.approx(24.0)
    out = recv(core, 1.0, Suspect(1, "p0", "p2"))
    timer = [a for a in out if isinstance(a, SetTimer) and a.key == ("suspicion", "p0")]
    assert 4.0 < timer[0].at < 24.0
    out = recv(core, 1.5, Suspect(1, "p0", "p3"))
    timer = [a for a in out if isinstance(a, SetTimer) and a.key == ("suspicion", "p0")]
    assert timer[0].at == pytest.approx(4.0)
    assert emitted(fire(core, 3.9, ("suspicion", "p0"))) == []  # not due yet
    out = fire(core, 4.0, ("suspicion", "p0"))
    assert [type(e) for e in emitted(out)] == [MemberFailed]


def test_lifeguard_off_uses_fixed_minimum_timeout():
    core = make(n_peers=9, lifeguard=False)
    out = recv(core, 0.0, Suspect(1, "p0", "p1"))
    timer = [a for a in out if isinstance(a, SetTimer) and a.key == ("suspicion", "p0")]
    assert timer[0].at == pytest.approx(4.0)


def test_refute_suspicion_about_self_jumps_past_accuser():
    core = make()
    out = recv(core, 1.0, Suspect(7, "me", "p1"))
    assert core.local.incarnation == 8
    assert core.local.status == MemberStatus.ALIVE
    assert core.awareness.score == 1
    assert emitted(out) == []
    # the refutation rides on the next packet we send
    out = recv(core, 1.1, Ping(3, "me", "p1"))
    (send,) = sends(out)
    alive = [m for m in send.messages if isinstance(m, Alive)]
    assert alive and alive[0].incarnation == 8 and alive[0].name == "me"


def test_dead_about_self_is_refuted_unless_leaving():
    core = make()
    recv(core, 1.0, Dead(3, "me", "p1"))
    assert core.local.incarnation == 4
    core.handle(2.0, Leave())
    recv(core, 2.1, Suspect(9, "me", "p1"))
    assert core.local.incarnation == 4 and core.local.status == MemberStatus.LEFT


def test_graceful_leave_goes_straight_to_left():
    core = make()
    out = recv(core, 1.0, Dead(1, "p0", "p0"))
    assert [type(e) for e in emitted(out)] == [MemberLeft]
    assert core.member("p0").status == MemberStatus.LEFT
    # later suspicion of a left member changes nothing
    assert emitted(recv(core, 2.0, Suspect(1, "p0", "p1"))) == []


def test_leave_sends_left_announcement_and_stops_probing():
    core = make()
    out = core.handle(1.0, Leave())
    deads = [m for s in sends(out) for m in s.messages if isinstance(m, Dead)]
    assert deads and all(d.source == d.name == "me" for d in deads)
    core.handle(1.0, Start())
    out = fire(core, 5.0, "probe")
    assert not [m for s in sends(out) for m in s.messages if isinstance(m, Ping)]


def test_name_conflict_rejected_for_live_member():
    core = make()
    out = recv(core, 1.0, Alive(9, "p0", "other-id", B))
    (event,) = emitted(out, NameConflict)
    assert event.known_node_id == "id-p0" and event.claimed_node_id == "other-id"
    assert core.member("p0").node_id == "id-p0" and core.member("p0").incarnation == 1


def test_name_conflict_about_local_name_is_local():
    core = make()
    (event,) = emitted(recv(core, 1.0, Alive(0, "me", "impostor", B)), NameConflict)
    assert event.local and core.local.node_id == "id-me"


def test_dead_name_reclaimed_by_new_node_id_after_reclaim_time():
    core = make(dead_node_reclaim_s=10.0)
    recv(core, 1.0, Dead(1, "p0", "p1"))
    assert emitted(recv(core, 5.0, Alive(2, "p0", "new", B)), NameConflict)
    out = recv(core, 12.0, Alive(2, "p0", "new", B))
    assert [e.cause for e in emitted(out, MemberJoined)] == ["rejoin"]
    assert core.member("p0").node_id == "new"


def test_probe_cycle_ack_keeps_alive_and_improves_health():
    core = make()
    core.awareness.apply_delta(2)
    core.handle(0.0, Start())
    out = fire(core, 1.0, "probe")
    (ping_send,) = sends(out)
    ping = next(m for m in ping_send.messages if isinstance(m, Ping))
    recv(core, 1.01, Ack(ping.seq), addr=ping_send.addr)
    assert core.awareness.score == 1
    out = fire(core, 10.0, "probe")
    assert emitted(out, MemberSuspected) == []


def test_probe_failure_indirect_nacks_fallback_then_suspect():
    core = make(indirect_checks=3)
    core.handle(0.0, Start())
    (ping_send,) = sends(fire(core, 1.0, "probe"))
    ping = next(m for m in ping_send.messages if isinstance(m, Ping))
    out = fire(core, 1.5, ("probe_timeout", ping.seq))
    indirect = [m for s in sends(out) for m in s.messages if isinstance(m, IndirectPing)]
    assert len(indirect) == 3 and all(i.target == ping.target and i.nack for i in indirect)
    streams = [a for a in out if isinstance(a, OpenStream)]
    assert len(streams) == 1 and isinstance(streams[0].message, Ping)
    recv(core, 1.6, Nack(ping.seq))  # one relay is alive but could not reach the target
    out = fire(core, 2.0, "probe")
    assert [e.name for e in emitted(out, MemberSuspected)] == [ping.target]
    assert core.awareness.score == 2  # 3 expected nacks, 1 received


def test_tcp_fallback_ack_saves_the_target():
    core = make()
    core.handle(0.0, Start())
    (ping_send,) = sends(fire(core, 1.0, "probe"))
    ping = next(m for m in ping_send.messages if isinstance(m, Ping))
    out = fire(core, 1.5, ("probe_timeout", ping.seq))
    (stream,) = [a for a in out if isinstance(a, OpenStream)]
    core.handle(1.7, StreamReply(stream.token, Ack(ping.seq)))
    assert emitted(fire(core, 2.0, "probe"), MemberSuspected) == []
    assert core.counters["fallback_probe_acks"] == 1


def test_buddy_system_puts_suspect_on_ping_to_suspect():
    core = make(n_peers=1)
    recv(core, 0.0, Suspect(1, "p0", "p1"))
    core.handle(0.0, Start())
    (send,) = sends(fire(core, 1.0, "probe"))
    assert any(isinstance(m, Suspect) and m.name == "p0" for m in send.messages)


def test_indirect_ping_relays_ack_or_nack():
    core = make()
    out = recv(core, 0.0, IndirectPing(42, "p1", B, True), addr=A)
    (relay,) = sends(out)
    own = next(m for m in relay.messages if isinstance(m, Ping))
    assert relay.addr == B and own.target == "p1"
    out = recv(core, 0.1, Ack(own.seq), addr=B)
    assert any(s.addr == A and Ack(42) in s.messages for s in sends(out))
    # second relay: target silent -> nack after the probe timeout
    out = recv(core, 1.0, IndirectPing(43, "p1", B, True), addr=A)
    own = next(m for m in sends(out)[0].messages if isinstance(m, Ping))
    out = fire(core, 1.5, ("relay", own.seq))
    assert any(s.addr == A and Nack(43) in s.messages for s in sends(out))


def test_ping_for_another_name_is_ignored():
    core = make()
    assert sends(recv(core, 0.0, Ping(1, "someone-else", "p0"))) == []
    assert core.counters["pings_wrong_target"] == 1


def test_piggyback_stays_within_packet_limit():
    core = make(n_peers=0, max_packet_bytes=600)
    for i in range(200):
        recv(core, 0.0, Alive(1, f"new{i:03d}", f"id{i}", ("10.1.0.1", i), b"m" * 40))
    out = recv(core, 1.0, Ping(1, "me", "x"))
    (send,) = sends(out)
    assert 1 < len(send.messages)
    assert send.size <= 600 - 64


def test_report_unreachable_starts_suspicion_only():
    core = make()
    out = core.handle(1.0, ReportUnreachable("p2"))
    assert [type(e) for e in emitted(out)] == [MemberSuspected]
    assert core.member("p2").status == MemberStatus.SUSPECT


def test_update_meta_bumps_incarnation_and_gossips():
    core = make()
    core.handle(1.0, UpdateMeta(b"roles"))
    assert core.local.incarnation == 1 and core.local.meta == b"roles"
    out = recv(core, 1.1, Ping(3, "me", "p1"))
    assert any(isinstance(m, Alive) and m.meta == b"roles" for m in sends(out)[0].messages)
    with pytest.raises(ValueError):
        core.handle(2.0, UpdateMeta(b"x" * 513))


def test_dead_members_are_reaped():
    core = make(reap_after_s=20.0)
    core.handle(0.0, Start())
    recv(core, 1.0, Dead(1, "p0", "p1"))
    assert emitted(fire(core, 10.0, "reap")) == []
    out = fire(core, 30.0, "reap")
    assert [type(e) for e in emitted(out)] == [MemberReaped]
    assert core.member("p0") is None


def test_join_push_pull_merges_and_reports():
    core = Membership(MembershipConfig(), name="me", node_id="id-me", addr=("h", 1),
                      rng=random.Random(1))
    out = core.handle(0.0, Join((A, B)))
    streams = [a for a in out if isinstance(a, OpenStream)]
    assert len(streams) == 2 and all(s.message.join for s in streams)
    remote = PushPull(False, "p0", [MemberState("p0", "id-p0", A, 3, MemberStatus.ALIVE),
                                    MemberState("p9", "id-p9", B, 1, MemberStatus.DEAD)])
    core.handle(0.1, StreamReply(streams[0].token, remote))
    out = core.handle(0.2, StreamReply(streams[1].token, None))
    assert [a for a in out if isinstance(a, JoinFinished)] == [JoinFinished(1, None)]
    assert core.member("p0").status == MemberStatus.ALIVE
    # a remote "dead" only makes us suspect (memberlist mergeState); p9 is unknown -> ignored
    assert core.member("p9") is None


def test_join_reports_conflict_with_existing_owner_of_name():
    core = Membership(MembershipConfig(), name="me", node_id="id-new", addr=("h", 1),
                      rng=random.Random(1))
    (stream,) = [a for a in core.handle(0.0, Join((A,))) if isinstance(a, OpenStream)]
    remote = PushPull(False, "p0", [MemberState("me", "id-old", A, 3, MemberStatus.ALIVE)])
    (finished,) = [a for a in core.handle(0.1, StreamReply(stream.token, remote))
                   if isinstance(a, JoinFinished)]
    assert finished.conflict is not None and finished.conflict.known_node_id == "id-new"


def test_rejoin_refutes_remote_dead_view_of_self():
    core = Membership(MembershipConfig(), name="me", node_id="id-me", addr=("h", 1),
                      rng=random.Random(1))
    (stream,) = [a for a in core.handle(0.0, Join((A,))) if isinstance(a, OpenStream)]
    remote = PushPull(False, "p0", [MemberState("me", "id-me", ("h", 1), 6, MemberStatus.DEAD)])
    core.handle(0.1, StreamReply(stream.token, remote))
    assert core.local.incarnation == 7


def test_stream_request_push_pull_replies_with_full_state():
    core = make(n_peers=2)
    out = core.handle(0.0, StreamRequest(A, 5, PushPull(True, "x", [])))
    (reply,) = [a for a in out if isinstance(a, ReplyStream)]
    assert reply.token == 5 and {m.name for m in reply.message.members} == {"me", "p0", "p1"}


def test_stale_timer_is_ignored():
    core = make()
    core.handle(0.0, Start())
    (ping_send,) = sends(fire(core, 1.0, "probe"))  # re-arms "probe" for t = 2.0
    assert fire(core, 1.5, "probe") == []  # a stale firing of the old timer
    assert fire(core, 0.0, "nonexistent") == []
    assert len(sends(fire(core, 2.0, "probe"))) == 1
