"""Sorted distinct values of a 1-d array, by a sort.

Why not ``np.unique``: numpy 2.4 answers ``np.unique(values)`` (no ``return_index``,
``return_inverse`` or ``return_counts``) from a hash table it then sorts, which on this project's
arrays of 64-bit ids is 10-40x slower than sorting and keeping each run's first value, from about
a thousand values up (Dec 1, numpy 2.4.6, this VM: 10^3 random ids 63 against 6 µs, 10^5 16-22 ms
against 0.65, 10^6 0.41-0.44 s against 10 ms; a replay window's 2·10^5 row ids ~50 ms against ~1;
numpy's issue #28375 tracks its hash-based unique). With ``return_inverse`` numpy sorts, and
those calls stay as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["unique"]


def unique(values: ArrayLike) -> NDArray[Any]:
    """``np.unique(values)`` (flattened, as numpy does): its distinct values, ascending, of its
    dtype; ``values`` is left as it was. Integer and boolean arrays by a sort; any other dtype is
    numpy's own (NaNs collapse as numpy collapses them)."""
    a = np.asarray(values)
    if a.dtype.kind not in "iub":  # (floats: numpy's NaN rule; others: its own order)
        return np.unique(a)
    s = np.sort(a.reshape(-1))
    if s.shape[0] < 2:
        return s
    keep = np.empty(s.shape[0], bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
