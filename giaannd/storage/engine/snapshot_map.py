"""A snapshot file mapped into memory, read-only, for a load whose row arrays are views of it.

Theory of operation
-------------------
Reading a snapshot into fresh arrays costs most of a load in the kernel mapping fresh anonymous
pages (~3.3 µs per 4 KiB on the development VM: docs/storage.md "Where a snapshot load goes").
Mapping the file instead (``mmap``, ``MAP_SHARED``, ``PROT_READ``: a snapshot is never written
after its rename) maps the page cache's pages into the process, 16 at a fault (the kernel's fault-
around), with no copy: ``view`` hands out numpy arrays over the file's bytes, which
``snapshot.read_snapshot`` makes the engine's base run (its entry keys and row offsets). They are
read-only: an in-place write raises rather than dirtying the page cache; the strengths, which
applies add to in place, are copied at load (4 of an entry's 21 bytes).

Lifetime. The mapping lives as long as one view of it does (numpy arrays keep the ``mmap`` object
alive; the last one to go unmaps it): until the engine's first fold, drop or regrowth replaces the
base's arrays (each builds new ones), and every row view and frozen engine taken before lets go.
This object keeps only a weak reference after the load (``loaded``), so it never extends that.

Disk. While mapped, a deleted (or replaced) snapshot file keeps its blocks: the next snapshot's
``finish_snapshot`` unlinks the old file, whose space comes back only at the unmapping.
``held_bytes`` says how much disk that is (a directory walk no longer sees the file), for the
node's disk accounting (``disk_usage.disk_usage``'s ``held_bytes``).

Memory. The mapped pages are page cache (``RssFile`` in /proc, not ``RssAnon``): clean pages the
kernel may drop under memory pressure and read back from disk at the next touch (a major fault,
milliseconds on a disk); ``ColumnStore.used_bytes`` counts entries, not pages, and is unchanged.
"""

from __future__ import annotations

import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["SnapshotMapping"]


class SnapshotMapping:
    """One snapshot file mapped read-only (module docstring). Build it with :meth:`open`."""

    def __init__(self, path: Path, mm: mmap.mmap, size: int, dev: int, ino: int) -> None:
        self.path, self.size, self._dev, self._ino = path, size, dev, ino
        self._mm: mmap.mmap | None = mm  # strong until ``loaded``
        self._ref = weakref.ref(mm)

    @classmethod
    def open(cls, path: Path) -> SnapshotMapping:
        """Map the whole file at ``path`` (at least one byte long).

        Raises:
            OSError, ValueError: the file cannot be opened or mapped (empty: ``ValueError``).
        """
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # Not read ahead here: one MADV_WILLNEED over the whole mapping reads only the device's
        # readahead size of it (a few MiB; the kernel cuts the request). The store's open reads the
        # file ahead of the load in steps instead (read_ahead.py).
        return cls(path, mm, st.st_size, st.st_dev, st.st_ino)

    def view(self, dtype: Any, count: int, offset: int) -> NDArray[Any]:
        """``count`` values of ``dtype`` at byte ``offset`` of the file, as a read-only array over
        the mapping (no copy); only before ``loaded``. The caller checked the range."""
        assert self._mm is not None, "view of a snapshot mapping after its load"
        return np.frombuffer(self._mm, dtype, count, offset)

    def loaded(self) -> None:
        """The load is over: drop this object's own reference, so the views alone keep the mapping."""
        self._mm = None

    @property
    def live(self) -> bool:
        """Whether the file is still mapped (some view of it is alive)."""
        return self._ref() is not None

    def held_bytes(self) -> int:
        """Disk bytes the mapping holds that no directory entry shows: the file's size while it is
        mapped and its path no longer names it (deleted or replaced), else 0."""
        if not self.live:
            return 0
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self.size
        return 0 if (st.st_dev, st.st_ino) == (self._dev, self._ino) else self.size
