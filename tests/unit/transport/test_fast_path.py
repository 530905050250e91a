"""The single-frame fast path of issue 19 (third pass): ``FrameDecoder.whole`` hands one whole
small request or response per read straight to ``deliver``; everything else it declines with
nothing consumed, and the general path decodes (and rejects) it as before. ``validate_spec``
remembers the specs it accepted. ``Connection`` frames bulk-free requests and replies itself.
"""

import asyncio

import msgspec
import numpy as np
import pytest

from peers import framing, wire
from peers.errors import LocalProtocolError, RemoteError, RemoteProtocolError
from peers.transport import Reply

from ._loopback import close_pair, connected_pair

KEY = [b"unit-fast-path-key-0123456789abc"]
pytestmark = pytest.mark.timeout(60)


def _encode(msg, bufs=()):
    return b"".join(bytes(p) for p in framing.encode_frame(msg, [memoryview(b).cast("B") for b in bufs]))


def _request(req_id=1, bufs=(), *, checksum=False, payload=b"\x01"):
    pairs = [framing.spec_for(b, with_checksum=checksum) for b in bufs]
    msg = wire.Request(req_id, msgspec.Raw(payload), [p[0] for p in pairs], 250.0)
    return msg, _encode(msg, [p[1] for p in pairs])


def _response(req_id=1, bufs=()):
    pairs = [framing.spec_for(b) for b in bufs]
    msg = wire.Response(req_id, msgspec.Raw(b"\xc0"), [p[0] for p in pairs])
    return msg, _encode(msg, [p[1] for p in pairs])


def _raw_frame(body):
    """A bulk-free frame around a body encoded by hand."""
    return framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, len(body), 0, 0, 0) + body


def _as_array16(msg):
    """A message encoded with an array16 header instead of msgspec's fixarray (valid msgpack)."""
    body = msgspec.msgpack.encode(msg)
    assert body[0] & 0xF0 == 0x90
    return b"\xdc\x00" + bytes([body[0] & 0x0F]) + body[1:]


class _Sink:
    """A decoder with ``deliver`` set, fed read by read as a ``BufferedProtocol`` would be."""

    def __init__(self):
        self.delivered = []
        self.allocated = []
        self.dec = framing.FrameDecoder(self._allocate)
        self.dec.deliver = lambda msg, bufs: self.delivered.append((msg, [bytes(b) for b in bufs]))

    def _allocate(self, message, specs):
        dests = [np.zeros(s.nbytes, np.uint8).data for s in specs]
        self.allocated.append(dests)
        return dests

    def read(self, data):
        """One socket read of ``data`` (which must fit ``get_buffer``): whole() first, else the
        general path, as ``Session.buffer_updated`` does. Returns (taken by whole, frames)."""
        target = self.dec.get_buffer()
        assert len(data) <= target.nbytes
        target[: len(data)] = data
        if self.dec.whole(len(data)):
            return True, []
        return False, self.dec.buffer_updated(len(data))


def _known(spec):
    framing.validate_spec(spec)  # what the general path does the first time it sees a spec


def test_whole_delivers_one_small_frame_per_read_as_the_general_path_decodes_it():
    buf = np.arange(100, dtype=np.float32)
    cases = [_request(1), _response(2), _request(3, [buf]), _response(4, [buf.reshape(10, 10)])]
    for msg, data in cases:
        for spec in msg.bulk:
            _known(spec)
        sink = _Sink()
        taken, frames = sink.read(data)
        general = framing.FrameDecoder(lambda m, specs: [np.zeros(s.nbytes, np.uint8).data for s in specs]).feed(data)
        assert taken and frames == []
        assert sink.delivered == [(general[0].message, [bytes(b) for b in general[0].buffers])]
        assert sink.delivered[0][0] == msg
        assert sink.dec.idle and sink.dec.frames_decoded == 1
        if msg.bulk:
            assert sink.delivered[0][1] == [buf.tobytes()]


