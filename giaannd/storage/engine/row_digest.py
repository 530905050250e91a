"""Row digests: what replicas compare to find rows that differ, without sending the rows.

Theory of operation
-------------------
Digests, all xxh3-64. ``row_digest`` hashes a row's field arrays; ``rows_digest`` has two versions
(``ROWS_DIGEST_VERSIONS``), named in the stream's verify messages (streaming/stream.py,
``StreamVerify.digest_version``), so that both ends hash the same way whatever their code:

- ``row_digest`` (anti-entropy repair, repair/plan.py / repair/wire.py): per row, a :class:`RowDigest`
  of three parts. ``keys`` hashes the key arrays and segments, ``strength`` the strengths, kept
  apart because float sums may differ in the last bit between replicas that applied the same
  batches in a different order (repair decides what such a difference means), and ``batches``
  is the number of applied batches that touched the row.
- ``rows_digest`` (stream verification, streaming/sender.py): for many rows, one hash, in the
  given order. Two stores give equal results exactly when they hold the same rows bit for bit
  (keys, strengths, segments), up to a 2**-64 collision. The rows come as one gathered batch
  (``RowEngine.gather``: field-major arrays), hashed at once, no per-row Python.

  - version 1: the row sizes in bytes (i64), then the rows in the region layout (regions.py):
    the value nodes computed before the row engine (issue 14, phase 2). Laying the rows out as
    regions is a scatter of every entry (~120 MB/s at 50 entries per row): it bounded a join.
  - version 2: the row lengths in entries (i64), then the four field arrays of the gathered
    rows as they are (segment, target column, target feature, strength): the same rows give the
    same bytes (a row's entries are contiguous in each field, rows in the given order, and the
    lengths say where each row ends), so it decides equality exactly as version 1 does, at hash
    speed (no layout pass). Used when both ends know it (the receiver's reply names the version it
    hashed; a sender answered in version 1 verifies again in version 1).

Pure functions; the store (column_store.py) exposes them as ``ColumnStore.digest`` and
``ColumnStore.rows_digest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.model.rows import Row
from giaannd.storage.engine.regions import ENTRY_BYTES, pack_regions

__all__ = ["ROWS_DIGEST_VERSIONS", "RowDigest", "row_digest", "rows_digest", "rows_digest_v2_pieces"]

#: The ``rows_digest`` versions this code computes (module docstring); the last is the newest.
ROWS_DIGEST_VERSIONS = (1, 2)


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


def rows_digest(offsets: NDArray[np.int64], rows: Row, version: int = 1) -> int:
    """One xxh3-64 over the rows (row i: ``rows`` entries ``[offsets[i], offsets[i+1])``) in digest
    ``version`` (module docstring): 1, the region sizes (i64 bytes) then the regions back to back;
    2, the row lengths (i64) then the field arrays.

    Raises:
        ValueError: a version not in ``ROWS_DIGEST_VERSIONS``.
    """
    if version == 2:
        return rows_digest_v2_pieces(np.diff(offsets),
                                     [(rows.segment, rows.target_column, rows.target_feature, rows.strength)])
    if version != 1:
        raise ValueError(f"unknown rows digest version {version}")
    h = xxhash.xxh3_64((ENTRY_BYTES * np.diff(offsets)).astype(np.int64).tobytes())
    h.update(pack_regions(offsets, rows).data)
    return h.intdigest()


def rows_digest_v2_pieces(lengths: NDArray[np.int64], pieces: Sequence[Sequence[NDArray[Any]]]) -> int:
    """``rows_digest(offsets, rows, 2)`` of rows given as consecutive pieces, each the four field
    arrays (segment, target column, target feature, strength) of some of the rows, in order
    (``RowEngine.pieces``: views of the store, no gathered copy): the same bytes hashed in the same
    order, so the same digest. ``lengths``: each row's entry count."""
    h = xxhash.xxh3_64(np.asarray(lengths).astype(np.int64).tobytes())
    for field in range(4):
        for piece in pieces:
            h.update(_bytes(piece[field]))
    return h.intdigest()
