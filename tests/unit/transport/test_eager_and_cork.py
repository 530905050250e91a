"""The small-request mechanisms of issue 19: handlers started inside the read callback
(``peers/transport/eager.py``) and corked writes (``Link.cork``, ``TcpLink``'s held frames).

The conformance suite checks behaviour end to end on every backend; these pin what the new
mechanisms promise: a handler that does not wait needs no Task, one that waits keeps Task
semantics (current task, timeouts and TaskGroups entered before its first await, cancellation,
its own context); corked frames keep write order, are the link's own bytes, are bounded, and are
dropped (never half-written) when the connection goes away mid-batch.
"""

import asyncio
import contextvars
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from peers import framing, wire
from peers.errors import PeerDead, TransportClosed
from peers.transport import Reply, eager, tcp
from peers.transport.tcp import TcpLink

from ._loopback import close_pair, connected_pair

KEY = [b"unit-eager-cork-key-0123456789ab"]
pytestmark = pytest.mark.timeout(60)

_var: contextvars.ContextVar[str] = contextvars.ContextVar("unit_eager_var", default="unset")


async def _pair(handler, scheme="tcp"):
    return await connected_pair(handler, KEY, scheme)


async def _teardown(server, listener, client, conn):
    await close_pair(server, listener, client, conn)


# ---- eager handlers -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_handler_that_does_not_wait_replies_from_the_read_callback_without_a_task():
    seen = []

    async def handler(incoming):
        seen.append(asyncio.current_task())
        return Reply(incoming.decode(int) + 1, [incoming.bulk[0] * 2] if incoming.bulk else [])

    server, listener, client, conn = await _pair(handler)
    created = []
    loop = asyncio.get_running_loop()
    original = loop.create_task

    def counting(coro, **kwargs):
        created.append(coro)
        return original(coro, **kwargs)

    loop.create_task = counting  # type: ignore[method-assign]
    try:
        for i in range(20):
            result = await conn.request(i, [np.arange(i + 1, dtype=np.int32)], timeout_s=5)
            assert result.decode(int) == i + 1
            np.testing.assert_array_equal(result.bulk[0], np.arange(i + 1, dtype=np.int32) * 2)
    finally:
        del loop.create_task
    assert not [c for c in created if isinstance(c, eager.Resumed)
                or getattr(c, "__qualname__", "").endswith("_serve")]
    assert all(isinstance(t, eager.TaskStandIn) and t.task is None for t in seen)
    assert listener.connections[0]._serving == {}
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_timeout_and_taskgroup_entered_before_the_first_await_act_on_the_continuing_task():
    tasks = {}

    async def handler(incoming):
        op = incoming.decode(str)
        before = asyncio.current_task()
        if op == "timeout":
            try:
                async with asyncio.timeout(0.05):  # entered during the eager first step
                    await asyncio.sleep(10)
            except TimeoutError:
                after = asyncio.current_task()
                tasks["timeout"] = (before, after)
                return Reply("timed out")
        if op == "group":
            async with asyncio.TaskGroup() as group:
                child = group.create_task(asyncio.sleep(0.01, "child"))
            return Reply(child.result())
        if op == "self-cancel":
            asyncio.current_task().cancel()  # delivered at the first await, as in a Task
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return Reply("cancelled at first await")
        return Reply("?")

    server, listener, client, conn = await _pair(handler)
    assert (await conn.request("timeout", timeout_s=5)).decode(str) == "timed out"
    before, after = tasks["timeout"]
    assert isinstance(before, eager.TaskStandIn) and isinstance(after, asyncio.Task)
    assert before.task is after and after.cancelling() == 0  # the timeout's cancel was undone
    assert (await conn.request("group", timeout_s=5)).decode(str) == "child"
    assert (await conn.request("self-cancel", timeout_s=5)).decode(str) == "cancelled at first await"
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_each_handler_runs_in_its_own_context_whether_or_not_it_waits():
    async def handler(incoming):
        op = incoming.decode(str)
        previous = _var.get()
        _var.set(op)
        if op.startswith("wait"):
            await asyncio.sleep(0)
        return Reply(previous)

    server, listener, client, conn = await _pair(handler)
    for op in ("a", "wait-b", "c", "wait-d"):
        assert (await conn.request(op, timeout_s=5)).decode(str) == "unset"
    assert _var.get() == "unset"
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_cancel_and_budget_reach_a_handler_that_waits_after_an_eager_start():
    started = asyncio.Event()
    outcome = []

    async def handler(incoming):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcome.append(incoming.decode(str))
            raise
        return Reply()

    server, listener, client, conn = await _pair(handler)
    task = asyncio.get_running_loop().create_task(conn.request("cancel-me", timeout_s=10))
    async with asyncio.timeout(5):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(TimeoutError):  # DeadlineExceeded: the server's budget or the caller's
        await conn.request("budget", timeout_s=0.2)
    async with asyncio.timeout(5):
        while len(outcome) < 2 or listener.connections[0]._serving:
            await asyncio.sleep(0.01)
    assert sorted(outcome) == ["budget", "cancel-me"]
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_frames_after_goodbye_in_the_same_read_are_not_served():
    served = []

    async def handler(incoming):
        served.append(incoming.decode(int))
        return Reply()

    server, listener, client, conn = await _pair(handler)
    await conn.request(0, timeout_s=5)
    goodbye = framing.encode_frame(wire.Goodbye("bye"))
    late = framing.encode_frame(wire.Request(99, msgspec.Raw(msgspec.msgpack.encode(1))))
    conn.link.write([*goodbye, *late])  # one write: the server reads both frames at once
    async with asyncio.timeout(5):
        while listener.connections:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert served == [0]
    await _teardown(server, listener, client, conn)


