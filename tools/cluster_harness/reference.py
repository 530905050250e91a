"""Writes checked against a reference: what the cluster harness adds to its client.

Every batch the client gets acknowledged is applied once to one plain ``ColumnStore`` (the
reference, kept in RAM); ``mismatches`` then says where an owner's rows differ from it. Writes are
retried with the same batch id until acknowledged (the client's contract), so nothing counts twice.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from giaannd.client.storage_client import QuorumNotReached, StorageClient
from giaannd.cluster.view import ClusterView
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.replication.service import StorageService
from tools.cluster_harness.data import make_batch

__all__ = ["ReferenceWrites"]


class ReferenceWrites:
    """``write`` / ``write_many`` / ``mismatches`` over ``client``, ``client_topology`` and the
    in-process ``services`` of the class it is mixed into (``Cluster``)."""

    reference: ColumnStore
    written: list[tuple[BatchId, RowBatch]]
    services: dict[str, StorageService]

    if TYPE_CHECKING:  # read-only properties of the class mixed into
        @property
        def client(self) -> StorageClient: ...

        @property
        def client_topology(self) -> ClusterView: ...

    async def write(self, batch: RowBatch, attempts: int = 20) -> BatchId:
        """Write until acknowledged (retrying the same id: the client's contract); then, and only
        then, the batch counts in the reference."""
        bid = self.client.next_batch_id()
        for attempt in range(attempts):
            try:
                await self.client.write(batch, bid)
                break
            except QuorumNotReached:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.05)
        self.reference.apply(bid, batch)
        self.written.append((bid, batch))
        return bid

    async def write_many(self, rng: np.random.Generator, n: int, columns: np.ndarray, rows: int = 8,
                         stop: asyncio.Event | None = None, pause_s: float = 0.0) -> int:
        done = 0
        for _ in range(n):
            if stop is not None and stop.is_set():
                break
            await self.write(make_batch(rng, rows, 4, rng.choice(columns, rows)))
            done += 1
            if pause_s:
                await asyncio.sleep(pause_s)
        return done

    def mismatches(self, names: list[str] | None = None) -> list[str]:
        """Every (row, owner) where an in-process owner's copy differs from the reference, under
        the client's placement; an owner must hold exactly the reference rows of its columns."""
        placement = self.client_topology.placement
        ref_keys = self.reference.keys()
        cols = np.unique(np.array([k[0] for k in ref_keys], np.uint64))
        owners = placement.owner_indices(cols)
        problems: list[str] = []
        by_col: dict[int, list[tuple[int, int]]] = {}
        for k in ref_keys:
            by_col.setdefault(k[0], []).append(k)
        for i, c in enumerate(cols.tolist()):
            for j in owners[i]:
                name = placement.names[int(j)]
                if names is not None and name not in names:
                    continue
                store = self.services[name].store
                assert store is not None
                have = [k for k in store.store.keys() if k[0] == c]
                if have != by_col[c]:
                    problems.append(f"{name} column {c:#x}: {len(have)} rows, reference {len(by_col[c])}")
                    continue
                for k in have:
                    want, got = self.reference.row(k), store.store.row(k)
                    assert want is not None and got is not None  # (keys of both)
                    if not want.equals(got):
                        problems.append(f"{name} row {k}: strengths differ from the reference")
        return problems
