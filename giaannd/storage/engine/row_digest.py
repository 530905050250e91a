"""Row digests: what replicas compare to find rows that differ, without sending the rows.

Theory of operation
-------------------
Two digests, both xxh3-64, over the bytes of rows in the region layout (regions.py), so they are
the values nodes computed before the row engine (issue 14, phase 2): replicas and stream ends of
different versions still agree.

- ``row_digest`` (anti-entropy repair, repair/plan.py / repair/wire.py): per row, a :class:`RowDigest`
  of three parts. ``keys`` hashes the key arrays and segments, ``strength`` the strengths, kept
  apart because float sums may differ in the last bit between replicas that applied the same
  batches in a different order (repair decides what such a difference means), and ``batches``
  is the number of applied batches that touched the row.
- ``rows_digest`` (stream verification, streaming/sender.py): for many rows, one hash over their
  region sizes (i64) then their regions, in the given order. Two stores give equal results exactly
  when they hold the same rows bit for bit (keys, strengths, segments), up to a 2**-64 collision.
  The rows come as one gathered batch (``RowEngine.gather``), laid out as regions by one vectorised
  pass (``regions.pack_regions``) and hashed at once: no per-row Python.

Pure functions; the store (column_store.py) exposes them as ``ColumnStore.digest`` and
``ColumnStore.rows_digest``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.model.rows import Row
from giaannd.storage.engine.regions import ENTRY_BYTES, pack_regions

__all__ = ["RowDigest", "row_digest", "rows_digest"]


@dataclass(frozen=True, slots=True)
class RowDigest:
    """What repair compares between replicas.

    ``keys``: xxh3_64 of the row's key arrays (order-independent of how the batches were applied);
    ``strength``: xxh3_64 of the strengths (float sums may differ in the last bit between replicas
    that applied the same batches in a different order); ``batches``: applied batches touching it.
    """

    keys: int
    strength: int
    batches: int


def row_digest(row: Row, touches: int) -> RowDigest:
    """The repair digest of one stored row (see :class:`RowDigest`): the hashes of its region's
    first 16 n bytes then last n (keys), and of the strengths in between."""
    keys = xxhash.xxh3_64(_bytes(row.target_column))
    keys.update(_bytes(row.target_feature))
    keys.update(_bytes(row.segment))
    return RowDigest(keys.intdigest(), xxhash.xxh3_64_intdigest(_bytes(row.strength)), touches)


def _bytes(values: NDArray[np.generic]) -> memoryview:
    """The array's bytes (a view when it is contiguous, as the engine's slices are)."""
    return np.ascontiguousarray(values).data.cast("B")


def rows_digest(offsets: NDArray[np.int64], rows: Row) -> int:
    """One xxh3-64 over the region sizes (i64 bytes) of the rows (row i: ``rows`` entries
    ``[offsets[i], offsets[i+1])``), then their regions back to back (module docstring)."""
    h = xxhash.xxh3_64((ENTRY_BYTES * np.diff(offsets)).astype(np.int64).tobytes())
    h.update(pack_regions(offsets, rows).data)
    return h.intdigest()
