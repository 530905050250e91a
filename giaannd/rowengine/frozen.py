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
from typing import Any

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.cow import PendingCopies
from giaannd.rowengine.jit import kernel, readonly
from giaannd.rowengine.run import ENTRIES_IN as _IN
from giaannd.rowengine.run import ENTRIES_OUT as _OUT
from giaannd.rowengine.run import SLICE_FROM, Run

__all__ = ["FrozenEngine"]

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
#: The entry fields, in the order the merge kernel takes and returns them.
_FIELD_INDEX = {"seg": 0, "tc": 1, "tf": 2, "st": 3}


def _window_buffers(bases: Sequence[NDArray[Any]], size: int) -> list[NDArray[Any]]:
    """Buffers for ``size`` delta entries gathered from windows: base position, row id and the
    four fields (``_gather_window``'s ``o*``)."""
    return [np.empty(size, np.int64), np.empty(size, np.int64)] + [np.empty(size, f.dtype) for f in bases]


@kernel(f"int64({readonly('int64')}, {readonly('int64')}, {readonly('int64')}, {_IN}, int64, int64, int64, "
        f"int64[::1], int64[::1], {_OUT})")
def _gather_window(offsets: I64, rows: I64, pos: I64, seg: NDArray[np.uint8], tc: U64, tf: U64,
                   st: NDArray[np.float32], lo: int, hi: int, o: int, opos: I64, orow: I64,
                   oseg: NDArray[np.uint8], otc: U64, otf: U64, ost: NDArray[np.float32]) -> int:
    """Entries ``[lo, hi)`` of a delta run (its ``offsets``, ``rows`` and fields) copied to
    ``o*[o:]``, each with its row id (``orow``: the merge orders entries of several runs that share a
    base position by row, then key); returns ``o`` past them. One pass: the row found once by a
    binary search, then followed entry by entry."""
    a, b = 0, rows.shape[0]
    while a < b:  # the row holding entry lo: the last offsets[r] <= lo
        m = (a + b) // 2
        if offsets[m + 1] <= lo:
            a = m + 1
        else:
            b = m
    r = a
    for x in range(lo, hi):
        while offsets[r + 1] <= x:
            r += 1
        opos[o] = pos[x]
        orow[o] = rows[r]
        oseg[o] = seg[x]
        otc[o] = tc[x]
        otf[o] = tf[x]
        ost[o] = st[x]
        o += 1
    return o


@kernel(f"void({_IN}, int64, {readonly('int64')}, {readonly('int64')}, {_IN}, {readonly('int64')}, {_OUT})")
def _merge_windows(bseg: NDArray[np.uint8], btc: U64, btf: U64, bst: NDArray[np.float32], lo: int, dpos: I64,
                   drow: I64, dseg: NDArray[np.uint8], dtc: U64, dtf: U64, dst: NDArray[np.float32], edges: I64,
                   oseg: NDArray[np.uint8], otc: U64, otf: U64, ost: NDArray[np.float32]) -> None:
    """``o*``: the base slice (base entries ``lo``, ``lo + 1``, ...) with the entries of k delta
    runs' windows inserted (window r: ``[edges[r], edges[r+1])`` of the ``d*`` arrays, in its
    run's order), in one pass. A delta entry lands before base entry ``dpos`` (run.fold_into_base's
    rule); entries of several runs are taken smallest (base position, row id, segment, target
    column, target feature) first: the global order, since the runs' keys are disjoint (what
    run.merge_deltas gives, pair by pair)."""
    k = edges.shape[0] - 1
    at = edges[:-1].copy()
    n = bseg.shape[0]
    i = 0
    o = 0
    while True:
        best = -1
        for r in range(k):
            x = at[r]
            if x < edges[r + 1]:
                if best < 0:
                    best = r
                else:
                    y = at[best]
                    if dpos[x] != dpos[y]:
                        smaller = dpos[x] < dpos[y]
                    elif drow[x] != drow[y]:
                        smaller = drow[x] < drow[y]
                    elif dseg[x] != dseg[y]:
                        smaller = dseg[x] < dseg[y]
                    elif dtc[x] != dtc[y]:
                        smaller = dtc[x] < dtc[y]
                    else:
                        smaller = dtf[x] < dtf[y]
                    if smaller:
                        best = r
        p = n if best < 0 else dpos[at[best]] - lo
        if p < i or p > n:
            raise ValueError("delta positions must be non-decreasing, inside the base slice")
        d = p - i
        if d >= SLICE_FROM:  # (run._merge's rule, measured there)
            oseg[o : o + d] = bseg[i:p]
            otc[o : o + d] = btc[i:p]
            otf[o : o + d] = btf[i:p]
            ost[o : o + d] = bst[i:p]
            o += d
            i = p
        else:
            while i < p:
                oseg[o] = bseg[i]
                otc[o] = btc[i]
                otf[o] = btf[i]
                ost[o] = bst[i]
                o += 1
                i += 1
        if best < 0:
            return
        x = at[best]
        oseg[o] = dseg[x]
        otc[o] = dtc[x]
        otf[o] = dtf[x]
        ost[o] = dst[x]
        o += 1
        at[best] = x + 1


