"""Frame codec: round trips, byte-by-byte feeding, limits checked before allocation."""

import msgspec
import numpy as np
import pytest

from peers import framing, wire
from peers.errors import LocalProtocolError, RemoteProtocolError


def _alloc_fresh(calls):
    def allocate(message, specs):
        calls.append((message, list(specs)))
        return [np.zeros(s.nbytes, np.uint8).data for s in specs]
    return allocate


def _request(bufs, *, checksum=False, req_id=7):
    pairs = [framing.spec_for(b, with_checksum=checksum) for b in bufs]
    msg = wire.Request(req_id, msgspec.Raw(msgspec.msgpack.encode({"k": [1, 2]})), [p[0] for p in pairs])
    return msg, b"".join(bytes(p) for p in framing.encode_frame(msg, [p[1] for p in pairs]))


def test_framing_round_trip_whole_and_bytewise():
    bufs = [np.arange(1000, dtype=np.float32), np.arange(6, dtype=np.int64).reshape(2, 3), np.zeros(0, np.uint8)]
    msg, data = _request(bufs, checksum=True)
    for step in (len(data), 1, 7, 4096):
        calls = []
        dec = framing.FrameDecoder(_alloc_fresh(calls))
        frames = []
        for i in range(0, len(data), step):
            frames += dec.feed(data[i:i + step])
        assert len(frames) == 1 and dec.idle
        got = frames[0]
        assert got.message == msg
        for spec, view, orig in zip(msg.bulk, got.buffers, bufs):
            arr = np.frombuffer(view, dtype=spec.dtype).reshape(spec.shape)
            np.testing.assert_array_equal(arr, orig)


def test_framing_many_frames_in_one_read_keep_order():
    data = b"".join(_request([np.full(10, i, np.int32)], req_id=i)[1] for i in range(1, 50))
    dec = framing.FrameDecoder(_alloc_fresh([]))
    frames = dec.feed(data)
    assert [f.message.id for f in frames] == list(range(1, 50))
    assert [np.frombuffer(f.buffers[0], np.int32)[0] for f in frames] == list(range(1, 50))


def test_framing_large_body_spans_reads():
    big = {"keys": list(range(40_000))}  # > STAGING_BYTES of msgpack
    msg = wire.Request(1, msgspec.Raw(msgspec.msgpack.encode(big)))
    data = b"".join(bytes(p) for p in framing.encode_frame(msg))
    assert len(data) > framing.STAGING_BYTES
    frames = framing.FrameDecoder(_alloc_fresh([])).feed(data)
    assert msgspec.msgpack.decode(frames[0].message.payload) == big


def test_framing_bulk_lands_in_destination_not_a_copy():
    dest = np.zeros(1 << 20, np.uint8)
    msg, data = _request([np.ones(1 << 20, np.uint8)])
    dec = framing.FrameDecoder(lambda m, specs: [dest.data])
    # emulate a socket: write into get_buffer() directly
    view, frames = memoryview(data), []
    while view.nbytes:
        target = dec.get_buffer()
        n = min(target.nbytes, view.nbytes, 100_000)
        target[:n] = view[:n]
        view = view[n:]
        frames += dec.buffer_updated(n)
    assert frames[0].buffers[0].obj is dest.data.obj or np.shares_memory(np.asarray(frames[0].buffers[0]), dest)
    assert dest.sum() == 1 << 20


@pytest.mark.parametrize("field,value,reason", [
    ("magic", b"XX", "bad_magic"),
    ("version", 9, "bad_version"),
    ("flags", 0x80, "bad_flags"),
    ("body_len", framing.MAX_BODY_BYTES + 1, "oversize"),
    ("nbufs", framing.MAX_BUFFERS_PER_FRAME + 1, "oversize"),
    ("bulk_len", framing.MAX_BULK_BYTES_PER_FRAME + 1, "oversize"),
])
def test_framing_bad_header_rejected_before_allocating(field, value, reason):
    fields = dict(magic=framing.MAGIC, version=framing.FRAME_VERSION, flags=0, body_len=3, nbufs=0, reserved=0,
                  bulk_len=0)
    fields[field] = value
    header = framing.HEADER.pack(*fields.values())
    calls = []
    dec = framing.FrameDecoder(_alloc_fresh(calls))
    with pytest.raises(RemoteProtocolError) as info:
        dec.feed(header)
    assert info.value.reason == reason and calls == []


