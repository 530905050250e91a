"""The stream writer ids a storage node received stream items under, kept durably.

A stream re-applies rows under writer ids of its own (``dedupe.scoped_writer``); repair must not
mistake those for training writers whose batches are missing, so it reads this file to exclude them
(repair/plan.py). The file is appended and fsynced before the first item under a new id is applied.

The columns those streams copied here (``stream_columns_of``, from the streams' scopes, dedupe.py)
matter to repair too: their rows hold, under the stream's ids, every batch the source had applied,
so repair must not ship a writer batch into them again under its own id (repair/plan.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import numpy as np
from numpy.typing import NDArray

from giaannd.atomic_file import fsync_dir
from giaannd.storage.engine.log_tail import append_synced
from giaannd.storage.streaming.dedupe import StreamScopes
from giaannd.unique import unique

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
    """Remember ``writer`` durably (a no-op when it is already recorded).

    Raises:
        OSError: the append or its fsync failed (a full disk, EIO); the id is not in the file
            (the append is cut off again), so the caller's retry writes and fsyncs it anew.
    """
    if writer in stream_writers_of(service):
        return
    service.data_dir.mkdir(parents=True, exist_ok=True)
    path = service.data_dir / STREAM_WRITERS_FILE
    # whole or not at all (log_tail.py): an id left in the file after a failed fsync would read
    # as recorded by the retry, though a power loss may drop it ("fsyncgate": the next fsync need
    # not cover it), and a part of one would shift every later id
    size = append_synced(path, np.array([writer], np.uint64).tobytes())
    if size == 0:  # a new file (or one a failed first append left empty): its name is durable
        fsync_dir(service.data_dir)  # only once its directory is synced


def stream_columns_of(service: StorageService) -> NDArray[np.uint64]:
    """The columns streams copied to this node (sorted, unique; open and closed streams, not the
    discarded ones, whose rows were dropped): read from the streams' scopes on disk (dedupe.py)."""
    parts = [cols for _, cols in StreamScopes.open(service.data_dir).items()]
    return unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
