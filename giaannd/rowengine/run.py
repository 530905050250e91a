"""Runs: many rows' entries in shared arrays, sorted by (row id, entry key), with a row index.

Theory of operation
-------------------
A :class:`Run` stores entries as a struct of arrays (``seg u8``, ``tc u64``, ``tf u64``, ``st f32``:
the Row format's 21 bytes per entry, giaannd/model/rows.py) in the *global order*
``(row id, segment, target column, target feature)``, with a row index: ``rows`` (sorted ids of
the rows it holds) and ``offsets`` (row ``rows[i]`` is ``[offsets[i], offsets[i+1])``). One row's
part of a run is a contiguous canonical slice: a read is four views, and finding a key of row r
is a search inside r's slice (search.find).

The row engine (engine.py) keeps one *base* run and a few *delta* runs, with disjoint keys. A delta
run has one more array, ``pos``: each entry's lower bound in the base (how many base entries come
before it in the global order), found when the entry arrived. Folding a delta run into the base
therefore needs no search: delta entry j lands at ``pos[j] + j``. Positions stay valid while the
base keeps its entries where they are (in-place adds move nothing); every fold takes all the delta
runs, so no delta outlives the base it points into.

Operations (each vectorised or compiled over every row and entry involved; inputs are not changed,
but for the engine's own merges, which consume one of them, below):

- :func:`merge_deltas`: two key-disjoint delta runs as one (the newer run's entries are located in
  the older one by one compiled walk over both runs' row indexes, galloping by key inside the rows
  both hold, :func:`insertion_points`; a newer run whose rows all come after the older's is a
  concatenation).
- :func:`fold_into_base`: a base and a delta run as the new base; built field by field, so the
  memory on top is at most one field of the new base (8 bytes per entry), not a second base (a
  delta entirely after the base is appended: a concatenation instead of the merge).
- :func:`merge_field`: one field of sorted entries with others inserted at their base positions, in
  one compiled sequential pass (the merges, folds and reads above and frozen.py's chunks use it).
- :func:`merge_into_slice`: one row's base slice with its delta entries (a read).
- :func:`gather_entries`: many rows' slices copied into one result, the four fields together,
  with other entries inserted at their positions, in one compiled pass (``RowEngine.gather``).

Merges in place (the engine's own folds and tier merges, ``grow``). A merge writes the consumed
run's buffers (``_merge_back``: from the end, old entry k moving to k plus the inserted entries
before it, so no write overtakes an unread entry; one compiled pass over every field of the run
when all of them go in place, ``_merged_fields``, no fresh memory) instead of new ones. Why: a
merge into a new buffer pays the first touch of every page of it (0.6-2.7 s per GB on the
development VM, docs/model.md "Rows at scale"), about as much as the copy itself, at every fold of
the whole base. The runs' contract is that a merge *replaces* arrays: a frozen engine
(frozen.py) reads the base's and the delta runs' key arrays in another thread while applies go on,
and a row read as views (``RowEngine.read``, ``pieces``) may still be on its way to a socket. So a
merge goes in place only when nothing else references the field or its buffer (``_merged``): every
numpy view, and every buffer export (``memoryview``), keeps the array it views alive, so any
holder shows in ``sys.getrefcount`` of the field or of its buffer, compared with the counts of a
field nobody else holds, measured at import through the same function (``_ALONE``: an interpreter
that counts differently cannot make a held buffer look free; this relies on CPython's exact
reference counts, as in the project's 3.12 with the GIL). Otherwise, and when the run lacks
room, the merge goes into new buffers, with ``MERGE_SLACK`` room for the next ones (a frozen
engine holds copies of the strengths, frozen.py, so it keeps only the key fields from going in
place). Merges that do not consume their inputs (reads, ``gather``, frozen.py's) never write in
place. Measured on the Zipf stream: docs/model.md "Rows at scale".
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import literal_unroll
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, prefetch, readonly
from giaannd.rowengine.posindex import PosIndex
from giaannd.rowengine.search import find
from giaannd.rowengine.search import find_in_gaps as find_in_gaps_kernel
from peers import madvise

__all__ = ["FIELDS", "POS_INDEX_MIN_GAP", "Alloc", "Buffer", "Run", "append_rows", "empty_buffer", "find_in_gaps",
           "fold_into_base", "gather_entries", "held", "insertion_points", "merge_deltas", "merge_field",
           "merge_into_slice", "new_fields", "offsets_of", "range_positions", "release_pages", "renumbered",
           "repeated", "window", "with_room"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F32 = NDArray[np.float32]
Bools = NDArray[np.bool_]

#: ``find_in_gaps`` makes a run's position index once it has searched the run for one key per this
#: many of its entries (the index costs a pass over them; a key's bisection of its row slice, tens
#: of probes).
POS_INDEX_MIN_GAP = 256
#: The entry fields, in the order every loop over them uses.
FIELDS = ("seg", "tc", "tf", "st")


def _contiguous(a: NDArray[Any], dtype: np.dtype[Any]) -> NDArray[Any]:
    """``a`` itself when it is a C-contiguous array of ``dtype`` (the usual case: no call into
    numpy), else a contiguous copy of that dtype."""
    if type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype)


_I64 = np.dtype(np.int64)


@kernel(f"void({readonly('int64')}, int64[::1])")
def _prefix_sums(lengths: I64, out: I64) -> None:
    total = 0
    out[0] = 0
    for i in range(lengths.shape[0]):
        total += lengths[i]
        out[i + 1] = total


def offsets_of(lengths: I64) -> I64:
    """``[0, l0, l0+l1, ...]``: the offsets of consecutive blocks of the given lengths (one kernel
    call whatever their number: numpy's ``cumsum`` into a zeroed array took 2 µs for a small
    read's few rows, and holds the GIL for the whole pass on large ones)."""
    out = np.empty(lengths.shape[0] + 1, np.int64)
    _prefix_sums(_contiguous(lengths, _I64), out)
    return out


@kernel(f"void({readonly('boolean')}, int64[::1])")
def _renumber(keep: NDArray[np.bool_], out: I64) -> None:
    kept = 0
    for i in range(keep.shape[0]):
        if keep[i]:
            kept += 1
        out[i] = kept - 1


def renumbered(keep: NDArray[np.bool_]) -> I64:
    """Each id's new id once the ids not in ``keep`` (a flag per id) are dropped and the rest
    renumbered densely in order: ``cumsum(keep) - 1`` (a dropped id gets its predecessor's), in a
    kernel that releases the GIL (numpy's ``cumsum`` holds it for the whole pass)."""
    out = np.empty(keep.shape[0], np.int64)
    _renumber(np.ascontiguousarray(keep, np.bool_), out)
    return out


@kernel(f"void({readonly('int64')}, {readonly('int64')}, {readonly('int64')}, int64[::1], int64[::1])")
def _ranges(rows: I64, offsets: I64, ids: I64, lo: I64, hi: I64) -> None:
    """``Run.ranges``: ``[lo[i], hi[i])`` the slice of row ``ids[i]``, empty at its place when the
    run does not hold it; rows indexed directly when they are every id below their count."""
    n = rows.shape[0]
    direct = n > 0 and rows[n - 1] == n - 1
    for i in range(ids.shape[0]):
        r = ids[i]
        if direct:
            j = min(max(r, 0), n)
        else:  # the first row not below r
            a, b = 0, n
            while a < b:
                m = (a + b) >> 1
                if rows[m] < r:
                    a = m + 1
                else:
                    b = m
            j = a
        lo[i] = offsets[j]
        hi[i] = offsets[j + 1] if j < n and rows[j] == r else offsets[j]


@dataclass(slots=True, eq=False)
class Run:
    """Entries of many rows in the global order, with a row index (module docstring).

    ``pos`` is None for the base run; in a delta run, each entry's lower bound in the base.
    """

    rows: I64
    offsets: I64
    seg: U8
    tc: U64
    tf: U64
    st: F32
    pos: I64 | None = None
    #: a delta run's position index, made once enough keys were searched in the run (``find_in_gaps``;
    #: runs never move their entries)
    _pos_index: PosIndex | None = field(default=None, repr=False)
    #: keys ``find_in_gaps`` bisected in this run's row slices while it had no position index
    bisected: int = field(default=0, repr=False)
    #: the entry fields (and ``pos``) are prefixes of buffers with spare room that this run alone
    #: may write past its end (appends: no other run or view sees beyond its own end), and, when
    #: nothing else references them (``_merged``), before it (merges in place, module docstring)
    spare: bool = field(default=False, repr=False)
    #: the same for the row index (``rows``, ``offsets``): set by ``append_rows`` only, which is
    #: called run after run (a replay's), where copying the row index each time would be O(rows²)
    spare_index: bool = field(default=False, repr=False)

    def pos_index(self) -> PosIndex:
        """The bucketed search over ``pos`` (posindex.py); a delta run only."""
        assert self.pos is not None
        if self._pos_index is None:
            self._pos_index = PosIndex(self.pos)
        return self._pos_index

    @property
    def pos_indexed(self) -> bool:
        """Whether ``pos_index`` was made already."""
        return self._pos_index is not None

    @classmethod
    def empty(cls) -> Run:
        return cls(np.empty(0, np.int64), np.zeros(1, np.int64), np.empty(0, np.uint8),
                   np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.float32))

    @classmethod
    def from_sorted(cls, row: I64, seg: U8, tc: U64, tf: U64, st: F32, pos: I64 | None = None) -> Run:
        """A run from entries already in the global order, ``row`` giving each entry's row id."""
        first = np.ones(row.shape[0], bool)
        first[1:] = row[1:] != row[:-1]
        starts = np.flatnonzero(first)
        return cls(row[starts].astype(np.int64, copy=False), np.append(starts, row.shape[0]).astype(np.int64),
                   seg, tc, tf, st, pos)

    @property
    def num_entries(self) -> int:
        return int(self.st.shape[0])

    @property
    def nbytes(self) -> int:
        arrays = (self.rows, self.offsets, self.seg, self.tc, self.tf, self.st, self.pos)
        extra = self._pos_index.nbytes if self._pos_index is not None else 0
        return extra + sum(int(a.nbytes) for a in arrays if a is not None)

    def arrays(self) -> list[NDArray[Any]]:
        """Every array the run holds (its row index, fields and ``pos``): for page advice."""
        return [a for a in (self.rows, self.offsets, self.seg, self.tc, self.tf, self.st, self.pos) if a is not None]

    def counts(self) -> I64:
        """Entries of each row of ``rows``."""
        return np.diff(self.offsets)

    def ranges(self, row_ids: I64) -> tuple[I64, I64]:
        """(lo, hi): the slice of each row (ids >= 0); a row the run does not hold gets the empty
        slice at the place its entries would go (``lo == hi``). A run holding every id below its
        count (a base, mostly) is indexed directly instead of searched (2·10^5 ids in 10^6 rows:
        no binary search per id). One compiled pass (``_ranges``): the numpy passes it replaces
        cost ~4 µs for a small read's few rows."""
        ids = _contiguous(row_ids, _I64)
        lo, hi = np.empty(ids.shape[0], np.int64), np.empty(ids.shape[0], np.int64)
        _ranges(_contiguous(self.rows, _I64), _contiguous(self.offsets, _I64), ids, lo, hi)
        return lo, hi

    def row_slice(self, row_id: int) -> tuple[int, int]:
        """The slice of one row (``(x, x)``, empty, when the run does not hold it)."""
        i = int(np.searchsorted(self.rows, row_id))
        if i < self.rows.shape[0] and int(self.rows[i]) == row_id:
            return int(self.offsets[i]), int(self.offsets[i + 1])
        return int(self.offsets[i]), int(self.offsets[i])


