"""Seeded fuzzing of the frame decoder (h11 style): whole buffers and byte-by-byte.

Invariant: every input either decodes to frames or raises ``RemoteProtocolError`` — never another
exception, never an allocation above the limits (the allocator records every request it gets).
"""

import random

import msgspec
import numpy as np
import pytest

from peers import framing, wire
from peers.errors import RemoteProtocolError

SEED = 20261122


def _valid_frames(rng):
    out = []
    for i in range(rng.randrange(1, 4)):
        bufs = [np.frombuffer(rng.randbytes(rng.randrange(0, 300) * 4), np.float32) for _ in range(rng.randrange(0, 3))]
        pairs = [framing.spec_for(b, with_checksum=rng.random() < 0.5) for b in bufs]
        msg = wire.Request(i + 1, msgspec.Raw(msgspec.msgpack.encode(list(range(rng.randrange(5))))),
                           [p[0] for p in pairs], rng.choice([None, 12.5]))
        out.append(b"".join(bytes(p) for p in framing.encode_frame(msg, [p[1] for p in pairs])))
    return b"".join(out)


def _mutations(rng, data):
    yield rng.randbytes(rng.randrange(0, 200))  # garbage
    yield data[: rng.randrange(len(data))]  # truncation
    b = bytearray(data)
    for _ in range(rng.randrange(1, 6)):  # bit flips
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    yield bytes(b)
    b = bytearray(data)  # oversize length fields
    offset = rng.choice([4, 8, 12])
    width = {4: 4, 8: 2, 12: 8}[offset]
    b[offset:offset + width] = rng.choice([b"\xff" * width, (2**31).to_bytes(8, "little")[:width]])
    yield bytes(b)
    yield framing.MAGIC + rng.randbytes(rng.randrange(18, 100))  # plausible magic, garbage after


def _decode(data, chunk):
    allocations = []

    def allocate(message, specs):
        total = sum(s.nbytes for s in specs)
        assert total <= framing.MAX_BULK_BYTES_PER_FRAME
        allocations.append(total)
        return [np.empty(s.nbytes, np.uint8).data for s in specs]

    dec = framing.FrameDecoder(allocate)
    frames = []
    try:
        for i in range(0, len(data), chunk):
            frames += dec.feed(data[i:i + chunk])
    except RemoteProtocolError as exc:
        assert exc.reason
        return None
    return frames


@pytest.mark.parametrize("seed", range(SEED, SEED + 30))
def test_fuzz_frame_decoder_never_crashes(seed):
    rng = random.Random(seed)
    data = _valid_frames(rng)
    assert _decode(data, len(data)) is not None
    for mutated in _mutations(rng, data):
        for chunk in (max(len(mutated), 1), 1, rng.randrange(1, 64)):
            _decode(mutated, chunk)


def test_fuzz_frame_decoder_oversize_never_allocates():
    # a header announcing 4 GiB of bulk and a matching, self-consistent spec: refused by the limit
    n = framing.MAX_BULK_BYTES_PER_FRAME + 8
    body = wire.encode(wire.Request(1, msgspec.Raw(b"\xc0"), [wire.BufferSpec("<u8", (n // 8,), n)]))
    header = framing.HEADER.pack(framing.MAGIC, 1, 0, len(body), 1, 0, n)
    assert _decode(header + body, 1) is None
