"""Copies of arrays taken at one moment, made a chunk at a time while their owner goes on writing.

Why: a snapshot reads the store as it was when it began (a frozen view: frozen.py), in another
thread, while applies go on. The keys of the frozen runs are never written in place (a merge
replaces arrays), but the strengths, the rows' lengths and the touch counts are: the freeze used
to copy them whole while writes waited, O(store) (40-60 ms at 8.6·10^7 entries here; seconds at
the mission's 10^10 entries a node). Now the freeze only *names* the copies (``PendingCopies``):
the reader makes them, chunk by chunk (``finish``, in the snapshot's thread, before it reads
anything), and a writer about to change a chunk that is not copied yet copies that chunk first
(``before_write``, on the writer's thread). Each chunk is copied once, by whichever comes first,
under one lock, so the copy is the arrays as they were at the freeze, bit for bit, and writes wait
at most for the chunks they touch (``CHUNK`` entries each), never for the whole store.

Contract with the owner: every in-place write of a source's memory while a copy of it is pending
is announced first with the array the write goes through (the source, or another view starting
at the same address: they are told apart by address, not by object) and the positions it writes
(``before_write``); writes past the copied length need no announcement; a source array that is
*replaced* (a merge into new buffers, a regrowth) needs none either, as the pending copy keeps
the old one (and, holding it, keeps merges from writing it in place: run.py). The row engine and
the column store are the only owners (engine.py ``freeze``, storage column_store.py ``freeze``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd.unique import unique

__all__ = ["CHUNK", "PendingCopies", "PendingSet"]

#: Entries per chunk. A write copies every chunk it touches that is not copied yet, so what a batch
#: of adds spread over the store can wait for is (chunks it touches) × this, whatever the store's
#: size: 4 Ki entries (16 KiB of strengths) keep a batch of 1,500 rows at ~25 MB, ~2-5 ms here,
#: where 64 Ki made the first batch after a freeze copy most of the store, as the freeze did.
CHUNK: Final = 1 << 12
_SHIFT: Final = CHUNK.bit_length() - 1
#: Chunks the reader copies per hold of the lock: a writer waits at most for one hold (1 MiB of
#: strengths, ~0.1 ms), and the reader takes the lock once per this many chunks, not per chunk.
READER_CHUNKS: Final = 64


class PendingCopies:
    """``dst[i][:] = src[i][:n[i]]`` for each pair, as of construction, made lazily (module
    docstring). ``pairs``: (source array, entries to copy, destination of that length)."""

    def __init__(self, pairs: Sequence[tuple[NDArray[Any], int, NDArray[Any]]]) -> None:
        self._lock = threading.Lock()
        self._src = [s for s, _, _ in pairs]
        self._dst = [d for _, _, d in pairs]
        self._n = [int(n) for _, n, _ in pairs]
        for s, n, d in pairs:
            if d.shape[0] != n or s.shape[0] < n or d.dtype != s.dtype:
                raise ValueError("a pending copy's destination must be the source's first n entries' size and type")
        # by the memory a source starts at, not its array object: a write may come through another
        # view of the same memory (an append into a run's spare room replaces its field with a
        # longer view of the same buffer), which the address names as well
        self._index = {_address(s): i for i, (s, n, _) in enumerate(pairs) if n > 0}
        self._copied = [np.zeros(-(-n // CHUNK), bool) for n in self._n]
        self._left = sum(c.shape[0] for c in self._copied)
        #: chunks copied by writers (``before_write``) rather than by the reader
        self.copied_by_writers = 0

    @property
    def done(self) -> bool:
        """Every chunk copied (or ``cancel``\\ led): writes need not announce themselves any more."""
        return self._left == 0

    def _copy(self, i: int, first: int, stop: int) -> None:
        """Copy chunks ``[first, stop)`` of pair ``i`` (none of them copied yet), under the lock."""
        lo = first << _SHIFT
        hi = min(stop << _SHIFT, self._n[i])
        self._dst[i][lo:hi] = self._src[i][lo:hi]
        self._copied[i][first:stop] = True
        self._left -= stop - first
        if self._left == 0:
            self._let_go()

    def before_write(self, array: NDArray[Any], positions: NDArray[np.integer[Any]]) -> None:
        """``array`` (the array the write goes through: a source, or any view of the memory a
        source starts at) is about to be written at ``positions``: copy the chunks among them not
        copied yet. Other arrays: nothing."""
        if self._left == 0 or positions.shape[0] == 0:
            return
        i = self._index.get(_address(array))
        if i is None:
            return
        copied = self._copied[i]
        chunks = np.asarray(positions, np.int64) >> _SHIFT
        chunks = chunks[chunks < copied.shape[0]]
        chunks = chunks[~copied[chunks]]  # (a first look without the lock: copied chunks stay copied)
        if chunks.shape[0] == 0:
            return
        with self._lock:
            if self._left == 0:  # (finished or cancelled meanwhile)
                return
            for chunk in unique(chunks).tolist():
                if not copied[chunk]:
                    self._copy(i, chunk, chunk + 1)
                    self.copied_by_writers += 1

    def finish(self) -> None:
        """Copy every chunk not copied yet (the reader's thread; writes may go on meanwhile), up
        to ``READER_CHUNKS`` per hold of the lock, runs of chunks not copied in one copy each."""
        for i, copied in enumerate(self._copied):
            for g in range(0, copied.shape[0], READER_CHUNKS):
                if copied[g : g + READER_CHUNKS].all():
                    continue
                with self._lock:
                    if self._left == 0:  # (cancelled meanwhile)
                        return
                    todo = np.flatnonzero(~copied[g : g + READER_CHUNKS]) + g
                    if todo.shape[0] == 0:  # (a writer copied the rest since the look above)
                        continue
                    # runs of consecutive chunks: one copy each
                    breaks = np.flatnonzero(np.diff(todo) != 1) + 1
                    for run in np.split(todo, breaks):
                        self._copy(i, int(run[0]), int(run[-1]) + 1)

    def cancel(self) -> None:
        """Never mind the copies (the view was released unread): writes stop announcing themselves,
        the sources are let go."""
        with self._lock:
            self._left = 0
            self._let_go()

    def _let_go(self) -> None:
        """Drop the references to the arrays: the sources (a held array is never merged in place:
        run.py) and the destinations (the reader's; freeing them is its business, not that of
        whichever writer or freeze comes next)."""
        self._src, self._dst, self._index = [], [], {}


class PendingSet:
    """The copies an owner's lazy freezes left pending (one per freeze not yet read): what an owner
    keeps, so that each in-place write is announced to every one of them (``before_write``)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[PendingCopies] = []

    def add(self, pending: PendingCopies) -> None:
        """A lazy freeze's copies (those done meanwhile are forgotten)."""
        self._pending = [p for p in self._pending if not p.done] + [pending]

    def before_write(self, array: NDArray[Any], positions: NDArray[np.integer[Any]]) -> None:
        """``PendingCopies.before_write`` of each; a no-op (one test) while none is pending."""
        if self._pending:
            for pending in self._pending:
                pending.before_write(array, positions)
            if any(p.done for p in self._pending):
                self._pending = [p for p in self._pending if not p.done]

    def finish(self) -> None:
        """Make every pending copy now, in this thread (before a write that cannot announce itself)."""
        for pending in self._pending:
            pending.finish()
        self._pending = []


def _address(array: NDArray[Any]) -> tuple[int, str]:
    """Where an array's first element lies, and its type: two arrays with the same one index the
    same memory alike."""
    return int(array.__array_interface__["data"][0]), array.dtype.str
