"""Repair glue: drive hints, rebuild missing batches from the peers' update logs, compare replicas
(the decisions are in repair/plan.py). Hints go through ``ClusterControl`` (remote nodes too); the
rebuild and the comparison read update logs and stores, so they cover only the services local to
this process (``control.service``): a remote repair (log records over the stream endpoint) is not
built."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.storage.engine.update_log import list_segments, scan_segment
from giaannd.storage.repair.plan import add_record, plan_repair
from giaannd.storage.repair.wire import Divergence, rows_differ
from giaannd.storage.replication.hint_delivery import HINT_DRAIN_RETRY
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.column_sets import member
from giaannd.storage.streaming.sender import apply_local
from giaannd.storage.streaming.writers import stream_columns_of, stream_writers_of
from peers.placement import Placement
from peers.retry import attempts

if TYPE_CHECKING:
    from giaannd.storage.rebalance.operations import ClusterControl

__all__ = ["repair"]

#: Bound on waiting for hinted handoff to drain before comparing.
HINT_DRAIN_TIMEOUT_S: Final = 60.0
#: Rows read from each of two stores per comparison step (``_compare_replicas``).
COMPARE_ROWS: Final = 65_536


def _logged_batches(service: StorageService) -> dict[BatchId, RowBatch]:
    """The batch records still in a node's update log (read-only scan of its segments)."""
    assert service.store is not None
    directory = service.store.directory
    segments = list_segments(directory)
    out: dict[BatchId, RowBatch] = {}
    for i, (first, path) in enumerate(segments):
        with contextlib.suppress(FileNotFoundError):  # dropped by a snapshot meanwhile
            for rec in scan_segment(path, first, is_last=i == len(segments) - 1).records:
                if rec.batch_id is not None and rec.batch is not None:
                    add_record(out, rec.batch_id, rec.batch)  # (one record per share of an id)
    return out


async def repair(control: ClusterControl, names: Sequence[str] | None = None,
                 tolerance: float = 1e-5) -> dict[str, Any]:
    """Repair the replicas served by this process (repair/plan.py): deliver hints, rebuild each node's
    missing batches from its peers' update logs, then compare every replica of every row.

    Returns:
        {"batches_shipped", "rows_shipped", "unrecoverable": {node: [...]}, "unlogged": {node: {peer:
         count}} (repair.RepairPlan), "rows_compared",
         "rows_divergent": [...] (at most ``wire.MAX_DIVERGENT_LISTED`` described),
         "rows_divergent_count", "hints_left"}.
    """
    live = [n for n in control.view().live() if control.service(n) is not None]
    targets = [n for n in (names or live) if n in live]
    deadline = asyncio.get_running_loop().time() + HINT_DRAIN_TIMEOUT_S
    async for _ in attempts(HINT_DRAIN_RETRY, deadline=deadline):
        if not await control.hints_held_for(live):
            break
        await control.deliver_hints()
    placement = control.view().placement
    services = {n: control.service(n) for n in live}
    logs = {n: _logged_batches(s) for n, s in services.items() if s is not None}
    applied = {n: s.store.store.applied for n, s in services.items() if s is not None and s.store is not None}
    excluded = set().union(*(stream_writers_of(s) for s in services.values() if s is not None))
    shipped = rows = 0
    unrecoverable: dict[str, list[str]] = {}
    unlogged: dict[str, dict[str, int]] = {}
    for dst in targets:
        svc = services[dst]
        assert svc is not None
        me = placement.names.index(dst)

        def owned(cols: NDArray[np.uint64], me: int = me) -> NDArray[np.bool_]:
            return np.asarray((placement.owner_indices(cols) == me).any(axis=1), np.bool_)

        streamed = stream_columns_of(svc)

        def copied(cols: NDArray[np.uint64], streamed: NDArray[np.uint64] = streamed) -> NDArray[np.bool_]:
            return member(cols, streamed)

        peers = [p for p in logs if p != dst]
        plan = plan_repair(applied[dst], owned, {p: logs[p] for p in peers}, {p: applied[p] for p in peers},
                           excluded, copied)
        for bid, share in plan.shares.items():
            if await apply_local(svc, bid, share):
                shipped, rows = shipped + 1, rows + share.num_rows
        if plan.unlogged:
            unlogged[dst] = plan.unlogged
        if plan.unrecoverable:
            unrecoverable[dst] = [f"{b.writer:#x}/{b.seq}: {why}" for b, why in plan.unrecoverable.items()]
    compared, divergent = _compare_replicas(placement, services, tolerance)
    return {"batches_shipped": shipped, "rows_shipped": rows, "unrecoverable": unrecoverable,
            "unlogged": unlogged, "rows_compared": compared, "rows_divergent": divergent.listed,
            "rows_divergent_count": divergent.count, "hints_left": await control.hints_held_for(live)}


def _compare_replicas(placement: Placement, services: Mapping[str, StorageService | None],
                      tolerance: float) -> tuple[int, Divergence]:
    """Every row of every local replica against the other local owners of its column: per row,
    the first owner (in placement order) that holds it is the reference, and each other local
    owner's copy must equal it within ``tolerance``. Arrays throughout: the rows are compared per
    (reference, other) pair of stores, ``COMPARE_ROWS`` keys at a time (``wire.rows_differ``)."""
    stores = {n: s.store.store for n, s in services.items() if s is not None and s.store is not None}
    divergent = Divergence()
    union = KeyIndex()
    for st in stores.values():
        union.lookup_or_add(*st.key_arrays())
    a, b = union.keys()
    if not a.shape[0]:
        return 0, divergent
    order = np.lexsort((b, a))
    cols, feats = a[order], b[order]
    names = placement.names
    owners = placement.owner_indices(cols)  # (rows, replicas): indices into names
    local = np.array([n in stores for n in names])[owners]
    holds = np.zeros(owners.shape, bool)
    for i, name in enumerate(names):
        if name in stores:
            at = owners == i
            holds[at] = (stores[name].row_lengths(cols, feats) > 0)[np.nonzero(at)[0]]
    has_ref = holds.any(axis=1)
    ref = owners[np.arange(owners.shape[0]), holds.argmax(axis=1)]  # the first owner holding the row
    for j in range(owners.shape[1]):
        other = owners[:, j]
        check = has_ref & local[:, j] & (other != ref)
        for r, o in np.unique(np.stack([ref[check], other[check]], axis=1), axis=0).tolist():
            rows = np.flatnonzero(check & (ref == r) & (other == o))
            for lo in range(0, rows.shape[0], COMPARE_ROWS):
                c, f = cols[rows[lo:lo + COMPARE_ROWS]], feats[rows[lo:lo + COMPARE_ROWS]]
                differ = rows_differ(c, f, stores[names[r]].read_rows(c, f), stores[names[o]].read_rows(c, f),
                                     tolerance)
                divergent.add(c[differ], f[differ], f"{names[o]} differs from {names[r]}")
    return int(cols.shape[0]), divergent