#: Empty arrays of every field's dtype: what a consumed run's fields are set to (references
#: to nothing, so they keep no buffer alive; see ``_merged``).
_NO_ENTRIES: dict[str, NDArray[Any]] = {"seg": np.empty(0, np.uint8), "tc": np.empty(0, np.uint64),
                                        "tf": np.empty(0, np.uint64), "st": np.empty(0, np.float32),
                                        "pos": np.empty(0, np.int64)}


def _run(rows: I64, offsets: I64, fields: dict[str, NDArray[Any]], spare: bool) -> Run:
    """A run of the fields by name (``pos`` for a delta run)."""
    return Run(rows, offsets, fields["seg"], fields["tc"], fields["tf"], fields["st"], fields.get("pos"), spare=spare)


_ROW_INDEX = ", ".join(readonly("int64") for _ in range(4))


@kernel(f"int64({_ROW_INDEX}, int64[::1], int64[::1])")
def _union(a_rows: I64, a_off: I64, b_rows: I64, b_off: I64, rows: I64, counts: I64) -> int:
    """``_union_rows`` into ``rows``/``counts`` (room for both runs' rows); returns how many."""
    i = 0
    j = 0
    o = 0
    na = a_rows.shape[0]
    nb = b_rows.shape[0]
    while i < na or j < nb:
        if j >= nb or (i < na and a_rows[i] < b_rows[j]):
            rows[o] = a_rows[i]
            counts[o] = a_off[i + 1] - a_off[i]
            i += 1
        elif i >= na or b_rows[j] < a_rows[i]:
            rows[o] = b_rows[j]
            counts[o] = b_off[j + 1] - b_off[j]
            j += 1
        else:
            rows[o] = a_rows[i]
            counts[o] = a_off[i + 1] - a_off[i] + b_off[j + 1] - b_off[j]
            i += 1
            j += 1
        o += 1
    return o


