"""The predicted read of issue 19 (fifth pass): after a request too large for one read, the
decoder borrows its owner's buffer (``FrameDecoder.lend``) and reads the next request of the same
shape — header, body and bulk — in one read into it, the bulk landing where the owner put it.
Whatever else arrives in that read (another shape, a short read, several frames, a bad frame) is
copied out and decoded by the general path, with the same results and errors as without the
prediction.
"""

import asyncio

import msgspec
import numpy as np
import pytest

from peers import framing, wire
from peers.errors import RemoteProtocolError
from peers.transport import Reply

from ._loopback import close_pair, connected_pair
from .test_fast_path import _known, _request, _response, _Sink

KEY = [b"unit-predicted-read-key-0123456x"]
pytestmark = pytest.mark.timeout(60)
ROOM = 256  # where the owner below puts a lent frame's bulk (as ``Connection`` does)
BIG = framing.STAGING_BYTES  # 64 KiB: with its header and body, too large for one staging read


class _LendingSink(_Sink):
    """``_Sink`` whose owner keeps one buffer and lends it as ``Connection.lend`` does (the bulk at
    ``ROOM``): a one-buffer request's ``allocate`` takes the kept buffer while it is there — the
    lent view for the predicted size, else a place among the lent read's bytes (the owner may
    reuse that memory once the read was declined, so those bytes must have been copied out) —,
    anything else gets fresh memory."""

    def __init__(self):
        super().__init__()
        self.kept = np.zeros(3 * BIG, np.uint8)
        self.free = True  # the kept buffer is not lent to a request (it comes back at ``_lend``)
        self.lent = None
        self.loans = 0
        self.dec.lend = self._lend

    def _lend(self, head, nbytes):
        self.free = True  # the request that held it was delivered (handled, in ``Connection``)
        if head > ROOM or ROOM + nbytes > self.kept.nbytes:
            return None
        whole = memoryview(self.kept)
        self.lent = whole[ROOM : ROOM + nbytes]
        self.loans += 1
        return whole[ROOM - head : ROOM + nbytes], self.lent

    def _allocate(self, message, specs):
        if type(message) is wire.Request and len(specs) == 1 and self.free and specs[0].nbytes <= self.kept.nbytes:
            lent, self.lent, self.free = self.lent, None, False
            nbytes = specs[0].nbytes
            if lent is not None and lent.nbytes == nbytes:
                dest = lent
            else:  # the memory is the owner's again: here it even writes to it before handing it out
                dest = memoryview(self.kept)[ROOM + 64 :][:nbytes]
                dest[:] = b"\xee" * nbytes
            self.allocated.append([dest])
            return [dest]
        return super()._allocate(message, specs)

    def drain(self, data, first=None):
        """Deliver ``data`` read by read (each read as large as ``get_buffer`` allows, the first
        one ``first`` bytes if given); returns the frames the general path completed."""
        frames = []
        while data:
            n = min(self.dec.get_buffer().nbytes, len(data), first or len(data))
            first = None
            _taken, got = self.read(data[:n])
            frames += got
            data = data[n:]
        return frames


def _big(seed, extra=0):
    return ((np.arange(BIG + extra) + seed) % 251).astype(np.uint8)


def _primed():
    """A sink that has received one 64 KiB request (so the next one is predicted)."""
    sink = _LendingSink()
    msg, data = _request(1, [_big(1)])
    _known(msg.bulk[0])
    assert sink.drain(data) == [] and len(sink.delivered) == 1
    return sink


def test_the_next_request_of_the_same_shape_is_read_in_one_read_into_the_lent_buffer():
    sink = _primed()
    for i in range(2, 5):
        arr = _big(i)
        msg, data = _request(i, [arr])
        target = sink.dec.get_buffer()
        assert target.nbytes == len(data) and target.obj is sink.kept  # header, body and bulk: one read
        taken, frames = sink.read(data)
        assert taken and frames == [] and sink.dec.idle
        assert sink.delivered[-1] == (msg, [arr.tobytes()])
        assert sink.allocated[-1][0].obj is sink.kept
        np.testing.assert_array_equal(sink.kept[ROOM : ROOM + BIG], arr)  # the bulk landed in place
    assert sink.loans == 4 and sink.dec.frames_decoded == 4


def test_a_predicted_request_split_across_reads_continues_in_place():
    sink = _primed()
    arr = _big(7)
    msg, data = _request(2, [arr])
    head = len(data) - BIG
    taken, _ = sink.read(data[: head + 1000])  # header, body and the first bytes of the bulk
    assert taken and sink.delivered[1:] == []
    target = sink.dec.get_buffer()
    assert target.nbytes == BIG - 1000 and target.obj is sink.kept  # the rest: straight in place
    taken, _ = sink.read(data[head + 1000 :])
    assert taken and sink.delivered[1] == (msg, [arr.tobytes()]) and sink.dec.idle


