"""Bucketed position index of a delta run: where a base position falls, in two gathers.

A delta run's entries carry ``pos``, their lower bound in the base (run.py), sorted. Every batch
looks up tens of thousands of positions in every delta run, and ``np.searchsorted`` pays a binary
search of ~20 dependent, cache-missing steps per query on a run of 10^6 entries (measured 13.5 ms
for 60k queries into 3·10^6 positions). Positions spread over ``[0, base length]`` (the base is
where the keys already are), so a table of the first entry of every bucket of ``2**shift``
positions, about one entry per bucket, gives each query a range of a few entries in two gathers.

``first[b]`` = the number of entries with ``pos >> shift < b`` (a ``bincount`` and a ``cumsum``,
O(entries), 8 bytes per entry). The bucket of a query holds every entry with the query's position
and the query's insertion point (at worst at one of its ends), which is all run.find_in_gaps needs:
inside a row's slice the entries are in key order, so a key search over any range that covers the
insertion point finds it. A skewed bucket costs rounds of that search, never a wrong answer: the
entries of rows the base does not hold yet all sit at one position (the end of the base), and the
row's slice narrows those.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["PosIndex"]

I64 = NDArray[np.int64]


class PosIndex:
    """Bucket bounds over one sorted, non-negative int64 array (module docstring)."""

    __slots__ = ("_first", "_nb", "_shift")

    def __init__(self, pos: I64) -> None:
        n = int(pos.shape[0])
        top = int(pos[-1]) + 1 if n else 1
        self._shift = max(0, (top // max(n, 1)).bit_length() - 1)  # ~1 entry per bucket
        self._nb = (top >> self._shift) + 1
        counts = np.bincount(pos >> self._shift, minlength=self._nb)
        self._first = np.zeros(self._nb + 1, np.int64)
        np.cumsum(counts, out=self._first[1:])

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
