"""Seeded fuzzing of the packet and frame decoders (h11 style: whole buffers and truncations).

Invariant: ``open_packet``/``open_frame`` either return messages or raise
PacketRejected; nothing else escapes. Opened garbage fed to a core through a
codec that rejected it changes nothing (the glue never calls the core then).
"""

import random

import msgspec
import pytest

from peers.keyring import Keyring
from peers.membership.codec import PacketCodec, PacketRejected
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
    encode_compound,
)

KEY = bytes(range(32))


def codec(cluster="fuzz", key=KEY):
    return PacketCodec(cluster, Keyring([key]))


SAMPLE = [Ping(1, "a", "b"), Ack(2), Nack(3), IndirectPing(4, "t", ("127.0.0.1", 9), True),
          Alive(5, "n", "id", ("10.0.0.1", 1), b"meta"), Suspect(6, "n", "s"), Dead(7, "n", "n")]


def test_roundtrip_all_message_types():
    c = codec()
    assert c.open_packet(c.seal_packet(SAMPLE)) == SAMPLE
    pp = PushPull(True, "x", [MemberState("a", "id", ("h", 1), 3, MemberStatus.SUSPECT, b"m")])
    frame = c.seal_frame(pp)
    assert PacketCodec.frame_length(frame[:4]) == len(frame) - 4
    assert c.open_frame(frame[4:]) == pp


def _mutations(rng, data):
    yield data
    for cut in range(0, len(data), max(1, len(data) // 40)):
        yield data[:cut]
    for _ in range(60):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        yield bytes(b)
    for _ in range(40):
        yield rng.randbytes(rng.randint(0, 300))


@pytest.mark.parametrize("seed", range(5))
def test_fuzz_sealed_packets_parse_or_counted_rejection(seed):
    rng = random.Random(seed)
    c = codec()
    reasons = set()
    sealed = c.seal_packet(rng.sample(SAMPLE, rng.randint(1, len(SAMPLE))))
    for data in _mutations(rng, sealed):
        try:
            c.open_packet(data)
        except PacketRejected as exc:
            reasons.add(exc.reason)
    assert reasons <= {"truncated", "bad_version", "wrong_label", "wrong_key", "oversized"}
    assert "wrong_key" in reasons and "truncated" in reasons


@pytest.mark.parametrize("seed", range(5))
def test_fuzz_authentic_garbage_payloads_are_malformed_not_crashes(seed):
    """Garbage *inside* a valid seal (a peer with the key but a bug): decode must reject."""
    rng = random.Random(100 + seed)
    c = codec()
    payload = encode_compound(SAMPLE)
    rejected = 0
    for body in _mutations(rng, payload):
        try:
            messages = c.open_packet(c.seal(body))
        except PacketRejected as exc:
            assert exc.reason == "malformed"
            rejected += 1
        else:
            assert isinstance(messages, list) and messages
        try:
            c.open_frame(c.seal(body))
        except PacketRejected as exc:
            assert exc.reason == "malformed"
    assert rejected > 0


def test_oversized_packet_and_frame_rejected_before_work():
    c = codec()
    with pytest.raises(PacketRejected, match="oversized"):
        c.open_packet(b"\x01" * 70_000)
    with pytest.raises(PacketRejected, match="oversized"):
        PacketCodec.frame_length((2**31).to_bytes(4, "big"))


def test_wrong_label_and_version_and_key_are_named():
    sealed = codec("other").seal_packet([Ack(1)])
    with pytest.raises(PacketRejected) as e:
        codec().open_packet(sealed)
    assert e.value.reason == "wrong_label"
    with pytest.raises(PacketRejected) as e:
        codec().open_packet(b"\x02" + sealed[1:])
    assert e.value.reason == "bad_version"
    with pytest.raises(PacketRejected) as e:
        codec(key=bytes(32)).open_packet(codec().seal_packet([Ack(1)]))
    assert e.value.reason == "wrong_key"


def test_limits_enforced_by_schema():
    c = codec()
    too_long_meta = Alive(1, "n", "id", ("h", 1), b"x" * 513)
    with pytest.raises(PacketRejected, match="malformed"):
        c.open_packet(c.seal(msgspec.msgpack.encode([too_long_meta])))
    with pytest.raises(PacketRejected, match="malformed"):
        c.open_packet(c.seal(msgspec.msgpack.encode([])))


def test_unknown_trailing_fields_are_tolerated():
    """A newer peer appends fields: older decoders ignore them (append-only rule)."""
    c = codec()
    newer = [5, 9, "n", "id", ["h", 1], b"", [1, 1, 1], "a-future-field"]
    (alive,) = c.open_packet(c.seal(msgspec.msgpack.encode([newer])))
    assert alive == Alive(9, "n", "id", ("h", 1), b"", (1, 1, 1))


def test_rotation_opens_with_any_installed_key():
    old, new = bytes(32), bytes(range(32))
    a, b = PacketCodec("c", Keyring([old])), PacketCodec("c", Keyring([old]))
    b.keyring.install(new)
    a.keyring.install(new)
    a.keyring.use(new)  # a seals with new; b still seals with old
    assert b.open_packet(a.seal_packet([Ack(1)])) == [Ack(1)]
    assert a.open_packet(b.seal_packet([Ack(2)])) == [Ack(2)]


def _random_message(rng):
    name = rng.choice(["me", "p0", "p1", "zz", "x" * 128])
    inc = rng.choice([0, 1, 2, 2**63 - 1])
    addr = (rng.choice(["10.0.0.1", "h", ""]), rng.randrange(65536))
    return rng.choice([
        lambda: Ping(rng.randrange(2**32), name, "p1"),
        lambda: Ack(rng.randrange(2**32)),
        lambda: Nack(rng.randrange(2**32)),
        lambda: IndirectPing(rng.randrange(2**32), name, addr, rng.random() < 0.5),
        lambda: Alive(inc, name, rng.choice(["id-p0", "id-me", "other"]), addr,
                      rng.randbytes(rng.randrange(64))),
        lambda: Suspect(inc, name, rng.choice(["p0", "p1", "me", "ghost"])),
        lambda: Dead(inc, name, rng.choice(["p0", name, "ghost"])),
    ])()


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_core_accepts_any_schema_valid_message_without_raising(seed):
    import random as _random

    from peers.membership.config import MembershipConfig
    from peers.membership.events import Received, Start, TimerFired
    from peers.membership.state import Membership

    rng = _random.Random(seed)
    core = Membership(MembershipConfig(), name="me", node_id="id-me", addr=("h", 1),
                      rng=_random.Random(seed))
    core.restore([MemberState("p0", "id-p0", ("h", 2), 1, MemberStatus.ALIVE),
                  MemberState("p1", "id-p1", ("h", 3), 1, MemberStatus.ALIVE)])
    core.handle(0.0, Start())
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.05
        core.handle(now, Received(("h", 9), [_random_message(rng) for _ in range(3)]))
        if rng.random() < 0.1:
            core.handle(now, TimerFired(rng.choice(["probe", "gossip", "push_pull", "reap"])))
    local = core.local
    assert local.node_id == "id-me" and local.status == MemberStatus.ALIVE
    assert core.num_live() == sum(m.status in (MemberStatus.ALIVE, MemberStatus.SUSPECT)
                                  for m in core.members())
