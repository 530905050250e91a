"""One column across its replicas: ``StorageClient.column_info`` and its report types.

Theory of operation
-------------------
A column's owners are computed locally (placement order, live or not). Every live owner is asked
at once for its view of the column (``ColumnInfo``, paged by feature cursor, at most
``MAX_COLUMN_INFO_PAGES`` pages); the pages are summed: rows, entries and bytes add up, and the
order-free digests (keys, strengths) add modulo 2**64, so the sum over pages equals the digest of
the whole column. An owner believed down is listed but not asked; an owner whose answer fails is
listed with ``error``, never raised, so one bad replica does not hide the others. Digests are
asked in the newest per-row digest version (``protocol.ROW_DIGEST_VERSIONS``; version 2 is hashed
a page at a time on the node); owners that answered in different versions (one from before
versions answers 1) are asked again in the oldest, so the digests compared are of one version.

``ColumnReport.keys_agree`` / ``strength_agree`` compare what the answering owners hold: equal
keys mean the replicas hold the same rows and entries; equal strengths additionally need the same
float sums, which replicas that applied the same batches in another order may miss in the last bit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final

import numpy as np

from giaannd import protocol as p
from giaannd.client.errors import REQUEST_FAILURES, RemoteBadRequest
from giaannd.client.node_call import NodeCall
from giaannd.cluster.view import ClusterView

__all__ = ["MAX_COLUMN_INFO_PAGES", "ColumnReplicaInfo", "ColumnReport", "column_report", "replica_info"]

#: Pages one owner may answer for one ``column_info`` (MAX_COLUMN_INFO_ROWS rows each: 16 Mi
#: features, far beyond any column); a node still paging past it is reported as failed.
MAX_COLUMN_INFO_PAGES: Final = 1024


@dataclass(frozen=True)
class ColumnReplicaInfo:
    """One owner's view of a column (``StorageClient.column_info``). The counts are None when the
    owner is believed down (not asked) or its answer failed (``error``)."""

    node: str
    live: bool
    rows: int | None = None
    entries: int | None = None
    bytes: int | None = None
    keys_digest: int | None = None
    strength_digest: int | None = None
    batches: int | None = None
    error: str | None = None
    #: the digest version of ``keys_digest`` / ``strength_digest`` (protocol.ROW_DIGEST_VERSIONS)
    digest_version: int | None = None


@dataclass(frozen=True)
class ColumnReport:
    """A column's owners under ``epoch`` (placement order) with what each live one holds.

    ``keys_agree``: every answering owner holds the same rows with the same entry keys;
    ``strength_agree``: also bit-identical strengths (replicas that applied the same batches in
    another order may differ in the last bit of a float sum, so this one can be False on a healthy
    cluster); both None when fewer than two owners answered."""

    column: int
    epoch: str
    replicas: list[ColumnReplicaInfo]

    @property
    def answered(self) -> list[ColumnReplicaInfo]:
        return [r for r in self.replicas if r.rows is not None]

    @property
    def keys_agree(self) -> bool | None:
        got = self.answered
        return None if len(got) < 2 else len({(r.rows, r.entries, r.keys_digest) for r in got}) == 1

    @property
    def strength_agree(self) -> bool | None:
        got = self.answered
        return None if len(got) < 2 else len({(r.keys_digest, r.strength_digest) for r in got}) == 1


async def column_report(topology: ClusterView, call: NodeCall, column: int,
                        page_rows: int = p.MAX_COLUMN_INFO_ROWS, timeout_s: float | None = None) -> ColumnReport:
    """``StorageClient.column_info`` (its docstring; module docstring for how)."""
    placement = topology.placement
    owners = [placement.names[int(i)]
              for i in placement.owner_indices(np.array([column], np.uint64))[0]]
    live = [topology.is_live(n) for n in owners]
    results = await asyncio.gather(
        *(replica_info(call, n, column, page_rows, timeout_s) for n, ok in zip(owners, live) if ok),
        return_exceptions=True)
    replicas = _collect(owners, live, results)
    versions = {r.digest_version for r in replicas if r.rows is not None}
    if len(versions) > 1:  # an owner from before digest versions: all in the oldest, to compare
        low = min(v for v in versions if v is not None)
        again = [r.node for r in replicas if r.rows is not None and r.digest_version != low]
        redone = await asyncio.gather(*(replica_info(call, n, column, page_rows, timeout_s, low) for n in again),
                                      return_exceptions=True)
        fresh = dict(zip(again, _collect(again, [True] * len(again), redone)))
        replicas = [fresh.get(r.node, r) for r in replicas]
    return ColumnReport(column, placement.epoch, replicas)


def _collect(names: list[str], live: list[bool], results: list[ColumnReplicaInfo | BaseException]
             ) -> list[ColumnReplicaInfo]:
    """The owners' entries: down (not asked), answered, or failed with the error."""
    it = iter(results)
    replicas = []
    for name, ok in zip(names, live):
        if not ok:
            replicas.append(ColumnReplicaInfo(name, False))
            continue
        got = next(it)
        if isinstance(got, ColumnReplicaInfo):
            replicas.append(got)
        elif isinstance(got, REQUEST_FAILURES):
            replicas.append(ColumnReplicaInfo(name, True, error=f"{type(got).__name__}: {got}"))
        else:
            raise got
    return replicas


async def replica_info(call: NodeCall, node: str, column: int, page_rows: int,
                        timeout_s: float | None, digest_version: int = p.ROW_DIGEST_VERSIONS[-1]) -> ColumnReplicaInfo:
    """One live owner's pages of ``column``, summed (module docstring), with digests in
    ``digest_version`` or the newest the owner knows below it (every page in the same one)."""
    mask = (1 << 64) - 1
    rows = entries = nbytes = keys = strength = batches = 0
    msg = p.ColumnInfo(column, limit=page_rows, digest_version=digest_version)
    version: int | None = None
    for _ in range(MAX_COLUMN_INFO_PAGES):
        reply, _ = await call(node, msg, (), timeout_s)
        if not isinstance(reply, p.ColumnInfoPage):
            raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ColumnInfo", node)
        if reply.digest_version not in p.ROW_DIGEST_VERSIONS or version not in (None, reply.digest_version):
            raise RemoteBadRequest(f"ColumnInfo pages in digest versions {version} and {reply.digest_version}", node)
        version = reply.digest_version
        rows, entries, nbytes = rows + reply.rows, entries + reply.entries, nbytes + reply.bytes
        keys, strength = (keys + reply.keys_digest) & mask, (strength + reply.strength_digest) & mask
        batches += reply.batches
        if reply.done:
            return ColumnReplicaInfo(node, True, rows, entries, nbytes, keys, strength, batches,
                                     digest_version=version)
        if reply.next_feature <= msg.after_feature and msg.started:
            raise RemoteBadRequest("ColumnInfo cursor did not advance", node)
        msg = p.ColumnInfo(column, reply.next_feature, True, page_rows, digest_version)
    raise RemoteBadRequest(f"column {column} not done after {MAX_COLUMN_INFO_PAGES} pages", node)
