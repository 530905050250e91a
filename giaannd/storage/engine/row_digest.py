"""Row digests: what replicas compare to find rows that differ, without sending the rows.

Theory of operation
-------------------
Two digests over the column store's regions (layout: regions.py), both xxh3-64:

- ``row_digest`` (anti-entropy repair, repair/plan.py / repair/wire.py): per row, a :class:`RowDigest`
  of three parts. ``keys`` hashes the key arrays and segments, ``strength`` the strengths, kept
  apart because float sums may differ in the last bit between replicas that applied the same
  batches in a different order (repair decides what such a difference means), and ``batches``
  is the number of applied batches that touched the row.
- ``rows_digest`` (stream verification, streaming/sender.py): for a list of row keys, which are stored,
  and one hash over the stored ones' region sizes then their regions, in the given order. Two
  stores give equal results exactly when they hold the same rows bit for bit (keys, strengths,
  segments), up to a 2**-64 collision.

Both read the regions as they are (memoryview or ndarray buffers): no per-row array views and no
copies. Pure functions over the store's slots; the store (column_store.py) exposes them as
``ColumnStore.digest`` and ``ColumnStore.rows_digest``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import xxhash
from numpy.typing import ArrayLike, NDArray

from giaannd.model.rows import RowKey
from giaannd.storage.engine.regions import ENTRY_BYTES, RowSlot

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


def row_digest(slot: RowSlot) -> RowDigest:
    """The repair digest of one stored row (see :class:`RowDigest`)."""
    region = slot.region.data  # (a memoryview: slicing it is cheaper than making array views)
    n = len(region) // ENTRY_BYTES
    keys = xxhash.xxh3_64(region[: 16 * n])
    keys.update(region[20 * n :])
    return RowDigest(keys.intdigest(), xxhash.xxh3_64_intdigest(region[16 * n : 20 * n]), slot.touches)


def rows_digest(slots: Mapping[RowKey, RowSlot], row_column: ArrayLike,
                row_feature: ArrayLike) -> tuple[NDArray[np.uint8], int]:
    """Which of the given rows are in ``slots`` (1/0 per key, in the given order), and one xxh3-64
    over the stored ones' region sizes (i64) then their regions, in that order (module docstring).
    Per row a dict lookup and one streaming-hash update (measured faster than hashing
    concatenations of the regions, which copies them first).

    Raises:
        ValueError: ``row_column`` and ``row_feature`` differ in length.
    """
    rc = np.asarray(row_column).astype(np.uint64, copy=False).reshape(-1)
    rf = np.asarray(row_feature).astype(np.uint64, copy=False).reshape(-1)
    if rc.shape != rf.shape:
        raise ValueError("row_column and row_feature differ in length")
    get = slots.get
    found = [get(k) for k in zip(rc.tolist(), rf.tolist())]
    present = np.fromiter((s is not None for s in found), np.uint8, len(found))
    regions = [s.region for s in found if s is not None]
    h = xxhash.xxh3_64(np.fromiter((r.shape[0] for r in regions), np.int64, len(regions)).tobytes())
    # (an ndarray is a buffer; hashing it directly is faster than through ``.data``)
    update: Callable[[NDArray[np.uint8]], None] = h.update  # type: ignore[assignment]
    for region in regions:
        update(region)
    return present, h.intdigest()
