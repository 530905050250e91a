"""A pool of pre-touched receive buffers.

Why: writing into memory that was never touched runs at half memcpy speed (page faults, see
transport-baseline.md §1), and UCX registers a buffer once per address (its registration cache), so
a receive buffer should be allocated once, touched once, and reused. Buffers are grouped in
power-of-two size classes; a lease returns its buffer to the free list when released. The pool keeps
at most ``max_idle_bytes`` of idle buffers; requests above ``max_pooled_buffer_bytes`` get a one-off
(still touched) buffer that is dropped on release.

Not thread-safe: one pool per event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from peers import madvise

__all__ = ["BufferPool", "Lease", "DEFAULT_MAX_IDLE_BYTES", "DEFAULT_MAX_POOLED_BUFFER_BYTES"]

#: Idle pooled memory kept per pool (per node, in the daemon).
DEFAULT_MAX_IDLE_BYTES: Final = 1 * 2**30
#: Larger receive buffers are not pooled (a rare snapshot chunk should not pin memory forever).
DEFAULT_MAX_POOLED_BUFFER_BYTES: Final = 512 * 2**20
_MIN_CLASS_BYTES: Final = 4096
#: New buffers from this size are mapped by the kernel (``MADV_POPULATE_WRITE``) rather than
#: written: no user-space pass over pages the kernel has just zeroed (new 8 MiB-class leases, six
#: alternated pairs: lower in five, e.g. 0.30 -> 0.16 CPU ms/MB; docs/topology.md "Which end
#: bounds a join"); smaller ones come from the allocator's heap, mostly mapped already.
_POPULATE_FROM_BYTES: Final = 1 << 20


def _touch(backing: np.ndarray) -> None:
    """Map every page of a new buffer: asked of the kernel for large ones (the partial pages at
    the ends, if any, are written), written where it refuses (older kernels) or for small ones."""
    n = backing.nbytes
    if n >= _POPULATE_FROM_BYTES and madvise.populate(backing, 0, n):
        backing[:madvise.PAGE].fill(0)
        backing[n - madvise.PAGE:].fill(0)
        return
    backing.fill(0)


@dataclass(eq=False, slots=True)
class Lease:
    """A borrowed buffer: ``view`` is exactly the requested size."""

    view: memoryview
    _backing: np.ndarray
    _pool: BufferPool | None

    def release(self) -> None:
        """Give the buffer back (idempotent). The caller must not use ``view`` afterwards."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.leased -= 1
        backing = self._backing
        size = backing.nbytes
        if size > pool.max_pooled_buffer_bytes or size < _MIN_CLASS_BYTES or size & (size - 1):
            return  # a one-off buffer (not a power-of-two class)
        if pool.idle_bytes + size > pool.max_idle_bytes:
            return
        pool._free.setdefault(size, []).append(backing)
        pool.idle_bytes += size

    @property
    def capacity(self) -> int:
        """Bytes of the buffer behind ``view`` (its size class): a lease may be reused for any
        size up to this (``whole``)."""
        return self._backing.nbytes

    def whole(self) -> memoryview:
        """A byte view of the whole buffer (``capacity`` bytes), to slice for a reuse."""
        return memoryview(self._backing)  # type: ignore[arg-type]

    def forget(self) -> None:
        """Stop accounting for the buffer without reusing it: a UCX transfer that cannot be
        cancelled (a posted receive, or a posted send whose connection died) may still write or
        read it, so it must never be lent again — nor freed: the pool keeps it (idempotent)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.leased -= 1
            pool.quarantined += 1
            # freed, its pages would go back to the system: a peer's late rendezvous read of a
            # posted send then fails (UCX aborts that process), or reads whatever is mapped there
            pool._quarantine.append(self._backing)


class BufferPool:
    """Size-classed free lists of pre-touched ``uint8`` arrays."""

    def __init__(
        self,
        *,
        max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES,
        max_pooled_buffer_bytes: int = DEFAULT_MAX_POOLED_BUFFER_BYTES,
    ) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.max_pooled_buffer_bytes = max_pooled_buffer_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self.idle_bytes = 0
        self.leased = 0  # outstanding leases (a leak check in tests)
        self.allocations = 0  # fresh allocations (the pool's miss count)
        self.quarantined = 0  # leases forgotten because a transfer with them could not be cancelled
        self._quarantine: list[np.ndarray] = []  # their buffers, kept for good (``Lease.forget``)

    def lease(self, nbytes: int) -> Lease:
        """Borrow a buffer of at least ``nbytes`` (the caller checked the limits already)."""
        size = _MIN_CLASS_BYTES if nbytes <= _MIN_CLASS_BYTES else 1 << (nbytes - 1).bit_length()
        free = self._free.get(size)
        if free:
            backing = free.pop()
            self.idle_bytes -= size
        else:
            backing = np.empty(size if size <= self.max_pooled_buffer_bytes else nbytes, np.uint8)
            _touch(backing)  # every page mapped now, not on the hot receive path
            self.allocations += 1
        self.leased += 1
        # memoryview(ndarray): 0.14 µs here, numpy's backing.data 0.34 µs
        return Lease(memoryview(backing)[:nbytes], backing, self)  # type: ignore[arg-type]

    def clear(self) -> None:
        """Drop every idle buffer."""
        self._free.clear()
        self.idle_bytes = 0