# ---- corked writes (TcpLink with a recording transport) -------------------------------------------


class _Transport:
    """Records what a TcpLink hands to the socket; ``writelines`` is one writev."""

    def __init__(self, link):
        self.link, self.writes, self.closing, self.on_write = link, [], False, None

    def write(self, data):
        self._record([data])

    def writelines(self, parts):
        self._record(list(parts))

    def _record(self, parts):
        assert not self.closing, "written after close"
        self.writes.append(b"".join(bytes(p) for p in parts))
        if self.on_write is not None:
            self.on_write()

    def is_closing(self):
        return self.closing

    def set_write_buffer_limits(self, high):
        pass

    def get_extra_info(self, name):
        return None

    def abort(self):
        self.closing = True

    def close(self):
        self.closing = True

    @property
    def stream(self):
        return b"".join(self.writes)


def _link(vectored):
    session = SimpleNamespace(decoder=SimpleNamespace(get_buffer=lambda hint=-1: memoryview(bytearray(8))),
                              buffer_updated=lambda n: None, start=lambda: None, lost=lambda exc: None)
    link = TcpLink(lambda _link: session)
    transport = _Transport(link)
    link.connection_made(transport)
    link._vectored = vectored
    return link, transport


def _frame(tag, nbytes=0):
    """A frame's parts as Connection writes them: header+body bytes, then a bulk view."""
    parts = [tag * 24]
    if nbytes:
        parts.append(np.full(nbytes, tag[0], np.uint8).data)
    return parts


@pytest.mark.parametrize("vectored", [True, False])
def test_corked_frames_keep_write_order_around_a_large_frame(vectored):
    link, transport = _link(vectored)
    a, b = _frame(b"a", 100), _frame(b"b")
    big = _frame(b"c", tcp._HOLD_FRAME_BYTES + 1)  # too large to hold, still one writev
    d = _frame(b"d", 10)
    expected = b"".join(bytes(p) for f in (a, b, big, d) for p in f)
    link.cork()
    link.write(a)
    link.write(b)
    assert transport.writes == []  # held
    link.write(big)  # writes what is held first, together with it
    assert len(transport.writes) == 1
    link.write(d)
    link.uncork()
    assert transport.stream == expected
    assert len(transport.writes) == 2


def test_held_frames_are_the_links_own_bytes():
    link, transport = _link(True)
    bulk = np.arange(64, dtype=np.uint8)
    link.cork()
    link.write([b"H" * 24, bulk.data])
    bulk[:] = 0  # the caller reuses its buffer as soon as write returned
    link.uncork()
    assert transport.stream == b"H" * 24 + bytes(range(64))


