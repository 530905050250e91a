"""``RemoteStreamRunner`` (rebalance/remote_source.py) against a scripted source: no sockets, no
sleeps; the source answers what the test lets it answer, and waits are counted in requests."""

import asyncio

import pytest

from giaannd.storage.rebalance import remote_source
from giaannd.storage.rebalance.source_control import SourceClose, SourceRate, SourceStart, SourceState, SourceStatus

START = SourceStart(7, "mem://target", "a", "d", [("a", 1.0)], [("a", 1.0), ("d", 1.0)], 1, label="a->d")


class ScriptedSource:
    """The source end of every control connection: applies a start's rate and a ``SourceRate`` as
    a ``SourceRegistry`` does (its throttle is ``rate``); holds the reply to the first
    ``SourceStart`` until ``answer_start`` is set."""

    def __init__(self) -> None:
        self.rate: float | None | str = "never set"
        self.started = asyncio.Event()
        self.answer_start = asyncio.Event()
        self.statuses = 0
        self.polled = asyncio.Condition()

    async def handle(self, msg):
        finished = False
        if isinstance(msg, SourceStart):
            self.rate = msg.rate_bytes_s
            self.started.set()
            await self.answer_start.wait()
        elif isinstance(msg, SourceRate):
            self.rate = msg.rate_bytes_s
        elif isinstance(msg, SourceClose):
            finished = True
        elif isinstance(msg, SourceStatus):
            async with self.polled:
                self.statuses += 1
                self.polled.notify_all()
        return SourceState(msg.stream_id, "done" if finished else "streaming", finished, finished, None, {})

    async def wait_statuses(self, n: int) -> None:
        async with self.polled:
            await self.polled.wait_for(lambda: self.statuses >= n)


@pytest.fixture
def source(monkeypatch):
    src = ScriptedSource()

    class Client:
        def __init__(self, transport, address, *, timeout_s=None):
            self.is_connected = False

        async def request(self, msg, bulk=()):
            self.is_connected = True
            return await src.handle(msg), []

        async def close(self):
            self.is_connected = False

    monkeypatch.setattr(remote_source, "SourceClient", Client)
    return src


@pytest.mark.asyncio
async def test_remote_runner_rate_set_before_the_start_is_answered_reaches_the_source(source):
    """The operator's rate (``giaannctl node topology rate``) arriving while the source's
    ``SourceStart`` (sent with the previous rate) is unanswered is applied once the source started.
    It used to be kept only for a later re-issued start: the stream ran at the old rate
    (unthrottled) until a reconnect or a resume, if ever."""
    runner = remote_source.RemoteStreamRunner(None, "mem://source", START)
    task = asyncio.create_task(runner.run())
    try:
        async with asyncio.timeout(10):
            await source.started.wait()
            assert source.rate is None
            runner.set_rate(1000.0)
            source.answer_start.set()
            await source.wait_statuses(3)  # the source answered three polls since it started
        assert source.rate == 1000.0
        runner.set_rate(None)  # and a later change, in order on the same connection
        async with asyncio.timeout(10):
            await source.wait_statuses(source.statuses + 2)
        assert source.rate is None
        runner.close()
        async with asyncio.timeout(10):
            await task
        assert runner.state == "done"
    finally:
        task.cancel()
        await asyncio.gather(task, *runner._background, return_exceptions=True)
