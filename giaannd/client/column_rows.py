"""One column's rows, read from one replica: ``StorageClient.read_column`` (issue 21).

Theory of operation
-------------------
A column's rows are the keys ``(column, feature)``: one contiguous stretch of a storage node's key
order. So the read is a scan of *one* owner, with the ``ScanRows`` request every node already
serves (no protocol change), in non-owned mode (every row the node holds, no placement filter):

- **Start** just before ``(column, 0)``: the cursor is exclusive, so it is the last possible key
  of the previous column, ``(column - 1, 2**64 - 1)`` (column 0: from the first row).
- **Pages** are capped in bytes (``ScanRows.max_bytes``); a row bigger than a page comes in pieces,
  resumed inside the row by ``(key, entry)``, and ``RowBatch.concat`` of the pieces adds them back
  up into the canonical row (as the cluster scan does, client/scan.py).
- **Stop** when a page passes the column (it holds a row of a later column, or its cursor lies
  past the column), when the node has no more rows (``done``), or once more than ``max_entries``
  entries were read: the answer is then cut at ``max_entries`` (rows in key order, entries in row
  order) and ``truncated``; ``total_entries`` then comes from the same node's ``ColumnInfo``
  (column_info.py: counts without the entries), so a huge column is never moved whole.
- **Failover**: the owners are tried one at a time, live ones in placement order; one that fails
  (any ``REQUEST_FAILURES``, or a malformed page) is logged and the next one is read from the
  start, the same semantics as a replicated read: any one replica's copy, never a mix of two.
  Every owner failing, or none live, raises ``ReadFailed``. An owner that answers without rows
  answers for the column (as a read of an absent row does): the column has no rows.

Bounded: at most ``MAX_COLUMN_READ_PAGES`` pages per owner (a node whose cursor stops advancing
is treated as failed), and the entries held are at most ``max_entries`` plus one page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import numpy as np

from giaannd import protocol as p
from giaannd.client.column_info import replica_info
from giaannd.client.errors import REQUEST_FAILURES, ReadFailed, RemoteBadRequest
from giaannd.client.node_call import NodeCall
from giaannd.cluster.view import ClusterView
from giaannd.model.rows import RowBatch

__all__ = ["MAX_COLUMN_READ_PAGES", "ColumnRead", "cut_entries", "read_column", "read_column_from"]

# The storage client's parts log under the client's name (operators and tests filter on it).
log = logging.getLogger("giaannd.client.storage_client")

#: Pages one owner may answer for one column read. With the default 4 MiB pages that is 16 GiB of
#: rows, past any column (``max_entries`` is at most 10 Mi entries: ~50 pages); a node still paging
#: after it (a cursor that never moves on) is treated as failed.
MAX_COLUMN_READ_PAGES: Final = 4096
_LAST_FEATURE: Final = (1 << 64) - 1


def _position(cursor: tuple[int, int, int]) -> tuple[int, int, int]:
    """A cursor as an ordered position: entry 0 means after the whole row, so after any piece of it."""
    column, feature, entry = cursor
    return column, feature, entry if entry else 1 << 64


@dataclass(frozen=True)
class ColumnRead:
    """A column's rows as one owner (``node``) holds them: canonical, in key order, cut at the
    read's ``max_entries`` (then ``truncated``); ``total_entries``: all of the column's entries."""

    column: int
    node: str
    rows: RowBatch
    total_entries: int
    truncated: bool


def cut_entries(batch: RowBatch, limit: int) -> RowBatch:
    """The first ``limit`` entries of ``batch`` (rows in order, the last one possibly cut), as views."""
    if batch.num_entries <= limit:
        return batch
    last = int(np.searchsorted(batch.offsets, limit, "left"))  # rows [0, last) hold the first `limit`
    offsets = np.minimum(batch.offsets[: last + 1], limit)
    return RowBatch(batch.row_column[:last], batch.row_feature[:last], offsets, batch.segment[:limit],
                    batch.target_column[:limit], batch.target_feature[:limit], batch.strength[:limit])


async def read_column(topology: ClusterView, call: NodeCall, column: int, max_entries: int,
                      page_bytes: int, timeout_s: float | None = None) -> ColumnRead:
    """``StorageClient.read_column`` (its docstring; module docstring for how)."""
    placement = topology.placement
    owners = [placement.names[int(i)] for i in placement.owner_indices(np.array([column], np.uint64))[0]]
    live = [n for n in owners if topology.is_live(n)]
    if not live:
        raise ReadFailed(f"column {column:#x}: no live owner (owners {', '.join(owners)})")
    failures: list[str] = []
    for node in live:
        try:
            return await read_column_from(call, node, column, max_entries, page_bytes, timeout_s)
        except REQUEST_FAILURES as exc:
            log.info("column read failover column=%#x node=%s: %s", column, node, exc)
            failures.append(f"{node}: {exc}")
    raise ReadFailed(f"column {column:#x}: every live owner failed ({'; '.join(failures)})")


async def read_column_from(call: NodeCall, node: str, column: int, max_entries: int, page_bytes: int,
                           timeout_s: float | None = None) -> ColumnRead:
    """The column's rows as ``node`` holds them (module docstring: start, pages, stop).

    Raises:
        RemoteBadRequest: a reply that is not a scan page, or a cursor that does not advance.
        REQUEST_FAILURES: the node could not be used.
    """
    page_bytes = min(page_bytes, p.scan_page_bytes(0, p.MAX_BATCH_ENTRIES), p.scan_page_bytes(p.MAX_BATCH_ROWS, 0))
    cursor = (column - 1, _LAST_FEATURE, 0) if column > 0 else None
    pieces: list[RowBatch] = []
    held = 0
    for _ in range(MAX_COLUMN_READ_PAGES):
        msg = p.ScanRows(cursor[0] if cursor else 0, cursor[1] if cursor else 0, cursor is not None,
                         p.MAX_SCAN_ROWS, False, max_bytes=page_bytes, after_entry=cursor[2] if cursor else 0)
        reply, bulk = await call(node, msg, timeout_s=timeout_s)
        if not isinstance(reply, p.ScanPage):
            raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ScanRows", node)
        batch = p.check_batch(bulk)
        mine = batch.row_column == np.uint64(column)
        if bool(mine.any()):
            pieces.append(batch if bool(mine.all()) else batch.select_rows(mine))
            held += pieces[-1].num_entries
        next_cursor = (reply.next_column, reply.next_feature, reply.next_entry)
        passed = bool((batch.row_column > np.uint64(column)).any()) or reply.next_column > column
        if passed or reply.done or held > max_entries:
            break
        if cursor is not None and _position(next_cursor) <= _position(cursor):
            raise RemoteBadRequest(f"ScanRows cursor did not advance past {cursor}", node)
        cursor = next_cursor
    else:
        raise RemoteBadRequest(f"column {column:#x} not read after {MAX_COLUMN_READ_PAGES} pages", node)
    rows = RowBatch.concat(pieces)
    if rows.num_entries <= max_entries:
        return ColumnRead(column, node, rows, rows.num_entries, False)
    info = await replica_info(call, node, column, p.MAX_COLUMN_INFO_ROWS, timeout_s)
    # (rows applied between the scan and the count can only add: the count is at least what was read)
    total = max(info.entries or 0, rows.num_entries)
    return ColumnRead(column, node, cut_entries(rows, max_entries), total, True)
