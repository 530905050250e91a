"""Every row key of a store in (column, feature) order, kept up to date without sorting the store.

Theory of operation
-------------------
Scans (export, repair's digest pages, a stream's key listing, ``held_columns``) walk the rows in
key order, but the row engine numbers rows densely in the order they were created
(rowengine/keyindex.py). Before, the store kept one sorted copy of every key and rebuilt it, one
``lexsort`` of the whole store (4.4 s at 10^7 rows here), whenever a row had been created since:
under training, which creates rows all the time, *every* scan page sorted the store again.

Rows are only ever appended (new ids above the old ones) or, on a drop of columns, renumbered.
So this keeps two sorted runs:

- ``main``: the keys of ids ``[0, n_main)``, sorted;
- ``tail``: the keys of ids ``[n_main, n)``, sorted, created since ``main`` was last merged.

New rows are sorted among themselves (their count, not the store's) and merged into the tail;
once the tail holds more than 1/``TAIL_SHARE`` of ``main`` (at least ``MIN_TAIL``), it is merged
into ``main``: one linear, compiled merge pass (``_merge_into``), so a row costs
O(``TAIL_SHARE``) copies over its life, not a sort of the store per change. That merge is
O(store): on a storage node (``merge_apart``) one into a main of more than ``MERGE_APART_KEYS``
keys runs in a worker thread (``merge_source``, ``merge_runs``, ``install_merge``: the runs are
never written, only replaced, so the thread reads them while scans go on; the rows created
meanwhile stay in the tail), not inside the scan page or listing that found it due. Taking new
rows in sorts those rows only, but ``refresh`` sorts every row created since the last call, where
it runs: a storage node's first listing after hours of training found millions waiting, a sort of
~0.1 s per 10^6 rows on its event loop. So a storage node sorts them in a worker thread once
``column_store.KEYS_BEHIND_APART_ROWS`` wait (``tail_source``, ``extended_tail``, ``install_tail``:
refused when a listing took them in first), and a listing sorts at most about that many. Who needs every key
as one sorted array (``full``) gets the tail merged in first; a scan page needs only the keys
after its cursor (``window``): the next keys of each run, merged, whatever the store's size. A
drop of rows (``drop``) filters both runs and renumbers their ids in one linear pass, no sort
(until Nov 30 a drop made the next listing sort every key again: minutes of ``lexsort`` on the
event loop at 10^9 rows, after every topology change that released columns); keys that had
fallen behind (a drop they did not follow, or fewer rows than covered) are rebuilt from scratch
by ``refresh`` (one sort).

Memory: 24 bytes per row (two keys and an id), and while a merge into ``main`` runs, the new
copy of it (24 more).
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly
from giaannd.rowengine.run import range_positions, renumbered
from giaannd.unique import unique

__all__ = ["MERGE_APART_KEYS", "MIN_TAIL", "TAIL_SHARE", "Keys", "MainRun", "SortedKeys", "TailSource", "difference",
           "extended_tail", "merge_runs", "sorted_rows"]

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]
Keys = tuple[U64, U64, I64]
#: ``SortedKeys.tail_source``: (the tail, the first row it does not cover, the row count, the drops)
TailSource = tuple[Keys, int, int, int]

#: A merge of the tail into a ``main`` of more keys than this is left to ``merge_source`` and
#: ``install_merge`` (a storage node's worker thread) where ``merge_apart`` is set (module docstring).
MERGE_APART_KEYS: Final = 1 << 20
#: The tail is merged into ``main`` once it holds more than 1/TAIL_SHARE of it ...
TAIL_SHARE: Final = 16
#: ... and more than this many keys.
MIN_TAIL: Final = 4096
_RUN = f"{readonly('uint64')}, {readonly('uint64')}, {readonly('int64')}"


@kernel(f"int64({_RUN}, {_RUN}, uint64[::1], uint64[::1], int64[::1])")
def _merge_into(ac: U64, af: U64, ai: I64, bc: U64, bf: U64, bi: I64, oc: U64, of: U64, oi: I64) -> int:
    """The first ``len(oc)`` keys of runs a and b (each sorted by (column, feature), keys
    distinct), merged into ``oc``/``of``/``oi``; returns how many were written."""
    i = j = k = 0
    na, nb, n = ac.shape[0], bc.shape[0], oc.shape[0]
    while k < n and (i < na or j < nb):
        if j >= nb or (i < na and (ac[i] < bc[j] or (ac[i] == bc[j] and af[i] < bf[j]))):
            oc[k], of[k], oi[k] = ac[i], af[i], ai[i]
            i += 1
        else:
            oc[k], of[k], oi[k] = bc[j], bf[j], bi[j]
            j += 1
        k += 1
    return k


@kernel(f"int64({readonly('uint64')}, {readonly('uint64')}, {readonly('uint64')}, {readonly('uint64')},"
        " uint64[::1], uint64[::1])")
def _difference_into(ac: U64, af: U64, bc: U64, bf: U64, oc: U64, of: U64) -> int:
    """The keys of run a not in run b (both sorted by (column, feature), keys distinct), in order,
    into ``oc``/``of``; returns how many."""
    j = k = 0
    nb = bc.shape[0]
    for i in range(ac.shape[0]):
        c, f = ac[i], af[i]
        while j < nb and (bc[j] < c or (bc[j] == c and bf[j] < f)):
            j += 1
        if j < nb and bc[j] == c and bf[j] == f:
            continue
        oc[k], of[k] = c, f
        k += 1
    return k


def difference(ac: U64, af: U64, bc: U64, bf: U64) -> tuple[U64, U64]:
    """The keys (ac[i], af[i]) that are not among (bc[j], bf[j]), sorted: both lists sorted by
    (column, feature) with distinct keys (a store's key listings). One compiled merge pass."""
    if bc.shape[0] == 0:
        return ac, af
    oc, of = np.empty(ac.shape[0], np.uint64), np.empty(ac.shape[0], np.uint64)
    c = np.ascontiguousarray
    k = _difference_into(c(ac, np.uint64), c(af, np.uint64), c(bc, np.uint64), c(bf, np.uint64), oc, of)
    return oc[:k], of[:k]


def _sorted(c: U64, f: U64, ids: I64) -> Keys:
    """The keys sorted by (column, feature), with their ids: ``np.lexsort((f, c))``'s order.

    Sorted by column first (numpy's unstable, vectorised sort: 2.2 ms for 1.5·10^5 random keys,
    its stable one 8.8), then by (column's rank, feature) packed into one uint64 where both fit (a
    store's do: ranks < rows, features small ids): one ``lexsort`` of one key that is in order but
    for the features within each column. 2x cheaper than ``lexsort``'s two stable sorts of both
    keys (11 against 24 ms for 1.5·10^5 keys, 235 against 500 for 2·10^6; a source's first key
    listing sorts every key). Falls back to those where the two do not fit, or where keys repeat
    (``lexsort`` keeps ties in id order, the unstable first sort would not; a store's keys are
    distinct)."""
    n = c.shape[0]
    if n < 2:
        return c.copy(), f.copy(), ids.copy()
    by_column = np.argsort(c)
    cs, fs = c[by_column], f[by_column]
    packed = np.empty(n, np.uint64)  # the column's rank, 1 based, then the feature's bits
    packed[0] = 1
    np.not_equal(cs[1:], cs[:-1], out=packed[1:])
    np.cumsum(packed, out=packed)
    f_bits = int(fs.max()).bit_length()
    if int(packed[-1]).bit_length() + f_bits <= 64:
        np.left_shift(packed, np.uint64(f_bits), out=packed)
        np.bitwise_or(packed, fs, out=packed)
        within = np.lexsort((packed,))
        np.take(packed, within, out=packed)  # in place: numpy buffers the take when out overlaps
        repeats = bool((packed[1:] == packed[:-1]).any())
        del packed  # each temporary goes as soon as it is used: a store's first listing sorts every key
        if not repeats:
            cs, fs = cs[within], fs[within]
            np.take(by_column, within, out=by_column)
            return cs, fs, ids[by_column]
    del by_column, cs, fs
    order = np.lexsort((f, c))
    return c[order], f[order], ids[order]


def _merge(a: Keys, b: Keys, count: int | None = None) -> Keys:
    """Two sorted runs of distinct keys as one (its first ``count`` keys when given): one
    compiled pass."""
    if count is None:
        if not b[0].shape[0]:
            return a
        if not a[0].shape[0]:
            return b
    n = a[0].shape[0] + b[0].shape[0] if count is None else min(count, a[0].shape[0] + b[0].shape[0])
    out: Keys = (np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n, np.int64))
    _merge_into(*a, *b, *out)
    return out