def _union_rows(a: Run, b: Run) -> tuple[I64, I64]:
    """The sorted union of two runs' row ids and each row's total entry count. One compiled merge
    of the two row indexes: the numpy passes it replaces (a search, masks, a masked add, two
    merges) held the GIL for ~8 ms each per 5·10^6 rows, stalling the event loop while a fold ran
    in its worker thread (storage/replication/background_fold.py)."""
    c = np.ascontiguousarray
    n = a.rows.shape[0] + b.rows.shape[0]
    rows, counts = np.empty(n, np.int64), np.empty(n, np.int64)
    o = _union(c(a.rows, np.int64), c(a.offsets, np.int64), c(b.rows, np.int64), c(b.offsets, np.int64), rows,
               counts)
    return rows[:o], counts[:o]


_MERGE_TYPES = ("uint8", "uint64", "int64", "float32")
#: ``_merge`` (and frozen._merge_windows) copies gaps of at least this many entries as one slice,
#: shorter ones element by element.
SLICE_FROM = 64


@kernel(*(f"void({readonly(t)}, {readonly(t)}, {readonly('int64')}, {t}[::1])" for t in _MERGE_TYPES))
def _merge(old: NDArray[np.generic], new: NDArray[np.generic], pos: I64, out: NDArray[np.generic]) -> None:
    """``out``: ``old`` with ``new[j]`` inserted before ``old[pos[j]]`` (after the old entries where
    ``pos[j]`` is their count), in one sequential pass. A gap of ``SLICE_FROM`` old entries or
    more is one slice copy (2x an element loop on long gaps); a shorter one, element by element:
    a slice assignment's own cost is that of a few dozen elements, and dense inserts (a snapshot's
    pieces, where a delta entry comes every few base entries) made it most of the merge (uint64,
    23 % inserts: 3.7-4.0 ns per entry with slices everywhere, 2.4-2.6 so; 1 % inserts unchanged)."""
    i = 0
    o = 0
    n_old = old.shape[0]
    for j in range(new.shape[0]):
        p = pos[j]
        if p < i or p > n_old:
            raise ValueError("merge positions must be non-decreasing, inside [0, len(old)]")
        d = p - i
        if d >= SLICE_FROM:
            out[o : o + d] = old[i:p]
            o += d
            i = p
        else:
            while i < p:
                out[o] = old[i]
                o += 1
                i += 1
        out[o] = new[j]
        o += 1
    out[o:] = old[i:]


def merge_field(old: NDArray[Any], new: NDArray[Any], pos: I64, out: NDArray[Any] | None = None) -> NDArray[Any]:
    """One field of sorted entries with others inserted: ``new[j]`` lands before ``old[pos[j]]``,
    i.e. at ``pos[j] + j``, and the ``old`` entries fill the other slots in order. ``pos``
    (non-decreasing, in ``[0, len(old)]``, checked) is each inserted entry's lower bound in ``old``.
    ``out``: where to write (its length ``len(old) + len(new)``), else a new array.

    Compiled (``_merge``): a sequential copy, where the index scatter before it wrote every entry
    through an 8-byte index (and built the index arrays, 16 bytes per entry, first)."""
    if out is None:
        out = np.empty(old.shape[0] + new.shape[0], old.dtype)
    if out.shape[0] != old.shape[0] + new.shape[0] or not new.dtype == old.dtype == out.dtype:
        # checked here, not by an assert: the kernel writes without bounds checks
        raise ValueError("merge_field: out must hold len(old) + len(new) entries of old's dtype")
    c = np.ascontiguousarray
    _merge(c(old), c(new), c(pos, np.int64), out)
    return out


ENTRY_TYPES = ("uint8", "uint64", "uint64", "float32")  # FIELDS' dtypes
#: Slices ahead whose first cache lines ``_gather_entries`` asks for before it copies a slice
#: (``prefetch``): 4 MiB pages of rows of 50 entries scattered over 1.4·10^7 entries, read with
#: reused page buffers: 0.62-0.71 ms/MB against 0.77-0.97 without.
_GATHER_AHEAD = 8
ENTRIES_IN = ", ".join(readonly(t) for t in ENTRY_TYPES)
ENTRIES_OUT = ", ".join(f"{t}[::1]" for t in ENTRY_TYPES)


@kernel(f"void({ENTRIES_IN}, {readonly('int64')}, {readonly('int64')}, {ENTRIES_IN}, {readonly('int64')}, "
        f"{ENTRIES_OUT})")
