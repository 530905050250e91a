"""A stream source's page buffers, reused from page to page.

Each chunk a source reads is a copy of its rows (``ColumnStore.read_rows``) into new arrays; at 4
MiB a page the two u64 fields are over the storage node's mmap threshold
(``storage.malloc-mmap-threshold-bytes``), so every page was a fresh mapping whose pages the copy
faulted in, one by one (0.35-0.45 ms/MB on this VM, docs/topology.md "Fourth pass"), and gave back
when it was freed. ``PagePool`` lends the gather a set of four field buffers (``take``, the
``rowengine.run.Alloc`` the read is given) and takes them back once the receiver has acknowledged
the page (``give_back``): the receiver then holds every byte of it, so the transport is done with
the buffers. A page the receiver never acknowledged (a lost connection, a refusal: it is sent again
from the same buffers) is not given back, and one the stream cut into parts (a row larger than a
chunk) is never given back either: the pool keeps no strong reference to a lent set, so such
buffers are freed with the page, as before.

At most ``keep`` sets are kept idle (a stream has its window plus the chunk it reads ahead at most
in use at once), each of ``entries`` entries: a page larger than that gets fresh arrays. Not
thread-safe: one pool per stream, used on its event loop.
"""

from __future__ import annotations

import weakref
from typing import Final

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.rowengine.run import Fields, new_fields

__all__ = ["PagePool"]

_DTYPES: Final = (np.dtype(np.uint8), np.dtype(np.uint64), np.dtype(np.uint64), np.dtype(np.float32))


class PagePool:
    """Field buffers of ``entries`` entries each, lent to a stream's page reads (module docstring)."""

    def __init__(self, entries: int, keep: int) -> None:
        self.entries, self.keep = max(1, entries), max(0, keep)
        self._idle: list[Fields] = []
        #: the segment buffer of every set lent and not given back, by its id (weak: a set never
        #: given back goes with its page)
        self._lent: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self.allocations = 0  # sets made (the pool's misses)
        self.reused = 0  # pages read into a set given back before

    @property
    def idle_sets(self) -> int:
        """Sets given back and not lent again."""
        return len(self._idle)

    @property
    def lent_sets(self) -> int:
        """Sets lent whose pages are still alive and were not given back."""
        return len(self._lent)

    def take(self, total: int) -> Fields:
        """Four fields of ``total`` entries: views of an idle set, or of a new one; fresh arrays
        (not lent) when ``total`` is over the pool's size."""
        if total > self.entries:
            return new_fields(total)
        if self._idle:
            bufs = self._idle.pop()
            self.reused += 1
        else:
            bufs = new_fields(self.entries)
            self.allocations += 1
        self._lent[id(bufs[0])] = bufs[0]
        return (bufs[0][:total], bufs[1][:total], bufs[2][:total], bufs[3][:total])

    def give_back(self, page: RowBatch) -> bool:
        """``page`` (read with ``take``) is acknowledged: its buffers may be lent again. False, and
        nothing kept, when its fields are not one set this pool lent (fresh arrays, a delta)."""
        fields = (page.segment, page.target_column, page.target_feature, page.strength)
        bufs = tuple(f.base for f in fields)
        seg = bufs[0]
        if not isinstance(seg, np.ndarray) or self._lent.get(id(seg)) is not seg:
            return False
        if not all(isinstance(b, np.ndarray) and b.shape == (self.entries,) and b.dtype == d
                   for b, d in zip(bufs, _DTYPES)):
            return False
        del self._lent[id(seg)]
        if len(self._idle) < self.keep:
            self._idle.append(bufs)  # type: ignore[arg-type]
        return True
