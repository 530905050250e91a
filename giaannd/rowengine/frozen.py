"""A frozen engine: the rows at one moment, read by another thread while the owner keeps applying.

Theory of operation
-------------------
What the engine changes in place is small: strengths (an add into the base or a delta run) and
the row lengths. Everything else is *replaced* while a frozen engine holds it: a delta merge and a
fold write a run's own buffers only when nothing else references them, and the references this
object keeps are such references (run.py "Merges in place"), so they merge into new arrays while
it lives; a drop builds a new base and key index, the key index's arrays only grow past the
keys they hold (new keys go beyond ``len``, a growth copies). So ``RowEngine.freeze`` keeps
references to every run's key arrays and row index and to the keys, and copies the strengths and
lengths: one memcpy of 4 bytes per entry (and 8 per row) on the applying thread, nothing per row.
Drop it when done: while it lives, the engine defers its folds into the base (engine.py
``HELD_FOLD_LIMIT``: a fold would copy the whole base, old and new both resident until the view
goes) and merges no newer delta run into one the view holds (run.held).

The frozen rows are read in the engine's global order (row id, then entry key) as one field at a
time (``field_chunks``: a snapshot writes each field as one section): base entries in slices of
about ``chunk`` entries, each merged with the delta entries whose base positions fall in it
(run.fold_into_base's rule: delta entry j lands before base entry ``pos[j]``), so the memory on
top is a chunk, not a second copy of the store. The delta runs are merged a chunk at a time too
(each run's entries whose base positions fall in the chunk, run.window): merging them into one run
first would hold a copy of them all while the snapshot is written (up to HELD_FOLD_LIMIT/base_ratio
of the entries, engine.py). Reading never changes the live engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.run import Run, merge_deltas, merge_field, window

__all__ = ["FrozenEngine"]

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]


@dataclass(slots=True, eq=False)
class FrozenEngine:
    """An engine's rows at one moment (module docstring): row i is key ``(a[i], b[i])`` with
    ``lengths[i]`` entries; ``base`` and ``deltas`` the runs (their strengths are copies)."""

    a: U64
    b: U64
    lengths: I64
    base: Run
    deltas: list[Run]

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_entries(self) -> int:
        return self.base.num_entries + sum(d.num_entries for d in self.deltas)

    def offsets(self) -> I64:
        """Entry offsets of the rows in id order (row i is ``[offsets[i], offsets[i+1])``)."""
        out = np.zeros(self.lengths.shape[0] + 1, np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def field_chunks(self, name: str, chunk: int) -> Iterator[NDArray[np.generic]]:
        """Field ``name`` (``seg``, ``tc``, ``tf`` or ``st``) of every entry in the global order, in
        pieces of about ``chunk`` entries (at least 1; module docstring)."""
        for (piece,) in self.entry_chunks((name,), chunk):
            yield piece

    def entry_chunks(self, names: Sequence[str], chunk: int) -> Iterator[tuple[NDArray[np.generic], ...]]:
        """The fields ``names`` of every entry in the global order, in pieces of about ``chunk``
        entries (at least 1): one tuple per piece, a field each. The delta runs' entries that fall
        in a piece are merged once for all the fields asked: with several delta runs that merge
        costs more than the bytes (a snapshot writing its sections field by field would merge the
        same entries once per field).

        A piece is valid until the next one is asked for: merged pieces are written into buffers
        kept from piece to piece (one per field), so a snapshot's gigabytes of pieces do not each
        take fresh memory (a storage node maps every block of 1 MiB or more afresh,
        ``storage.malloc-mmap-threshold-bytes``, and each first touch of a page is a fault)."""
        bases = [getattr(self.base, name) for name in names]
        kept: list[NDArray[np.generic]] = [np.empty(0, f.dtype) for f in bases]
        n = self.base.num_entries
        step = max(1, chunk)
        if not self.deltas:
            for lo in range(0, n, step):
                yield tuple(f[lo : lo + step] for f in bases)
            return
        bounds = [*range(0, n, step), n]
        starts = [0] * len(self.deltas)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:] or [n])):
            last = i == len(bounds) - 2 or not bounds[1:]
            merged: Run | None = None
            for k, delta in enumerate(self.deltas):
                assert delta.pos is not None
                j = starts[k]
                starts[k] = delta.pos.shape[0] if last else int(np.searchsorted(delta.pos, hi, "left"))
                if starts[k] > j:
                    piece = window(delta, j, starts[k])
                    merged = piece if merged is None else merge_deltas(merged, piece)
            if merged is None:
                yield tuple(f[lo:hi] for f in bases)
            else:
                assert merged.pos is not None
                at = merged.pos - lo
                size = hi - lo + merged.num_entries
                for k, f in enumerate(bases):
                    if kept[k].shape[0] < size:
                        kept[k] = np.empty(max(size, 2 * kept[k].shape[0]), f.dtype)
                yield tuple(merge_field(f[lo:hi], getattr(merged, name), at, kept[k][:size])
                            for k, (f, name) in enumerate(zip(bases, names)))