def _gather_entries(seg: U8, tc: U64, tf: U64, st: F32, lo: I64, n: I64, nseg: U8, ntc: U64, ntf: U64, nst: F32,
                    pos: I64, oseg: U8, otc: U64, otf: U64, ost: F32) -> None:
    """``o*``: the entries ``[lo[r], lo[r] + n[r])`` of every slice r one after another, with new
    entry j inserted before gathered entry ``pos[j]`` (``merge_field``'s rule over the gathered
    slices), the four fields of a slice copied together: one sequential pass of slice copies, no
    index of every entry. (Fields together, not one pass per field: when the slices lie scattered
    over a large run, each slice's four reads miss the cache at once instead of one after another:
    measured 0.55-0.58 ms/MB against 0.77-1.05 for a pass per field and 1.2-1.3 for numpy's gather
    through an index, 4 MB pages of rows of 50 entries scattered over 20·10^6 entries.) The first
    cache line of each field of the slice ``_GATHER_AHEAD`` on is asked for before a slice is
    copied, so the misses of scattered slices overlap."""
    m = pos.shape[0]
    j = 0
    o = 0
    v = 0  # slice entries gathered so far
    rows = lo.shape[0]
    for r in range(min(_GATHER_AHEAD, rows)):
        prefetch(seg, lo[r])
        prefetch(tc, lo[r])
        prefetch(tf, lo[r])
        prefetch(st, lo[r])
    for r in range(rows):
        if r + _GATHER_AHEAD < rows and n[r + _GATHER_AHEAD] > 0:
            a = lo[r + _GATHER_AHEAD]
            prefetch(seg, a)
            prefetch(tc, a)
            prefetch(tf, a)
            prefetch(st, a)
        s = lo[r]
        e = s + n[r]
        v_end = v + n[r]
        while j < m and pos[j] < v_end:  # inserted before an entry of this slice
            p = pos[j]
            if p < v:
                raise ValueError("merge positions must be non-decreasing, inside [0, len(gathered)]")
            d = p - v
            if d > 0:  # (a slice assignment costs ~30 ns a field even when empty: entries of
                # a delta run's rows come one after another, most with nothing between them)
                oseg[o : o + d] = seg[s : s + d]
                otc[o : o + d] = tc[s : s + d]
                otf[o : o + d] = tf[s : s + d]
                ost[o : o + d] = st[s : s + d]
                o += d
                s += d
                v = p
            oseg[o] = nseg[j]
            otc[o] = ntc[j]
            otf[o] = ntf[j]
            ost[o] = nst[j]
            o += 1
            j += 1
        d = e - s
        if d > 0:
            oseg[o : o + d] = seg[s:e]
            otc[o : o + d] = tc[s:e]
            otf[o : o + d] = tf[s:e]
            ost[o : o + d] = st[s:e]
            o += d
        v = v_end
    while j < m:  # inserted after every gathered entry
        if pos[j] != v:
            raise ValueError("merge positions must be non-decreasing, inside [0, len(gathered)]")
        oseg[o] = nseg[j]
        otc[o] = ntc[j]
        otf[o] = ntf[j]
        ost[o] = nst[j]
        o += 1
        j += 1


Fields = tuple[U8, U64, U64, F32]


#: Where a gather writes: ``alloc(total)`` returns the four fields (seg, tc, tf, st) of ``total``
#: entries each, contiguous, of ``FIELDS``' dtypes (a caller's reused buffers: a stream's pages).
Alloc = Callable[[int], Fields]


def new_fields(total: int) -> Fields:
    """Four fresh fields of ``total`` entries (``Alloc``'s default)."""
    return (np.empty(total, np.uint8), np.empty(total, np.uint64), np.empty(total, np.uint64),
            np.empty(total, np.float32))


@kernel(f"int64({readonly('int64')}, {readonly('int64')}, int64)")
def _slices_total(lo: I64, n: I64, size: int) -> int:
    """The entries of the slices ``[lo[i], lo[i] + n[i])``, or -1 when one does not lie inside
    ``[0, size)`` (a negative start or length, or past the end): ``gather_entries``' check in one
    call, where four numpy reductions and their temporaries cost ~5 µs on a small read."""
    total = 0
    for i in range(lo.shape[0]):
        a = lo[i]
        k = n[i]
        if a < 0 or k < 0 or a + k > size:
            return -1
        total += k
    return total


#: The entry fields' dtypes (``ENTRY_TYPES``), made once: ``np.dtype(name)`` per call is not free.
_ENTRY_DTYPES = tuple(np.dtype(t) for t in ENTRY_TYPES)
_NO_POS = np.empty(0, np.int64)


def gather_entries(src: Fields, lo: I64, n: I64, new: Fields | None = None, pos: I64 | None = None,
                   alloc: Alloc = new_fields) -> Fields:
    """The entries ``[lo[i], lo[i] + n[i])`` of the four fields ``src`` (seg, tc, tf, st: a run's,
    a batch's) for every slice i, concatenated (copies), with the entries ``new`` inserted at
    ``pos`` when given (``merge_field``'s rule: new entry j before gathered entry ``pos[j]``,
    positions non-decreasing, checked). One compiled pass (``_gather_entries``) writing each slice
    straight into the result; a gather through an index of every entry (``field[index]``) built
    that index first (8 bytes per entry) and read through it, field after field. The result is
    ``alloc(total)`` (checked: the kernel writes without bounds checks), fresh arrays by default."""
    lo, n = _contiguous(lo, _I64), _contiguous(n, _I64)
    size = src[0].shape[0]
    srcs: Sequence[NDArray[Any]] = src
    if any(f.dtype != t for f, t in zip(srcs, _ENTRY_DTYPES)):  # (refused, not converted: a copy of a run)
        raise ValueError("gather_entries: the fields must be of the entry dtypes (seg, tc, tf, st)")
    fs = [_contiguous(f, t) for f, t in zip(srcs, _ENTRY_DTYPES)]
    gathered = _slices_total(lo, n, size) if lo.shape[0] == n.shape[0] else -1
    if gathered < 0 or fs[1].shape[0] != size or fs[2].shape[0] != size or fs[3].shape[0] != size:
        # checked here: the kernel copies without bounds checks
        raise ValueError("gather_entries: every slice must lie inside the fields, of one length")
    if new is None or pos is None:
        ns, pos = [f[:0] for f in fs], _NO_POS
    else:
        if any(new[i].dtype != src[i].dtype or new[i].shape[0] != pos.shape[0] for i in range(4)):
            raise ValueError("gather_entries: new must be of the fields' dtypes, one position per entry")
        news: Sequence[NDArray[Any]] = new
        ns, pos = [_contiguous(f, t) for f, t in zip(news, _ENTRY_DTYPES)], _contiguous(pos, _I64)
    total = gathered + pos.shape[0]
    out = alloc(total)
    if alloc is not new_fields:  # (new_fields makes them right)
        fields: tuple[NDArray[Any], ...] = tuple(out)
        if len(fields) != 4 or any(o.shape != (total,) or o.dtype != t or not o.flags.c_contiguous
                                   or not o.flags.writeable for o, t in zip(fields, _ENTRY_DTYPES)):
            raise ValueError("gather_entries: alloc must return four writable contiguous fields of the "
                             "requested length and the fields' dtypes")
    _gather_entries(fs[0], fs[1], fs[2], fs[3], lo, n, ns[0], ns[1], ns[2], ns[3], pos, *out)
    return out


