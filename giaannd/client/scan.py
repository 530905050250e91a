"""Cluster-wide scan: every row of the storage cluster exactly once (``StorageClient.scan_all``).

Theory of operation
-------------------
Every row is owned by R nodes; a scan must return it once. Each live storage node is asked
(``ScanRows``, paged by a ``(column, feature)`` cursor) for the rows of the columns whose *first
live owner* it is: the request names the down nodes to skip and the placement epoch, and the node
filters with the same placement (storage/replication/requests.py ``scan_chain_mask``), so replicas never
duplicate a row. The client re-checks every page with the same mask and drops (with a warning)
rows outside the node's share, so a node that ignores the filter (e.g. one running without a
topology) cannot make the scan repeat rows.

**Failover**: if a node fails mid-scan, its remaining share (after its cursor) is asked of every
other live node with ``via=[failed node]``: each returns the rows of those columns whose *next*
owner it is, which is again a partition. A chain of R failed owners, or no other live node, raises
``ReadFailed``. **Consistency**: a change of placement during a scan (seen locally, or a node
answering NotOwner because it scans under another epoch) raises ``ScanInterrupted``; the pages
already yielded may then miss or repeat rows, so the caller starts again.

Pages of one node come in key order; pages of different nodes are not merged.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Final

import numpy as np

from giaannd import protocol as p
from giaannd.client.errors import (
    REQUEST_FAILURES,
    ReadFailed,
    RemoteBadRequest,
    RemoteNotOwner,
    ScanInterrupted,
)
from giaannd.client.node_call import NodeCall
from giaannd.cluster.view import ClusterView
from giaannd.model.rows import RowBatch
from giaannd.protocol import scan_chain_mask

__all__ = ["DEFAULT_SCAN_PAGE_ROWS", "scan_cluster"]

# The storage client's parts log under the client's name (operators and tests filter on it).
log = logging.getLogger("giaannd.client.storage_client")

#: Rows asked per ScanRows page (storage caps it at MAX_SCAN_ROWS and by entries).
DEFAULT_SCAN_PAGE_ROWS: Final = 16_384


async def scan_cluster(topology: ClusterView, call: NodeCall, page_rows: int = DEFAULT_SCAN_PAGE_ROWS,
                       timeout_s: float | None = None) -> AsyncIterator[RowBatch]:
    """``StorageClient.scan_all`` (its docstring; module docstring for how)."""
    placement = topology.placement
    epoch, names, r = placement.epoch, placement.names, placement.effective_replicas
    skip = [n for n in names if not topology.is_live(n)]
    skip_mask = np.array([n in skip for n in names])
    todo: deque[tuple[str, tuple[str, ...], tuple[int, int] | None]] = deque(
        (n, (), None) for n in names if n not in skip)
    if not todo:
        raise ReadFailed("no live storage node to scan")
    while todo:
        node, via, after = todo.popleft()
        while True:
            if topology.placement.epoch != epoch:
                raise ScanInterrupted(f"placement changed from {epoch} during the scan")
            msg = p.ScanRows(after[0] if after else 0, after[1] if after else 0, after is not None,
                             page_rows, True, skip, list(via), epoch)
            try:
                reply, bulk = await call(node, msg, timeout_s=timeout_s)
                if not isinstance(reply, p.ScanPage):
                    raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ScanRows", node)
                batch = p.check_batch(bulk)
            except RemoteNotOwner as exc:
                raise ScanInterrupted(f"{node} scans under another placement ({exc})") from None
            except REQUEST_FAILURES as exc:
                chain = (*via, node)
                others = [n for n in names if n not in skip and n not in chain]
                if len(chain) >= r or not others:
                    raise ReadFailed(f"scan: {node} failed ({exc}) and no other live owner is left "
                                     f"for its columns") from None
                log.info("scan failover node=%s after=%s to=%s: %s", node, after, others, exc)
                todo.extend((o, chain, after) for o in others)
                break
            if batch.num_rows:
                # the node filtered with our placement; re-check (a node that ignores the
                # filter, e.g. one running without a topology, must not duplicate rows)
                ok = scan_chain_mask(placement, batch.row_column, skip_mask,
                                     [names.index(n) for n in (*via, node)])
                if not bool(ok.all()):
                    log.warning("scan: %s returned %d rows outside its share; dropped", node,
                                int((~ok).sum()))
                    batch = batch.select_rows(ok)
            if batch.num_rows:
                yield batch
            if reply.done:
                break
            after = (reply.next_column, reply.next_feature)