def _other_shape():
    return [_request(2, [_big(2)], payload=msgspec.msgpack.encode(bytes(300)))]  # longer body


def _bigger_bulk():
    return [_request(2, [_big(2, extra=1000)])]


def _smaller_bulk_then_small_frames():
    return [_request(2, [_big(2, extra=-1000)]), _request(3), _request(4, [np.arange(10, dtype=np.int32)])]


def _small_frames():
    return [_request(2), _request(3), _request(4)]


def _response_of_the_same_shape():
    return [_response(2, [_big(2)])]


@pytest.mark.parametrize("frames", [_other_shape, _bigger_bulk, _smaller_bulk_then_small_frames, _small_frames,
                                    _response_of_the_same_shape])
@pytest.mark.parametrize("first", [None, 10, 30])  # the whole read, or a short one (header cut)
def test_a_read_that_is_not_the_predicted_frame_goes_the_general_path_unchanged(frames, first):
    sink = _primed()
    sent = frames()
    for msg, _ in sent:
        for spec in getattr(msg, "bulk", []):
            _known(spec)
    data = b"".join(d for _, d in sent)
    assert sink.dec.get_buffer().obj is sink.kept  # the next frame was predicted
    done = sink.drain(data, first)
    got = [(m, bufs) for m, bufs in sink.delivered[1:]] + [(f.message, [bytes(b) for b in f.buffers]) for f in done]
    want = [(msg, [d[len(d) - msg.bulk[0].nbytes :]] if msg.bulk else []) for msg, d in sent]
    assert sorted(got, key=lambda mb: mb[0].id) == want  # each frame once, its bulk intact
    assert sink.dec.idle and sink.dec.frames_decoded == 1 + len(sent)


@pytest.mark.parametrize(("field", "value", "reason"), [(0, b"XX", "bad_magic"), (1, 9, "bad_version"),
                                                         (2, 0x80, "bad_flags")])
def test_a_bad_header_in_the_predicted_read_is_rejected_as_before(field, value, reason):
    sink = _primed()
    msg, data = _request(2, [_big(2)])
    fields = list(framing.HEADER.unpack_from(data, 0))
    fields[field] = value
    bad = framing.HEADER.pack(*fields) + data[framing.HEADER_BYTES :]
    with pytest.raises(RemoteProtocolError) as err:
        sink.drain(bad)
    assert err.value.reason == reason


def test_a_spec_that_disagrees_with_the_header_in_the_predicted_read_is_rejected_as_before():
    sink = _primed()
    arr = _big(2)
    spec, view = framing.spec_for(arr)
    wrong = wire.BufferSpec("|u1", (BIG + 8,), BIG + 8)  # self-consistent, but not the header's length
    body = msgspec.msgpack.encode(wire.Request(2, msgspec.Raw(b"\x01"), [wrong], 250.0))
    frame = framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, len(body), 1, 0, BIG) + body + bytes(view)
    assert len(frame) == len(_request(2, [arr])[1])  # the predicted size: only the spec differs
    with pytest.raises(RemoteProtocolError) as err:
        sink.drain(frame)
    assert err.value.reason == "bad_header"


@pytest.mark.asyncio
@pytest.mark.parametrize("waits", [False, True])
async def test_requests_of_mixed_sizes_arrive_intact_through_the_predicted_read(waits):
    async def handler(incoming):
        if waits and incoming.decode(int) % 3 == 0:
            await asyncio.sleep(0)
        data = incoming.bulk[0]
        return Reply(int(data.astype(np.int64).sum()), [data[:16].copy(), data[-16:].copy()])

    server, listener, client, conn = await connected_pair(handler, KEY)
    served = listener.connections[0]
    sizes = [BIG, BIG, BIG, BIG + 1000, BIG, BIG - 1000, BIG, 100, BIG, 200_000, BIG, BIG]
    for i, size in enumerate(sizes):
        arr = ((np.arange(size) * (i + 3)) % 253).astype(np.uint8)
        result = await conn.request(i, [arr], timeout_s=5)
        assert result.decode(int) == int(arr.astype(np.int64).sum())
        np.testing.assert_array_equal(result.bulk[0], arr[:16])
        np.testing.assert_array_equal(result.bulk[1], arr[-16:])
    await asyncio.sleep(0.01)
    assert served._leases == {} and server.pool.leased == (served._spare is not None)
    await close_pair(server, listener, client, conn)
    assert server.pool.leased == 0 and client.pool.leased == 0
