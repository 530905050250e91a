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

Operations (each vectorised or compiled over every row and entry involved; inputs are not changed):

- :func:`merge_deltas`: two key-disjoint delta runs as one (the newer run's entries are located in
  the older one by base position first, :func:`find_in_gaps`, then by key inside that gap; a newer
  run whose rows all come after the older's is a concatenation).
- :func:`fold_into_base`: a base and a delta run as a new base; built field by field, so the
  memory on top is one field of the new base (8 bytes per entry), not a second base (a delta
  entirely after the base is appended: a concatenation instead of the merge).
- :func:`merge_field`: one field of sorted entries with others inserted at their base positions, in
  one compiled sequential pass (the merges, folds and reads above and frozen.py's chunks use it).
- :func:`fold_in_place`: a fold that moves the base's entries in its spare room from the back
  instead of building new fields (``RowEngine.apply_in_order``, a start-up replay: no view of the
  base may be held, and no fresh memory is touched but the room the new entries fill).
- :func:`merge_into_slice`: one row's base slice with its delta entries (a read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly
from giaannd.rowengine.posindex import PosIndex
from giaannd.rowengine.search import find_in_gaps as find_in_gaps_kernel

__all__ = ["FIELDS", "Run", "append_rows", "find_in_gaps", "fold_in_place", "fold_into_base", "merge_deltas",
           "merge_field", "merge_into_slice", "offsets_of", "with_room"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F32 = NDArray[np.float32]
Bools = NDArray[np.bool_]

#: The entry fields, in the order every loop over them uses.
FIELDS = ("seg", "tc", "tf", "st")


def offsets_of(lengths: I64) -> I64:
    """``[0, l0, l0+l1, ...]``: the offsets of consecutive blocks of the given lengths."""
    out = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


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
    #: a delta run's position index, made on its first lookup (runs never move their entries)
    _pos_index: PosIndex | None = field(default=None, repr=False)
    #: the four entry fields are prefixes of buffers with spare room that this run alone may write
    #: past its end (``fold_into_base``'s append; no other run or view sees beyond its own end)
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

    def counts(self) -> I64:
        """Entries of each row of ``rows``."""
        return np.diff(self.offsets)

    def ranges(self, row_ids: I64) -> tuple[I64, I64]:
        """(lo, hi): the slice of each row; a row the run does not hold gets the empty slice at the
        place its entries would go (``lo == hi``)."""
        i = np.searchsorted(self.rows, row_ids)
        lo = self.offsets[i]
        if self.rows.shape[0] == 0:
            return lo, lo
        held = self.rows[np.minimum(i, self.rows.shape[0] - 1)] == row_ids
        return lo, np.where(held, self.offsets[np.minimum(i + 1, self.rows.shape[0])], lo)

    def row_slice(self, row_id: int) -> tuple[int, int]:
        """The slice of one row (``(x, x)``, empty, when the run does not hold it)."""
        i = int(np.searchsorted(self.rows, row_id))
        if i < self.rows.shape[0] and int(self.rows[i]) == row_id:
            return int(self.offsets[i]), int(self.offsets[i + 1])
        return int(self.offsets[i]), int(self.offsets[i])


def _union_rows(a: Run, b: Run) -> tuple[I64, I64]:
    """The sorted union of two runs' row ids and each row's total entry count."""
    i = np.searchsorted(a.rows, b.rows)
    held = np.zeros(b.rows.shape[0], bool)
    if a.rows.shape[0]:
        held = a.rows[np.minimum(i, a.rows.shape[0] - 1)] == b.rows
    counts = a.counts()
    b_counts = b.counts()
    counts[i[held]] += b_counts[held]
    at = i[~held]
    return merge_field(a.rows, b.rows[~held], at), merge_field(counts, b_counts[~held], at)


_MERGE_TYPES = ("uint8", "uint64", "int64", "float32")


@kernel(*(f"void({readonly(t)}, {readonly(t)}, {readonly('int64')}, {t}[::1])" for t in _MERGE_TYPES))
def _merge(old: NDArray[np.generic], new: NDArray[np.generic], pos: I64, out: NDArray[np.generic]) -> None:
    """``out``: ``old`` with ``new[j]`` inserted before ``old[pos[j]]`` (after the old entries where
    ``pos[j]`` is their count), in one sequential pass (slice copies: 2x a per-element loop)."""
    i = 0
    o = 0
    n_old = old.shape[0]
    for j in range(new.shape[0]):
        p = pos[j]
        if p < i or p > n_old:
            raise ValueError("merge positions must be non-decreasing, inside [0, len(old)]")
        d = p - i
        out[o : o + d] = old[i:p]
        o += d
        i = p
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


@kernel(f"void(uint8[::1], uint64[::1], uint64[::1], float32[::1], int64, {readonly('uint8')}, {readonly('uint64')},"
        f" {readonly('uint64')}, {readonly('float32')}, {readonly('int64')})")
def _merge_back(seg: U8, tc: U64, tf: U64, st: F32, n: int, nseg: U8, ntc: U64, ntf: U64, nst: F32, pos: I64) -> None:
    """``merge_field`` of the four entry fields in place: their first ``n`` entries (the old ones)
    become ``n + len(pos)`` with new entry j before old entry ``pos[j]``, walking from the back
    (every old entry moves up by the number of new entries before it, into slots already read).
    The four fields in one loop: 2.3x four passes (the per-entry bookkeeping is shared, and a
    replay's new keys lie a few entries apart)."""
    i = n
    o = n + pos.shape[0]
    for j in range(pos.shape[0] - 1, -1, -1):
        p = pos[j]
        if p > i or p < 0:
            raise ValueError("merge positions must be non-decreasing, inside [0, len(old)]")
        shift = o - i
        for k in range(i - 1, p - 1, -1):
            seg[k + shift] = seg[k]
            tc[k + shift] = tc[k]
            tf[k + shift] = tf[k]
            st[k + shift] = st[k]
        o -= i - p + 1
        i = p
        seg[o] = nseg[j]
        tc[o] = ntc[j]
        tf[o] = ntf[j]
        st[o] = nst[j]


def find_in_gaps(run: Run, row_lo: I64, row_hi: I64, pos: I64, qs: U8, qc: U64, qf: U64) -> tuple[I64, Bools]:
    """Keys ``(qs, qc, qf)`` in a delta run: each one's lower bound in its row slice ``[row_lo,
    row_hi)`` of the run, and whether the key is there. ``pos``: each key's base position, which
    narrows its slice to its *gap*, the entries that share that position (entries with a smaller
    position are smaller, larger ones larger): usually empty or a few entries.

    The position's range comes from the run's bucket index (posindex.py), not a binary search: it
    may hold a few more entries than the gap, which the key search then passes over; one compiled
    pass per key (search.find_in_gaps).
    """
    index = run.pos_index()
    return find_in_gaps_kernel(run.seg, run.tc, run.tf, index.first, index.shift, row_lo, row_hi, pos, qs, qc, qf)


def merge_deltas(older: Run, newer: Run) -> Run:
    """The union of two key-disjoint delta runs, as a new delta run (nothing is added)."""
    assert older.pos is not None and newer.pos is not None
    if older.rows.shape[0] and newer.rows.shape[0] and newer.rows[0] > older.rows[-1]:
        # every newer row after every older one (new rows, as a stream brings): a concatenation
        cat = np.concatenate
        return Run(cat((older.rows, newer.rows)), cat((older.offsets, newer.offsets[1:] + older.offsets[-1])),
                   cat((older.seg, newer.seg)), cat((older.tc, newer.tc)), cat((older.tf, newer.tf)),
                   cat((older.st, newer.st)), cat((older.pos, newer.pos)))
    row_lo, row_hi = older.ranges(newer.rows)
    n = newer.counts()
    at, _ = find_in_gaps(older, np.repeat(row_lo, n), np.repeat(row_hi, n), newer.pos, newer.seg, newer.tc, newer.tf)
    rows, counts = _union_rows(older, newer)
    seg, tc, tf, st = (merge_field(getattr(older, f), getattr(newer, f), at) for f in FIELDS)
    return Run(rows, offsets_of(counts), seg, tc, tf, st, merge_field(older.pos, newer.pos, at))


def fold_into_base(base: Run, delta: Run, grow: bool = False) -> Run:
    """``base`` with every entry of ``delta`` inserted (keys disjoint), as a new base.

    ``grow``: the engine's own base, which later folds will append to: an append then goes into
    the base's spare room, or into a new buffer with ``APPEND_SLACK`` room (``_appended``). Left
    False for one-off merges (``RowEngine.gather``'s reads), whose result must be exactly its size.

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
    out = Run(rows, offsets_of(counts), base.seg, base.tc, base.tf, base.st, spare=append and grow)
    for f in FIELDS:
        if append and grow:
            field = _appended(getattr(base, f), getattr(delta, f), base.spare)
        elif append:
            field = np.concatenate((getattr(base, f), getattr(delta, f)))
        else:
            field = merge_field(getattr(base, f), getattr(delta, f), delta.pos)
        setattr(base, f, field[:0])  # drop the old field before building the next
        setattr(out, f, field)
    base.spare = False  # consumed: its (empty) fields must never be appended to
    return out


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
        setattr(base, f, field[:0])
        setattr(out, f, field)
    base.spare = base.spare_index = False
    return out


def with_room(base: Run, room: int) -> Run:
    """``base`` copied into buffers with room for ``room`` more entries past its end (``Run.spare``):
    the folds that append the next ``room`` entries (a stream's chunks, whose total the receiver
    knows when the stream opens) then write into it, instead of each fold past the spare room
    copying the whole base into a buffer ``APPEND_SLACK`` larger (about ``1 / APPEND_SLACK`` copies
    of every entry while a node fills by appends). ``base`` is left as it was (views of it too)."""
    n = base.num_entries
    out = Run(base.rows, base.offsets, base.seg, base.tc, base.tf, base.st, spare=True)
    for f in FIELDS:
        old = getattr(base, f)
        grown = np.empty(n + room, old.dtype)
        grown[:n] = old
        setattr(out, f, grown[:n])
    return out


#: A base that ``fold_in_place`` outgrows moves to buffers this many times its new size: a replay's
#: windows then merge in place until it has doubled (room never written is address space, not
#: resident memory), where ``APPEND_SLACK``'s room took a new buffer every few windows.
FOLD_IN_PLACE_GROWTH = 2


def _has_room(field: NDArray[np.generic], n: int) -> bool:
    """Whether ``field`` is the prefix of a buffer of at least ``n`` entries."""
    buf = field.base
    return isinstance(buf, np.ndarray) and buf.shape[0] >= n and field.ctypes.data == buf.ctypes.data


def fold_in_place(base: Run, delta: Run) -> Run:
    """``fold_into_base(base, delta, grow=True)``, moving the base's entries in place where its
    fields have the spare room (``Run.spare``): a merge from the back (``_merge_back``), so no field
    of the new base is fresh memory (a new process's first touch of a page costs ~20x a reused
    one, docs/model.md; a fold per replay window into new arrays was most of a replay's time).
    Without the room, the merge writes into new buffers ``FOLD_IN_PLACE_GROWTH`` times its size,
    whose room the next folds then use.

    Only where nothing else holds views of the base's entries (a start-up replay, before any read
    or freeze): they move. Consumes ``base`` like ``fold_into_base``."""
    assert delta.pos is not None
    n, m = base.num_entries, delta.num_entries
    rows, counts = _union_rows(base, delta)
    old = {f: getattr(base, f) for f in FIELDS}
    for f in FIELDS:  # consumed: the old fields live on in ``old`` only, each dropped once merged
        setattr(base, f, np.empty(0, old[f].dtype))
    if base.spare and all(_has_room(old[f], n + m) for f in FIELDS):
        c = np.ascontiguousarray
        bufs = [old[f].base for f in FIELDS]
        _merge_back(bufs[0], bufs[1], bufs[2], bufs[3], n, c(delta.seg), c(delta.tc), c(delta.tf), c(delta.st),
                    c(delta.pos, np.int64))
    else:
        bufs = []
        for f in FIELDS:
            buf = np.empty(FOLD_IN_PLACE_GROWTH * (n + m), old[f].dtype)
            merge_field(old.pop(f), getattr(delta, f), delta.pos, buf[: n + m])
            bufs.append(buf)
    k = n + m
    out = Run(rows, offsets_of(counts), bufs[0][:k], bufs[1][:k], bufs[2][:k], bufs[3][:k], spare=True)
    base.spare = False
    return out


def merge_into_slice(seg: U8, tc: U64, tf: U64, st: F32, lo: int, delta: Run) -> tuple[U8, U64, U64, F32]:
    """One row: its base slice (the four arrays, starting at base index ``lo``) with its delta
    entries (``delta``: that row's entries only, with base positions), merged: a copy."""
    assert delta.pos is not None
    at = delta.pos - lo
    return (merge_field(seg, delta.seg, at), merge_field(tc, delta.tc, at), merge_field(tf, delta.tf, at),
            merge_field(st, delta.st, at))
