"""The probabilistic-delimiter flag set, replicated through storage as one reserved row.

Why a row and not gossip (ARCHITECTURE §4 allows either): the flags are a *grow-only set* of
feature ids that column assignment reads (giaann-algorithm.md §2.4, §3.3). Storing them as row
``FLAG_ROW = (column 0, feature 0)`` makes them exactly as durable and replicated as the deltas that
depend on them, with no new protocol:

* column id 0 is never a real column (``ids.py`` remaps a hash of 0 to 1), so the row cannot
  collide with model data; placement gives it R owners like any column;
* a flag is the entry ``(segment 0, target_column 0, target_feature = flagged feature id)``;
  storage adds strengths of equal keys, so writing a flag again only raises that entry's strength
  (a count of proposals, never read) — membership in the set is "entry present", which is
  commutative, idempotent and grow-only, exactly the set semantics;
* a worker sends the flags it discovered *in the same batch* as the deltas of the sentences that
  discovered them (one batch id: both land or neither), and reads the row back between batches to
  learn other workers' flags. With one worker the refresh never adds anything, so training equals
  the sequential core; with B workers a flag found by worker A reaches worker B at B's next
  refresh — the only source of difference from a sequential run (measured in the tests and docs).

Pure (sans-IO): building the row and reading it; the pipeline does the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import numpy as np

from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.unique import unique

__all__ = ["FLAG_ROW", "FlagTracker", "flag_ids", "flags_batch", "with_flags", "without_flag_row"]

#: The reserved row holding the replicated flag set (column 0 is never a real column).
FLAG_ROW: Final[RowKey] = (0, 0)
_FLAG_SEGMENT: Final = 0
_FLAG_TARGET_COLUMN: Final = 0


def flags_batch(feature_ids: Iterable[int]) -> RowBatch:
    """A canonical one-row batch adding ``feature_ids`` to the flag row (empty if none)."""
    ids = unique(np.fromiter((int(f) for f in feature_ids), dtype=np.uint64))
    n = int(ids.shape[0])
    if n == 0:
        return RowBatch.empty()
    return RowBatch(
        np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.array([0, n], np.int64),
        np.full(n, _FLAG_SEGMENT, np.uint8), np.full(n, _FLAG_TARGET_COLUMN, np.uint64), ids,
        np.ones(n, np.float32),
    )


def with_flags(batch: RowBatch, feature_ids: Iterable[int]) -> RowBatch:
    """``batch`` plus the flag row for ``feature_ids``, still canonical, without a re-sort: the flag
    row's key (0, 0) sorts before every real row (column ids are never 0).

    Raises:
        ValueError: ``batch`` already holds a row of column 0.
    """
    flags = flags_batch(feature_ids)
    if flags.num_rows == 0:
        return batch
    if batch.num_rows == 0:
        return flags
    if int(batch.row_column[0]) == FLAG_ROW[0]:
        raise ValueError("a model delta batch holds a row of the reserved column 0")
    return RowBatch(
        np.concatenate([flags.row_column, batch.row_column]),
        np.concatenate([flags.row_feature, batch.row_feature]),
        np.concatenate([flags.offsets, batch.offsets[1:] + flags.offsets[-1]]),
        np.concatenate([flags.segment, batch.segment]),
        np.concatenate([flags.target_column, batch.target_column]),
        np.concatenate([flags.target_feature, batch.target_feature]),
        np.concatenate([flags.strength, batch.strength]),
    )


def flag_ids(row: Row) -> set[int]:
    """The feature ids flagged in a flag row as read from storage.

    Raises:
        ValueError: the row holds an entry that no flag writer produces (corrupt or foreign data).
    """
    if len(row) and (np.any(row.segment != _FLAG_SEGMENT) or np.any(row.target_column != _FLAG_TARGET_COLUMN)):
        raise ValueError("flag row holds entries outside (segment 0, target column 0)")
    return set(row.target_feature.tolist())


def without_flag_row(batch: RowBatch) -> RowBatch:
    """``batch`` minus the reserved flag row (exports show model rows only)."""
    keep = ~((batch.row_column == FLAG_ROW[0]) & (batch.row_feature == FLAG_ROW[1]))
    return batch if bool(keep.all()) else batch.select_rows(keep)


class FlagTracker:
    """What one worker knows of the replicated set, and what it found that it has not sent.

    Args:
        known: flags already in storage when the worker starts.
    """

    def __init__(self, known: Iterable[int] = ()) -> None:
        self.known: set[int] = set(known)
        self._sent_or_seen: set[int] = set(self.known)

    def merge_remote(self, remote: Iterable[int]) -> set[int]:
        """Add flags read from storage; returns the ones new to this worker."""
        new = set(remote) - self.known
        self.known |= new
        self._sent_or_seen |= new
        return new

    def take_unsent(self, local: Iterable[int]) -> set[int]:
        """Flags in ``local`` (the worker's assigner set) never sent nor seen in storage; marks
        them sent (the caller puts them in its next batch, which is retried until it lands)."""
        new = set(local) - self._sent_or_seen
        self._sent_or_seen |= new
        self.known |= new
        return new
