"""The event loop's lag and stalls (giaannd/runtime/loop_watch.py): a loop held longer than
``stall_s`` is reported once, from another thread, with the stack that holds it; a loop that keeps
running is never reported; the lag samples see how late the loop ran."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import pytest

from giaannd.runtime.loop_watch import LoopWatch, StallClock


def test_a_stall_is_reported_once_when_it_reaches_its_bound_and_again_only_after_a_beat():
    clock = StallClock(1.0, now=10.0)
    assert clock.check(10.9) is None  # under the bound
    assert clock.check(11.2) == pytest.approx(1.2)  # reached: reported ...
    assert clock.check(15.0) is None  # ... once, however long it lasts
    clock.beat(15.1)  # the loop ran again
    assert clock.check(15.5) is None
    assert clock.check(16.3) == pytest.approx(1.2)  # a new stall
    with pytest.raises(ValueError):
        StallClock(0.0, now=0.0)


def _hold_the_loop_for(seconds: float) -> None:  # (its name is looked for in the logged stack)
    time.sleep(seconds)


@contextlib.asynccontextmanager
async def _watching(watch: LoopWatch):  # type: ignore[no-untyped-def]
    """``watch`` running on this loop for the block, stopped (its thread joined) after it."""
    stopping = asyncio.Event()
    task = asyncio.create_task(watch.run(stopping))
    await asyncio.sleep(0.05)  # (the task sleeping)
    try:
        yield
    finally:
        stopping.set()
        await asyncio.wait_for(task, 5)


@pytest.mark.asyncio
async def test_a_loop_held_past_the_bound_is_logged_with_the_stack_that_holds_it(caplog):
    lags: list[float] = []
    held: list[float] = []
    watch = LoopWatch(0.3, lags.append, held.append)
    with caplog.at_level(logging.WARNING, logger="giaannd.runtime.loop_watch"):
        async with _watching(watch):
            await asyncio.sleep(0.6)  # a few beats, nothing held
            assert watch.stalls == 0 and held == []
            _hold_the_loop_for(0.9)
            await asyncio.sleep(0.6)  # beats again: no second report for the same stall
    assert watch.stalls == 1 and len(held) == 1 and held[0] >= 0.3
    lines = [r.getMessage() for r in caplog.records if "event loop held" in r.getMessage()]
    assert len(lines) == 1 and "_hold_the_loop_for" in lines[0]
    assert "loop-watch" not in lines[0] and "the other threads are in" in lines[0]
    assert max(lags) >= 0.6  # the sample that waited behind the held loop


@pytest.mark.asyncio
async def test_a_loop_that_keeps_running_is_never_reported_and_the_thread_ends_with_it():
    lags: list[float] = []
    watch = LoopWatch(0.5, lags.append)
    async with _watching(watch):
        for _ in range(12):  # short pieces of work, each far under the bound
            _hold_the_loop_for(0.02)
            await asyncio.sleep(0.05)
    assert watch.stalls == 0 and len(lags) >= 1
    assert watch._thread is None  # noqa: SLF001 (joined)


@pytest.mark.asyncio
async def test_without_a_bound_only_the_lag_is_sampled():
    lags: list[float] = []
    watch = LoopWatch(0.0, lags.append)
    async with _watching(watch):
        _hold_the_loop_for(0.3)
        await asyncio.sleep(0.3)
    assert watch.stalls == 0 and lags and max(lags) >= 0.05
    with pytest.raises(ValueError):
        LoopWatch(-1.0, lags.append)


def _spin_in_a_thread(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


@pytest.mark.asyncio
async def test_a_stall_names_what_the_other_threads_are_doing(caplog):
    stop = threading.Event()
    other = threading.Thread(target=_spin_in_a_thread, args=(stop,), name="busy-worker")
    other.start()
    watch = LoopWatch(0.2, lambda _lag: None)
    try:
        with caplog.at_level(logging.WARNING, logger="giaannd.runtime.loop_watch"):
            async with _watching(watch):
                _hold_the_loop_for(0.6)
    finally:
        stop.set()
        other.join()
    line = next(r.getMessage() for r in caplog.records if "event loop held" in r.getMessage())
    assert "busy-worker:" in line and "_spin_in_a_thread" in line
    assert "idle-worker" not in line and "more waiting for work" in line


@pytest.fixture(autouse=True)
def _an_idle_thread():  # type: ignore[no-untyped-def]
    """A thread waiting for work, as a pool's are: counted in a stall's line, not listed."""
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, name="idle-worker")
    idle.start()
    yield
    stop.set()
    idle.join()