def test_cork_nests_and_bounds_what_it_holds():
    link, transport = _link(True)
    link.cork()
    link.cork()
    link.write(_frame(b"x", 10))
    link.uncork()
    assert transport.writes == []  # the outer cork still holds
    frame = _frame(b"y", tcp._HOLD_FRAME_BYTES - 24)  # the largest frame that is held
    count = tcp._HOLD_MAX_BYTES // tcp._HOLD_FRAME_BYTES + 3
    for _ in range(count):
        link.write(frame)
    assert 1 <= len(transport.writes) < count  # written in pieces of at most the cap, not all held
    assert all(len(w) <= tcp._HOLD_MAX_BYTES + tcp._HOLD_FRAME_BYTES for w in transport.writes)
    link.uncork()
    assert transport.stream == bytes(_frame(b"x", 10)[0]) + b"x" * 10 + \
        (b"y" * 24 + b"y" * (tcp._HOLD_FRAME_BYTES - 24)) * count


@pytest.mark.asyncio
async def test_a_full_socket_during_the_batch_write_makes_the_link_unflushed_until_resumed():
    link, transport = _link(True)
    transport.on_write = link.pause_writing  # the kernel took only part of the batch
    link.cork()
    link.write(_frame(b"p", 10))
    link.write(_frame(b"q", 10))
    link.uncork()
    assert len(transport.writes) == 1 and not link.flushed  # Connection awaits drain() now
    waiter = asyncio.get_running_loop().create_task(link.drain())
    await asyncio.sleep(0)
    assert not waiter.done()
    link.resume_writing()
    await asyncio.wait_for(waiter, 5)
    assert link.flushed


def test_connection_lost_mid_batch_drops_held_frames_and_later_writes_fail():
    link, transport = _link(True)
    link.cork()
    link.write(_frame(b"r", 10))
    transport.closing = True
    link.connection_lost(ConnectionResetError("reset"))
    link.uncork()  # nothing is written to a closed transport, nothing raises
    assert transport.writes == [] and link._held == []
    with pytest.raises(TransportClosed):
        link.write(_frame(b"s"))


def test_close_writes_held_frames_first_abort_drops_them():
    link, transport = _link(True)
    link.cork()
    link.write(_frame(b"t"))
    link.close()  # e.g. a Reject: it must reach the peer
    assert transport.stream == b"t" * 24
    link2, transport2 = _link(True)
    link2.cork()
    link2.write(_frame(b"u"))
    link2.abort()
    assert transport2.writes == []


# ---- corked writes end to end -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_pipelined_requests_share_writes_and_every_reply_matches_its_request(monkeypatch):
    batches = []
    original = TcpLink._write_held

    def counting(self, transport):
        batches.append(sum(1 for part in self._held if bytes(part[:3]) == b"GP\x01"))  # frames
        original(self, transport)

    monkeypatch.setattr(TcpLink, "_write_held", counting)

    async def handler(incoming):
        if incoming.decode(int) % 3 == 0:
            await asyncio.sleep(0)  # some replies come from tasks, in a later iteration
        return Reply(incoming.decode(int), [incoming.bulk[0] + 1])

    server, listener, client, conn = await _pair(handler)
    n = 64
    results = await asyncio.wait_for(asyncio.gather(
        *(conn.request(i, [np.full(100 + i, i, np.int64)], timeout_s=10) for i in range(n))), 30)
    for i, result in enumerate(results):
        assert result.decode(int) == i
        np.testing.assert_array_equal(result.bulk[0], np.full(100 + i, i + 1, np.int64))
    assert batches and max(batches) > 1  # requests or replies left several to a write
    assert conn.in_flight == 0
    await _teardown(server, listener, client, conn)


@pytest.mark.asyncio
async def test_connection_failing_while_replies_are_held_fails_every_pending_request():
    server_conns = []

    async def handler(incoming):
        if incoming.decode(int) == 5:  # mid-batch: earlier replies are held by the cork
            server_conns[0].fail(PeerDead("membership: declared dead"))
        return Reply(incoming.decode(int))

    server, listener, client, conn = await _pair(handler)
    server_conns.extend(listener.connections)
    gathered = asyncio.gather(*(conn.request(i, timeout_s=10) for i in range(10)), return_exceptions=True)
    results = await asyncio.wait_for(gathered, 10)  # nothing hangs on a dropped batch
    for i, result in enumerate(results):
        assert isinstance(result, TransportClosed) or result.decode(int) == i
    assert all(isinstance(r, TransportClosed) for r in results[5:])
    assert conn.is_closed and conn.in_flight == 0
    await _teardown(server, listener, client, conn)
