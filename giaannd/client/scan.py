"""Cluster-wide scan: every row of the storage cluster exactly once, in key order (``StorageClient.scan_all``).

Theory of operation
-------------------
Every row is owned by R nodes; a scan must return it once. Each live storage node is asked
(``ScanRows``, paged by a ``(column, feature, entry)`` cursor) for the rows of the columns whose
*first live owner* it is: the request names the down nodes to skip and the placement epoch, and the
node filters with the same placement (``protocol.scan_chain_mask``), so replicas never duplicate a
row. The client re-checks every page with the same mask and drops (with a warning) rows outside the
node's share, so a node that ignores the filter (e.g. one running without a topology) cannot make
the scan repeat rows: the row kept is the agreed owner's, whatever the other replicas hold.

**Streams, merged**: every node's share is one stream of pages in key order; the streams are read
concurrently and merged k-way, a page at a time (scan_merge.py ``PageMerge``), so the scan yields
the whole cluster in global key order while holding at most one page per stream (an export written
as it goes: compute/cluster_export.py). Pages are capped in bytes (``ScanRows.max_bytes``); a row
bigger than a page comes in pieces, one per page (storage/engine/row_scan.py), resumed by
``(row key, entry offset)``: consecutive pages may then share a key, the row being the
concatenation of its pieces (``RowBatch.concat`` of the pages adds them back up).

**Failover**: if a node fails mid-scan, its remaining share (after its cursor) is asked of every
other live node with ``via=[failed node]``: each returns the rows of those columns whose *next*
owner it is, which is again a partition; those streams are merged in place of the failed one
(recursively). A chain of failed owners that, with the nodes skipped as down, may cover every
owner of some column (``len(chain) + len(skip) >= R``: those rows are on no node left), or no
other live node, raises ``ReadFailed``: the rows are unavailable, never silently missing.
**Consistency**: a change of placement during a scan (seen locally, or a node answering NotOwner
because it scans under another epoch) raises ``ScanInterrupted``; the pages already yielded may
then miss or repeat rows, so the caller starts again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from giaannd import protocol as p
from giaannd.client.errors import (
    REQUEST_FAILURES,
    ReadFailed,
    RemoteBadRequest,
    RemoteNotOwner,
    ScanInterrupted,
)
from giaannd.client.node_call import NodeCall
from giaannd.client.scan_merge import PageMerge
from giaannd.cluster.view import ClusterView
from giaannd.model.rows import RowBatch
from giaannd.protocol import scan_chain_mask
from peers.placement import Placement

__all__ = ["DEFAULT_SCAN_PAGE_BYTES", "DEFAULT_SCAN_PAGE_ROWS", "scan_cluster"]

# The storage client's parts log under the client's name (operators and tests filter on it).
log = logging.getLogger("giaannd.client.storage_client")

#: Rows asked per ScanRows page (storage caps it at MAX_SCAN_ROWS and by bytes).
DEFAULT_SCAN_PAGE_ROWS: Final = 16_384
#: Bytes asked per ScanRows page (the default of compute.export-page-bytes): a scan holds about
#: two pages per live node (the merge's and the one in flight): 64 MiB on an 8-node cluster.
DEFAULT_SCAN_PAGE_BYTES: Final = 4 << 20

#: A cursor: after the row (column, feature); entry > 0: inside it, from that entry.
_Cursor = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class _Scan:
    """What every stream of one scan shares."""

    topology: ClusterView
    call: NodeCall
    placement: Placement
    epoch: str
    names: tuple[str, ...]
    replicas: int
    skip: list[str]
    skip_mask: NDArray[np.bool_]
    page_rows: int
    page_bytes: int
    timeout_s: float | None


async def scan_cluster(topology: ClusterView, call: NodeCall, page_rows: int = DEFAULT_SCAN_PAGE_ROWS,
                       timeout_s: float | None = None,
                       page_bytes: int = DEFAULT_SCAN_PAGE_BYTES) -> AsyncIterator[RowBatch]:
    """``StorageClient.scan_all`` (its docstring; module docstring for how)."""
    placement = topology.placement
    names = tuple(placement.names)
    skip = [n for n in names if not topology.is_live(n)]
    # never ask for a page this client would refuse (check_batch's limits): a row over them is
    # then cut by the node instead of making the scan fail (no row may be unscannable)
    page_bytes = min(page_bytes, p.scan_page_bytes(0, p.MAX_BATCH_ENTRIES), p.scan_page_bytes(p.MAX_BATCH_ROWS, 0))
    scan = _Scan(topology, call, placement, placement.epoch, names, placement.effective_replicas, skip,
                 np.array([n in skip for n in names]), page_rows, page_bytes, timeout_s)
    first = [n for n in names if n not in skip]
    if not first:
        raise ReadFailed("no live storage node to scan")
    async with aclosing(_merged([_node_pages(scan, n, (), None) for n in first])) as pages:
        async for page in pages:
            yield page


async def _merged(streams: Sequence[AsyncGenerator[RowBatch, None]]) -> AsyncGenerator[RowBatch, None]:
    """The pages of ``streams`` (each in key order) merged into key order (``PageMerge``); the
    streams a merge step waits for are read concurrently."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for page in only:
                yield page
        return
    merge = PageMerge(len(streams))
    try:
        while not merge.done:
            wanted = merge.wanted()
            if wanted:
                for i, next_page in zip(wanted, await _next_pages([streams[i] for i in wanted])):
                    merge.feed(i, next_page)
            out = merge.pop()
            if out is not None and out.num_rows:
                yield out
        if merge.duplicates:
            log.warning("scan: %d rows held by two streams; the first stream's kept", merge.duplicates)
    finally:
        for s in streams:
            await s.aclose()


