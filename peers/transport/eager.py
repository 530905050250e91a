"""Run a request handler's first step inside the receive callback; make a Task only if it waits.

Why: a Task per request cost the server about 20 µs of its ~70 µs of CPU per small request
(measured across two processes with ``tools/bench/transport.py``: creating the Task, registering
it in asyncio's weak set of all tasks, one more loop iteration before the handler starts and one
for its done-callback). Most handlers (reads served from memory, rejections) never wait: their
reply can leave from inside the read callback, as a raw socket server's does. Python 3.12 has
this built in (``eager_start``); 3.11, which giaannd runs on, does not, so it is done here:

- ``context.run(step, loop, stand_in, coro)`` sends ``None`` into the coroutine, in a copy of the
  current context (a handler's ``ContextVar.set`` stays its own, as in a Task), while a
  ``TaskStandIn`` is the loop's current task, so ``asyncio.current_task()``, ``asyncio.timeout``
  and ``TaskGroup`` work before the handler's first ``await``. ``StopIteration``: it finished.
- finished: nothing else is made. Waiting: ``continue_in_task`` wraps the suspended coroutine in
  ``Resumed`` (it first hands the Task what the coroutine waits for, then forwards ``send`` and
  ``throw``) and runs it in a real Task in the same context; the stand-in forwards ``cancel``,
  ``uncancel`` and ``cancelling`` to that Task from then on, so a timeout armed during the first
  step cancels the task that now runs the handler.

Only usable when no task is current (a protocol callback): the mem backend delivers frames from a
task and UCX bulk completes in one, and there the caller makes a Task as before.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from types import TracebackType
from typing import Any

__all__ = ["TaskStandIn", "Resumed", "step", "continue_in_task"]

_enter_task = asyncio.tasks._enter_task
_leave_task = asyncio.tasks._leave_task


class TaskStandIn:
    """``asyncio.current_task()`` while a handler's first step runs outside any Task.

    Before the handler waits, cancellation requests are counted here (a handler can only cancel
    itself synchronously then); once it waits they are applied to the real Task and every call is
    forwarded to it.
    """

    # class-level defaults and no __init__: made once per request, usually never touched again
    task: asyncio.Task[Any] | None = None
    _cancels = 0
    _name = "request handler"

    def attach(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        for _ in range(self._cancels):
            task.cancel()

    def cancel(self, msg: Any = None) -> bool:
        if self.task is not None:
            return self.task.cancel(msg)
        self._cancels += 1
        return True

    def cancelling(self) -> int:
        return self.task.cancelling() if self.task is not None else self._cancels

    def uncancel(self) -> int:
        if self.task is not None:
            return self.task.uncancel()
        if self._cancels:
            self._cancels -= 1
        return self._cancels

    def done(self) -> bool:
        return self.task.done() if self.task is not None else False

    def cancelled(self) -> bool:
        return self.task.cancelled() if self.task is not None else False

    def get_name(self) -> str:
        return self.task.get_name() if self.task is not None else self._name

    def __getattr__(self, name: str) -> Any:
        task = object.__getattribute__(self, "task")
        if task is None:
            raise AttributeError(f"{name}: the handler has not waited yet, so it has no Task")
        return getattr(task, name)


class Resumed(Coroutine[Any, Any, Any]):
    """A coroutine suspended after its first step, as a Task can run it: the first ``send``
    returns what the coroutine waits for (the Task then waits on it); later ones, and every
    ``throw`` (cancellation), go to the coroutine itself."""

    __slots__ = ("_coro", "_waiting", "_started")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self._coro, self._waiting, self._started = coro, waiting, False

    def send(self, value: Any) -> Any:
        if not self._started:
            self._started = True
            waiting, self._waiting = self._waiting, None
            return waiting
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None) -> Any:
        self._started = True
        self._waiting = None
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # pragma: no cover - asyncio throws instances

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        raise TypeError("Resumed is run by a Task (continue_in_task), not awaited")


def step(loop: asyncio.AbstractEventLoop, stand_in: TaskStandIn, coro: Coroutine[Any, Any, Any]) -> Any:
    """Send ``None`` into ``coro`` with ``stand_in`` as the current task; returns what the
    coroutine now waits for. Run it in a context copy: ``context.run(step, loop, stand_in, coro)``.

    Raises:
        StopIteration: the coroutine finished (no Task is needed).
        RuntimeError: a task is current (use a Task from the start).
        BaseException: whatever the coroutine raised (it is finished then).
    """
    _enter_task(loop, stand_in)  # type: ignore[arg-type]  # a stand-in, see TaskStandIn
    try:
        return coro.send(None)
    finally:
        _leave_task(loop, stand_in)  # type: ignore[arg-type]


def continue_in_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], waiting: Any,
                     stand_in: TaskStandIn, context: contextvars.Context) -> asyncio.Task[Any]:
    """A Task that runs the rest of ``coro`` (suspended on ``waiting``) in ``context``."""
    task = loop.create_task(Resumed(coro, waiting), context=context)
    stand_in.attach(task)
    return task