def _distinct(sorted_columns: U64) -> U64:
    """The distinct values of a sorted array, in order."""
    if sorted_columns.shape[0] < 2:
        return sorted_columns.copy()
    first = np.empty(sorted_columns.shape[0], bool)
    first[0] = True
    np.not_equal(sorted_columns[1:], sorted_columns[:-1], out=first[1:])
    return sorted_columns[first]


def _from(keys: Keys, after: tuple[int, int] | None) -> int:
    """The position of the first key >= ``after`` in a sorted run (0: no cursor)."""
    if after is None:
        return 0
    c, f = keys[0], keys[1]
    ac = np.uint64(after[0])
    lo, hi = int(np.searchsorted(c, ac, "left")), int(np.searchsorted(c, ac, "right"))
    return lo + int(np.searchsorted(f[lo:hi], np.uint64(after[1]), "left"))


#: A main run made apart (a worker thread) and its distinct columns (``SortedKeys.columns``), made
#: there too: both passes are O(rows).
MainRun = tuple[Keys, U64]


def _columns_of(main: Keys) -> U64:
    """A main run's distinct columns, read-only (``SortedKeys.columns`` hands them out as they are)."""
    columns = _distinct(main[0])
    columns.flags.writeable = False
    return columns


def _with_columns(main: Keys) -> MainRun:
    return main, _columns_of(main)


