"""The stream writer ids a storage node received stream items under, kept durably.

A stream re-applies rows under writer ids of its own (``dedupe.scoped_writer``); repair must not
mistake those for training writers whose batches are missing, so it reads this file to exclude them
(repair/plan.py). The file is appended and fsynced before the first item under a new id is applied.

The columns those streams copied here (``stream_columns_of``, from the streams' scopes, dedupe.py)
matter to repair too: their rows hold, under the stream's ids, every batch the source had applied,
so repair must not ship a writer batch into them again under its own id (repair/plan.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

import numpy as np
from numpy.typing import NDArray

from giaannd.storage.streaming.dedupe import StreamScopes

if TYPE_CHECKING:
    from giaannd.storage.replication.service import StorageService

__all__ = ["STREAM_WRITERS_FILE", "record_stream_writer", "stream_columns_of", "stream_writers_of"]

#: Per storage data directory: the stream writer ids this node received items under (u64 each,
#: appended and fsynced before the first item is applied). Repair excludes them (repair/plan.py).
STREAM_WRITERS_FILE: Final = "stream-writers.u64"


def stream_writers_of(service: StorageService) -> set[int]:
    """The writer ids streams used on this node (empty when none ever arrived)."""
    path = service.data_dir / STREAM_WRITERS_FILE
    if not path.exists():
        return set()
    raw = path.read_bytes()
    return set(np.frombuffer(raw[: len(raw) // 8 * 8], np.uint64).tolist())


def record_stream_writer(service: StorageService, writer: int) -> None:
    """Remember ``writer`` durably (a no-op when it is already recorded)."""
    if writer in stream_writers_of(service):
        return
    service.data_dir.mkdir(parents=True, exist_ok=True)
    with open(service.data_dir / STREAM_WRITERS_FILE, "ab") as f:
        f.write(np.array([writer], np.uint64).tobytes())
        f.flush()
        os.fsync(f.fileno())


def stream_columns_of(service: StorageService) -> NDArray[np.uint64]:
    """The columns streams copied to this node (sorted, unique; open and closed streams, not the
    discarded ones, whose rows were dropped): read from the streams' scopes on disk (dedupe.py)."""
    parts = [cols for _, cols in StreamScopes.open(service.data_dir).items()]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
