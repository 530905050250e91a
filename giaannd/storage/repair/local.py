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
from giaannd.storage.engine.update_log import list_segments, scan_segment
from giaannd.storage.repair.plan import plan_repair
from giaannd.storage.replication.hint_delivery import HINT_DRAIN_RETRY
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.sender import apply_local
from giaannd.storage.streaming.writers import stream_writers_of
from peers.placement import Placement
from peers.retry import attempts

if TYPE_CHECKING:
    from giaannd.storage.rebalance.operations import ClusterControl

__all__ = ["repair"]

#: Bound on waiting for hinted handoff to drain before comparing.
HINT_DRAIN_TIMEOUT_S: Final = 60.0


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
                    out[rec.batch_id] = rec.batch
    return out


async def repair(control: ClusterControl, names: Sequence[str] | None = None,
                 tolerance: float = 1e-5) -> dict[str, Any]:
    """Repair the replicas served by this process (repair/plan.py): deliver hints, rebuild each node's
    missing batches from its peers' update logs, then compare every replica of every row.

    Returns:
        {"batches_shipped", "rows_shipped", "unrecoverable": {node: [...]}, "unlogged": {node: {peer:
         count}} (repair.RepairPlan), "rows_compared",
         "rows_divergent": [...], "hints_left"}.
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

        peers = [p for p in logs if p != dst]
        plan = plan_repair(applied[dst], owned, {p: logs[p] for p in peers}, {p: applied[p] for p in peers},
                           excluded)
        for bid, share in plan.shares.items():
            if await apply_local(svc, bid, share):
                shipped, rows = shipped + 1, rows + share.num_rows
        if plan.unlogged:
            unlogged[dst] = plan.unlogged
        if plan.unrecoverable:
            unrecoverable[dst] = [f"{b.writer:#x}/{b.seq}: {why}" for b, why in plan.unrecoverable.items()]
    compared, divergent = _compare_replicas(placement, services, tolerance)
    return {"batches_shipped": shipped, "rows_shipped": rows, "unrecoverable": unrecoverable,
            "unlogged": unlogged,
            "rows_compared": compared, "rows_divergent": divergent,
            "hints_left": await control.hints_held_for(live)}


def _compare_replicas(placement: Placement, services: Mapping[str, StorageService | None],
                      tolerance: float) -> tuple[int, list[str]]:
    """Every row of every local replica against the other local owners of its column."""
    stores = {n: s.store.store for n, s in services.items() if s is not None and s.store is not None}
    keys = sorted(set().union(*(set(st.keys()) for st in stores.values()))) if stores else []
    if not keys:
        return 0, []
    cols = np.array([k[0] for k in keys], np.uint64)
    owners = placement.owner_indices(cols)
    divergent: list[str] = []
    for i, key in enumerate(keys):
        copies = [(placement.names[int(j)], stores[placement.names[int(j)]].row(key))
                  for j in owners[i] if placement.names[int(j)] in stores]
        present = [(n, r) for n, r in copies if r is not None]
        if not present:
            continue
        base_name, base = present[0]
        for name, row in copies:
            if row is None or not base.equals(row, rtol=tolerance):
                divergent.append(f"row {key}: {name} differs from {base_name}")
    return len(keys), divergent


