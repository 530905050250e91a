"""giaannd.protocol: round trips, append-only tags, limits, and h11-style decoder fuzzing."""

import random

import msgspec
import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.model.rows import RowBatch

REQUESTS = [
    p.ReadRows("epoch"),
    p.ApplyBatch(2**64 - 1, 2**64 - 1, 7, "e", None),
    p.ApplyBatch(1, 2, 0, "", "node-b"),
    p.RowDigests(),
    p.GetUsage(),
    p.BatchesApplied(5, [1, 2, 3]),
]
REPLIES = [
    p.RowsReply(), p.ApplyAck(), p.ApplyAck(True, False, True), p.DigestsReply(),
    p.UsageReply(10, 5, 1, 2, False, 3), p.AppliedMask([True, False]),
    p.StoreFull(1, 2, 3), p.NotOwner("e", "why"), p.BadRequest("bad"), p.Unavailable("later"),
]


@pytest.mark.parametrize("msg", REQUESTS)
def test_protocol_request_round_trip(msg):
    assert p.decode_request(p.encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES)
def test_protocol_reply_round_trip(msg):
    assert p.decode_reply(p.encode(msg)) == msg


def test_protocol_tags_are_append_only():
    # Changing one of these breaks every deployed peer: add new messages with new tags instead.
    tags = {cls.__name__: cls.__struct_config__.tag for cls in [
        p.ReadRows, p.ApplyBatch, p.RowDigests, p.GetUsage, p.BatchesApplied, p.RowsReply, p.ApplyAck,
        p.DigestsReply, p.UsageReply, p.AppliedMask, p.StoreFull, p.NotOwner, p.BadRequest, p.Unavailable]}
    assert tags == {"ReadRows": 1, "ApplyBatch": 2, "RowDigests": 3, "GetUsage": 4, "BatchesApplied": 5,
                    "RowsReply": 64, "ApplyAck": 65, "DigestsReply": 66, "UsageReply": 67, "AppliedMask": 68,
                    "StoreFull": 128, "NotOwner": 129, "BadRequest": 130, "Unavailable": 131}
    assert msgspec.structs.fields(p.ApplyBatch)[-1].name == "hint_for"


def test_protocol_unknown_fields_from_newer_peers_are_ignored():
    raw = msgspec.msgpack.encode({"type": 2, "writer": 1, "seq": 2, "future_field": [1, 2]})
    assert p.decode_request(raw) == p.ApplyBatch(1, 2)


@pytest.mark.parametrize("raw", [
    msgspec.msgpack.encode({"type": 2, "writer": -1, "seq": 1}),
    msgspec.msgpack.encode({"type": 2, "writer": 1, "seq": 0}),
    msgspec.msgpack.encode({"type": 1, "placement_epoch": "x" * (p.MAX_TEXT_CHARS + 1)}),
    msgspec.msgpack.encode({"type": 64}),  # a reply is not a request
    msgspec.msgpack.encode([1]),
    b"",
])
def test_protocol_rejects_invalid_requests(raw):
    with pytest.raises(p.ProtocolViolation):
        p.decode_request(raw)


def test_protocol_fuzz_decoders_whole_and_byte_by_byte():
    rng = random.Random(1234)
    corpus = [p.encode(m) for m in REQUESTS + REPLIES]
    for _ in range(300):
        base = bytearray(rng.choice(corpus))
        for _ in range(rng.randint(1, 4) if base else 0):
            base[rng.randrange(len(base))] = rng.randrange(256)
        corpus.append(bytes(base))
        corpus.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))))
    for blob in corpus:
        for data in (blob, *(blob[:i] for i in range(len(blob)))):
            for decode in (p.decode_request, p.decode_reply):
                try:
                    decode(data)
                except p.ProtocolViolation:
                    pass


def _batch():
    return RowBatch.from_entries(np.array([1, 1, 2], np.uint64), np.array([0, 0, 3], np.uint64),
                                 np.array([0, 1, 2], np.uint8), np.array([5, 6, 7], np.uint64),
                                 np.array([0, 0, 1], np.uint64), np.array([1, 2, 3], np.float32))


def test_protocol_check_batch_accepts_canonical_and_rejects_broken():
    b = _batch()
    assert p.check_batch(b.buffers()).num_entries == 3
    with pytest.raises(p.ProtocolViolation, match="7 buffers"):
        p.check_batch(b.buffers()[:3])
    bad = b.buffers()
    bad[6] = np.array([1, np.inf, 2], np.float32)
    with pytest.raises(p.ProtocolViolation, match="non-finite"):
        p.check_batch(bad)


def test_protocol_check_batch_limits_come_before_validation(monkeypatch):
    monkeypatch.setattr(p, "MAX_BATCH_ENTRIES", 2)
    with pytest.raises(p.ProtocolViolation, match="over the limit"):
        p.check_batch(_batch().buffers())
    monkeypatch.setattr(p, "MAX_BATCH_ENTRIES", 100)
    monkeypatch.setattr(p, "MAX_BATCH_ROWS", 1)
    with pytest.raises(p.ProtocolViolation, match="over the limit"):
        p.check_batch(_batch().buffers())


def test_protocol_check_keys():
    k = np.arange(4, dtype=np.uint64)
    cols, feats = p.check_keys([k, k], 4)
    assert cols is k and feats is k
    for bulk, match in [([k], "2 key buffers"), ([k, k[:3]], "differ"), ([k, k.astype(np.int64)], "uint64"),
                        ([k.reshape(2, 2), k.reshape(2, 2)], "1-d")]:
        with pytest.raises(p.ProtocolViolation, match=match):
            p.check_keys(bulk, 4)
    with pytest.raises(p.ProtocolViolation, match="limit"):
        p.check_keys([k, k], 3)


def test_a_request_nesting_deeper_than_the_decoder_recurses_is_a_protocol_violation():
    """A peer's request whose unknown field nests ~5,000 arrays deep (msgspec skips it recursively
    and raises RecursionError): refused like any bad body, and ``request_tag`` says garbage (-1).
    Before, the RecursionError escaped all three."""
    proto = p
    payload = b"\x82\xa4type\x02\xa1x" + b"\x91" * 5000 + b"\x01"  # {"type": 2, "x": [[[...1...]]]}
    assert proto.request_tag(payload) == -1
    with pytest.raises(proto.ProtocolViolation, match="undecodable"):
        proto.decode_request(payload)
    with pytest.raises(proto.ProtocolViolation, match="undecodable"):
        proto.runtime_request(b"\x82\xa4type\x0a\xa1x" + b"\x91" * 5000 + b"\x01", tag=10)
