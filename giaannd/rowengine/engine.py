"""The row engine: rows of sorted entries, updated by add in O(delta · log) whatever their size.

Theory of operation
-------------------
State (run.py describes the two kinds of run):

- ``_index`` (keyindex.py): row key ``(a, b)`` -> dense row id; ``_lengths[id]``: entries per row.
- ``_base``: one base run, each row a contiguous canonical slice;
- ``_deltas``: a few delta runs (oldest, largest first) holding the keys that arrived since the
  base was last rebuilt, each entry located in the base by its lower bound ``pos``.
- Invariant: **every key lives in exactly one run**; a run's entries are in the global order
  (row id, segment, target column, target feature).

``apply`` (one canonical batch: rows unique, each row's entries sorted with unique keys):

1. Row ids for the batch's keys (new rows get the next ids); entries put in row-id order.
2. Base: every entry is searched in its row's slice (search.find, one compiled pass). Found keys
   get the increment added **in place**. Every entry now knows its lower bound in the base.
3. Delta runs, largest first, for the entries not found yet that the filter of the delta runs'
   keys does not rule out (``_delta_keys``, deltafilter.py: on a training stream most are new, and
   each would otherwise be searched in every run): each is located in the run (its row's slice,
   narrowed to the entries near its base position by the run's bucket index once the run has been
   searched enough to have one, run.find_in_gaps and posindex.py, then a key search over the few
   entries left); found keys are added in place.
4. Keys found nowhere are new: they become a new delta run (with their base positions).
5. Tiers: while the newest delta run holds at least 1/``fanout`` of the entries of the one before,
   the two are merged. When the delta runs together hold 1/``base_ratio`` of the base, they are
   merged and folded into the base (run.fold_into_base: entry j of the delta lands at
   ``pos[j] + j``, no search). While something else holds the arrays (a frozen engine: a
   snapshot being written; run.held), neither is copied: a tier merge never goes into a held run
   (the newer runs merge among themselves), and a fold due is deferred, up to
   ``HELD_FOLD_LIMIT`` / ``base_ratio`` (below), and done, in place, by the first commit after the
   holder lets go. ``commit(fold=False)`` (a storage node, which folds in a worker thread) also
   leaves tier merges of more than ``INLINE_MERGE_ENTRIES`` to ``merge_tiers`` (``merge_due``).

``apply_in_order`` (a log replay's window of batches that share rows and keys, inorder.py): the
delta runs are folded first, the window's entries are grouped by row (a counting sort) and each
row's sorted stably, one compiled walk per row adds to the base keys in place and folds the new
keys (each the left fold of its increments in batch order), and those are merged into the base
once (run.fold_into_base with grow: in place, from the back, into the base's spare room, when
nothing else holds the base's arrays). No delta run, no
tiers: one move of the base per window instead of a search per entry, a sort of the new keys and
the tiers' merges and folds per group.

Cost: a batch of m entries costs O(m · log(row length)) for the base search plus O(m · log) for
the delta runs, whatever the size of the rows it touches; the tiers rewrite an entry
O(log_fanout) times as a delta and about ``base_ratio + 1`` times as part of the base over its
life (each fold rewrites the base, which by then has grown by 1/``base_ratio``; in place, without
fresh memory, when nothing else holds it: run.py "Merges in place"). Python work is per
run and per batch, never per row or per entry (the per-entry loops are compiled kernels, jit.py).
Today's ``RowStore`` (before this engine) re-sorted every touched row in full per batch: O(N²) for
the rows at the head of a Zipf stream.

Exactness: a key's strength is the left fold of its increments in batch order, rounded to float32
after each batch, exactly as merging a batch into a row did before (float32 + float32 is the
correctly rounded sum, equal to adding in float64 and rounding once: 53 >= 2·24 + 2 bits, so the
double rounding is innocuous). Merges and folds move entries and never add.

Reads see one canonical row: the row's base slice (views, no copy, when no delta run holds any of
its keys) or that slice merged with its delta entries (a copy; ``compact`` folds everything into
the base, after which every read is views). Views are live until the next ``apply``/``compact``:
an in-place add changes their strengths; a fold or merge after a view was taken replaces the
arrays (the view keeps the old data: a merge goes in place only when no view or frozen engine holds
the run, run.py "Merges in place").

Memory per entry: the 21 bytes of the entry in the base; 16 bytes more while it is in a delta
run (its base position, and its share of the run's bucket index, posindex.py), and the delta runs
hold at most 1/``base_ratio`` of the base (``HELD_FOLD_LIMIT`` / ``base_ratio`` while a fold is
deferred); per row, 16 bytes in each run's row index, 8 of length
and 32-64 in the key index. A fold in place needs nothing on top; one into new buffers (a view
or frozen engine holds the base, or its room is used up) needs one field of the new base (8 bytes
per entry) on top (run.merge_field writes it in one pass, no index arrays), a delta merge likewise
the merged delta run. New buffers get room for the next merges (run.MERGE_SLACK): address space,
mapped page by page as merges write into it.

Pages: every method that writes fresh arrays (``commit`` and the merges and folds it does,
``merge_tiers``, ``compact``, ``apply_in_order``, ``append_new_rows``, ``drop_rows``) runs with
numpy's huge-page advice off (``_in_small_pages``, pages.py): on this project's VM a huge page's
first touch cost the core's apply a quarter of its time at 10^5 sentences.

Threads: one owner applies and reads; but a fold may run in another thread (a storage node's,
off its event loop: ``commit(fold=False)``, ``fold_due``, then ``compact`` in a worker thread). So
every method that reads or replaces the runs holds the engine's lock (``_locked``, reentrant): a
call that arrives while a fold moves the base waits for it instead of reading arrays being moved
(the kernels hold no Python objects and release the GIL, jit.py, so the owner's thread runs
meanwhile). What a fold leaves alone is not locked: the key index, the row lengths and the entry
count (``row_ids``, ``lengths``, ``keys``, ``num_*``); ``nbytes`` and ``delta_entries`` may be
a fold's before or after figure. Views handed out before a fold stay what they were (run.py,
"Merges in place": a held buffer is never moved in place), so are frozen engines (frozen.py).

Failures: a fold or tier merge consumes the runs it merges (their fields dropped one by one, the
runs taken out of the engine first, run.py), an append to the base consumes it likewise, and a
drop renumbers the base before the key index; so one that raises midway (out of memory at an
allocation) has lost entries or left them under other ids: the engine is then *broken*
(``_moving``), and every later call that reads or replaces the runs raises ``RuntimeError``
instead of answering without them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.cow import PendingCopies, PendingSet
from giaannd.rowengine.deltafilter import DeltaFilter
from giaannd.rowengine.frozen import FrozenEngine
from giaannd.rowengine.inorder import by_row, fold_rows
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.rowengine.pages import small_pages
from giaannd.rowengine.run import (
    FIELDS,
    Alloc,
    Buffer,
    Run,
    append_rows,
    empty_buffer,
    find_in_gaps,
    fold_into_base,
    gather_entries,
    held,
    merge_deltas,
    merge_field,
    merge_into_slice,
    new_fields,
    offsets_of,
    range_positions,
    release_pages,
    renumbered,
    with_room,
)
from giaannd.rowengine.search import find

__all__ = ["DEFAULT_BASE_RATIO", "DEFAULT_FANOUT", "INLINE_MERGE_ENTRIES", "ApplyPlan", "EngineStats", "Entries",
           "InOrderApplied", "RowEngine"]

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
F32 = NDArray[np.float32]

#: A newer delta run is merged into the one before it once it holds at least 1/DEFAULT_FANOUT of
#: its entries, so each delta run is at least ``fanout`` times the next: at most
#: log_fanout(deltas / batch) runs to search per batch. Larger: fewer runs, more rewriting (a run
#: absorbs more merges before it moves up).
DEFAULT_FANOUT = 2
#: The delta runs are folded into the base once they hold 1/DEFAULT_BASE_RATIO of its entries.
#: Each fold copies the whole base, so an entry is copied about ratio + 1 times in its life as
#: part of the base: smaller is less copying, but up to 1/ratio of the entries then sit in delta
#: runs (8 more bytes each, and more to search per batch and to merge on a read).
DEFAULT_BASE_RATIO = 4
#: While something else holds the base's arrays (a frozen engine: a snapshot being written from
#: another thread), a fold cannot go in place (run.py "Merges in place"): it would copy the whole
#: base, old and new both resident until the holder lets go (21 bytes per entry on top). So the
#: fold is *deferred* while the base is held (run.held) and the delta runs hold less than
#: HELD_FOLD_LIMIT / base_ratio of it (the bound: past it the fold copies, as before); the first
#: commit after the holder lets go folds them, in place. 1: never deferred. Tried at 4 (delta runs
#: up to the base's size at the default ratio: a delta entry costs 16 bytes more than a base entry,
#: a fold under a holder 21 per base entry): no better on tools.bench.live_rss (one run each), and
#: the fold after the snapshot then moves more at once (docs/storage.md "Known gaps").
HELD_FOLD_LIMIT = 2
#: ``commit(fold=False)`` (a storage node, which folds in a worker thread) leaves a tier merge of
#: more entries than this to ``merge_tiers``, in the same thread: the largest merges rewrite up to
#: 1/base_ratio of the store (~0.3-0.5 s at 10^8 entries), and inside a commit they ran on the
#: node's event loop. 2^20 entries: ~10-30 ms of merge.
INLINE_MERGE_ENTRIES = 1 << 20


@dataclass(frozen=True, slots=True, eq=False)
class Entries:
    """Sorted entries (one row, or many rows with offsets elsewhere): the Row format's four arrays."""

    seg: U8
    tc: U64
    tf: U64
    st: F32

    def __len__(self) -> int:
        return int(self.st.shape[0])


