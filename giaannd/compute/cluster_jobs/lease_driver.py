"""Asyncio glue for one node's lease agent (leases.py): the clock, the timer, register reads and
writes through the StorageClient, and the windows, run by a callable the caller gives.

Thin on purpose (STYLE.md item 2): every decision is the agent's. The driver owns one event
queue; each action is run as a task whose outcome comes back as an event:

=============  =========================================================================
action         run as                                         event back
=============  =========================================================================
``ReadRow``    ``StorageClient.read_register``               ``RowRead`` / ``OpFailed``
``CasRow``     ``StorageClient.cas_register``                ``CasDone`` / ``OpFailed`` /
                                                              ``WriteRejected``
``RunWindow``  ``run_window(action)`` (writes its batch)     ``WindowWritten`` / ``WindowFailed``
``DropWindow`` cancels that window's task                     none
``SetTimer``   the one timer (a later one replaces it)       ``Tick``
``Finished``   ends ``run``                                   none
=============  =========================================================================

A register call that raises a storage failure (no quorum, a timeout, no storage members) is an
``OpFailed``: the agent treats its outcome as unknown. So is a call that has not answered within
``register_timeout_s``: half the time from a renewal falling due to the lease's end. The agent
sends one request per row at a time, and the register client's own bounds are per request (the
StorageClient's 10 s by default, for each phase of each round): an owner the quorum needs that
accepts a request and never answers held the row past the lease's end (6.7 s after a renewal
fell due, with the defaults), so the holder dropped its windows and no renewal was sent again.
Cancelling the call is safe: its outcome was unknown anyway, and the agent re-reads the row.

A write whose value the client rejects (``ValueError``: over the register value cap) is a
``WriteRejected``: it was never sent, so no answer will come (before, the agent waited for one for
good and the job hung). A window task that raises anything but cancellation is a
``WindowFailed`` (the caller's runner retries storage itself; what reaches the driver is final).
``halt()`` (a node stopping) and ``cancel()`` (the operator) are events too.

The compute service runs one driver per cluster job it follows (cluster_train.py);
tests/integration/test_lease_driver.py runs several drivers against real storage services.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from giaannd.client.errors import REQUEST_FAILURES
from giaannd.client.registers import CasOutcome, RegisterRead, Version
from giaannd.compute.cluster_jobs.lease_events import (
    Action,
    Begin,
    CancelJob,
    CasDone,
    CasRow,
    DropWindow,
    Event,
    Finished,
    Halt,
    LeaseSettings,
    OpFailed,
    ReadRow,
    RowRead,
    RunWindow,
    SetTimer,
    Tick,
    WindowFailed,
    WindowWritten,
    WriteRejected,
)
from giaannd.compute.cluster_jobs.leases import LeaseAgent

__all__ = ["LeaseDriver", "Registers", "register_timeout_s"]

log = logging.getLogger(__name__)

#: Failures of a register call that leave its outcome unknown (the agent re-reads, retries).
_UNKNOWN = (*REQUEST_FAILURES, LookupError, TimeoutError)
#: Floor of ``register_timeout_s``.
MIN_REGISTER_CALL_S = 1.0


def register_timeout_s(settings: LeaseSettings) -> float:
    """Bound on one register call, all its rounds and phases (module docstring): a renewal sent
    when it falls due (``renew_s``) and given up on after this is sent again (after ``retry_s``)
    with as long again left before the lease ends (``lease_s``). 3.3 s with the defaults; never
    under ``MIN_REGISTER_CALL_S``, so that the second-long leases of tests on a loaded host do not
    turn every slow call into a failure and a retry."""
    return max(MIN_REGISTER_CALL_S, (settings.lease_s - settings.renew_s) / 2)


class Registers(Protocol):
    """What the driver needs of a StorageClient."""

    async def read_register(self, key: str, timeout_s: float | None = None) -> RegisterRead: ...

    async def cas_register(self, key: str, expect: Version | None, value: bytes = b"",
                           timeout_s: float | None = None) -> CasOutcome: ...


class LeaseDriver:
    """Runs ``agent`` (module docstring).

    Args:
        agent: the node's agent for one job.
        registers: the storage client (its register calls).
        run_window: runs one window to its W acks (raises when it cannot); may return what it
            counted (``WindowWritten.units``).
        clock: monotonic seconds (the agent's ``now``).
    """

    def __init__(self, agent: LeaseAgent, registers: Registers,
                 run_window: Callable[[RunWindow], Awaitable[int | None]], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.agent, self._registers, self._run_window, self._clock = agent, registers, run_window, clock
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._windows: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._timer_at: float | None = None
        self._call_timeout_s = register_timeout_s(agent.settings)

    def halt(self) -> None:
        """This node stops: the agent completes what is written and gives the rest back."""
        self._events.put_nowait(Halt())

    def cancel(self, reason: str = "cancelled") -> None:
        """The operator cancels the job (every node stops once it reads the job row)."""
        self._events.put_nowait(CancelJob(reason))

    async def run(self, begin: Begin | None = None) -> Finished:
        """Follow the job until the agent finishes; returns how (``done``, ``released``...)."""
        self._events.put_nowait(begin or Begin())
        try:
            while True:
                event = await self._next_event()
                now = self._clock()
                self.agent.wall_offset_s = time.time() - now
                for action in self.agent.handle(now, event):
                    if isinstance(action, Finished):
                        return action
                    self._start(action)
        finally:
            tasks = [*self._tasks, *self._windows.values()]
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _next_event(self) -> Event:
        if self._timer_at is None:
            return await self._events.get()
        wait = max(0.0, self._timer_at - self._clock())
        try:
            return await asyncio.wait_for(self._events.get(), wait)
        except TimeoutError:
            self._timer_at = None
            return Tick()

    def _start(self, action: Action) -> None:
        if isinstance(action, SetTimer):
            self._timer_at = action.at
        elif isinstance(action, DropWindow):
            task = self._windows.pop((action.stage, action.window), None)
            if task is not None:
                task.cancel()
        elif isinstance(action, RunWindow):
            key = (action.stage, action.window)
            self._windows[key] = asyncio.get_running_loop().create_task(self._window(action))
        elif isinstance(action, ReadRow | CasRow):
            task = asyncio.get_running_loop().create_task(self._register(action))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _register(self, action: ReadRow | CasRow) -> None:
        # one call per row at a time: one that hangs must not outlast the lease (module docstring)
        bound = asyncio.timeout(self._call_timeout_s)
        try:
            async with bound:
                if isinstance(action, ReadRow):
                    got = await self._registers.read_register(action.key)
                    event: Event = RowRead(action.key, got.version, got.value)
                else:
                    out = await self._registers.cas_register(action.key, action.expect, action.data)
                    event = CasDone(action.key, out.ok, out.version, out.value)
        except _UNKNOWN as exc:
            why = f"no answer within {self._call_timeout_s:g}s" if bound.expired() else str(exc) or type(exc).__name__
            log.info("register %s failed key=%s: %s", type(action).__name__, action.key, why)
            event = OpFailed(action.key, why)
        except ValueError as exc:  # the value itself (cas_register's "Raises"): no answer would come
            if not isinstance(action, CasRow):
                raise
            log.error("register write rejected key=%s bytes=%d: %s", action.key, len(action.data), exc)
            event = WriteRejected(action.key, str(exc))
        self._events.put_nowait(event)

    async def _window(self, action: RunWindow) -> None:
        key = (action.stage, action.window)
        try:
            units = await self._run_window(action)
            event: Event = WindowWritten(action.stage, action.window, units or 0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the runner retried what can be retried: this one is final
            log.exception("window failed stage=%d window=%d", action.stage, action.window)
            event = WindowFailed(action.stage, action.window, f"{type(exc).__name__}: {exc}")
        finally:
            if self._windows.get(key) is asyncio.current_task():
                del self._windows[key]
        self._events.put_nowait(event)
