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
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from giaannd.protocol import BatchId

__all__ = ["AppliedSet", "BatchId"]

_U64_MAX = 0xFFFFFFFFFFFFFFFF


def _check(batch_id: BatchId) -> None:
    if not (0 <= batch_id.writer <= _U64_MAX and 1 <= batch_id.seq <= _U64_MAX):
        raise ValueError(f"batch id out of range: {batch_id}")


class AppliedSet:
    """Applied batch ids with per-writer floors (module docstring)."""

    __slots__ = ("_floor", "_above")

    def __init__(self) -> None:
        self._floor: dict[int, int] = {}
        self._above: dict[int, set[int]] = {}

    def __contains__(self, batch_id: object) -> bool:
        if not isinstance(batch_id, tuple) or len(batch_id) != 2:
            return False
        writer, seq = batch_id
        return seq <= self._floor.get(writer, 0) or seq in self._above.get(writer, ())

    def add(self, batch_id: BatchId) -> None:
        _check(batch_id)
        writer, seq = batch_id
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

    def floor(self, writer: int) -> int:
        return self._floor.get(writer, 0)

    def __len__(self) -> int:
        """Number of stored ids (floors + exceptions): the memory it takes, not the ids it covers."""
        return len(self._floor) + sum(len(s) for s in self._above.values())

    def writers(self) -> Iterator[int]:
        return iter(sorted(set(self._floor) | set(self._above)))

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
            if f:
                out._floor[w] = f
            if exc:
                out._above[w] = set(exc)
        return out