def test_framing_spec_inconsistent_with_shape_rejected():
    spec = wire.BufferSpec("<f4", (10,), 41)
    msg = wire.Request(1, msgspec.Raw(b"\xc0"), [spec])
    body = wire.encode(msg)
    data = framing.HEADER.pack(framing.MAGIC, 1, 0, len(body), 1, 0, 41) + body
    calls = []
    with pytest.raises(RemoteProtocolError) as info:
        framing.FrameDecoder(_alloc_fresh(calls)).feed(data)
    assert info.value.reason == "bad_spec" and calls == []


def test_framing_oversize_buffer_spec_rejected_before_allocating():
    n = framing.MAX_BUFFER_BYTES + 8
    spec = wire.BufferSpec("<f8", (n // 8,), n)
    msg = wire.Request(1, msgspec.Raw(b"\xc0"), [spec])
    body = wire.encode(msg)
    data = framing.HEADER.pack(framing.MAGIC, 1, 0, len(body), 1, 0, n) + body
    calls = []
    with pytest.raises(RemoteProtocolError) as info:
        framing.FrameDecoder(_alloc_fresh(calls)).feed(data)
    assert info.value.reason == "oversize" and calls == []


def test_framing_checksum_mismatch_detected():
    msg, data = _request([np.arange(100, dtype=np.int32)], checksum=True)
    corrupted = bytearray(data)
    corrupted[-1] ^= 0xFF
    with pytest.raises(RemoteProtocolError) as info:
        framing.FrameDecoder(_alloc_fresh([])).feed(bytes(corrupted))
    assert info.value.reason == "checksum"


def test_framing_decoder_dead_after_error():
    dec = framing.FrameDecoder(_alloc_fresh([]))
    with pytest.raises(RemoteProtocolError):
        dec.feed(b"garbage-garbage-garbage!")
    with pytest.raises(LocalProtocolError):
        dec.get_buffer()


def test_framing_sender_refuses_what_receiver_would_refuse():
    with pytest.raises(LocalProtocolError):
        framing.spec_for(np.zeros(3, dtype=np.complex64))
    with pytest.raises(LocalProtocolError):
        framing.spec_for(np.zeros((4, 4), np.float32)[:, 1])


def test_framing_torch_tensor_spec_shares_memory():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    spec, view = framing.spec_for(t)
    assert spec == wire.BufferSpec("<f4", (3, 4), 48)
    dest = torch.zeros(3, 4)
    framing.as_bytes_view(dest)[:] = view
    assert torch.equal(dest, t)


# -- issue 16 item 1: memory follows the bytes that arrived, not the lengths a header claims ----------

def _body_frame(nbytes, req_id=1):
    msg = wire.Request(req_id, msgspec.Raw(msgspec.msgpack.encode(b"x" * nbytes)))
    return msg, b"".join(bytes(p) for p in framing.encode_frame(msg))


def test_framing_large_body_is_allocated_as_it_arrives():
    # a header announcing the largest body, then a few bytes: at most one chunk is allocated
    header = framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, framing.MAX_BODY_BYTES, 0, 0, 0)
    dec = framing.FrameDecoder(_alloc_fresh([]))
    assert dec.feed(header + bytes(100)) == []
    assert dec.get_buffer().nbytes <= framing.BODY_CHUNK_BYTES
    assert dec.buffered_bytes <= framing.STAGING_BYTES + framing.BODY_CHUNK_BYTES


@pytest.mark.parametrize("step", [None, framing.BODY_CHUNK_BYTES + 3, 65536, 4093])
def test_framing_chunked_body_round_trip(step):
    msg, data = _body_frame(2 * framing.BODY_CHUNK_BYTES + 12345)
    tail_msg, tail = _request([np.arange(10, dtype=np.int32)], req_id=2)
    data += tail
    dec = framing.FrameDecoder(_alloc_fresh([]))
    step = step or len(data)
    frames = []
    for i in range(0, len(data), step):
        frames += dec.feed(data[i:i + step])
        assert dec.buffered_bytes <= framing.STAGING_BYTES + i + step + framing.BODY_CHUNK_BYTES
    assert [f.message for f in frames] == [msg, tail_msg] and dec.idle


def test_framing_lowered_body_limit_refuses_before_allocating():
    header = framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, 2**20, 0, 0, 0)
    dec = framing.FrameDecoder(_alloc_fresh([]), max_body_bytes=64 * 2**10)
    with pytest.raises(RemoteProtocolError) as info:
        dec.feed(header)
    assert info.value.reason == "oversize" and dec.buffered_bytes <= framing.STAGING_BYTES
    with pytest.raises(ValueError):
        framing.FrameDecoder(_alloc_fresh([]), max_body_bytes=framing.MAX_BODY_BYTES + 1)