def sorted_rows(keys_a: U64, keys_b: U64, num_rows: int) -> MainRun:
    """The keys of rows ``[0, num_rows)`` sorted, with their ids: a whole index's main run, built
    apart (a worker thread) and given to ``SortedKeys.install``. Pure: reads the arrays only."""
    return _with_columns(_sorted(keys_a[:num_rows], keys_b[:num_rows], np.arange(num_rows, dtype=np.int64)))


def extended_tail(keys_a: U64, keys_b: U64, tail: Keys, first: int, num_rows: int) -> Keys:
    """``tail`` with the keys of rows ``[first, num_rows)`` sorted in: a sort of those rows only,
    then one compiled merge pass. Pure: reads the arrays only (``SortedKeys.refresh`` calls it on the
    caller's thread; a storage node, once many rows wait, in a worker thread: ``tail_source``)."""
    new = _sorted(keys_a[first:num_rows], keys_b[first:num_rows], np.arange(first, num_rows, dtype=np.int64))
    return _merge(tail, new)


def merge_runs(main: Keys, tail: Keys) -> MainRun:
    """``main`` and ``tail`` merged (one compiled pass): ``merge_source``'s runs, in a worker
    thread, for ``install_merge``. Pure: reads the runs only."""
    return _with_columns(_merge(main, tail))


