"""``RemoteStreamRunner``: the coordinator's handle on a stream whose source is another process.

Theory of operation
-------------------
It has the surface ``Rebalance`` uses from a local ``StreamRunner`` (``run()``, the ``caught_up``
and ``finished`` events, ``state``, ``error``, ``label``, ``progress()``, ``close()``,
``abort(reason)``, ``reconnects``; pause is cancelling the ``run()`` task), but the stream itself
runs on the source node (source_control.py). ``run()`` is a loop of one request at a time on a
control connection to the source's stream endpoint:

- **start**: ``SourceStart`` first and after every reconnect. It is idempotent (a known stream id
  is resumed, not started twice), so a dropped connection costs nothing. Once a start was
  acknowledged, re-issues carry ``resume=True``: a source that restarted then refuses clearly
  instead of starting an empty stream (its queue of forwarded writes died with it).
- **close**: once ``close()`` was called, ``SourceClose`` (again after a reconnect: idempotent).
- **rate**: once ``set_rate`` changed the rate from the one the source was last given (by a start
  or a ``SourceRate``), ``SourceRate``: on this connection, so the source takes the changes in
  order, and a rate set while a ``SourceStart`` carrying the previous one was unanswered follows it.
- **status**: otherwise ``SourceStatus``, polled with a backoff from ``POLL_S[0]`` to ``POLL_S[1]``
  while nothing changes (reset by any change and by ``close()``).

Each reply (``SourceState``) is mirrored: ``state``, ``error``, the progress dictionary, and the
events (``caught_up`` / ``finished``). A refusal fails the runner with the source's reason; a
source unreachable for ``SOURCE_UNREACHABLE_S`` fails it too (every wait is bounded).

Pause: when the ``run()`` task is cancelled the runner sends ``SourcePause`` from a background task
(the source stops sending and keeps collecting its writes); the next ``run()`` awaits that pause
first, so a quick resume cannot be overtaken by it, then re-issues ``SourceStart`` (resume).
``abort(reason)`` fails the runner locally at once and sends ``SourceAbort`` in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Final

import msgspec
import numpy as np
from numpy.typing import NDArray

from giaannd.storage.rebalance.source_control import (
    SourceAbort,
    SourceClient,
    SourceClose,
    SourceControlError,
    SourcePause,
    SourceRate,
    SourceStart,
    SourceState,
    SourceStatus,
)
from peers.errors import PeersError
from peers.retry import Backoff
from peers.transport import Transport

__all__ = ["POLL_S", "SOURCE_UNREACHABLE_S", "RemoteStreamRunner"]

log = logging.getLogger(__name__)

#: Status poll interval: first and largest (grows 1.5x per unchanged poll).
POLL_S: Final = (0.02, 0.5)
#: Reconnect backoff to an unreachable source: ceiling of the first full-jitter wait, and the largest.
RECONNECT_BACKOFF_S: Final = (0.05, 1.0)
#: A source unreachable this long fails the stream (the operation then fails; the old placement stays).
SOURCE_UNREACHABLE_S: Final = 120.0
#: Bound on the background pause / abort / rate requests.
BACKGROUND_REQUEST_TIMEOUT_S: Final = 10.0

_Unreachable = (PeersError, OSError, asyncio.TimeoutError)


def _initial_progress(label: str) -> dict[str, Any]:
    return {"stream": label, "state": "starting", "bytes_total_estimate": 0, "bytes_done": 0,
            "rate_bytes_s": 0.0, "eta_s": None, "items_acked": 0, "deltas": 0, "resent_items": 0,
            "reconnects": 0, "error": None}


class RemoteStreamRunner:
    """Drives one stream whose source runs on another node (module docstring).

    Args:
        transport: dials the source's stream endpoint.
        source_address: the source's StreamEndpoint address.
        start: the ``SourceStart`` to issue (its ``resume`` flag is managed here).
        columns: the columns the coordinator planned for this stream (sent in bulk; the source
            adds the ones it computes itself).
        locate_source: the source's stream endpoint address now (None: unknown), asked when it is
            unreachable: a source that restarted listens on a new port unless its stream-bind
            names one, and there it refuses the stream at once ("restarted").
    """

    def __init__(self, transport: Transport, source_address: str, start: SourceStart,
                 columns: NDArray[np.uint64] | None = None,
                 locate_source: Callable[[], str | None] | None = None) -> None:
        self.transport, self.source_address = transport, source_address
        self.locate_source = locate_source
        self._start_msg = start
        self._columns = np.zeros(0, np.uint64) if columns is None else np.asarray(columns, np.uint64)
        self.label = start.label or f"stream {start.stream_id:#x}"
        self.rate_bytes_s = start.rate_bytes_s
        self.state = "streaming"
        self.error: str | None = None
        self.caught_up = asyncio.Event()
        self.finished = asyncio.Event()
        self.reconnects = 0
        self._progress = _initial_progress(self.label)
        self._client = SourceClient(transport, source_address)
        self._acknowledged = False  # a SourceStart was answered: unknown id later = restart
        self._rate_at_source = start.rate_bytes_s  # the rate the source was last given
        self._need_start = True
        self._close_requested = self._close_sent = False
        self._wake = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._pausing: asyncio.Task[None] | None = None

    @property
    def stream_id(self) -> int:
        return self._start_msg.stream_id

    # -- Rebalance's surface ------------------------------------------------------------------------
    def close(self) -> None:
        """The cutover closed the stream: the source stops forwarding, finishes, then ``finished``."""
        self._close_requested = True
        if self.state not in ("done", "failed"):
            self.state = "closing"
        self._wake.set()

    def abort(self, reason: str) -> None:
        """Give up this stream here and at the source."""
        if self.state in ("done", "failed"):
            return
        self._fail(reason)
        self._background_request(SourceAbort(self.stream_id, reason))

    def set_rate(self, rate_bytes_s: float | None) -> None:
        """This stream's throttle at the source: sent by ``run()``'s loop once the source started
        (module docstring), and carried by every later ``SourceStart`` (a paused stream's resume)."""
        self.rate_bytes_s = rate_bytes_s
        self._wake.set()

    def progress(self) -> dict[str, Any]:
        out = dict(self._progress)
        out.update(stream=self.label, state=self.state, error=self.error, control_reconnects=self.reconnects)
        return out

    # -- the loop -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until done or failed (never raises for stream problems: see ``state``/``error``)."""
        if self._pausing is not None:  # a pause sent by a previous, cancelled run goes first
            with contextlib.suppress(Exception):
                await self._pausing
            self._pausing = None
        self._need_start = True
        poll, backoff = POLL_S[0], Backoff(*RECONNECT_BACKOFF_S)
        unreachable_since: float | None = None
        try:
            while self.state not in ("done", "failed"):
                self._wake.clear()  # (before the step: a close or a rate set meanwhile wakes the wait)
                try:
                    changed = self._absorb(await self._step())
                    unreachable_since = None
                    backoff.reset()
                except SourceControlError as exc:
                    self._fail(f"source refused: {exc}")
                    break
                except _Unreachable as exc:
                    now = time.monotonic()
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since > SOURCE_UNREACHABLE_S:
                        self._fail(f"source unreachable for {SOURCE_UNREACHABLE_S}s: {exc}")
                        break
                    wait_s = backoff.next_delay()
                    log.info("%s: source unreachable (%s); retrying in %.2fs", self.label, exc, wait_s)
                    await self._reset()
                    self._relocate_source()
                    await asyncio.sleep(wait_s)
                    continue
                if self.state in ("done", "failed"):
                    break
                poll = POLL_S[0] if changed else min(poll * 1.5, POLL_S[1])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), poll)
        except asyncio.CancelledError:
            if self.state not in ("done", "failed"):
                self._pausing = self._background_request(SourcePause(self.stream_id))
            await self._reset(count=False)
            raise
        await self._client.close()

    async def _step(self) -> Any:
        if self._acknowledged and not self._need_start and not self._client.is_connected:
            # the control connection dropped between requests: re-issue the (idempotent) start
            self._need_start, self._close_sent = True, False
            self.reconnects += 1
        if self._need_start:
            start = msgspec.structs.replace(self._start_msg, resume=self._acknowledged,
                                            rate_bytes_s=self.rate_bytes_s)
            reply, _ = await self._client.request(start, [self._columns] if self._columns.size else [])
            self._acknowledged, self._need_start = True, False
            self._rate_at_source = start.rate_bytes_s
            if not self._close_requested:
                return reply
        if self._close_requested and not self._close_sent:
            reply, _ = await self._client.request(SourceClose(self.stream_id))
            self._close_sent = True
            return reply
        if self.rate_bytes_s != self._rate_at_source:
            rate = self.rate_bytes_s
            reply, _ = await self._client.request(SourceRate(self.stream_id, rate))
            self._rate_at_source = rate
            return reply
        return (await self._client.request(SourceStatus(self.stream_id)))[0]

    def _absorb(self, reply: Any) -> bool:
        """Mirror the source's state; returns whether anything changed."""
        if not isinstance(reply, SourceState):
            raise SourceControlError(f"unexpected reply {type(reply).__name__}")
        before = (self.state, self._progress.get("items_acked"), self._progress.get("bytes_done"))
        self._progress = dict(reply.progress) or self._progress
        if reply.state == "failed":
            self._fail(reply.error or "failed at the source")
            return True
        if reply.finished:
            self.state = "done"
            self.caught_up.set()
            self.finished.set()
        else:
            # "closing" stays until the source confirms it (a status taken before SourceClose)
            if not (self._close_requested and reply.state in ("streaming", "caught-up")):
                self.state = reply.state
            if reply.caught_up:
                self.caught_up.set()
        return before != (self.state, self._progress.get("items_acked"), self._progress.get("bytes_done"))

    def _fail(self, message: str) -> None:
        if self.state not in ("done", "failed"):
            self.state, self.error = "failed", message
            self.caught_up.set()
            self.finished.set()
            self._wake.set()
            log.warning("%s failed: %s", self.label, message)

    def _relocate_source(self) -> None:
        """Dial the source where it is now (before, a source restarted on another port was dialled
        at the old one for ``SOURCE_UNREACHABLE_S`` before the stream failed)."""
        address = self.locate_source() if self.locate_source is not None else None
        if address and address != self.source_address:
            log.info("%s: source moved to %s", self.label, address)
            self.source_address = address
            self._client = SourceClient(self.transport, address)

    async def _reset(self, count: bool = True) -> None:
        """Drop the control connection: the next step reconnects and re-issues SourceStart."""
        self._need_start, self._close_sent = True, False
        if count:
            self.reconnects += 1
        await self._client.close()

    def _background_request(self, msg: msgspec.Struct) -> asyncio.Task[None] | None:
        """Send ``msg`` on its own connection without waiting (sync callers; bounded; best effort)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None

        async def send() -> None:
            client = SourceClient(self.transport, self.source_address, timeout_s=BACKGROUND_REQUEST_TIMEOUT_S)
            try:
                await client.request(msg)
            except (SourceControlError, *_Unreachable) as exc:
                log.info("%s: %s not delivered to the source: %s", self.label, type(msg).__name__, exc)
            finally:
                await client.close()

        task = loop.create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