def test_whole_declines_everything_else_and_the_general_path_decodes_it_unchanged():
    one, two = np.arange(10, dtype=np.int32), np.arange(3, dtype=np.int64)
    for spec in (framing.spec_for(one)[0], framing.spec_for(two)[0]):
        _known(spec)
    two_frames = _request(1)[1] + _request(2)[1]
    declined = [
        two_frames,  # several frames in one read (pipelined): the session corks their replies
        _request(1)[1][:-1],  # the body is not complete yet
        _request(1, [one, two])[1],  # two buffers
        _request(1, [np.zeros(0, np.uint8)])[1],  # an empty buffer
        _request(1, [one], checksum=True)[1],  # a checksum: verified on the general path
        _encode(wire.ErrorReply(1, "ValueError", "no")),
        _encode(wire.Cancel(1)),
        # valid msgpack that is not a fixarray: the tag is not the body's second byte, so the
        # type whole() guesses is wrong (a request and a response read as other types, and a
        # Goodbye whose second byte is the request tag)
        _raw_frame(_as_array16(wire.Request(7, msgspec.Raw(b"\xc0")))),
        _raw_frame(_as_array16(wire.Response(8, msgspec.Raw(b"\xc0")))),
        _raw_frame(b"\xdc\x0a\x00\x0e\xa1x" + b"\xc0" * (0x0A00 - 2)),
    ]
    for data in declined:
        sink = _Sink()
        expected = framing.FrameDecoder(sink._allocate).feed(data)
        sink.allocated.clear()
        taken, frames = sink.read(data)
        assert not taken and sink.delivered == []
        assert [f.message for f in frames] == [f.message for f in expected]
        assert [[bytes(b) for b in f.buffers] for f in frames] == [[bytes(b) for b in f.buffers] for f in expected]


def test_whole_declines_a_spec_it_has_not_seen_validated_then_takes_it():
    shape = (7, 3, 5)  # a shape no other test uses
    arr = np.ones(shape, np.int16)
    spec = framing.spec_for(arr)[0]
    framing._VALID_SPECS.pop(spec, None)
    sink = _Sink()
    taken, frames = sink.read(_request(1, [arr])[1])
    assert not taken and len(frames) == 1  # the general path validated it...
    assert spec in framing._VALID_SPECS
    taken, frames = sink.read(_request(2, [arr])[1])
    assert taken and frames == [] and sink.delivered[0][0].id == 2  # ...so the next one is fast


@pytest.mark.parametrize("field, value, reason", [("magic", b"XX", "bad_magic"), ("version", 9, "bad_version"),
                                                  ("flags", 0x80, "bad_flags")])
def test_whole_declines_a_bad_header_and_the_general_path_rejects_it(field, value, reason):
    msg, data = _request(1)
    fields = dict(zip(("magic", "version", "flags", "body_len", "nbufs", "reserved", "bulk_len"),
                      framing.HEADER.unpack_from(data)))
    fields[field] = value
    data = framing.HEADER.pack(*fields.values()) + data[framing.HEADER_BYTES:]
    sink = _Sink()
    with pytest.raises(RemoteProtocolError) as err:
        sink.read(data)
    assert err.value.reason == reason and sink.delivered == []


def test_whole_declines_an_undecodable_body_and_the_general_path_rejects_it():
    body = b"\x96\x0a\x01"  # an array header that promises more than the body holds
    data = framing.HEADER.pack(framing.MAGIC, framing.FRAME_VERSION, 0, len(body), 0, 0, 0) + body
    sink = _Sink()
    with pytest.raises(RemoteProtocolError) as err:
        sink.read(data)
    assert err.value.reason == "bad_body" and sink.delivered == []


def test_whole_declines_a_spec_that_disagrees_with_the_header():
    arr = np.arange(16, dtype=np.uint8)
    msg, data = _request(1, [arr])
    _known(msg.bulk[0])
    fields = list(framing.HEADER.unpack_from(data))
    fields[6] -= 1  # bulk_len one short of the spec's nbytes
    data = framing.HEADER.pack(*fields) + data[framing.HEADER_BYTES:-1]
    sink = _Sink()
    with pytest.raises(RemoteProtocolError) as err:
        sink.read(data)
    assert err.value.reason == "bad_header" and sink.delivered == []


def test_whole_stepwise_decoder_is_left_to_the_general_path():
    sink = _Sink()
    sink.dec.stepwise = True
    taken, frames = sink.read(_request(1)[1])
    assert not taken and len(frames) == 1


@pytest.mark.parametrize("split", [None, 1000])
def test_whole_frame_larger_than_one_read_finishes_in_its_destination(split):
    arr = (np.arange(framing.STAGING_BYTES + 5000) % 251).astype(np.uint8)  # over the staging buffer
    msg, data = _request(1, [arr])
    _known(msg.bulk[0])
    sink = _Sink()
    first = sink.dec.get_buffer().nbytes
    taken, frames = sink.read(data[:first])
    assert taken and frames == [] and sink.delivered == []
    dest = sink.allocated[0][0]
    rest = data[first:]
    if split:  # a read that does not finish the buffer goes the general way, the last one fast
        assert sink.dec.get_buffer().nbytes == len(rest)
        taken, frames = sink.read(rest[:split])
        assert not taken and frames == []
        rest = rest[split:]
    target = sink.dec.get_buffer()
    assert target.obj is dest.obj  # the kernel writes straight into the destination
    taken, frames = sink.read(rest)
    assert taken and frames == [] and sink.dec.idle
    assert sink.delivered == [(msg, [arr.tobytes()])]
    assert sink.dec.frames_decoded == 1


