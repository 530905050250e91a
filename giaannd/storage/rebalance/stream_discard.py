"""Discarding streams on their receiver: ``StreamDiscards``, the part of the stream endpoint
(endpoint.py) that drops what an abandoned stream brought.

``DiscardStream`` (an operation abandoned before its cutover, rebalance/operations.py): the stream
is marked discarded in its scope (durable: streaming/dedupe.py), then the rows of its columns this
node does not own and no other open stream brings are dropped (a logged drop, synced before the
reply: release.py ``abandoned_stream_columns``). A discarded stream is refused from then on, its
resume as well as a fresh start: the rows it had brought are gone.

A stream whose coordinator died before it could send ``DiscardStream`` (or never reached this
node) would keep its rows here for good. Its sources give it up once no coordinator asked about it
for ``source_control.ORPHAN_AFTER_S``; ``StreamEndpoint.discard_idle`` (the daemon calls it
periodically with ``endpoint.IDLE_STREAM_DISCARD_S``, twice that) discards, the same way, every
open stream that sent this node nothing for that long (counted from this process's start for the
streams it found open on disk), so a node left with an orphan's partial rows can take those columns
again. A removenode or replace of a dead member need not wait for that: its coordinator first sends
``DiscardStreamsFrom`` (the member) to the receivers, which discard the same way the open streams
whose hello named that member as their source node (recorded in the stream's scope, durable). A
member this node sees live is refused: its streams may be running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np

from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.rebalance.release import abandoned_stream_columns
from giaannd.storage.rebalance.source_control import (
    DiscardStream,
    DiscardStreamsFrom,
    StreamDiscarded,
    StreamsDiscarded,
)
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.dedupe import StreamScopes
from giaannd.storage.streaming.stream import StreamRefused

__all__ = ["StreamDiscards"]

log = logging.getLogger(__name__)


class StreamDiscards:
    """Discards streams received here (module docstring). The endpoint keeps the per-stream state:
    ``locks`` (one item of a stream at a time, and a discard waits for the item being applied),
    ``store`` (its durable store) and ``forget`` (drop what it keeps of a stream; called under the
    stream's lock, before the sync)."""

    def __init__(self, service: StorageService, scopes: StreamScopes, locks: dict[int, asyncio.Lock], *,
                 store: Callable[[], DurableStore], forget: Callable[[int], None]) -> None:
        self.service, self.scopes, self._locks = service, scopes, locks
        self._durable, self._forget = store, forget
        #: monotonic time of each stream's last request here (``idle``)
        self.seen: dict[int, float] = {}
        self.idle_discarded = 0  # streams ``idle`` discarded

    async def handle(self, msg: DiscardStream | DiscardStreamsFrom
                     ) -> StreamDiscarded | StreamsDiscarded | StreamRefused:
        """One discard request; errors are answered as a fatal refusal."""
        try:
            if isinstance(msg, DiscardStream):
                return await self.discard(msg.stream_id)
            return await self._discard_from(msg.source)
        except (ValueError, RuntimeError, OSError) as exc:
            sid = msg.stream_id if isinstance(msg, DiscardStream) else 0
            return StreamRefused(sid, 0, f"discard: {type(exc).__name__}: {exc}"[:400], fatal=True)

    async def idle(self, idle_s: float, now: float | None = None) -> list[int]:
        """Discard every open stream that sent this node nothing for ``idle_s`` (module docstring);
        returns their ids. A stream that cannot be discarded now (a placement override in force)
        is tried again at the next call. ``now``: ``time.monotonic()`` unless given."""
        now = time.monotonic() if now is None else now
        done = []
        for sid in self.scopes.open_streams():
            if now - self.seen.setdefault(sid, now) < idle_s:
                continue
            try:
                await self.discard(sid)
            except (ValueError, RuntimeError, OSError) as exc:
                log.warning("idle stream %#x not discarded yet: %s", sid, exc)
                continue
            done.append(sid)
        if done:
            log.warning("discarded %d streams that sent nothing for %.0f s (their operations ended without "
                        "discarding them): %s", len(done), idle_s, ", ".join(f"{sid:#x}" for sid in done))
        self.idle_discarded += len(done)
        return done

    async def _discard_from(self, source: str) -> StreamsDiscarded:
        """``DiscardStreamsFrom`` (module docstring): discard every open stream ``source`` sent.

        Raises:
            ValueError: ``source`` is live in this node's view (or empty).
            RuntimeError: a placement override is in force (``discard``).
        """
        topology = self.service.topology
        if topology is None:
            raise RuntimeError("storage service is not open")
        if not source or topology.is_live(source):
            raise ValueError(f"{source or '(no name)'} is live here: the streams it sends may be running")
        streams = self.scopes.open_streams_from(source)
        rows = 0
        for sid in streams:
            rows += (await self.discard(sid)).rows
        if streams:
            log.warning("discarded %d open streams from removed member=%s (it died mid-stream): %d rows dropped",
                        len(streams), source, rows)
        return StreamsDiscarded(source, len(streams), rows)

    async def discard(self, stream_id: int) -> StreamDiscarded:
        """``DiscardStream`` (module docstring): mark, drop what this node does not own, sync."""
        topology = self.service.topology
        if topology is None:
            raise RuntimeError("storage service is not open")
        if topology.override is not None:
            raise RuntimeError("a placement override is in force (a cutover is under way): what this node "
                               "owns is not settled")
        async with self._locks.setdefault(stream_id, asyncio.Lock()):  # an item being applied lands first
            durable, folds = self._durable(), self.service.folds
            if folds is None:
                raise RuntimeError("storage service is not open")
            candidates: list[np.ndarray] = []

            def among() -> np.ndarray:
                columns = self.scopes.discard(stream_id)
                candidates.append(abandoned_stream_columns(topology.placement, self.service.node_name, columns,
                                                           self.scopes.columns_of_open_streams(stream_id)))
                return candidates[0]

            # as release.release_unowned: behind the store's fold gate, the O(store) parts in threads
            _, result = await folds.drop(durable, lambda held: held, among)
            drop = candidates[0]
            self._forget(stream_id)
            if result.rows:
                await asyncio.to_thread(durable.sync)
        log.info("discarded stream %#x: dropped %d rows of %d columns (%d bytes)", stream_id, result.rows,
                 drop.shape[0], result.bytes)
        return StreamDiscarded(stream_id, int(drop.shape[0]), int(result.rows))