def _pairs(*types: str) -> str:
    """The type string of ``_merge_back``'s fields: a tuple of (buffer, inserted entries) pairs."""
    return "Tuple((" + "".join(f"Tuple(({t}[::1], {readonly(t)})), " for t in types) + "))"


#: The field sets ``_merge_back`` merges in one pass: one field of each type (a merge field by
#: field), the four entry fields (a fold into the base), those and ``pos`` (a delta runs' merge).
_MERGE_SETS = (*((t,) for t in _MERGE_TYPES), ("uint8", "uint64", "uint64", "float32"),
               ("uint8", "uint64", "uint64", "float32", "int64"))


@kernel(*(f"void({_pairs(*ts)}, int64, {readonly('int64')})" for ts in _MERGE_SETS))
def _merge_back(fields: tuple[tuple[NDArray[Any], NDArray[Any]], ...], n_old: int, pos: I64) -> None:
    """For each ``(buf, new)`` of ``fields``, ``buf[:n_old + len(pos)]``: ``buf[:n_old]`` with
    ``new[j]`` inserted before old entry ``pos[j]``, written in place from the end: old entry k
    moves to ``k`` plus the count of ``pos[j] <= k``, so going down from the last one, every write
    lands at or after the entry it overwrites is read (a write never overtakes an unread entry).
    The positions are checked before anything is written (``merge_field``'s rule), so a bad call
    leaves every ``buf`` as it was.

    Several fields in one pass (a run's fields, merged at the same positions): the loop's control,
    a branch per inserted entry that the predictor mostly misses, is paid once rather than once per
    field (2.7·10^6 entries inserted at random into 1.2·10^7, a Zipf replay window's fold: 0.079 s
    for the four fields against 0.121 field by field)."""
    m = pos.shape[0]
    prev = 0
    for j in range(m):
        p = pos[j]
        if p < prev or p > n_old:
            raise ValueError("merge positions must be non-decreasing, inside [0, len(old)]")
        prev = p
    i = n_old
    o = n_old + m
    for j in range(m - 1, -1, -1):
        p = pos[j]
        while i > p:
            i -= 1
            o -= 1
            for f in literal_unroll(fields):
                f[0][o] = f[0][i]
        o -= 1
        for f in literal_unroll(fields):
            f[0][o] = f[1][j]


#: Room a merged field's new buffer gets past the merged entries (``grow``), as a share of them,
#: so the next merges into that run (folds into the base, tier merges into a delta run) go in
#: place (``_merge_back``) instead of into fresh memory: a fold grows the base by 1/base_ratio,
#: so at 1.0 a base buffer takes about three folds before it is outgrown. Room never written costs
#: address space, not memory (a page is mapped at its first write).
MERGE_SLACK = 1.0


def _holders(run: Run, name: str) -> tuple[int, int]:
    """``sys.getrefcount`` of ``run``'s field ``name`` and of the buffer it is a view of, as seen
    from here (compared with ``_ALONE``, measured through this same function)."""
    a = getattr(run, name)
    buf = a.base
    return sys.getrefcount(a), sys.getrefcount(buf)


def _alone() -> tuple[int, int]:
    """``_holders`` of a field that only its run references, a prefix view of a buffer that only
    that field references: the counts when nothing else holds either (measured, not assumed, so a
    change in how the interpreter counts references cannot make a shared buffer look unshared)."""
    run = Run.empty()
    run.seg = np.empty(2, np.uint8)[:1]
    return _holders(run, "seg")


_ALONE = _alone()


def held(run: Run) -> bool:
    """Whether something else references one of ``run``'s entry fields: a frozen engine (frozen.py
    keeps the field arrays themselves), or, for a run with buffers of its own (``Run.spare``), a
    view handed out (which references the buffer): ``_merged``'s test, field by field. A merge
    that consumes a held run must go into new buffers, and the held arrays stay resident."""
    for f in FIELDS:
        field_refs, buffer_refs = _holders(run, f)
        if field_refs != _ALONE[0] or (run.spare and buffer_refs != _ALONE[1]):
            return True
    return False


#: Bytes ``release_pages`` gives back per ``madvise`` call (each call releases the GIL).
_RELEASE_PIECE = 64 << 20


def release_pages(run: Run) -> bool:
    """Give the memory of ``run``'s entry fields back to the kernel now, a piece at a time with the
    GIL released (``madvise(MADV_DONTNEED)``), when nothing but ``run`` references them (``held``)
    and numpy allocated them (not a view of a mapped file): for a caller about to let go of a large
    run in a worker thread. Why: freeing a large array unmaps its pages while the GIL is held, ~75
    ms per GB in small pages on this project's VM (a recovery's and a stream's buffers fault in
    small pages: storage/engine/page_advice.py), and that stops the event loop beside the thread
    (a drop of columns at 8.6·10^7 entries: 98-357 ms); after this the free has no pages left to
    walk. The run must not be read afterwards (its memory reads as zeros). Returns whether it was
    done."""
    if held(run) or not madvise.AVAILABLE:
        return False
    for f in FIELDS:
        arr = getattr(run, f)
        owner = arr.base if run.spare and isinstance(arr.base, np.ndarray) else arr
        if not owner.flags.owndata:
            continue
        start, size = owner.ctypes.data, owner.nbytes
        for at in range(0, size, _RELEASE_PIECE):
            madvise.advise(start + at, start + min(size, at + _RELEASE_PIECE), mmap.MADV_DONTNEED)
    return True


