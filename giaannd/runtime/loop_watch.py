"""Event-loop lag and stalls, watched from outside the loop.

Theory of operation
-------------------
Everything a node serves (gossip's acks, reads, applies, streams, the admin API) runs on one asyncio
event loop, so work that holds the loop's thread (an O(store) sort or copy done inline, a blocking
call) delays all of it, and a stall longer than membership's probe timeout can get the node suspected by
its peers. The store's O(store) work is meant to run in worker threads (docs/storage.md); this
module is how an operator sees whether it does, and what held the loop when it did not:

- **lag**: a task on the loop sleeps ``TICK_S`` (or a quarter of ``stall_s``, if shorter) and
  records how late it woke (``giaannd_event_loop_lag_seconds``, four samples a second: the loop's
  scheduling delay, what any callback waits on top of its own work), and notes when it ran, the
  loop's *beat*;
- **stalls**: a daemon thread looks at the beat every quarter of ``stall_s``; once the loop has not
  beaten for ``stall_s`` it takes the loop thread's Python stack (``sys._current_frames``), logs it
  once per stall at WARNING with how long the loop has been held so far, and counts the stall
  (``giaannd_event_loop_stalls_total``), with the innermost frames of every other thread: the
  stack names the code that holds the loop, or, when the loop thread is in C code (waiting for the
  GIL), the other threads name who holds it. A stall shorter than ``stall_s`` shows in the lag
  histogram only.

``StallClock`` holds the decision (pure: times in, a report or nothing out); ``LoopWatch`` does the
sleeping, the thread and the logging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Final

__all__ = ["LAG_BUCKETS_S", "OTHER_THREAD_FRAMES", "STACK_FRAMES", "TICK_S", "LoopWatch", "StallClock"]

log = logging.getLogger(__name__)

#: How often the loop's task wakes (its lag is sampled this often).
TICK_S: Final = 0.25
#: Frames of the loop thread's stack a stall's log line keeps (the innermost ones).
STACK_FRAMES: Final = 12
#: Frames of each other thread's stack a stall's log line names.
OTHER_THREAD_FRAMES: Final = 3
#: Lag buckets, 1 ms to 30 s: a loop that keeps up wakes within a millisecond or two.
LAG_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StallClock:
    """When the loop counts as stalled, and each stall reported once. ``beat(now)`` from the loop;
    ``check(now)`` from the watching thread: the seconds the loop has been held when a stall of at
    least ``stall_s`` is first seen, else None."""

    def __init__(self, stall_s: float, now: float) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        self.stall_s = stall_s
        self._beat = now
        self._reported_beat: float | None = None

    def beat(self, now: float) -> None:
        self._beat = now

    def check(self, now: float) -> float | None:
        beat = self._beat  # (one read: the loop may beat meanwhile)
        held = now - beat
        if held < self.stall_s or self._reported_beat == beat:
            return None
        self._reported_beat = beat
        return held


class LoopWatch:
    """The lag sampler (``run``, a task on the loop) and, with ``stall_s`` > 0, the stall thread.

    Args:
        stall_s: seconds without a beat that count as a stall (0: no thread, lag only).
        observe_lag: called on the loop with each lag sample in seconds (a histogram's ``observe``).
        on_stall: called in the watching thread with the seconds held, once per stall (a counter's
            ``inc``), before the log line.
    """

    def __init__(self, stall_s: float, observe_lag: Callable[[float], None],
                 on_stall: Callable[[float], None] | None = None) -> None:
        if stall_s < 0:
            raise ValueError(f"stall_s must be >= 0, got {stall_s}")
        self.stall_s = stall_s
        self._observe = observe_lag
        self._on_stall = on_stall
        self._clock: StallClock | None = None
        self._loop_thread: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: stalls seen so far (tests)
        self.stalls = 0

    async def run(self, stopping: asyncio.Event) -> None:
        """Sample the lag until ``stopping`` is set; the stall thread runs meanwhile."""
        self._loop_thread = threading.get_ident()
        tick = min(TICK_S, self.stall_s / 4) if self.stall_s > 0 else TICK_S  # (beats well inside a stall's bound)
        now = time.monotonic()
        if self.stall_s > 0:
            self._clock = StallClock(self.stall_s, now)
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
            self._thread.start()
        try:
            while not stopping.is_set():
                due = time.monotonic() + tick
                await asyncio.sleep(tick)
                now = time.monotonic()
                self._observe(max(0.0, now - due))
                if self._clock is not None:
                    self._clock.beat(now)
        finally:
            self._stop.set()
            thread, self._thread = self._thread, None
            if thread is not None:
                await asyncio.to_thread(thread.join, 5.0)

    def _watch(self) -> None:
        clock = self._clock
        assert clock is not None
        while not self._stop.wait(clock.stall_s / 4):
            held = clock.check(time.monotonic())
            if held is None:
                continue
            self.stalls += 1
            if self._on_stall is not None:
                self._on_stall(held)
            log.warning("event loop held for %.2f s so far (nothing else this node serves runs meanwhile); "
                        "the loop thread is in:\n%s\nthe other threads are in:\n%s", held, self.loop_stack(),
                        self.other_threads())

    def loop_stack(self) -> str:
        """The loop thread's Python stack, innermost ``STACK_FRAMES`` frames, as text (its innermost
        frame the loop's own ``run`` when the thread is in C code: waiting for the GIL that another
        thread holds, or in a C call)."""
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None  # noqa: SLF001
        if frame is None:
            return "  (no Python frame: the loop is not running)"
        return "".join(traceback.format_list(traceback.extract_stack(frame)[-STACK_FRAMES:])).rstrip()

    def other_threads(self) -> str:
        """One line per other thread with a Python frame: its name and innermost
        ``OTHER_THREAD_FRAMES`` frames, innermost first (a thread holding the GIL through a long C
        call keeps the loop from running as surely as the loop's own code does); threads waiting
        for work (``_IDLE_FRAMES``) are counted, not listed."""
        names = {t.ident: t.name for t in threading.enumerate()}
        lines, idle = [], 0
        for ident, frame in sys._current_frames().items():  # noqa: SLF001
            if ident in (self._loop_thread, threading.get_ident()):
                continue
            if _idle(frame):
                idle += 1
                continue
            inner = traceback.extract_stack(frame)[-OTHER_THREAD_FRAMES:][::-1]
            where = " <- ".join(f"{f.name} ({f.filename}:{f.lineno})" for f in inner)
            lines.append(f"  {names.get(ident, ident)}: {where}")
        if idle:
            lines.append(f"  ({idle} more waiting for work)")
        return "\n".join(sorted(lines)) or "  (none)"


#: (file name, function) of the innermost frame of a thread that waits for work: a pool worker
#: between jobs, a thread in ``Event.wait``/``Condition.wait`` or a queue's ``get``.
_IDLE_FRAMES: Final = frozenset({("thread.py", "_worker"), ("threading.py", "wait"), ("queue.py", "get"),
                                 ("selectors.py", "select")})


def _idle(frame: FrameType) -> bool:
    return (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name) in _IDLE_FRAMES
