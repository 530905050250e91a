"""Releasing columns a node no longer owns: the old owners' half of a finished topology change.

Theory of operation
-------------------
A join, decommission, removenode or replace (rebalance/operations.py) copies each moved column to its new
owners and then switches every node to the new placement; the old owners that lost a column keep
its rows, unserved (reads and writes of it go to the new owners, and requests.py refuses the
column here as not owned). ``release_unowned`` deletes them: it asks the placement in force on
this node which of the columns its store holds have this node among their R owners, and drops the
rest through ``DurableStore.drop_columns`` (a logged, replayed record: docs/storage.md), then
syncs the log. ``unowned_columns`` is that decision, pure.

Only the rows go. The applied set keeps every batch id, so a late duplicate of a batch this node
applied before the move is still ignored, and a stray old write cannot bring part of a column back
(ownership is checked before any apply anyway).

When it is safe (the caller's duty; this module cannot see it): no topology operation is running
and the ring is settled, i.e. every node computes the placement this node does and the columns'
new owners hold complete, verified copies. Otherwise it loses data:

- *During an operation* the old placement stays in force until cutover. A receiving node holds
  partial copies of columns it does not own yet: dropping them leaves holes that the stream will
  never re-send (its durable resume point, the stream writer's applied-set floor, says they
  arrived). A source reads the rows it streams chunk by chunk while the stream runs, and serves
  them until cutover: rows dropped before their chunk is read never reach the target. Cancelling
  an operation leaves the old placement in force, under which nothing moved is unowned.
- *On an unsettled ring* (a placement override in force, or a ring this node has not caught up
  with) the placement this node computes is not the one every node uses: a node whose view lags
  (a ring change it has not pulled yet, a member it has not heard of) would drop columns it still
  owns, or whose new owners have no verified copy. The daemon calls it only after a committed ring
  change, once no stream ran here for ``storage.release-delay-s`` and no override is set
  (rebalance/daemon.py).

A node outside the placement (decommissioned, or not switched in yet) is refused with
``LookupError`` rather than emptied: a decommissioned node's data is removed with its data
directory, and a joining node must keep what it is receiving.

**Rows of an abandoned stream** (``abandoned_stream_columns``): when an operation fails or is
cancelled before its cutover, its coordinator asks every receiver to discard the streams it opened
(rebalance/stream_discard.py, ``DiscardStream``). The old placement stays in force, so the rows such a
stream brought are partial copies of columns the receiver does not own; kept, they would make the
next stream of those columns refuse the node ("already holds rows", rows are sums and cannot be
replaced in place). Dropped are the stream's columns that the node does not own under the
placement in force (all of them on a node outside it: a joining node owns nothing yet) and that
no other open stream brings. The stream is marked discarded first, durably, so it can never
resume over the holes.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from numpy.typing import NDArray

from giaannd.storage.engine.column_store import DropResult
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.column_sets import member
from giaannd.unique import unique
from peers.placement import Placement

__all__ = ["abandoned_stream_columns", "release_unowned", "unowned_columns"]

log = logging.getLogger(__name__)


def unowned_columns(placement: Placement, node: str, columns: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The ``columns`` of which ``node`` is not one of the owners under ``placement``. Pure.

    Raises:
        LookupError: ``node`` is not a member of ``placement``.
    """
    if node not in placement.names:
        raise LookupError(f"{node!r} is not in the placement ({len(placement.names)} members)")
    cols = np.asarray(columns).astype(np.uint64, copy=False).reshape(-1)
    if cols.shape[0] == 0:
        return cols
    me = placement.names.index(node)
    owned: NDArray[np.bool_] = (placement.owner_indices(cols) == me).any(axis=1)
    return cols[~owned]


def abandoned_stream_columns(placement: Placement, node: str, stream_columns: NDArray[np.uint64],
                            other_streams: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The columns of an abandoned stream that ``node`` drops (module docstring): those it does not
    own under ``placement`` (every one when it is not a member) and no other open stream
    (``other_streams``) brings. Pure."""
    cols = unique(np.asarray(stream_columns).astype(np.uint64, copy=False).reshape(-1))
    if node in placement.names:
        cols = unowned_columns(placement, node, cols)
    if cols.shape[0] and other_streams.shape[0]:
        cols = cols[~member(cols, unique(other_streams))]
    return cols


async def release_unowned(service: StorageService) -> DropResult:
    """Drop every column this node holds that it does not own under ``service.topology.placement``
    (module docstring: call it only with no topology operation running and the ring settled).
    Returns what was dropped, durable (the log is synced) on return.

    Raises:
        RuntimeError: the service is not open.
        LookupError: no storage members known, or this node is not one of them.
        OSError: the log write or sync failed (a failed write drops nothing; after a failed sync
            the rows are gone in RAM but may come back at restart: call it again).
    """
    durable, topology, folds = service.store, service.topology, service.folds
    if durable is None or topology is None or folds is None:
        raise RuntimeError("storage service is not open")
    used: list[Placement] = []

    def pick(held: NDArray[np.uint64]) -> NDArray[np.uint64]:
        used.append(topology.placement)
        return unowned_columns(used[0], service.node_name, held)

    # Behind the store's fold gate (background_fold.py ``drop``): the writes' lock held from the
    # listing to the drop, so the decision and the drop see one store state; the placement is read
    # once, on the event loop; the listing and the drop, O(store), run in worker threads.
    drop, result = await folds.drop(durable, pick)
    placement = used[0]
    if result.rows:
        await asyncio.to_thread(durable.sync)
    log.info("released unowned columns node=%s epoch=%s columns=%d rows=%d bytes=%d",
             service.node_name, placement.epoch, drop.shape[0], result.rows, result.bytes)
    return result
