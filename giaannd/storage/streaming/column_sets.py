"""Sets of column ids as sorted, unique uint64 arrays, for the checks made on every write a stream
sees (a source's delta filter, a receiver's direct-write dedupe).

Why not ``np.isin`` / ``np.setdiff1d`` / ``np.union1d``: they sort their inputs together on every
call, O((m + C) log(m + C)) for m values against a set of C columns, and a stream's set holds every
column it carries (up to 10^5-10^6 at the mission's size): tens of milliseconds per write on the
event loop. A binary search per value costs O(m log C), and growing the set (only when a write
brings columns it lacks) one insert, O(C).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.unique import unique

__all__ = ["member", "missing", "with_columns"]

U64 = NDArray[np.uint64]


def member(values: U64, columns: U64) -> NDArray[np.bool_]:
    """Per value: is it in ``columns`` (sorted, unique)?"""
    if not columns.shape[0]:
        return np.zeros(values.shape[0], bool)
    at = np.searchsorted(columns, values)
    at[at == columns.shape[0]] = 0
    out: NDArray[np.bool_] = columns[at] == values
    return out


def missing(columns: U64, values: U64) -> U64:
    """The ``values`` (any order, repeats allowed) not in ``columns`` (sorted, unique): sorted, unique."""
    new = unique(np.asarray(values, np.uint64))
    out: U64 = new[~member(new, columns)]
    return out


def with_columns(columns: U64, values: U64) -> U64:
    """``columns`` (sorted, unique) with ``values`` added (any order, repeats allowed): the same
    array when nothing is new."""
    new = missing(columns, values)
    if not new.shape[0]:
        return columns
    return np.insert(columns, np.searchsorted(columns, new), new)