def test_validate_spec_remembers_only_valid_specs_without_checksums_and_stays_bounded():
    framing._VALID_SPECS.clear()
    good = wire.BufferSpec("<f4", (3, 4), 48)
    framing.validate_spec(good)
    assert good in framing._VALID_SPECS
    bad = wire.BufferSpec("<f4", (3, 4), 47)
    for _ in range(2):  # refused every time, never remembered
        with pytest.raises(RemoteProtocolError):
            framing.validate_spec(bad)
    assert bad not in framing._VALID_SPECS
    framing.validate_spec(wire.BufferSpec("<f4", (3, 4), 48, 12345))
    assert len(framing._VALID_SPECS) == 1
    framing.validate_spec(wire.BufferSpec("<f4", [3, 4], 48))  # a list shape: checked, not cached
    assert len(framing._VALID_SPECS) == 1
    for n in range(framing._VALID_SPECS_MAX + 10):
        framing.validate_spec(wire.BufferSpec("|u1", (n,), n))
    assert len(framing._VALID_SPECS) <= framing._VALID_SPECS_MAX


# ---- the connection's side ----------------------------------------------------------------------


async def _pair(handler):
    return await connected_pair(handler, KEY)


async def _teardown(server, listener, client, conn):
    await close_pair(server, listener, client, conn)


@pytest.mark.asyncio
@pytest.mark.parametrize("waits", [False, True])
async def test_requests_with_budgets_leave_no_bookkeeping_behind(waits):
    async def handler(incoming):
        if waits:
            await asyncio.sleep(0)
        return Reply(incoming.decode(int) * 2, [incoming.bulk[0] + 1] if incoming.bulk else [])

    server, listener, client, conn = await _pair(handler)
    served = listener.connections[0]
    for i in range(20):
        bulk = [np.full(i + 1, i, np.int64)] if i % 2 else []
        result = await conn.request(i, bulk, timeout_s=5)
        assert result.decode(int) == 2 * i
        if bulk:
            np.testing.assert_array_equal(result.bulk[0], bulk[0] + 1)
    await asyncio.sleep(0.01)  # a Task's done-callback runs one iteration after its reply
    assert served._serving == {} and served._replying == set() and served._expired == set()
    assert served._leases == {} and server.pool.leased == (served._spare is not None)
    assert conn._pending == {}
    await _teardown(server, listener, client, conn)
    assert served._spare is None and server.pool.leased == 0  # the kept buffer went back on close


@pytest.mark.asyncio
async def test_a_served_requests_buffer_is_reused_by_the_next_and_never_shared_with_a_waiting_one():
    release = asyncio.Event()

    async def handler(incoming):
        data = incoming.bulk[0]
        if incoming.decode(str) == "wait":
            await release.wait()
        return Reply(None, [data.copy()])  # what the buffer holds when the handler ends

    server, listener, client, conn = await _pair(handler)
    served = listener.connections[0]
    leases = []
    original = server.pool.lease
    server.pool.lease = lambda nbytes: leases.append(nbytes) or original(nbytes)
    for i in range(10):  # sequential, sizes within the first buffer's size class: one lease
        data = np.full(100 + 300 * i, i, np.uint8)
        np.testing.assert_array_equal((await conn.request("now", [data], timeout_s=5)).bulk[0], data)
    assert leases == [100]
    for i in range(5):  # a larger size: one lease, then that buffer is the one kept (and serves small ones)
        data = np.full(65536 if i < 4 else 10, i, np.uint8)
        np.testing.assert_array_equal((await conn.request("now", [data], timeout_s=5)).bulk[0], data)
    assert leases == [100, 65536] and served._spare.capacity == 65536
    assert server.pool.leased == 1  # the smaller one went back
    leases.clear()
    # a handler that waits keeps its buffer; requests meanwhile get others, not the same memory
    waiting = asyncio.ensure_future(conn.request("wait", [np.full(1000, 7, np.uint8)], timeout_s=5))
    async with asyncio.timeout(5):
        while not served._serving:
            await asyncio.sleep(0.001)
    for i in range(3):
        data = np.full(1000, 50 + i, np.uint8)
        np.testing.assert_array_equal((await conn.request("now", [data], timeout_s=5)).bulk[0], data)
    release.set()
    np.testing.assert_array_equal((await waiting).bulk[0], np.full(1000, 7, np.uint8))
    assert len(leases) == 1  # the waiting one held the kept buffer: one more lease, then kept
    big = np.ones(2 * 256 * 2**10, np.uint8)  # over the size kept: leased and given back
    await conn.request("now", [big], timeout_s=5)
    await asyncio.sleep(0.01)
    assert served._spare is not None and served._spare.capacity <= 256 * 2**10
    assert server.pool.leased == 1
    await _teardown(server, listener, client, conn)
    assert server.pool.leased == 0


