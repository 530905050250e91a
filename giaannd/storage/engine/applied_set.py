"""The set of applied batch ids, kept compact: per-writer high-water mark plus exceptions.

A batch id is ``(writer, seq)``: ``writer`` a 64-bit id unique to one writer's lifetime (a compute
node picks a random one at start, or derives it from node id + incarnation), ``seq`` counts up from 1
in that writer. One writer's batches go to many owner sets, so one storage node sees each writer's
sequence with gaps and out of order. The representation per writer is therefore

- ``floor``: every seq <= floor is *settled*: applied here, or promised by the writer never to be sent
  (``advance_floor``; the service layer carries the writer's "lowest seq still in flight" with its
  batches), and
- ``above``: the applied seqs > floor (a Python set).

Membership is ``seq <= floor or seq in above``. Without floors the structure degrades to a plain set
(correct, just larger); with floors it holds O(writers + batches in flight) ids, independent of
history, so snapshots stay small. Why not a plain set: it grows without bound over months of
training. Why not a high-water mark alone: the gaps (batches that went to other owners) would stop
it advancing, or, if it jumped over them, a late batch inside a gap would be wrongly ignored.

**Which columns of a batch were applied.** A node can receive *more than one share* of one batch
id: its own share from the writer, then, after a placement change, rows it owns only under the new
placement (a hint re-split by its holder, a writer's retry under the new placement; docs/topology.md).
Ignoring the later share because the id "was applied" lost those rows (the replace-during-training
defect). A column's rows of a batch are the same in every share (batches are split by the owners of
each column), so for training writers the unit of idempotency is **(batch id, column)**: the set
keeps, for every applied seq above the writer's promised floor, the columns applied under it
(``columns``), and a later share applies only the columns not seen yet (``ColumnStore.prepare``).

- Only *tracked* writers get this: a training writer is tracked from its first write (``track``,
  logged as a floor record so a replay tracks it again; kept in snapshots). Stream items and
  stream markers use writer ids of their own that are never tracked, so their (contiguous,
  unbounded) seqs keep costing nothing.
- ``promise(writer, floor)``, the writer's "never sent again" carried on every write, drops the
  columns at or below it: memory stays O(batches in flight). Not logged (a replay brings back the
  columns of the seqs in the log; the writer's next floor drops them again).
- An id applied for an untracked writer, at or below the promised floor, or with columns unknown
  counts as wholly applied: the behaviour before this change.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from giaannd.protocol import BatchId
from giaannd.unique import unique

__all__ = ["AppliedSet", "BatchId"]

_U64_MAX = 0xFFFFFFFFFFFFFFFF
_NO_COLUMNS: NDArray[np.uint64] = np.zeros(0, np.uint64)
_NO_COLUMNS.flags.writeable = False


def _check(batch_id: BatchId) -> None:
    if not (0 <= batch_id.writer <= _U64_MAX and 1 <= batch_id.seq <= _U64_MAX):
        raise ValueError(f"batch id out of range: {batch_id}")


class AppliedSet:
    """Applied batch ids with per-writer floors (module docstring)."""

    __slots__ = ("_floor", "_above", "_promised", "_columns")

    def __init__(self) -> None:
        self._floor: dict[int, int] = {}
        self._above: dict[int, set[int]] = {}
        #: per writer: the highest floor it promised (``promise``); seqs at or below it are whole
        self._promised: dict[int, int] = {}
        #: per writer: seq above the promised floor -> the columns applied under it (sorted, unique)
        self._columns: dict[int, dict[int, NDArray[np.uint64]]] = {}

    def __contains__(self, batch_id: object) -> bool:
        if not isinstance(batch_id, tuple) or len(batch_id) != 2:
            return False
        writer, seq = batch_id
        return seq <= self._floor.get(writer, 0) or seq in self._above.get(writer, ())

    def columns(self, batch_id: BatchId) -> NDArray[np.uint64] | None:
        """The columns applied under ``batch_id``: an empty array when none, None when the whole
        batch counts as applied (module docstring: untracked writer, promised, columns unknown)."""
        writer, seq = batch_id
        applied = batch_id in self
        if writer not in self._promised or seq <= self._promised[writer]:
            return None if applied else _NO_COLUMNS
        known = self._columns.get(writer, {}).get(seq)
        if known is not None:
            return known
        return None if applied else _NO_COLUMNS

    def tracked(self, writer: int) -> bool:
        """Whether ``writer``'s batches are idempotent per column (module docstring)."""
        return writer in self._promised

    def add(self, batch_id: BatchId, columns: NDArray[np.uint64] | None = None) -> None:
        """Record ``batch_id`` as applied; with ``columns`` (sorted, unique) and a tracked writer,
        also which of its columns (merged with those recorded before)."""
        _check(batch_id)
        writer, seq = batch_id
        if columns is not None and seq > self._promised.get(writer, _U64_MAX):
            per = self._columns.setdefault(writer, {})
            had = per.get(seq)
            if had is not None or batch_id not in self:  # applied before without columns stays whole
                per[seq] = columns if had is None else np.union1d(had, columns)
        floor = self._floor.get(writer, 0)
        if seq <= floor:
            return
        above = self._above.setdefault(writer, set())
        above.add(seq)
        # Absorb a contiguous run just above the floor (the common, in-order case keeps `above` empty).
        while floor + 1 in above:
            floor += 1
            above.discard(floor)
        self._floor[writer] = floor
        if not above:
            del self._above[writer]

    def advance_floor(self, writer: int, floor: int) -> None:
        """Record the writer's promise that no batch with seq <= ``floor`` will be sent again."""
        self.promise(writer, floor)
        if floor <= self._floor.get(writer, 0):
            return
        above = {s for s in self._above.get(writer, ()) if s > floor}
        while floor + 1 in above:
            floor += 1
            above.discard(floor)
        self._floor[writer] = floor
        if above:
            self._above[writer] = above
        else:
            self._above.pop(writer, None)

    def promise(self, writer: int, floor: int) -> None:
        """Track ``writer`` (module docstring) and record that it will never send a seq <=
        ``floor`` again: those seqs' columns are forgotten (they count as whole from now on)."""
        if writer in self._promised and floor <= self._promised[writer]:
            return
        self._promised[writer] = max(floor, self._promised.get(writer, 0))
        per = self._columns.get(writer)
        if per:
            for seq in [q for q in per if q <= floor]:
                del per[seq]
            if not per:
                del self._columns[writer]

    def promised(self, writer: int) -> int:
        return self._promised.get(writer, 0)

    def floor(self, writer: int) -> int:
        return self._floor.get(writer, 0)

    def __len__(self) -> int:
        """Number of stored ids (floors + exceptions): the memory it takes, not the ids it covers.
        Safe beside a thread that adds ids (a fold's held writes applied in a worker thread while
        the event loop reads ``used_bytes``): the values are listed in one C call under the GIL, where
        a Python loop over the dict raised "dictionary changed size during iteration"."""
        return len(self._floor) + sum(map(len, list(self._above.values())))

    def writers(self) -> Iterator[int]:
        return iter(sorted(set(self._floor) | set(self._above)))

    def touching(self, columns: NDArray[np.uint64]) -> list[BatchId]:
        """The ids applied here with at least one of ``columns`` (sorted, unique) among their
        recorded columns: tracked writers' ids above the promised floors, those a share may still
        come for (a writer's retry, a hint's re-split). A stream names those among its columns
        with its first chunk, so that its target ignores their rows when such a share comes there
        (streaming/dedupe.py, "Chunks"). Ids whose columns are not recorded (untracked writers, at
        or below a promise) are not listed. One pass over the ids in flight, whole-array tests;
        safe beside a thread that adds ids (each dict is listed in one C call, as ``__len__``)."""
        keys: list[tuple[int, int]] = []
        parts: list[NDArray[np.uint64]] = []
        for writer, per in list(self._columns.items()):
            for seq, cols in list(per.items()):
                keys.append((writer, seq))
                parts.append(cols)
        columns = np.asarray(columns, np.uint64)
        if not parts or columns.shape[0] == 0:
            return []
        cat = np.concatenate(parts)
        pos = np.minimum(np.searchsorted(columns, cat), columns.shape[0] - 1)
        hit = columns[pos] == cat
        owner = np.repeat(np.arange(len(parts)), [p.shape[0] for p in parts])
        return [BatchId(*keys[i]) for i in unique(owner[hit]).tolist()]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AppliedSet):
            return NotImplemented
        return self.to_arrays_equal(other)

    def to_arrays_equal(self, other: AppliedSet) -> bool:
        return all(np.array_equal(a, b) for a, b in zip(self.to_arrays(), other.to_arrays()))

    __hash__ = None  # type: ignore[assignment]

    # -- serialisation (snapshots) ----------------------------------------------------------------
    def to_arrays(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]:
        """(writers, floors, exception counts, exceptions concatenated, each writer's sorted)."""
        ws = list(self.writers())
        floors = [self._floor.get(w, 0) for w in ws]
        exc = [sorted(self._above.get(w, ())) for w in ws]
        flat = [s for e in exc for s in e]
        return (
            np.array(ws, np.uint64), np.array(floors, np.uint64),
            np.array([len(e) for e in exc], np.uint64), np.array(flat, np.uint64),
        )

    def column_arrays(self) -> tuple[NDArray[np.uint64], ...]:
        """The per-column state (snapshots): (tracked writers, their promised floors) and the
        recorded columns as (writers, seqs, column counts, columns concatenated), sorted."""
        tracked = sorted(self._promised)
        keys = sorted((w, q) for w, per in self._columns.items() for q in per)
        cols = [self._columns[w][q] for w, q in keys]
        return (np.array(tracked, np.uint64), np.array([self._promised[w] for w in tracked], np.uint64),
                np.array([w for w, _ in keys], np.uint64), np.array([q for _, q in keys], np.uint64),
                np.array([c.shape[0] for c in cols], np.uint64),
                np.concatenate(cols).astype(np.uint64, copy=False) if cols else np.zeros(0, np.uint64))

    def load_column_arrays(self, tracked: NDArray[np.uint64], promised: NDArray[np.uint64],
                           writers: NDArray[np.uint64], seqs: NDArray[np.uint64],
                           counts: NDArray[np.uint64], columns: NDArray[np.uint64]) -> None:
        """Inverse of ``column_arrays`` (on a set whose ids are loaded); raises ValueError if the
        arrays are inconsistent or name a batch that is not applied above a tracked floor."""
        if tracked.shape != promised.shape or not (writers.shape == seqs.shape == counts.shape):
            raise ValueError("applied columns: arrays disagree in length")
        if int(counts.sum(dtype=np.uint64)) != columns.shape[0]:
            raise ValueError("applied columns: column count does not match")
        self._promised = dict(zip(tracked.tolist(), promised.tolist()))
        self._columns = {}
        n = writers.shape[0]
        if n == 0:
            return
        # Whole-array checks (a snapshot of a busy node holds ~10^4 such batches: a check per batch
        # in Python was a quarter of its load), the first failing batch named.
        counts_i = counts.astype(np.int64)
        ends = np.cumsum(counts_i)
        starts = ends - counts_i
        order = np.argsort(tracked, kind="stable")
        t_sorted, p_sorted = tracked[order], promised[order]
        at = np.minimum(np.searchsorted(t_sorted, writers), max(t_sorted.shape[0] - 1, 0))
        good = np.zeros(n, bool)
        if t_sorted.shape[0]:
            good = (t_sorted[at] == writers) & (seqs > p_sorted[at])  # tracked, above its promise
        for w in unique(writers).tolist():  # applied: at or below the floor, or above it (few writers)
            mine = writers == w
            applied = seqs[mine] <= self._floor.get(w, 0)
            above = self._above.get(w)
            if above:
                applied |= np.isin(seqs[mine], np.fromiter(above, np.uint64, len(above)))
            good[mine] &= applied
        if columns.shape[0] > 1:  # each batch's columns ascending (pairs across batches not compared)
            rising = columns[1:] > columns[:-1]
            edges = ends[:-1] - 1
            rising[edges[(edges >= 0) & (edges < rising.shape[0])]] = True
            good[np.searchsorted(ends, np.flatnonzero(~rising), "right")] = False  # the batch of each fall
        if not good.all():
            i = int(np.flatnonzero(~good)[0])
            raise ValueError(f"applied columns: batch {(int(writers[i]), int(seqs[i]))} not applied above a tracked "
                             "floor, or its columns not sorted")
        # one copy of every column, each batch's a view of it (they go as their seqs are promised)
        kept = np.array(columns, np.uint64)
        for w, q, a, z in zip(writers.tolist(), seqs.tolist(), starts.tolist(), ends.tolist()):
            self._columns.setdefault(w, {})[q] = kept[a:z]

    @classmethod
    def from_arrays(
        cls,
        writers: NDArray[np.uint64],
        floors: NDArray[np.uint64],
        counts: NDArray[np.uint64],
        exceptions: NDArray[np.uint64],
    ) -> AppliedSet:
        """Inverse of ``to_arrays``; raises ValueError if the arrays are inconsistent."""
        if not (writers.shape == floors.shape == counts.shape):
            raise ValueError("applied set: writer arrays disagree in length")
        if int(counts.sum(dtype=np.uint64)) != exceptions.shape[0]:
            raise ValueError("applied set: exception count does not match")
        if writers.shape[0] > 1 and not np.all(writers[1:] > writers[:-1]):
            raise ValueError("applied set: writers not sorted and unique")
        out = cls()
        pos = 0
        for w, f, c in zip(writers.tolist(), floors.tolist(), counts.tolist()):
            exc = exceptions[pos : pos + c].tolist()
            pos += c
            if any(s <= f for s in exc) or len(set(exc)) != len(exc) or (f == 0 and not exc):
                raise ValueError(f"applied set: writer {w} has an invalid floor/exception list")
            # a floor of 0 is kept too: ``add`` keeps one for a writer seen with a gap below its
            # first seq, and ``__len__`` (``used_bytes``) counts it, so a restart changes no size
            out._floor[w] = f
            if exc:
                out._above[w] = set(exc)
        return out
