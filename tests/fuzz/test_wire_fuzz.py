"""Seeded fuzzing of the control-message decoder: a message or ``msgspec`` DecodeError/ValidationError
(which the framing layer maps to ``RemoteProtocolError``), never anything else."""

import random

import msgspec
import pytest

from peers import wire

SAMPLES = [
    wire.Hello(1, 1, "node", "cluster", b"n" * 16, ["inline", "ucx"], b"addr"),
    wire.Welcome(1, "node", b"n" * 16, b"p" * 32, ["inline"]),
    wire.Auth(b"p" * 32),
    wire.Ready("ucx"),
    wire.Reject("bad_key", "no"),
    wire.Request(9, msgspec.Raw(msgspec.msgpack.encode({"a": 1})), [wire.BufferSpec("<f4", (2, 2), 16, 7)], 5.0),
    wire.Response(9, msgspec.Raw(b"\xc0")),
    wire.ErrorReply(9, "ValueError", "boom"),
    wire.Cancel(9),
    wire.Goodbye("bye"),
]


@pytest.mark.parametrize("seed", range(40))
def test_fuzz_wire_decoder(seed):
    rng = random.Random(seed)
    dec = wire.decoder()
    data = bytearray(wire.encode(rng.choice(SAMPLES)))
    candidates = [bytes(data[: rng.randrange(len(data) + 1)]), rng.randbytes(rng.randrange(64))]
    for _ in range(3):
        data[rng.randrange(len(data))] = rng.randrange(256)
    candidates.append(bytes(data))
    for blob in candidates:
        try:
            msg = dec.decode(blob)
        except wire.DECODE_ERRORS:
            continue
        assert isinstance(msg, wire.Message.__args__)


def test_fuzz_wire_round_trip_all_samples():
    dec = wire.decoder()
    for msg in SAMPLES:
        got = dec.decode(wire.encode(msg))
        assert type(got) is type(msg)
        assert wire.encode(got) == wire.encode(msg)
