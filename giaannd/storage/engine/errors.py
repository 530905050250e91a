"""Errors of the storage role: a full store, and files that fail validation (with file and offset)."""

from __future__ import annotations

from giaannd.errors import CorruptFileError, Refused

__all__ = ["CorruptLogError", "CorruptSnapshotError", "StoreFullError"]


class StoreFullError(Refused):
    """Applying the batch would take the store past its configured capacity; nothing was changed.

    The node reports ``is_full`` in its metadata; writers should route to other replicas or wait for
    capacity to be added. Being refused is better than being killed by the kernel's OOM killer.
    """

    reason = "store_full"

    def __init__(self, needed_bytes: int, used_bytes: int, capacity_bytes: int) -> None:
        self.needed_bytes = needed_bytes
        self.used_bytes = used_bytes
        self.capacity_bytes = capacity_bytes
        super().__init__(
            f"store full: applying needs {needed_bytes} more bytes, {used_bytes} of "
            f"{capacity_bytes} used; write refused, nothing changed"
        )


class _CorruptAt(CorruptFileError):
    """A corrupt file, with the byte offset where validation failed (always known here)."""

    offset: int

    def __init__(self, path: str, offset: int, detail: str) -> None:
        super().__init__(path, detail, offset=offset)


class CorruptLogError(_CorruptAt):
    """An update-log record before the tail fails validation: start-up stops, nothing is dropped."""

    reason = "corrupt_log"


class CorruptSnapshotError(_CorruptAt):
    """A snapshot fails validation: start-up stops rather than silently losing its rows."""

    reason = "corrupt_snapshot"