def _readonly(a: NDArray[Any], dtype: Any = None) -> NDArray[Any]:
    """``a`` as a contiguous read-only view: the type ``_merge_back`` takes for what it inserts."""
    out = np.ascontiguousarray(a, dtype).view()
    out.flags.writeable = False
    return out


def _room(run: Run, name: str, m: int, grow: bool) -> NDArray[np.generic] | None:
    """The buffer that ``run``'s field ``name`` and ``m`` more entries may be merged into in place
    (``_merged``'s conditions), else None."""
    alone = grow and run.spare and _holders(run, name) == _ALONE  # first: ``old`` below is a reference
    old = getattr(run, name)
    buf = old.base
    if alone and isinstance(buf, np.ndarray) and buf.base is None and buf.shape[0] >= old.shape[0] + m \
            and buf.flags.writeable:
        return buf
    return None


def _merged(run: Run, name: str, new: NDArray[np.generic], pos: I64, grow: bool) -> NDArray[np.generic]:
    """``run``'s field ``name`` with ``new`` inserted at ``pos`` (``merge_field``'s rule), for a
    merge that consumes ``run`` (``grow``: the engine's own runs, which later merges go into).

    In place (``_merge_back``: one pass, no fresh memory) when ``grow``, the field is a prefix of a
    buffer this run owns (``Run.spare``) with room for the new entries, and **nothing but the run
    references the field or its buffer** (``_room``): every numpy view keeps the array it views
    alive, so a view handed out (``RowEngine.read``'s, a storage node's row on its way to a socket)
    or a frozen engine's reference (frozen.py) shows as a reference count above ``_ALONE``; those
    must keep the entries they saw, so the merge then goes into a new buffer, as every merge did
    before. Else into a new buffer, with ``MERGE_SLACK`` room when ``grow``."""
    buf = _room(run, name, new.shape[0], grow)
    old = getattr(run, name)
    n, m = old.shape[0], new.shape[0]
    if buf is not None:
        _merge_back(((buf, _readonly(new)),), n, _readonly(pos, np.int64))
        return buf[: n + m]
    out = np.empty(n + m + (int((n + m) * MERGE_SLACK) if grow else 0), old.dtype)
    return merge_field(old, new, pos, out[: n + m])


def _merged_fields(run: Run, names: tuple[str, ...], news: Sequence[NDArray[Any]], pos: I64, grow: bool,
                   consume: bool) -> dict[str, NDArray[Any]]:
    """``_merged`` of the fields ``names`` of ``run`` (``news`` inserted at the same ``pos``): in
    one pass of ``_merge_back`` over them all when every one goes in place, else field by field
    (``consume``: each old field dropped from ``run`` before the next is built, so a merge into new
    buffers holds one field on top at a time)."""
    bufs = [_room(run, f, x.shape[0], grow) for f, x in zip(names, news)]
    rooms = [b for b in bufs if b is not None]
    if len(rooms) == len(names):
        n, m = getattr(run, names[0]).shape[0], pos.shape[0]
        _merge_back(tuple((b, _readonly(x)) for b, x in zip(rooms, news)), n, _readonly(pos, np.int64))
        for f in names:
            setattr(run, f, _NO_ENTRIES[f])
        return {f: b[: n + m] for f, b in zip(names, rooms)}
    del bufs, rooms  # references to the buffers: ``_merged`` must see none but the run's
    out = {}
    for f, x in zip(names, news):
        out[f] = _merged(run, f, x, pos, grow)
        if consume:
            setattr(run, f, _NO_ENTRIES[f])
    return out


def find_in_gaps(run: Run, row_lo: I64, row_hi: I64, pos: I64, qs: U8, qc: U64, qf: U64) -> tuple[I64, Bools]:
    """Keys ``(qs, qc, qf)`` in a delta run: each one's lower bound in its row slice ``[row_lo,
    row_hi)`` of the run, and whether the key is there. ``pos``: each key's base position, which
    narrows its slice to its *gap*, the entries that share that position (entries with a smaller
    position are smaller, larger ones larger): usually empty or a few entries.

    The position's range comes from the run's bucket index (posindex.py), not a binary search: it
    may hold a few more entries than the gap, which the key search then passes over; one compiled
    pass per key (search.find_in_gaps). The index costs a pass over the run and is kept with it:
    it is made once the keys searched in the run since it was made reach one per
    ``POS_INDEX_MIN_GAP`` of its entries; until then each key bisects its row slice (search.find),
    with the same answers. So a run searched for a few keys per batch (those the delta filter did
    not rule out, deltafilter.py) pays no pass over itself for them, and one searched batch after
    batch pays at most about twice what the index would have cost it from the start.
    """
    if not run.pos_indexed and (run.bisected + qs.shape[0]) * POS_INDEX_MIN_GAP < run.num_entries:
        run.bisected += qs.shape[0]
        return find(run.seg, run.tc, run.tf, row_lo, row_hi, qs, qc, qf)
    index = run.pos_index()
    return find_in_gaps_kernel(run.seg, run.tc, run.tf, index.first, index.shift, row_lo, row_hi, pos, qs, qc, qf)


_RUN_KEYS = ", ".join(readonly(t) for t in ("int64", "int64", "uint8", "uint64", "uint64"))


@kernel(f"void({_RUN_KEYS}, {_RUN_KEYS}, int64[::1])")
def _insertion_points(arows: I64, aoff: I64, aseg: U8, atc: U64, atf: U64, brows: I64, boff: I64, bseg: U8, btc: U64,
                      btf: U64, out: I64) -> None:
    """``out[j]``: how many entries of run a come before entry j of run b in the global order (row
    id, then segment, target column, target feature; the runs' keys disjoint). One walk over b's
    rows; inside a row a holds too, each key galloped from the previous one's answer, so a row with
    few b entries costs O(log) of a's, not a scan."""
    ra = 0
    na = arows.shape[0]
    for rb in range(brows.shape[0]):
        row = brows[rb]
        while ra < na and arows[ra] < row:
            ra += 1
        i = aoff[ra]
        if ra == na or arows[ra] != row:  # a has none of this row: every b entry goes at its place
            for j in range(boff[rb], boff[rb + 1]):
                out[j] = i
            continue
        end = aoff[ra + 1]
        for j in range(boff[rb], boff[rb + 1]):
            s, c, f = bseg[j], btc[j], btf[j]
            # gallop: the first index in [i, end) whose key is not below b's key
            step = 1
            hi = i
            while hi < end and (aseg[hi] < s or (aseg[hi] == s and (atc[hi] < c or (atc[hi] == c and atf[hi] < f)))):
                i = hi + 1
                hi = i + step
                step *= 2
            if hi > end:
                hi = end
            while i < hi:
                m = (i + hi) // 2
                if aseg[m] < s or (aseg[m] == s and (atc[m] < c or (atc[m] == c and atf[m] < f))):
                    i = m + 1
                else:
                    hi = m
            out[j] = i