@dataclass(slots=True, eq=False)
class FrozenEngine:
    """An engine's rows at one moment (module docstring): row i is key ``(a[i], b[i])`` with
    ``lengths[i]`` entries; ``base`` and ``deltas`` the runs (their strengths are copies)."""

    a: U64
    b: U64
    lengths: I64
    base: Run
    deltas: list[Run]
    #: the strengths' and lengths' copies a lazy freeze left to the reader (``materialize``)
    pending: PendingCopies | None = None

    def materialize(self) -> None:
        """Make the copies a lazy ``RowEngine.freeze`` left pending (cow.py), in this thread, while
        the engine goes on; a no-op once done, or for an eager freeze. Before any read."""
        if self.pending is not None:
            self.pending.finish()
            self.pending = None

    def cancel(self) -> None:
        """Never read: the pending copies are dropped (the engine's writes stop copying for them)."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None

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
        entries (at least 1): one tuple per piece, a field each. Each piece is one compiled pass
        (``_merge_windows``) over its base slice and the delta runs' entries whose base positions
        fall in it, all four fields at once: pairwise merges of the runs' windows first (numpy
        searches and a new run per pair, then one merge per field) cost a snapshot about twice
        as much (docs/storage.md "Direct snapshot writes").

        A piece is valid until the next one is asked for: merged pieces are written into buffers
        kept from piece to piece (one per field), so a snapshot's gigabytes of pieces do not each
        take fresh memory (a storage node maps every block of 1 MiB or more afresh,
        ``storage.malloc-mmap-threshold-bytes``, and each first touch of a page is a fault)."""
        order = [_FIELD_INDEX[name] for name in names]
        bases: list[NDArray[Any]] = [self.base.seg, self.base.tc, self.base.tf, self.base.st]
        n = self.base.num_entries
        step = max(1, chunk)
        if not self.deltas:
            for lo in range(0, n, step):
                yield tuple(bases[k][lo : lo + step] for k in order)
            return
        kept: list[NDArray[Any]] = [np.empty(0, f.dtype) for f in bases]
        picked = _window_buffers(bases, 0)
        spans: list[tuple[Run, int, int]] = []
        bounds = [*range(0, n, step), n]
        starts = [0] * len(self.deltas)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:] or [n])):
            last = i == len(bounds) - 2 or not bounds[1:]
            edges = [0]
            for k, delta in enumerate(self.deltas):
                assert delta.pos is not None
                j = starts[k]
                starts[k] = delta.pos.shape[0] if last else int(np.searchsorted(delta.pos, hi, "left"))
                if starts[k] > j:
                    edges.append(edges[-1] + starts[k] - j)
                    spans.append((delta, j, starts[k]))
            if not spans:
                yield tuple(bases[k][lo:hi] for k in order)
                continue
            if picked[0].shape[0] < edges[-1]:  # the windows' entries, back to back (buffers kept)
                picked = _window_buffers(bases, max(edges[-1], 2 * picked[0].shape[0]))
            o = 0
            for d, j, end in spans:
                assert d.pos is not None
                o = _gather_window(d.offsets, d.rows, d.pos, d.seg, d.tc, d.tf, d.st, j, end, o, *picked)
            spans.clear()
            size = hi - lo + edges[-1]
            for k, f in enumerate(bases):
                if kept[k].shape[0] < size:
                    kept[k] = np.empty(max(size, 2 * kept[k].shape[0]), f.dtype)
            out: list[NDArray[Any]] = [kept[k][:size] for k in range(4)]
            c = np.ascontiguousarray
            w_pos, w_row, w_seg, w_tc, w_tf, w_st = picked
            _merge_windows(c(bases[0][lo:hi]), c(bases[1][lo:hi]), c(bases[2][lo:hi]), c(bases[3][lo:hi]), lo,
                           w_pos, w_row, w_seg, w_tc, w_tf, w_st, np.array(edges, np.int64), *out)
            yield tuple(out[k] for k in order)