def test_framing_stepwise_hands_out_one_frame_then_the_rest_under_new_limits():
    # what the session does: a handshake frame, then (same read) a frame over the stranger limit
    small = _body_frame(10, req_id=1)
    big = _body_frame(200_000, req_id=2)
    data = memoryview(small[1] + big[1])
    dec = framing.FrameDecoder(_alloc_fresh([]), max_body_bytes=64 * 2**10, stepwise=True)
    target = dec.get_buffer()  # one socket read: the small frame and the start of the big one
    n = target.nbytes
    target[:] = data[:n]
    assert [f.message for f in dec.buffer_updated(n)] == [small[0]]
    dec.max_body_bytes, dec.stepwise = framing.MAX_BODY_BYTES, False
    assert dec.more() == []  # the big one is incomplete, and no longer over the limit
    assert [f.message for f in dec.feed(data[n:])] == [big[0]]
    assert dec.idle and dec.more() == []


def test_framing_close_drops_buffers():
    dec = framing.FrameDecoder(_alloc_fresh([]))
    dec.feed(_body_frame(200_000)[1][:100_000])
    dec.close()
    assert dec.buffered_bytes == 0
    with pytest.raises(LocalProtocolError):
        dec.get_buffer()


# -- hostile bodies and specs: a typed protocol error, never an exception that escapes the decoder ---

def _nested_request_frame(depth):
    """A Request whose (opaque) payload is ``depth`` nested one-element arrays."""
    body = b"\x96\x0a\x01" + b"\x91" * depth + b"\xc0" + b"\x90\xc0\x00"  # [10, 1, [[...nil]], [], nil, 0]
    return framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, len(body), 0, 0, 0) + body


def _read_like_the_session(dec, data):
    """One socket read of ``data``: the hot path (``whole``) first, then the general path."""
    target = dec.get_buffer()
    target[:len(data)] = data
    if not dec.whole(len(data)):
        dec.buffer_updated(len(data))


@pytest.mark.parametrize("hot_path", [False, True])
def test_framing_deeply_nested_payload_is_bad_body(hot_path):
    # msgspec skips a Raw payload recursively and raises RecursionError past the interpreter's
    # limit: it must become ``bad_body`` like any other undecodable body (a stranger can send it)
    assert len(framing.FrameDecoder(_alloc_fresh([])).feed(_nested_request_frame(100))) == 1  # well formed
    data = _nested_request_frame(5000)
    assert len(data) < framing.STAGING_BYTES
    dec = framing.FrameDecoder(_alloc_fresh([]))
    with pytest.raises(RemoteProtocolError) as info:
        if hot_path:
            dec.deliver = lambda message, buffers: None
            _read_like_the_session(dec, data)
        else:
            dec.feed(data)
    assert info.value.reason == "bad_body"


@pytest.mark.parametrize("shape", [(0, 2**63), (0, 2**64 - 1), (0, 2**40, 2**40), (2**40, 2**40, 0)])
def test_framing_empty_spec_numpy_cannot_represent_is_bad_spec(shape):
    # nbytes = 0 = itemsize × Π shape, but ``np.empty(shape)`` raises ValueError: the receiver
    # could not type the buffer (a response's destination is ``np.empty(spec.shape)``)
    spec = wire.BufferSpec("|u1", shape, 0)
    msg = wire.Response(1, msgspec.Raw(b"\xc0"), [spec])
    data = b"".join(bytes(p) for p in framing.encode_frame(msg, [memoryview(b"")]))
    calls = []
    with pytest.raises(RemoteProtocolError) as info:
        framing.FrameDecoder(_alloc_fresh(calls)).feed(data)
    assert info.value.reason == "bad_spec" and calls == []


def test_framing_empty_specs_numpy_can_represent_still_pass():
    for shape in [(0,), (0, 3), (5, 0, 7), (0, 2**20)]:
        spec = wire.BufferSpec("<f8", shape, 0)
        msg = wire.Response(1, msgspec.Raw(b"\xc0"), [spec])
        data = b"".join(bytes(p) for p in framing.encode_frame(msg, [memoryview(b"")]))
        frames = framing.FrameDecoder(_alloc_fresh([])).feed(data)
        assert [f.message for f in frames] == [msg]
        np.empty(shape, np.float64)  # what the receiver makes of it
