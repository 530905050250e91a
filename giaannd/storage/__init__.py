"""Storage role: the in-RAM column store, its update log and snapshots (ARCHITECTURE §8).

Layers, bottom up: ``row_merge`` (pure merge-add planning), ``applied_set`` (idempotency),
``column_store`` (rows in RAM, memory accounting), ``update_log`` and ``snapshot`` (on-disk formats),
``recovery`` (``DurableStore``: the three together, restart = snapshot + log replay). All synchronous;
the asyncio service sits on ``DurableStore``. On-disk formats: docs/storage.md.
"""

from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ColumnStore, DropResult, RowDigest, StoreUsage
from giaannd.storage.engine.errors import CorruptLogError, CorruptSnapshotError, StoreFullError
from giaannd.storage.engine.recovery import ApplyResult, DurableStore, RecoveryReport

__all__ = [
    "AppliedSet",
    "ApplyResult",
    "ColumnStore",
    "CorruptLogError",
    "CorruptSnapshotError",
    "DropResult",
    "DurableStore",
    "RecoveryReport",
    "RowDigest",
    "StoreFullError",
    "StoreUsage",
]