def insertion_points(older: Run, newer: Run) -> I64:
    """For each entry of ``newer``, how many entries of ``older`` come before it in the global order
    (the runs' keys disjoint): where ``merge_field`` inserts it. Compiled (``_insertion_points``):
    one walk over the runs' row indexes, galloping inside shared rows; the base positions are not
    needed. Until Nov 29 ``merge_deltas`` found them by a search per key in its gap of the older
    run (``find_in_gaps``), which also built the older run's position index and per-key row ranges."""
    out = np.empty(newer.num_entries, np.int64)
    if newer.num_entries:
        _insertion_points(older.rows, older.offsets, older.seg, older.tc, older.tf, newer.rows, newer.offsets,
                          newer.seg, newer.tc, newer.tf, out)
    return out


@kernel(f"void({readonly('int64')}, {readonly('int64')}, int64[::1])")
def _repeat(values: I64, counts: I64, out: I64) -> None:
    o = 0
    for i in range(values.shape[0]):
        v = values[i]
        for _ in range(counts[i]):
            out[o] = v
            o += 1


def repeated(values: I64, counts: I64) -> I64:
    """``np.repeat(values, counts)`` (int64), compiled: numpy's holds the GIL for the whole pass
    (70-120 ms per 10^7 entries measured on a delta merge), which stopped the event loop while a
    fold ran in a worker thread (storage/replication/background_fold.py); the kernel releases it."""
    c = np.ascontiguousarray
    values, counts = c(values, np.int64), c(counts, np.int64)
    if values.shape != counts.shape or (counts.shape[0] and int(counts.min()) < 0):
        raise ValueError("repeated: one non-negative count per value")  # (the kernel writes unchecked)
    out = np.empty(int(counts.sum()), np.int64)
    _repeat(values, counts, out)
    return out