class SortedKeys:
    """The sorted keys of one store (module docstring). ``refresh`` first, with the engine's
    keys, its row count and the store's drop count; then ``full`` or ``window``."""

    def __init__(self) -> None:
        empty: Keys = (np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.int64))
        self._main, self._tail = empty, empty
        self._n = 0  # ids [0, n) are in main or tail
        self._drops = -1
        #: main's distinct columns (``columns``), kept until main changes (None: not made since)
        self._main_columns: U64 | None = None
        #: merges of the tail into a main of more keys than this are left to another thread
        #: (``merge_source``/``install_merge``); None: every merge inline (the core, tests)
        self.merge_apart: int | None = None
        #: such a merge is due (set by ``refresh``)
        self.merge_due = False

    def _set_runs(self, main: Keys, tail: Keys, columns: U64 | None = None) -> None:
        if main is not self._main:
            self._main_columns = columns
        self._main, self._tail = main, tail

    def refresh(self, keys_a: U64, keys_b: U64, num_rows: int, drops: int) -> None:
        """Take in the rows created since the last call (ids ``[covered, num_rows)``; ``keys_a``/
        ``keys_b``: the engine's keys by id), or start again after a drop."""
        if drops != self._drops or num_rows < self._n:
            main = _sorted(keys_a[:num_rows], keys_b[:num_rows], np.arange(num_rows, dtype=np.int64))
            self._set_runs(main, (main[0][:0], main[1][:0], main[2][:0]))
            self._n, self._drops = num_rows, drops
            return
        if num_rows == self._n:
            return
        self._tail = extended_tail(keys_a, keys_b, self._tail, self._n, num_rows)
        self._n = num_rows
        self._tail_grew()

    def _tail_grew(self, apart: bool = False) -> None:
        """The tail took rows in: merge it into main once it outgrows its share, or say so where
        such merges are left to another thread (``merge_apart``: those into a larger main; with
        ``apart``, all of them: the tail took in rows sorted apart, which may be many)."""
        if self._tail[0].shape[0] > max(MIN_TAIL, self._main[0].shape[0] // TAIL_SHARE):
            if self.merge_apart is None or (not apart and self._main[0].shape[0] <= self.merge_apart):
                self._fold()
            else:
                self.merge_due = True

    def behind(self, num_rows: int, drops: int) -> int:
        """How many rows were created since the keys last took rows in (0 when the keys are not
        current for ``drops``: a rebuild, the start's sort or a listing's, is what they need)."""
        return num_rows - self._n if self._drops == drops and num_rows > self._n else 0

    def tail_source(self, num_rows: int, drops: int) -> TailSource | None:
        """What a worker thread needs to take the rows created since in (``extended_tail``): (the
        tail, the first row not covered, ``num_rows``, ``drops``); None when nothing is behind.
        The tail is never written, only replaced, so the thread reads it while this object goes
        on."""
        if not self.behind(num_rows, drops):
            return None
        return self._tail, self._n, num_rows, drops

    def install_tail(self, tail: Keys, source: TailSource) -> bool:
        """Take ``tail`` (``extended_tail`` of ``tail_source``'s tail and rows) as the tail, unless
        the tail or the rows covered changed meanwhile (a listing took the rows in itself, a merge
        into main or a drop replaced the runs): then the next ``refresh`` takes them in as before.
        Returns whether it was taken."""
        old, first, num_rows, drops = source
        if old is not self._tail or first != self._n or drops != self._drops:
            return False
        self._tail, self._n = tail, num_rows
        self._tail_grew(apart=True)
        return True

    def merge_source(self) -> tuple[Keys, Keys, int, int] | None:
        """The runs of a due merge (``merge_due``), for ``merge_runs`` in another thread: (main,
        tail, rows covered, drops). The runs are never written, only replaced, so the thread reads
        them while this object goes on; None when no merge is due."""
        if not self.merge_due:
            return None
        return self._main, self._tail, self._n, self._drops

    def install_merge(self, merged: MainRun, main: Keys, rows: int, drops: int) -> bool:
        """Take ``merged`` (``merge_runs`` of ``merge_source``'s main and tail) as the main run: the
        tail keeps the rows created since (ids from ``rows`` on). Refused (False) when main changed
        meanwhile (a full listing merged it, a drop filtered it: ``drops``); the next ``refresh``
        then says again whether a merge is due."""
        self.merge_due = False
        if main is not self._main or drops != self._drops or rows > self._n:
            return False
        tail = self._tail
        newer = tail[2] >= rows
        self._set_runs(merged[0], (tail[0][newer], tail[1][newer], tail[2][newer]), merged[1])
        return True

    def install(self, main: MainRun, num_rows: int, drops: int) -> bool:
        """Take ``main`` (``sorted_rows`` of the rows ``[0, num_rows)`` of the store at its drop
        count ``drops``, sorted in another thread) as the main run, unless these keys are current
        for ``drops`` already (a listing built them meanwhile); the next ``refresh`` then sorts only
        the rows created since. The caller checks that ``drops`` is still the store's. Returns
        whether it was taken."""
        if self.current(drops):
            return False
        keys = main[0]
        self._set_runs(keys, (keys[0][:0], keys[1][:0], keys[2][:0]), main[1])
        self._n, self._drops = num_rows, drops
        return True

    def current(self, drops: int) -> bool:
        """Whether these keys were built for the store's ``drops`` (a drop since leaves them to be
        rebuilt by the next ``refresh``)."""
        return self._drops == drops

    def drop(self, keep: NDArray[np.bool_], drops: int) -> None:
        """Follow a drop of rows (``keep``: a flag per row id, the rows renumbered densely in id
        order, as ``RowEngine.drop_rows`` does; ``drops``: the store's drop count after it) without
        sorting again: each run filtered and its ids renumbered, one linear pass. Only keys that
        were current before the drop (``current(drops - 1)``) and cover every row are followed;
        others are left to the next ``refresh``'s rebuild."""
        keep = np.asarray(keep, bool)
        if not self.current(drops - 1) or keep.shape[0] != self._n:
            return
        new_id = renumbered(keep)  # (numpy's cumsum holds the GIL: this runs in a worker thread)

        def kept(run: Keys) -> Keys:
            hit = keep[run[2]]
            return run[0][hit], run[1][hit], new_id[run[2][hit]]

        main = kept(self._main)  # (main's columns too: this runs in the drop's worker thread)
        self._set_runs(main, kept(self._tail), _columns_of(main))
        self._n = int(new_id[-1]) + 1 if keep.shape[0] else 0
        self._drops = drops

    def _fold(self) -> None:
        main = _merge(self._main, self._tail)
        self._set_runs(main, (main[0][:0], main[1][:0], main[2][:0]))
        self.merge_due = False

    def columns(self) -> U64:
        """Every column that has a row, sorted, unique: main's (one pass over it, kept until main
        changes) merged with the tail's. Costs O(columns + tail), not a pass over every key, so
        that a listing of the held columns (a topology operation's ``ListColumns`` and each
        ``SourceStart``, a release) does not grow with the rows (until Nov 30 it merged the tail
        into main and walked every key)."""
        if self._main_columns is None:
            self._main_columns = _columns_of(self._main)
        main, tail = self._main_columns, _distinct(self._tail[0])
        if not tail.shape[0]:
            return main
        # the tail's columns main lacks, inserted in order (a merge: numpy's ``union1d`` uniques the
        # concatenation with a hash table, ~100 ms for 3·10^5 columns here)
        at = np.searchsorted(main, tail)
        held = np.zeros(tail.shape[0], bool)
        inside = at < main.shape[0]
        held[inside] = main[at[inside]] == tail[inside]
        return np.insert(main, at[~held], tail[~held])

    def full(self) -> Keys:
        """Every key, sorted, and its row id (the tail merged in first; the arrays are shared:
        do not change them)."""
        if self._tail[0].shape[0]:
            self._fold()
        return self._main

    def of_columns(self, columns: U64) -> Keys:
        """The keys (sorted) and row ids of every row of ``columns`` (any order, repeats allowed):
        each run's range of each column by binary search, then the two merged: the columns' rows'
        cost, not the store's (a stream source lists its columns this way at the start and at
        verification)."""
        wanted = unique(np.asarray(columns).astype(np.uint64, copy=False))
        found = []
        for run in (self._main, self._tail):
            lo = np.searchsorted(run[0], wanted, "left")
            at = range_positions(lo, np.searchsorted(run[0], wanted, "right") - lo)
            found.append((run[0][at], run[1][at], run[2][at]))
        return _merge(found[0], found[1])

    def window(self, after: tuple[int, int] | None, count: int) -> tuple[Keys, bool]:
        """The first ``count`` keys >= ``after`` (all keys when None), sorted, with their row ids,
        and whether more keys follow them: from each run its next ``count`` keys, merged, so the
        cost is the window's, not the store's."""
        parts = []
        more = False
        for run in (self._main, self._tail):
            at = _from(run, after)
            parts.append((run[0][at:at + count], run[1][at:at + count], run[2][at:at + count]))
            more = more or at + count < run[0].shape[0]
        if not parts[1][0].shape[0]:  # nothing of the tail from the cursor on: views of main
            return parts[0], more
        more = more or parts[0][0].shape[0] + parts[1][0].shape[0] > count
        return _merge(parts[0], parts[1], count), more