@dataclass(slots=True, eq=False)
class ApplyPlan:
    """A planned ``apply`` (``RowEngine.plan``): what ``commit`` writes. ``ids`` are the batch's row
    ids in id order (new rows' ids are the ones ``commit`` gives them), ``lengths`` their entries."""

    version: int
    #: keys of the rows the batch creates, in the order they get the next ids
    new_a: U64
    new_b: U64
    ids: I64
    lengths: I64
    #: in-place adds: (run, entry indexes in it, increments)
    adds: list[tuple[Run, I64, F32]] = field(default_factory=list)
    #: the keys found nowhere, as the next delta run
    new_run: Run | None = None

    @property
    def new_entries(self) -> int:
        return 0 if self.new_run is None else self.new_run.num_entries

    @property
    def new_rows(self) -> int:
        return int(self.new_a.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class InOrderApplied:
    """What ``RowEngine.apply_in_order`` did: ``ids``, the row id of every row occurrence, batch
    after batch; ``grown`` and ``added``, the rows that gained keys (ascending) and how many each
    (a row's length before is its length now less ``added``; a row not among them kept its length).
    Sized by the window, never by the store."""

    ids: I64
    grown: I64
    added: I64


@dataclass(slots=True)
class EngineStats:
    """Work counters: folds into the base and the base entries they wrote, delta merges and theirs."""

    folds: int = 0
    fold_entries: int = 0
    delta_merges: int = 0
    delta_merge_entries: int = 0
    #: commits that found a fold due but the base held (HELD_FOLD_LIMIT), so left it for later
    deferred_folds: int = 0


P = ParamSpec("P")
T = TypeVar("T")


def _locked(method: Callable[Concatenate[RowEngine, P], T]) -> Callable[Concatenate[RowEngine, P], T]:
    """``method`` run holding the engine's lock (module docstring, "Threads")."""

    def run(self: RowEngine, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self._lock:
            if self._broken is not None:
                raise RuntimeError("the row engine is broken: a fold or tier merge failed midway") from self._broken
            return method(self, *args, **kwargs)

    run.__name__, run.__qualname__, run.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return run


def _in_small_pages(method: Callable[Concatenate[RowEngine, P], T]) -> Callable[Concatenate[RowEngine, P], T]:
    """``method`` run with numpy's huge-page advice off (pages.py): a method that writes fresh
    arrays (merges, folds, the key index's growth) faults them in small pages."""

    def run(self: RowEngine, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with small_pages():
            return method(self, *args, **kwargs)

    run.__name__, run.__qualname__, run.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return run


_NO_IDS: I64 = np.empty(0, np.int64)
_EMPTY = Entries(np.empty(0, np.uint8), np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.float32))


class RowEngine:
    """Rows keyed by (a, b) uint64 pairs, merged by add (module docstring).

    Args:
        fanout: the delta tiers' size ratio (``DEFAULT_FANOUT``), at least 1.
        base_ratio: fold deltas into the base at 1/base_ratio of its size (``DEFAULT_BASE_RATIO``),
            at least 1.
    """

    def __init__(self, fanout: int = DEFAULT_FANOUT, base_ratio: int = DEFAULT_BASE_RATIO) -> None:
        if fanout < 1 or base_ratio < 1:
            raise ValueError("need fanout >= 1 and base_ratio >= 1")
        self.fanout = fanout
        self.base_ratio = base_ratio
        self.stats = EngineStats()
        self._index = KeyIndex()
        self._lengths: I64 = np.zeros(1024, np.int64)
        self._base = Run.empty()
        self._deltas: list[Run] = []
        #: every key of the delta runs, so that plan searches them only for keys they may hold
        self._delta_keys = DeltaFilter()
        self._entries = 0
        #: bumped by every change, so a stale ApplyPlan is caught
        self._version = 0
        #: held by every method that reads or replaces the runs (module docstring, "Threads")
        self._lock = threading.RLock()
        #: what a fold or tier merge raised midway, leaving runs half moved (module docstring,
        #: "Failures"): every locked call raises from then on
        self._broken: BaseException | None = None
        #: copies a lazy ``freeze`` named and its reader has not made yet (cow.py): every in-place
        #: write of the strengths or the lengths announces itself to them first
        self._pending = PendingSet()

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._index)

    @property
    def num_entries(self) -> int:
        return self._entries

    @property
    def num_deltas(self) -> int:
        return len(self._deltas)

    @property
    def delta_entries(self) -> int:
        """Entries held in delta runs (``compact`` folds them into the base)."""
        return sum(d.num_entries for d in self._deltas)

    @property
    def nbytes(self) -> int:
        """Bytes of every array the engine holds (runs, row indexes, key index, lengths, the delta
        runs' key filter)."""
        return (self._base.nbytes + sum(d.nbytes for d in self._deltas) + self._index.nbytes
                + int(self._lengths.nbytes) + self._delta_keys.nbytes)

    @_locked
    def arrays(self) -> list[NDArray[Any]]:
        """Every array the engine holds (``nbytes``' arrays), for page advice (a storage node
        offers them to khugepaged after a recovery filled them in small pages). Read-only use."""
        out = [a for run in (self._base, *self._deltas) for a in run.arrays()]
        return [*out, *self._index.arrays(), self._lengths, *self._delta_keys.arrays()]

    def lengths(self) -> I64:
        """Entries of every row, by row id (a view; do not mutate)."""
        return self._lengths[: len(self._index)]

    def keys(self) -> tuple[U64, U64]:
        """The key of every row, by row id (views; do not mutate)."""
        return self._index.keys()

    def row_ids(self, a: U64, b: U64) -> I64:
        """The id of every key (a[i], b[i]); -1 for a row never applied."""
        return self._index.lookup(a, b)

    def row_id(self, a: int, b: int) -> int:
        """The id of one key; -1 for a row never applied."""
        return self._index.lookup_one(a, b)

    def largest(self, k: int) -> I64:
        """Ids of the ``k`` longest rows, longest first."""
        lengths = self.lengths()
        k = min(k, lengths.shape[0])
        if k == 0:
            return np.empty(0, np.int64)
        top = np.argpartition(lengths, lengths.shape[0] - k)[lengths.shape[0] - k:]
        return top[np.argsort(-lengths[top], kind="stable")].astype(np.int64)

    # -- writes -----------------------------------------------------------------------------------
    def apply(self, a: U64, b: U64, offsets: I64, entries: Entries) -> None:
        """Add a canonical batch: rows ``(a[i], b[i])`` unique, row i's entries (sorted, unique keys)
        are ``entries[offsets[i]:offsets[i+1]]``. Equal keys add, new keys are inserted; rows with
        no entries are registered (``row_ids`` finds them) and hold nothing. ``plan`` + ``commit``."""
        self.commit(self.plan(a, b, offsets, entries))

    @_locked
    def plan(self, a: U64, b: U64, offsets: I64, entries: Entries) -> ApplyPlan:
        """Every search of an ``apply`` (its steps 1-4), without changing anything: the plan knows
        the growth (``new_entries``, ``new_rows``) before anything is written, so a caller can refuse
        the batch as a whole. Valid until the engine next changes (``commit`` checks)."""
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        lengths = np.diff(offsets)
        ids = self._index.lookup(a, b)
        new = ids < 0
        new_a, new_b = a[new], b[new]
        # rows not indexed yet get the next ids in batch order; commit appends them in that order
        ids[new] = len(self._index) + np.arange(new_a.shape[0], dtype=np.int64)
        if new.all():
            return self._plan_new_rows(new_a, new_b, ids, lengths, entries)
        if np.any(ids[1:] < ids[:-1]):  # new rows in key order interleave with old ones: sort by id
            order = np.argsort(ids, kind="stable")
            ids, lengths = ids[order], lengths[order]
            starts = offsets[:-1][order]
            entries = Entries(*gather_entries((entries.seg, entries.tc, entries.tf, entries.st), starts, lengths))
        seg, tc, tf, st = entries.seg, entries.tc, entries.tf, entries.st
        plan = ApplyPlan(self._version, new_a, new_b, ids, lengths)
        if st.shape[0] == 0:
            return plan
        row = np.repeat(ids, lengths)
        base = self._base
        lo, hi = base.ranges(ids)
        pos, hit = find(base.seg, base.tc, base.tf, np.repeat(lo, lengths), np.repeat(hi, lengths), seg, tc, tf)
        found = np.flatnonzero(hit)
        plan.adds.append((base, pos[found], st[found]))
        new = ~hit  # entries found nowhere yet
        if self._deltas and found.shape[0] < hit.shape[0]:
            q = np.flatnonzero(new)
            q = q[self._delta_keys.maybe(row, seg, tc, tf, q)]  # the ones a delta run may hold
            if q.shape[0]:
                new[self._find_in_deltas(q, row[q], seg[q], tc[q], tf[q], pos[q], st, plan.adds)] = False
        q = np.flatnonzero(new)
        if q.shape[0]:
            plan.new_run = Run.from_sorted(row[q], seg[q], tc[q], tf[q], st[q], pos[q])
        return plan

    def _find_in_deltas(self, q: I64, q_row: I64, qs: U8, qc: U64, qf: U64, qpos: I64, st: F32,
                        adds: list[tuple[Run, I64, F32]]) -> I64:
        """Look the entries ``q`` (ascending indexes into the batch's entries) up in the delta runs,
        largest run first (``q_row``: each one's row id; ``qpos``: its base position, which narrows
        the search to its gap in a run). The increments ``st[q]`` of the keys found join ``adds``
        in the order given; returns the entries of ``q`` found."""
        found: list[I64] = []
        for delta in sorted(self._deltas, key=lambda d: -d.num_entries):
            if q.shape[0] == 0:
                break
            row_lo, row_hi = delta.ranges(q_row)
            at, hit = find_in_gaps(delta, row_lo, row_hi, qpos, qs, qc, qf)
            if hit.any():
                adds.append((delta, at[hit], st[q[hit]]))
                found.append(q[hit])
                keep = ~hit
                q, q_row, qs, qc, qf, qpos = q[keep], q_row[keep], qs[keep], qc[keep], qf[keep], qpos[keep]
        return np.concatenate(found) if found else np.empty(0, np.int64)

    def _plan_new_rows(self, new_a: U64, new_b: U64, ids: I64, lengths: I64, entries: Entries) -> ApplyPlan:
        """``plan`` of a batch whose rows are all new (a stream's chunks, a replay of new rows):
        no run holds any of their keys, so there is nothing to search. Their ids are the next ones,
        ascending, so the entries are in the global order as given, and each one's base position
        is the end of the base (a new row's base slice is empty, after every base row). The plan
        is exactly what the general path makes (no adds; every entry in the new run), at the cost
        of four copies (the run must not alias the caller's arrays: in-place adds write into it)."""
        plan = ApplyPlan(self._version, new_a, new_b, ids, lengths)
        if entries.st.shape[0] == 0:
            return plan
        row = np.repeat(ids, lengths)
        pos = np.full(row.shape[0], self._base.num_entries, np.int64)
        plan.new_run = Run.from_sorted(row, entries.seg.copy(), entries.tc.copy(), entries.tf.copy(),
                                       entries.st.copy(), pos)
        return plan

    @_in_small_pages
    @_locked
    def append_new_rows(self, a: U64, b: U64, lengths: I64, parts: Sequence[Entries], room: int = 0) -> I64 | None:
        """Add rows of which none is held yet, straight into the base (run.append_rows): keys
        ``(a[i], b[i])`` unique, row i of ``lengths[i]`` entries, the entries of all rows being the
        ``parts`` one after another (each row's sorted, with unique keys). The engine ends as
        ``apply`` of their concatenation would leave it (the same ids, in order, and the same
        entries), with no search, no delta run and no fold: a replay's new rows cost a copy of
        their entries. The parts are copied (the caller keeps them). ``room``: entries expected to
        follow by later calls (run.append_rows).

        Returns the rows' ids; None, with nothing changed, when some key is a row already (the
        caller then goes the general way, ``plan``).

        Where the base has no spare room for them and holds more than ``INLINE_MERGE_ENTRIES``
        (a base mapped from its snapshot file, read-only; a node holding data that a stream or a
        replay adds rows to), the rows become a delta run instead (entries after the whole base:
        their base positions are its length), as a commit's new keys do: appending would copy the
        whole base into a larger buffer first, O(store) in the caller's thread (a storage node's
        event loop, a restart's replay) and, for a mapped base, the end of its mapping. The
        delta run goes into the base at the next fold (a storage node's: in a worker thread)."""
        a = np.asarray(a, np.uint64)
        b = np.asarray(b, np.uint64)
        lengths = np.asarray(lengths, np.int64)
        ids = self._index.append_new(a, b)
        if ids is None:
            return None
        self._version += 1
        self._grow_lengths(len(self._index))
        fields = [(p.seg, p.tc, p.tf, p.st) for p in parts]
        if self._appends_in_place(int(lengths.sum())):
            with self._moving():  # (append_rows consumes the base field by field)
                self._lengths[ids] = lengths
                self._entries += int(lengths.sum())
                self._base = append_rows(self._base, ids, lengths, fields, room)
        else:
            # (copies: the caller keeps the parts)
            seg, tc, tf, st = (np.concatenate([f[i] for f in fields]) for i in range(4))
            pos = np.full(st.shape[0], self._base.num_entries, np.int64)
            full = lengths > 0  # (a row without entries is registered, with no slice in any run)
            self._add_delta(Run(ids[full], offsets_of(lengths[full]), seg, tc, tf, st, pos), INLINE_MERGE_ENTRIES)
        return ids

    def _appends_in_place(self, entries: int) -> bool:
        """Whether ``entries`` new entries go into the base's tail (``append_new_rows``): its spare
        room holds them, or the base is small enough that regrowing it is inline work (at most
        ``INLINE_MERGE_ENTRIES`` entries copied)."""
        base = self._base
        return self._base_room() >= base.num_entries + entries or base.num_entries <= INLINE_MERGE_ENTRIES

    def _base_room(self) -> int:
        """Entries the base's buffers hold, its spare room included (its length when it has none)."""
        base = self._base
        buf = base.st.base
        return buf.shape[0] if base.spare and isinstance(buf, np.ndarray) else base.num_entries

    @_in_small_pages
    @_locked
    def commit(self, plan: ApplyPlan, fold: bool = True) -> None:
        """Carry out a ``plan``; nothing may change the engine between the two. ``fold``: fold the
        delta runs into the base when that is due (``fold_due``); False leaves it to the caller
        (a storage node folds in a worker thread, ``compact``, off its event loop).

        Raises:
            RuntimeError: the engine changed after the plan was made (nothing is written).
        """
        if plan.version != self._version:
            raise RuntimeError("stale ApplyPlan: the engine changed after plan()")
        self._version += 1
        if plan.new_a.shape[0]:
            self._index.append(plan.new_a, plan.new_b)
        self._grow_lengths(len(self._index))
        for run, at, add in plan.adds:
            self._pending.before_write(run.st, at)
            run.st[at] += add
        if plan.new_run is not None:
            self._add_delta(plan.new_run, None if fold else INLINE_MERGE_ENTRIES)
        if fold and self.fold_due():
            self.compact()

    def _add_delta(self, delta: Run, limit: int | None = None) -> None:
        self._hold_delta(delta, delta.counts())
        self._merge_tiers(limit)

    def _hold_delta(self, delta: Run, counts: I64) -> None:
        """Take on a delta run of new keys (``counts``: its entries per row): the one place runs
        join ``_deltas``, so the filter of their keys (``_delta_keys``) misses none."""
        self._delta_keys.add(delta, self._deltas)
        self._pending.before_write(self._lengths, delta.rows)
        self._lengths[delta.rows] += counts
        self._entries += delta.num_entries
        self._deltas.append(delta)

    def _merge_tiers(self, limit: int | None) -> None:
        """Size tiers: each run more than fanout times the next newer one. Not into a run something
        else holds (a frozen engine): that merge would copy it, and the held one stay resident; the
        newer runs merge among themselves meanwhile and pile up behind it, so once it is free the
        first pair (newest first) out of tier merges, and so on: the runs a lookup, a fold and a
        snapshot walk stay O(log) in number (a snapshot's view left 8 runs where 3 would do:
        tools/bench, docs/storage.md). ``limit``: leave a merge of more entries than this to
        ``merge_tiers`` (``merge_due`` says one is left)."""
        deltas = self._deltas
        at = len(deltas) - 2
        while at >= 0:
            older, newer = deltas[at], deltas[at + 1]
            if self._out_of_tier(older, newer) and (limit is None or older.num_entries + newer.num_entries <= limit):
                with self._moving():
                    deltas.pop(at + 1)
                    deltas[at] = self._merge(older, newer)
                at = min(at, len(deltas) - 2)  # the merged run against its newer neighbour again
            else:
                at -= 1

    @_locked
    def merge_due(self) -> bool:
        """Whether a tier merge of the delta runs was left by ``commit(fold=False)`` (more than
        ``INLINE_MERGE_ENTRIES``): ``merge_tiers`` does it (a storage node: in a worker thread,
        like a fold)."""
        deltas = self._deltas
        return any(self._out_of_tier(deltas[i], deltas[i + 1]) for i in range(len(deltas) - 1))

    def _out_of_tier(self, older: Run, newer: Run) -> bool:
        """Two adjacent delta runs to merge: the newer holds at least 1/fanout of the older, which
        nothing else holds."""
        return newer.num_entries * self.fanout >= older.num_entries and not held(older)

    @_in_small_pages
    @_locked
    def merge_tiers(self) -> None:
        """The tier merges of the delta runs that are due, however large (``merge_due``)."""
        if self.merge_due():
            self._version += 1
            self._merge_tiers(None)

    @_locked
    def fold_due(self, scale: float = 1.0) -> bool:
        """Whether the delta runs are due to be folded into the base: they hold 1/base_ratio of it,
        and the base is not held by something else while they hold less than HELD_FOLD_LIMIT /
        base_ratio of it (the fold is then deferred, counted in ``stats.deferred_folds``: the first
        commit after the holder lets go does it, in place). ``scale`` multiplies both thresholds (a
        storage node's jittered fold point, storage/replication/background_fold.py)."""
        if not self._deltas:
            return False
        share = sum(d.num_entries for d in self._deltas) * self.base_ratio
        base = self._base.num_entries * scale
        if share < base:
            return False
        if share < base * HELD_FOLD_LIMIT and held(self._base):
            self.stats.deferred_folds += 1
            return False
        return True

    def _merge(self, older: Run, newer: Run) -> Run:
        self.stats.delta_merges += 1
        self.stats.delta_merge_entries += older.num_entries + newer.num_entries
        return merge_deltas(older, newer, grow=True)

    @_in_small_pages
    @_locked
    def apply_in_order(self, batches: Sequence[tuple[U64, U64, I64, Entries]], threads: int = 1) -> InOrderApplied:
        """``apply`` of each canonical batch ``(a, b, offsets, entries)`` in turn, in one go (log
        replay of batches that share rows and keys, recovery.py). The engine ends as ``apply`` of
        each batch in turn leaves it: the same row ids (new rows numbered in order of first
        occurrence), lengths and strengths bit for bit, since every key's increments are added one
        at a time in batch order, a new key starting from its first. Only the runs' layout differs:
        at most one delta run is left (below). Returns the row id of every row occurrence, batch
        after batch, and the rows that gained keys with how many (``InOrderApplied``). The
        batches' arrays are read, not kept.

        How (inorder.py): the delta runs are folded into the base first (none after a snapshot's
        load; an earlier call's, if it left one), so every key is in the base or new; the entries
        are grouped by row, each row's sorted stably; one compiled walk per row adds to the base
        keys in place and folds the new ones, which, in the global order with their base
        positions, are one delta run. No search per entry in log order, no tier merges.

        That run is left as the engine's only delta run unless a fold is due (``fold_due``: it holds
        1/base_ratio of the base), as a commit leaves its delta runs: the next call (a replay's next
        window) folds it first, so a replay of several windows moves the base once per window but
        the last, and a restart's replay of a log smaller than that share moves it not at all (the
        node's folds merge it later, off the request path; a base mapped from its snapshot file
        stays mapped until then). A run of under half the window's entries is copied out of the
        window's buffers, so it does not pin them.

        A fold moves the base's entries in place when nothing else holds them (``run._merged``:
        a start-up replay, before any read), else it goes into new buffers.

        ``threads``: the grouping and the rows' walk run in that many threads, each on its own
        rows (inorder.py: a window of ``PARALLEL_MIN_ENTRIES`` or more), with the same result bit
        for bit; the caller holds the engine alone meanwhile (a start-up replay)."""
        self._pending.finish()  # fold_rows adds to the base's strengths in place, unannounced
        self.compact()
        ids = [self._index.lookup_or_add(a, b)[0] for a, b, _, _ in batches]  # new rows: the next ids, in order
        self._version += 1
        self._grow_lengths(len(self._index))
        ids_all = np.concatenate(ids) if ids else np.empty(0, np.int64)
        if not any(e.st.shape[0] for _, _, _, e in batches):
            return InOrderApplied(ids_all, _NO_IDS, _NO_IDS)
        # the window's rows, ascending, and each occurrence's index among them: the grouping is
        # sized by the rows the window touches, not by every row held (a small log over a node of
        # 10^9 rows would otherwise make and pass over 16 GB of counts and cursors)
        window_rows, local = np.unique(ids_all, return_inverse=True)
        cuts = np.cumsum([0] + [i.shape[0] for i in ids])
        starts, gseg, gtc, gtf, gst = by_row(
            [(local[lo_:hi_], o, e.seg, e.tc, e.tf, e.st) for lo_, hi_, (_, _, o, e) in zip(cuts, cuts[1:], batches)],
            window_rows.shape[0], threads)
        at = np.flatnonzero(starts[1:] != starts[:-1])  # (rows of a window may have no entries)
        rows = window_rows[at]
        base = self._base
        lo, hi = base.ranges(rows)
        m, pos, counts = fold_rows(base.seg, base.tc, base.tf, base.st, at, starts, lo, hi, gseg, gtc, gtf, gst,
                                   threads)
        if m:
            got = counts > 0
            fields = (gseg[:m], gtc[:m], gtf[:m], gst[:m], pos)
            if 2 * m < gst.shape[0]:  # do not pin the whole window's buffers
                fields = tuple(f.copy() for f in fields)  # type: ignore[assignment]
            delta = Run(rows[got], offsets_of(counts[got]), *fields)
            self._hold_delta(delta, counts[got])
            if self.fold_due():
                self.compact()
            return InOrderApplied(ids_all, delta.rows, counts[got])
        return InOrderApplied(ids_all, _NO_IDS, _NO_IDS)

    @_in_small_pages
    @_locked
    def compact(self) -> None:
        """Fold every delta run into the base (reads then return views, without a copy)."""
        deltas = self._deltas
        if not deltas:
            return
        self._version += 1
        with self._moving():
            while len(deltas) >= 2:
                newer = deltas.pop()
                deltas[-1] = self._merge(deltas[-1], newer)
            delta = deltas.pop()
            self._delta_keys.clear()
            base, self._base = self._base, Run.empty()
            self.stats.folds += 1
            self.stats.fold_entries += base.num_entries + delta.num_entries
            self._base = fold_into_base(base, delta, grow=True)

    @contextmanager
    def _moving(self) -> Iterator[None]:
        """Around moves that consume runs (folds, tier merges, appends to the base, a drop's
        renumbering; module docstring, "Failures"): what raises inside marks the engine broken
        (``_broken``), then propagates."""
        try:
            yield
        except BaseException as exc:
            self._broken = exc
            raise

    @_locked
    def reserve(self, entries: int, buffer: Buffer = empty_buffer) -> None:
        """Make room in the base for ``entries`` more entries than it and the delta runs hold, so
        folds that append them (new rows: a stream's chunks) write into that room instead of
        regrowing the base (run.with_room, into buffers ``buffer`` makes). A hint: nothing is
        reserved for anyone, later applies of any kind may use the room or outgrow it. No-op when
        the room is there already, and when the base holds more than ``entries`` and
        ``INLINE_MERGE_ENTRIES`` entries: making the room copies the base, in the caller's thread (a
        storage node's event loop), so it is done where it costs at most what the room will hold (a
        joining node, empty or nearly); a node holding more takes the new rows as delta runs
        (``append_new_rows``), folded off that thread. Invalidates plans made before (the base run
        is replaced)."""
        base = self._base
        held = base.num_entries + sum(d.num_entries for d in self._deltas)
        if entries <= 0 or self._base_room() >= held + entries or base.num_entries > max(entries, INLINE_MERGE_ENTRIES):
            return
        self._version += 1
        self._base = with_room(base, held - base.num_entries + entries, buffer)

    @_locked
    def copy_base(self, buffer: Buffer = empty_buffer) -> None:
        """Copy the base run's entries and row offsets into new buffers (``buffer`` makes them,
        run.with_room), so that it no longer references the arrays it was built from: a base loaded
        as views of a mapped snapshot file lets go of the file (storage/engine/snapshot_map.py).
        Changes no row; invalidates plans made before."""
        self._version += 1
        base = with_room(self._base, 0, buffer)
        base.offsets = base.offsets.copy()
        self._base = base

    def room_fill(self, buffer: NDArray[Any]) -> int:
        """Entries of the base run while ``buffer`` (one of ``room()``'s) still holds it, else -1
        (the base moved to other buffers): a plain read, unlocked, so another thread may follow a
        fill of the room with it (storage/engine/column_store.py ``reserve``)."""
        base = self._base
        return base.num_entries if base.st.base is buffer else -1

    @_locked
    def room(self) -> tuple[list[NDArray[Any]], int] | None:
        """The base's four field buffers (seg, tc, tf, st: the whole buffers, spare room included)
        and how many entries they hold, when the base has spare room (``reserve``); else None.
        For advising the room's pages (storage/engine/column_store.py maps them ahead of a
        stream's chunks); the entries past the count are not rows yet."""
        base = self._base
        if not base.spare:
            return None
        buffers = [getattr(base, f).base for f in FIELDS]
        if not all(isinstance(b, np.ndarray) and b.shape[0] > base.num_entries for b in buffers):
            return None
        return buffers, base.num_entries

    @_locked
    def base_fields(self) -> tuple[U8, U64, U64, F32]:
        """The base run's four entry fields (seg, tc, tf, st: views of the buffers that hold them;
        read-only use, e.g. advising their pages)."""
        base = self._base
        return base.seg, base.tc, base.tf, base.st

    def _grow_lengths(self, n: int) -> None:
        if n > self._lengths.shape[0]:
            grown = np.zeros(max(n, 2 * self._lengths.shape[0]), np.int64)
            grown[: self._lengths.shape[0]] = self._lengths
            self._lengths = grown

    # -- reads ------------------------------------------------------------------------------------
    @_locked
    def read(self, row_id: int) -> Entries:
        """Row ``row_id``, canonical: views into the base when no delta holds part of it, else a copy."""
        base = self._base
        lo, hi = base.row_slice(row_id)
        merged = self._row_deltas(row_id)
        seg, tc, tf, st = base.seg[lo:hi], base.tc[lo:hi], base.tf[lo:hi], base.st[lo:hi]
        if merged is None:
            return Entries(seg, tc, tf, st) if hi > lo else _EMPTY
        return Entries(*merge_into_slice(seg, tc, tf, st, lo, merged))

    def _row_deltas(self, row_id: int) -> Run | None:
        """The delta runs' entries of row ``row_id``, merged into one run with their base positions
        (None: no delta holds part of the row)."""
        merged: Run | None = None
        for delta in self._deltas:
            a, z = delta.row_slice(row_id)
            if z > a:
                assert delta.pos is not None
                piece = Run(np.array([row_id], np.int64), np.array([0, z - a], np.int64), delta.seg[a:z],
                            delta.tc[a:z], delta.tf[a:z], delta.st[a:z], delta.pos[a:z])
                merged = piece if merged is None else merge_deltas(merged, piece)
        return merged

    @_locked
    def read_part(self, row_id: int, start: int, stop: int) -> tuple[int, Entries]:
        """Entries ``[start, stop)`` (clipped) of row ``row_id`` as ``read`` would give them, and the
        row's length: views into the base when no delta holds part of the row, else a copy of that
        part only. A delta entry ``j`` of the row (its runs' entries merged, in base-position order)
        lands at ``pos_j + j`` of the merged row and the base entries fill the other slots in order
        (``merge_field``), so the part needs the delta entries whose merged position falls in it and
        the base entries between: O(part + the row's delta entries), where ``read(row_id)[a:z]``
        merged the whole row first (a 10^8-entry row with one delta entry: 2.1 GB copied for every
        8 MiB part, docs/replication.md "Big rows")."""
        base = self._base
        lo, hi = base.row_slice(row_id)
        merged = self._row_deltas(row_id)
        d = 0 if merged is None else len(merged.seg)
        n = hi - lo + d
        a = min(max(start, 0), n)
        z = min(max(stop, a), n)
        if merged is None:
            return n, Entries(base.seg[lo + a:lo + z], base.tc[lo + a:lo + z], base.tf[lo + a:lo + z],
                              base.st[lo + a:lo + z])
        assert merged.pos is not None
        at = merged.pos - lo  # each delta entry's insertion point in the row's base slice
        slots = at + np.arange(d, dtype=np.int64)  # its position in the merged row (ascending)
        ja, jz = int(np.searchsorted(slots, a)), int(np.searchsorted(slots, z))
        ia, iz = lo + a - ja, lo + z - jz  # the base entries of the part (those before a: a - ja)
        into = at[ja:jz] - (a - ja)
        return n, Entries(merge_field(base.seg[ia:iz], merged.seg[ja:jz], into),
                          merge_field(base.tc[ia:iz], merged.tc[ja:jz], into),
                          merge_field(base.tf[ia:iz], merged.tf[ja:jz], into),
                          merge_field(base.st[ia:iz], merged.st[ja:jz], into))

    @_locked
    def read_many(self, row_ids: I64) -> tuple[I64, Entries]:
        """Rows ``row_ids`` (in that order) concatenated, with offsets (a copy; compacts first)."""
        self.compact()
        row_ids = np.asarray(row_ids, np.int64)
        lengths = self._lengths[row_ids]
        lo, _ = self._base.ranges(row_ids)
        base = self._base
        return offsets_of(lengths), Entries(*gather_entries((base.seg, base.tc, base.tf, base.st), lo, lengths))

    @_locked
    def gather(self, row_ids: I64, alloc: Alloc = new_fields) -> tuple[I64, Entries]:
        """Rows ``row_ids`` (in that order; ids may repeat) concatenated, with offsets: a copy, like
        ``read_many``, but without compacting first (a storage node serves reads between applies:
        a fold per read would cost O(store)). Each delta run's entries of those rows are gathered,
        their base positions moved to where their rows' base slices land in the result, and merged
        (run.merge_deltas); then one compiled pass copies every row's base slice into the result
        with those entries inserted (run.gather_entries): O(entries read), whatever the
        store, and no index of every entry. ``alloc``: where the result's entries go
        (run.gather_entries; a stream source's reused page buffers)."""
        row_ids = np.asarray(row_ids, np.int64)
        k = int(row_ids.shape[0])
        base = self._base
        lo, hi = base.ranges(row_ids)
        blen = hi - lo
        merged: Run | None = None
        b_off: I64 | None = None
        for delta in self._deltas:
            assert delta.pos is not None
            dlo, dhi = delta.ranges(row_ids)
            dlen = dhi - dlo
            if not dlen.any():
                continue
            if b_off is None:
                b_off = offsets_of(blen)
            # a delta entry's base position, moved to where its row's base slice lies in the result
            # (through an index: delta entries are at most 1/base_ratio of the store, few per read)
            pos = delta.pos[range_positions(dlo, dlen)] + np.repeat(b_off[:-1] - lo, dlen)
            seg, tc, tf, st = gather_entries((delta.seg, delta.tc, delta.tf, delta.st), dlo, dlen)
            piece = Run.from_sorted(np.repeat(np.arange(k, dtype=np.int64), dlen), seg, tc, tf, st, pos)
            merged = piece if merged is None else merge_deltas(merged, piece)
        fields = (base.seg, base.tc, base.tf, base.st)
        if merged is None:
            got = gather_entries(fields, lo, blen, alloc=alloc)
        else:
            assert merged.pos is not None
            got = gather_entries(fields, lo, blen, (merged.seg, merged.tc, merged.tf, merged.st), merged.pos,
                                 alloc)
        return offsets_of(self._lengths[row_ids]), Entries(*got)

    @_locked
    def pieces(self, row_ids: I64, max_pieces: int) -> list[Entries] | None:
        """The entries ``gather(row_ids)`` returns, as consecutive pieces without copying where it
        can: views of the base for runs of rows that lie next to each other in it (a stream's
        chunks on its receiver, long rows anywhere), copies (``gather``) of the runs of rows a delta
        run holds part of. For readers that only scan the entries (stream verification's digest).
        None when that takes more than ``max_pieces`` pieces: short rows scattered over the base,
        where one ``gather`` costs less than a piece per row."""
        row_ids = np.asarray(row_ids, np.int64)
        k = int(row_ids.shape[0])
        if k == 0:
            return []
        base = self._base
        lo, hi = base.ranges(row_ids)
        touched = np.zeros(k, bool)
        for delta in self._deltas:
            dlo, dhi = delta.ranges(row_ids)
            touched |= dhi > dlo
        first = np.ones(k, bool)  # rows that start a piece
        first[1:] = (touched[1:] != touched[:-1]) | (~touched[1:] & (lo[1:] != hi[:-1]))
        starts = np.flatnonzero(first)
        if starts.shape[0] > max_pieces:
            return None
        out = []
        for a, z in zip(starts.tolist(), np.append(starts[1:], k).tolist()):
            if touched[a]:
                out.append(self.gather(row_ids[a:z])[1])
            else:
                b, e = int(lo[a]), int(hi[z - 1])
                out.append(Entries(base.seg[b:e], base.tc[b:e], base.tf[b:e], base.st[b:e]))
        return out

    @_in_small_pages
    @_locked
    def drop_rows(self, keep: NDArray[np.bool_]) -> None:
        """Keep only the rows ``keep`` marks (a bool per row id), renumbered densely in id order
        (row i becomes ``cumsum(keep)[i] - 1``): the deltas are folded first, then the base's
        kept rows copied into new fields (one compiled pass of row slices, ``gather_entries``) and
        the key index rebuilt from the kept keys. O(store); for dropping whole columns after a
        topology change, in a worker thread (storage/replication/background_fold.py ``drop``), so
        no pass here holds the GIL over the entries or the rows (numpy's ``repeat`` and ``cumsum``
        do: 0.25 s of event loop stopped at 8.6·10^7 entries until Nov 30; and a gather through a
        mask of every entry was 8× slower than the slices)."""
        n = len(self._index)
        keep = np.asarray(keep, bool)
        if keep.shape[0] != n:
            raise ValueError(f"keep has {keep.shape[0]} flags for {n} rows")
        if keep.all():
            return
        self.compact()
        self._version += 1
        base = self._base
        kept_rows = keep[base.rows]
        counts = base.counts()[kept_rows]
        seg, tc, tf, st = gather_entries((base.seg, base.tc, base.tf, base.st), base.offsets[:-1][kept_rows], counts)
        with self._moving():  # (the rows renumbered in the base, not yet in the key index and lengths)
            self._base = Run(renumbered(keep)[base.rows[kept_rows]], offsets_of(counts), seg, tc, tf, st)
            release_pages(base)  # (its free below then walks no pages while holding the GIL)
            del base
            a, b = self.keys()
            lengths = self.lengths()[keep]
            self._index = KeyIndex.from_keys(a[keep], b[keep])
            self._lengths = np.zeros(max(1024, lengths.shape[0]), np.int64)
            self._lengths[: lengths.shape[0]] = lengths
            self._entries = int(lengths.sum())

    @classmethod
    def from_arrays(cls, a: U64, b: U64, offsets: I64, entries: Entries, fanout: int = DEFAULT_FANOUT,
                    base_ratio: int = DEFAULT_BASE_RATIO, spare: bool = False) -> RowEngine:
        """An engine holding row i = key ``(a[i], b[i])`` with entries ``entries[offsets[i]:offsets[i+1]]``
        (canonical: the caller checked), as one base run that *is* the given arrays (no copy): a
        snapshot's load is its reads, and the key index built in one vectorised pass. ``spare``: the
        four entry arrays are prefixes of buffers with room past their end, handed over to the
        engine (``Run.spare``: its folds and appends write into that room).

        Raises:
            ValueError: a key repeats.
        """
        engine = cls(fanout, base_ratio)
        offsets = np.asarray(offsets, np.int64)
        engine._index = KeyIndex.from_keys(a, b)
        r = len(engine._index)
        engine._base = Run(np.arange(r, dtype=np.int64), offsets, entries.seg, entries.tc, entries.tf, entries.st,
                           spare=spare)
        engine._grow_lengths(r)
        np.subtract(offsets[1:], offsets[:-1], out=engine._lengths[:r])  # (no temporary: fresh pages)
        engine._entries = int(offsets[-1]) if r else 0
        return engine

    @_locked
    def freeze(self, room: F32 | None = None, lazy: bool = False) -> FrozenEngine:
        """The engine as it is now, for a reader in another thread while this one goes on applying
        (frozen.py): references to every run's arrays and the keys, copies of only what changes in
        place (strengths, 4 B per entry, and the lengths).

        ``room``: a float32 buffer the strengths are copied into, run after run, while it has room
        (then into new arrays). Why: a caller that must hold writes off during the freeze (a
        storage snapshot) allocates and touches it beforehand, so the copy pays no page faults:
        0.04-0.05 s for 8.6·10^7 strengths against 0.1-0.6 s into fresh memory, measured.

        ``lazy``: the copies are only named here (cow.py ``PendingCopies``, O(runs)); the reader
        makes them, chunk by chunk, with ``FrozenEngine.materialize`` before it reads, while this
        engine goes on; an in-place write of a chunk not copied yet copies it first. So the
        caller holds writes off for no copy at all (a storage snapshot: 40-60 ms at 8.6·10^7
        entries before, growing with the store). Until ``materialize`` (or ``release``) returns,
        the frozen strengths and lengths must not be read."""
        a, b = self.keys()
        runs, at = [], 0
        pairs: list[tuple[NDArray[Any], int, NDArray[Any]]] = []
        for r in (self._base, *self._deltas):
            n = r.num_entries
            if room is not None and at + n <= room.shape[0]:
                st = room[at : at + n]
                at += n
            else:
                st = np.empty(n, np.float32)
            pairs.append((r.st, n, st))
            runs.append(Run(r.rows, r.offsets, r.seg, r.tc, r.tf, st, r.pos))
        n = len(self._index)
        lengths = np.empty(n, np.int64)
        pairs.append((self._lengths, n, lengths))
        pending = PendingCopies(pairs)
        if lazy:
            self._pending.add(pending)
        else:
            pending.finish()
        return FrozenEngine(a, b, lengths, runs[0], runs[1:], pending if lazy else None)

    def export(self) -> tuple[U64, U64, I64, Entries]:
        """Every row (empty ones too), sorted by key, concatenated: (a, b, offsets, entries), a copy."""
        a, b = self.keys()
        order = np.lexsort((b, a)).astype(np.int64)
        offsets, entries = self.read_many(order)
        return a[order], b[order], offsets, entries