def range_positions(starts: I64, lengths: I64) -> I64:
    """The positions of ranges ``[starts[i], starts[i] + lengths[i])``, back to back: the index that
    gathers those ranges of an array into one."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.shape[0] else 0
    out: I64 = np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
    return out


def merge_deltas(older: Run, newer: Run, grow: bool = False) -> Run:
    """The union of two key-disjoint delta runs, as a new delta run (nothing is added).

    ``grow``: the engine's own tier merge, which consumes ``older`` (later merges go into the
    result): merged in place, or appended into ``older``'s spare room, when nothing else holds its
    fields (``_merged``), else into new buffers with room to spare. Without it (reads, frozen.py)
    neither run is written."""
    assert older.pos is not None and newer.pos is not None
    if older.rows.shape[0] and newer.rows.shape[0] and newer.rows[0] > older.rows[-1]:
        # every newer row after every older one (new rows, as a stream brings): a concatenation
        cat = np.concatenate
        rows, offsets = cat((older.rows, newer.rows)), cat((older.offsets, newer.offsets[1:] + older.offsets[-1]))
        names = (*FIELDS, "pos")
        if not grow:
            return _run(rows, offsets, {f: cat((getattr(older, f), getattr(newer, f))) for f in names}, False)
        fields: dict[str, NDArray[Any]] = {}
        for f in names:
            fields[f] = _appended(getattr(older, f), getattr(newer, f), older.spare)
            setattr(older, f, _NO_ENTRIES[f])
        older.spare = False
        return _run(rows, offsets, fields, True)
    at = insertion_points(older, newer)
    rows, counts = _union_rows(older, newer)
    names = (*FIELDS, "pos")
    # consumed when grow: each old field dropped before the next is built
    fields = _merged_fields(older, names, [getattr(newer, f) for f in names], at, grow, grow)
    older.spare = older.spare and not grow
    return _run(rows, offsets_of(counts), fields, grow)


def fold_into_base(base: Run, delta: Run, grow: bool = False) -> Run:
    """``base`` with every entry of ``delta`` inserted (keys disjoint), as the new base.

    ``grow``: the engine's own base, which later folds go into: the merge is done in place when
    nothing else holds the base's fields (``_merged``), else into new buffers with room to spare;
    an append goes into the base's spare room, or into a new buffer with ``APPEND_SLACK`` room
    (``_appended``). Left False for one-off merges (``RowEngine.gather``'s reads), whose result must
    be exactly its size and whose inputs are never written.

    Consumes ``base``: each new field is built, then the old one is dropped from ``base`` before the
    next, so the memory on top is one field at a time (when nothing else holds the old arrays;
    views handed out earlier keep theirs alive, unchanged).
    """
    assert delta.pos is not None
    if base.num_entries == 0 and base.rows.shape[0] == 0 and not base.spare:
        # the first fold (a fresh node's first stream chunk, a replay from an empty log): the delta
        # run's arrays become the base as they are (runs never share their arrays with a caller);
        # not into an empty base with room reserved (``with_room``): that room is for these entries
        return Run(delta.rows, delta.offsets, delta.seg, delta.tc, delta.tf, delta.st)
    rows, counts = _union_rows(base, delta)
    # every delta entry after the whole base (rows new since the fold before: a stream's chunks, a
    # snapshot's replay): the merge is a concatenation, a third of the scatter's cost
    append = delta.num_entries > 0 and int(delta.pos[0]) == base.num_entries
    fields: dict[str, NDArray[Any]] = {}
    if append:
        for f in FIELDS:
            if grow:
                fields[f] = _appended(getattr(base, f), getattr(delta, f), base.spare)
            else:
                fields[f] = np.concatenate((getattr(base, f), getattr(delta, f)))
            setattr(base, f, _NO_ENTRIES[f])  # drop the old field before building the next
    else:
        fields = _merged_fields(base, FIELDS, [getattr(delta, f) for f in FIELDS], delta.pos, grow, True)
    base.spare = False  # consumed: its (empty) fields must never be appended to
    return _run(rows, offsets_of(counts), fields, grow)


#: Spare room an appended base field gets, as a share of its new length: the next appends (a
#: stream's chunks, a replay's runs) then write into it instead of copying the whole base with a
#: fresh allocation at every fold. The cost is memory: up to this share of a base grown by appends
#: (5 bytes per entry at 0.25), not counted in ``used_bytes`` (docs/storage.md "Known gaps").
APPEND_SLACK = 0.25


def _appended(old: NDArray[np.generic], new: NDArray[np.generic], spare: bool) -> NDArray[np.generic]:
    """``old`` followed by ``new`` (``_append_parts`` of one part)."""
    return _append_parts(old, [new], spare)


def _append_parts(old: NDArray[np.generic], parts: Sequence[NDArray[np.generic]], spare: bool,
                  room: int = 0) -> NDArray[np.generic]:
    """``old`` followed by ``parts``: written into ``old``'s spare room when it is a prefix of a
    buffer this base owns (``Run.spare``) with room enough, else into a new buffer with room for
    ``APPEND_SLACK`` of its length or ``room`` more entries, whichever is more (room that is never
    written costs address space, not memory: the kernel maps a page at its first write).
    Entries before ``len(old)`` are never written: views handed out earlier stay what they were."""
    n, m = old.shape[0], sum(p.shape[0] for p in parts)
    buf = old.base
    if not (spare and isinstance(buf, np.ndarray) and buf.shape[0] >= n + m):
        buf = np.empty(n + m + max(room, int((n + m) * APPEND_SLACK)), old.dtype)
        buf[:n] = old
    at = n
    for p in parts:
        buf[at : at + p.shape[0]] = p
        at += p.shape[0]
    return buf[: n + m]


def append_rows(base: Run, ids: I64, lengths: I64, parts: Sequence[tuple[U8, U64, U64, F32]], room: int = 0) -> Run:
    """``base`` with new rows after all of its own: ``ids`` (ascending, each greater than every row
    id the base holds or a delta run may hold), row ``ids[i]`` of ``lengths[i]`` entries, whose
    entries are the ``parts`` (seg, tc, tf, st) one after another, each row's canonical.

    In the global order (row id first) these entries come after the whole base, so they are its
    new tail: written straight into the base's spare room (``_append_parts``), with no search, no
    delta run and no fold. A delta run's base positions stay right (an entry's lower bound counts
    the base entries before it, and every appended one is after it). ``room``: entries expected to
    follow (a replay's later runs), so the buffers grow once rather than at every append.

    Consumes ``base`` like ``fold_into_base`` (its spare room now belongs to the result)."""
    assert int(lengths.sum()) == sum(p[0].shape[0] for p in parts)
    assert all(p[i].shape[0] == p[0].shape[0] for p in parts for i in range(1, 4))
    out = Run(_append_parts(base.rows, [ids], base.spare_index, ids.shape[0]),  # type: ignore[arg-type]
              _append_parts(base.offsets, [base.offsets[-1] + np.cumsum(lengths)], base.spare_index,  # type: ignore[arg-type]
                            ids.shape[0]),
              base.seg, base.tc, base.tf, base.st, spare=True, spare_index=True)
    for i, f in enumerate(FIELDS):
        field = _append_parts(getattr(base, f), [p[i] for p in parts], base.spare, room)
        setattr(base, f, _NO_ENTRIES[f])
        setattr(out, f, field)
    base.spare = base.spare_index = False
    return out


#: Makes an empty buffer: ``buffer(dtype, count)`` (``with_room``'s; e.g. one whose pages fault in
#: small, storage/engine/page_advice.py ``filled_buffer``).
Buffer = Callable[[Any, int], NDArray[Any]]


def empty_buffer(dtype: Any, count: int) -> NDArray[Any]:
    """``np.empty(count, dtype)`` (``Buffer``'s default)."""
    return np.empty(count, dtype)


def with_room(base: Run, room: int, buffer: Buffer = empty_buffer) -> Run:
    """``base`` copied into buffers with room for ``room`` more entries past its end (``Run.spare``):
    the folds that append the next ``room`` entries (a stream's chunks, whose total the receiver
    knows when the stream opens) then write into it, instead of each fold past the spare room
    copying the whole base into a buffer ``APPEND_SLACK`` larger (about ``1 / APPEND_SLACK`` copies
    of every entry while a node fills by appends). ``base`` is left as it was (views of it too).
    The buffers are ``buffer(dtype, n + room)``."""
    n = base.num_entries
    out = Run(base.rows, base.offsets, base.seg, base.tc, base.tf, base.st, spare=True)
    for f in FIELDS:
        old = getattr(base, f)
        grown = buffer(old.dtype, n + room)
        if grown.shape != (n + room,) or grown.dtype != old.dtype:
            raise ValueError("with_room: buffer must return count entries of the dtype asked for")
        grown[:n] = old
        setattr(out, f, grown[:n])
    return out


def window(run: Run, lo: int, hi: int) -> Run:
    """Entries ``[lo, hi)`` of ``run`` as a run (views; its row index cut to the rows they are in)."""
    i0 = int(np.searchsorted(run.offsets, lo, "right")) - 1
    i1 = int(np.searchsorted(run.offsets, hi, "left"))
    offsets = np.clip(run.offsets[i0 : i1 + 1], lo, hi) - lo
    pos = None if run.pos is None else run.pos[lo:hi]
    return Run(run.rows[i0:i1], offsets, run.seg[lo:hi], run.tc[lo:hi], run.tf[lo:hi], run.st[lo:hi], pos)


def merge_into_slice(seg: U8, tc: U64, tf: U64, st: F32, lo: int, delta: Run) -> tuple[U8, U64, U64, F32]:
    """One row: its base slice (the four arrays, starting at base index ``lo``) with its delta
    entries (``delta``: that row's entries only, with base positions), merged: a copy."""
    assert delta.pos is not None
    at = delta.pos - lo
    return (merge_field(seg, delta.seg, at), merge_field(tc, delta.tc, at), merge_field(tf, delta.tf, at),
            merge_field(st, delta.st, at))