@pytest.mark.asyncio
async def test_small_frames_keep_their_limits_on_the_sending_side():
    async def handler(incoming):
        return Reply(bytes(framing.MAX_BODY_BYTES))  # a reply body over the limit

    server, listener, client, conn = await _pair(handler)
    with pytest.raises(LocalProtocolError):
        await conn.request(msgspec.msgpack.encode(bytes(framing.MAX_BODY_BYTES)), timeout_s=5)
    with pytest.raises(RemoteError) as err:  # the handler's reply is refused there, typed here
        await conn.request(None, timeout_s=5)
    assert err.value.remote_type == "LocalProtocolError"
    server_handler_calls = len(listener.connections)
    assert server_handler_calls == 1 and not conn.is_closed  # refused frames were never half-written
    await _teardown(server, listener, client, conn)


def test_after_a_frame_too_large_for_one_read_the_next_is_read_header_and_body_first():
    big = (np.arange(framing.STAGING_BYTES + 100) % 253).astype(np.uint8)
    msg, data = _request(1, [big])
    _known(msg.bulk[0])
    sink = _Sink()
    first = sink.dec.get_buffer().nbytes
    assert first == framing.STAGING_BYTES
    sink.read(data[:first])
    sink.read(data[first:])
    assert len(sink.delivered) == 1
    msg2, data2 = _request(2, [big])
    head = len(data2) - big.nbytes
    assert sink.dec.get_buffer().nbytes == head  # header and body only
    taken, _ = sink.read(data2[:head])
    assert taken and sink.delivered[1:] == []
    target = sink.dec.get_buffer()
    assert target.nbytes == big.nbytes and target.obj is sink.allocated[-1][0].obj  # in place
    taken, _ = sink.read(data2[head:])
    assert taken and sink.delivered[1] == (msg2, [big.tobytes()])
    # guessed wrong: a longer body, then small frames; each is still decoded whole and in order
    msg3, data3 = _request(3, [big], payload=msgspec.msgpack.encode(bytes(500)))
    frames = []
    while len(data3):
        n = min(sink.dec.get_buffer().nbytes, len(data3))
        taken, got = sink.read(data3[:n])
        frames += got
        data3 = data3[n:]
    small = b"".join(_request(i)[1] for i in (4, 5))
    while len(small):
        n = min(sink.dec.get_buffer().nbytes, len(small))
        taken, got = sink.read(small[:n])
        frames += got
        small = small[n:]
    ids = [m.id for m, _ in sink.delivered] + [f.message.id for f in frames]
    assert sorted(ids) == [1, 2, 3, 4, 5] and sink.dec.idle
    assert sink.dec.get_buffer().nbytes == framing.STAGING_BYTES  # small frames: back to whole reads


@pytest.mark.asyncio
async def test_a_shorter_deadline_than_the_armed_one_still_fires():
    from peers.errors import DeadlineExceeded

    async def handler(incoming):
        await asyncio.sleep(30)
        return Reply()

    server, listener, client, conn = await _pair(handler)
    long = asyncio.ensure_future(conn.request(None, timeout_s=60))  # arms the caller's timer at 60 s
    await asyncio.sleep(0.01)
    async with asyncio.timeout(10):  # the 0.05 s deadline re-arms it earlier
        with pytest.raises(DeadlineExceeded):
            await conn.request(None, timeout_s=0.05)
    long.cancel()
    await _teardown(server, listener, client, conn)


def test_the_current_task_lookup_agrees_with_asyncio():
    """The handler start's cheap ``current_task`` (connection._current_task_of) must say what
    asyncio says on this Python: inside a task, that task; in a plain loop callback (a read
    callback), None — else requests would start eagerly inside a task, or never eagerly."""
    from peers.transport import connection

    async def main():
        loop = asyncio.get_running_loop()
        assert connection._current_task_of(loop) is asyncio.current_task() is not None
        seen = loop.create_future()
        loop.call_soon(lambda: seen.set_result((connection._current_task_of(loop), asyncio.current_task(loop))))
        assert await seen == (None, None)

    asyncio.run(main())
