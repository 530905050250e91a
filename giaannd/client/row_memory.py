"""The memory of large rows read by parts, kept when the caller drops a row and used again.

Why: a large row is received into memory the reader allocates for it, and the kernel's first
touch of fresh memory (map and zero every page; on a virtual machine the host may have to back
the page too) cost 0.5 to 5 times the socket copy of the same bytes on this host, with a spread
that made a large read's rate a matter of luck (docs/storage.md, "Big rows"). A reader that reads
large rows again and again (a hot row, a scan of big rows) can receive each into the pages of one
it dropped: those are mapped already.

How: the four entry arrays of a row of n entries are views of one byte array of ``21 n`` bytes
(target columns, target features, strengths, segments: each field aligned). The views reach that
memory through one ctypes array (``holder``), so the views and anything made from them keep the
holder alive, and when the last goes the holder's finalizer hands the byte array back here. Idle
arrays are kept up to ``max_idle_bytes`` (the most recently dropped first; older ones are let go
to the allocator), and a row takes the smallest idle array that holds it and is at most twice its
size (a small row does not pin a large array). ``max_idle_bytes`` 0 keeps nothing: every row gets
fresh memory.

Contents are never trusted: a read writes every byte of a row it returns (row_parts.py).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Final, cast

import numpy as np
from numpy.typing import NDArray

__all__ = ["DEFAULT_KEEP_ROW_BYTES", "RowMemory"]

#: Idle bytes a client keeps for large rows by default: rows up to about 12.7 million entries.
DEFAULT_KEEP_ROW_BYTES: Final = 256 << 20
#: Bytes of one entry over the four arrays (u8 + u64 + u64 + f32).
_ENTRY_BYTES: Final = 21


class RowMemory:
    """Entry arrays for large rows, recycled (module docstring). Thread-safe: a finalizer runs
    on whichever thread drops a row's last reference."""

    def __init__(self, max_idle_bytes: int = DEFAULT_KEEP_ROW_BYTES) -> None:
        self.max_idle_bytes = max(0, max_idle_bytes)
        self._idle: list[NDArray[np.uint8]] = []  # oldest first
        self._lock = threading.Lock()
        self.idle_bytes = 0
        self.reused = 0  # rows given idle memory
        self.fresh = 0  # rows given fresh memory

    def fields(self, n: int) -> tuple[list[NDArray[Any]], bool]:
        """The four entry arrays (segment u8, target_column u64, target_feature u64, strength f32)
        of a row of ``n`` entries, uninitialised, and whether their memory is fresh (never touched)."""
        need = _ENTRY_BYTES * n
        backing = self._take(need)
        fresh = backing is None
        if backing is None:
            backing = np.empty(need, np.uint8)
        holder = (ctypes.c_char * need).from_buffer(cast(Any, backing))  # numpy arrays are buffers
        if self.max_idle_bytes:
            weakref.finalize(holder, self._give_back, backing).atexit = False
        flat = np.frombuffer(cast(Any, holder), np.uint8)  # its base: the holder
        tc = flat[: 8 * n].view(np.uint64)
        tf = flat[8 * n : 16 * n].view(np.uint64)
        st = flat[16 * n : 20 * n].view(np.float32)
        seg = flat[20 * n :]
        with self._lock:
            if fresh:
                self.fresh += 1
            else:
                self.reused += 1
        return [seg, tc, tf, st], fresh

    def _take(self, need: int) -> NDArray[np.uint8] | None:
        with self._lock:
            best = -1
            for i, b in enumerate(self._idle):
                if need <= b.nbytes <= 2 * need and (best < 0 or b.nbytes < self._idle[best].nbytes):
                    best = i
            if best < 0:
                return None
            backing = self._idle.pop(best)
            self.idle_bytes -= backing.nbytes
            return backing

    def _give_back(self, backing: NDArray[np.uint8]) -> None:
        if backing.nbytes > self.max_idle_bytes:
            return
        with self._lock:
            self._idle.append(backing)
            self.idle_bytes += backing.nbytes
            while self.idle_bytes > self.max_idle_bytes:
                self.idle_bytes -= self._idle.pop(0).nbytes

    def clear(self) -> None:
        """Let every idle array go."""
        with self._lock:
            self._idle.clear()
            self.idle_bytes = 0
