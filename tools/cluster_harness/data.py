"""Test data and addresses for cluster tests: random canonical row batches, free loopback ports."""

from __future__ import annotations

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.sdk.local_cluster import free_port

__all__ = ["free_tcp_address", "make_batch"]


def free_tcp_address() -> str:
    """A ``tcp://127.0.0.1:PORT`` free right now, for a listener that must keep its address
    (``local_cluster.free_port``: below the ephemeral range, so no outgoing connection takes it)."""
    return f"tcp://127.0.0.1:{free_port()}"


def make_batch(rng: np.random.Generator, rows: int, entries_per_row: int = 4,
               columns: np.ndarray | None = None) -> RowBatch:
    """A canonical random delta batch (strengths small positive integers: exact float sums)."""
    n = rows * entries_per_row
    src_col = columns if columns is not None else rng.integers(1, 2**63, rows, dtype=np.uint64)
    sc = np.repeat(np.asarray(src_col, np.uint64), entries_per_row)
    sf = np.repeat(rng.integers(0, 50, rows, dtype=np.uint64), entries_per_row)
    return RowBatch.from_entries(sc, sf, rng.integers(0, 9, n).astype(np.uint8),
                                 rng.integers(1, 1000, n, dtype=np.uint64),
                                 rng.integers(0, 1000, n, dtype=np.uint64),
                                 rng.integers(1, 5, n).astype(np.float32))