async def _next_pages(streams: Sequence[AsyncGenerator[RowBatch, None]]) -> list[RowBatch | None]:
    """The next page of each of ``streams`` (None: finished), read concurrently. If one fails, the
    others' reads are cancelled and awaited first, so every stream can then be closed."""
    if len(streams) == 1:
        return [await anext(streams[0], None)]
    tasks = [asyncio.ensure_future(anext(s, None)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _node_pages(scan: _Scan, node: str, via: tuple[str, ...],
                      after: _Cursor | None) -> AsyncGenerator[RowBatch, None]:
    """The pages of ``node``'s share (the columns whose owner chain minus the skipped nodes starts
    with ``via + (node,)``) after ``after``, in key order; on a failure, the merged streams of the
    nodes that take the rest of the share over (module docstring)."""
    chain = (*via, node)
    chain_idx = [scan.names.index(n) for n in chain]
    while True:
        if scan.topology.placement.epoch != scan.epoch:
            raise ScanInterrupted(f"placement changed from {scan.epoch} during the scan")
        msg = p.ScanRows(after[0] if after else 0, after[1] if after else 0, after is not None,
                         scan.page_rows, True, scan.skip, list(via), scan.epoch, scan.page_bytes,
                         after[2] if after else 0)
        try:
            reply, bulk = await scan.call(node, msg, timeout_s=scan.timeout_s)
            if not isinstance(reply, p.ScanPage):
                raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ScanRows", node)
            batch = p.check_batch(bulk)
        except RemoteNotOwner as exc:
            raise ScanInterrupted(f"{node} scans under another placement ({exc})") from None
        except REQUEST_FAILURES as exc:
            others = [n for n in scan.names if n not in scan.skip and n not in chain]
            # a column of this share whose owners other than the chain are all skipped (down) has
            # no owner left, and no node will answer for it (the ``via`` filter passes only
            # columns with a next live owner): possible as soon as the skipped nodes can fill the
            # owner slots after the chain (any owner list occurs under the placement's hashing)
            if len(chain) + len(scan.skip) >= scan.replicas or not others:
                raise ReadFailed(f"scan: {node} failed ({exc}) and no other live owner is left "
                                 f"for its columns") from None
            log.info("scan failover node=%s after=%s to=%s: %s", node, after, others, exc)
            async with aclosing(_merged([_node_pages(scan, o, chain, after) for o in others])) as rest:
                async for page in rest:
                    yield page
            return
        if batch.num_rows:
            # the node filtered with our placement; re-check (a node that ignores the
            # filter, e.g. one running without a topology, must not duplicate rows)
            ok = scan_chain_mask(scan.placement, batch.row_column, scan.skip_mask, chain_idx)
            if not bool(ok.all()):
                log.warning("scan: %s returned %d rows outside its share; dropped", node, int((~ok).sum()))
                batch = batch.select_rows(ok)
        if batch.num_rows:
            yield batch
        if reply.done:
            return
        after = (reply.next_column, reply.next_feature, reply.next_entry)
