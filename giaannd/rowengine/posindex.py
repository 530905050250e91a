"""Bucketed position index of a delta run: where a base position falls, in two gathers.

A delta run's entries carry ``pos``, their lower bound in the base (run.py), sorted. Every batch
looks up tens of thousands of positions in every delta run, and ``np.searchsorted`` pays a binary
search of ~20 dependent, cache-missing steps per query on a run of 10^6 entries (measured 13.5 ms
for 60k queries into 3·10^6 positions). Positions spread over ``[0, base length]`` (the base is
where the keys already are), so a table of the first entry of every bucket of ``2**shift``
positions, about ``BUCKET_ENTRIES`` entries per bucket, gives each query a range of a few entries
in two gathers.

``first[b]`` = the number of entries with ``pos >> shift < b``: one compiled walk over the sorted
positions (``_bucket_starts``), 8 bytes per bucket of 4-8 entries, so 1-2 bytes per entry. Buckets of about one
entry each, made by a ``bincount`` and a ``cumsum``, cost 8-16 bytes per entry and 5.6-6.4 ns per
entry to build (10^6-2·10^7 entries), which a storage node paid for every large delta run a plan
searched (15-21 % of its plans' samples in the cluster bench); with ~8 entries a bucket the build
is a sequential read of ``pos``, and a query's key search bisects ~3 more entries, in the same
cache lines. The bucket of a query holds every entry with the query's position and the query's
insertion point (at worst at one of its ends), which is all run.find_in_gaps needs: inside a row's
slice the entries are in key order, so a key search over any range that covers the insertion point
finds it. A skewed bucket costs rounds of that search, never a wrong answer: the entries of rows
the base does not hold yet all sit at one position (the end of the base), and the row's slice
narrows those.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly

__all__ = ["BUCKET_ENTRIES", "PosIndex"]

I64 = NDArray[np.int64]

#: At most about this many entries a bucket (a power of two; the shift rounds down, so 4-8).
BUCKET_ENTRIES = 8


@kernel(f"void({readonly('int64')}, int64, int64[::1])")
def _bucket_starts(pos: I64, shift: int, first: I64) -> None:
    """``first[b]``: how many of the sorted ``pos`` are below ``b << shift``, for every slot."""
    n = pos.shape[0]
    j = 0
    for b in range(first.shape[0]):
        limit = b << shift
        while j < n and pos[j] < limit:
            j += 1
        first[b] = j


class PosIndex:
    """Bucket bounds over one sorted, non-negative int64 array (module docstring)."""

    __slots__ = ("_first", "_nb", "_shift")

    def __init__(self, pos: I64) -> None:
        n = int(pos.shape[0])
        top = int(pos[-1]) + 1 if n else 1
        per_entry = (top // max(n, 1)).bit_length() - 1  # ~1 entry a bucket at this shift
        self._shift = max(0, per_entry + BUCKET_ENTRIES.bit_length() - 1)
        self._nb = (top >> self._shift) + 1
        self._first = np.empty(self._nb + 1, np.int64)
        _bucket_starts(np.ascontiguousarray(pos, np.int64), self._shift, self._first)

    @property
    def nbytes(self) -> int:
        return int(self._first.nbytes)

    @property
    def first(self) -> I64:
        """``first[b]``: the entries in buckets before ``b``; ``first[nb]`` is all of them."""
        return self._first

    @property
    def shift(self) -> int:
        """A position ``p`` is in bucket ``min(p >> shift, nb)``: every entry equal to ``p`` lies in
        ``[first[b], first[b + 1])`` (``first[nb]`` for the last), and so does its insertion point."""
        return self._shift
