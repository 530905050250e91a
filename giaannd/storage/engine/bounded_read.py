"""Which rows of a bounded read go in its reply (``ColumnStore.read_bounded``), in one compiled pass.

A ``ReadRows`` of a client that reads large rows by parts (protocol "Rows of any size") is answered
with the requested rows, in key order, while they add up to at most ``max_entries`` entries; a row
longer than that is left out of the reply and listed as large (at most ``max_large`` of them, then
the reply stops), and the reply stops before the first row that does not fit, so the client asks
again for the keys after it.

Why compiled: the same rule as whole-array passes (the lengths gathered, two cumulative sums, masks,
an argmax and three ``flatnonzero``) was ~15 numpy calls, ~25 µs of a small read's ~45 µs on the
node (a read of 1 to 16 rows, the per-token fetch of inference: tools/bench/readpath.py), whatever
the rows' sizes. One loop over the keys answers the same.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly

__all__ = ["BoundedPick", "pick_bounded"]

I64 = NDArray[np.int64]


@kernel(f"int64({readonly('int64')}, {readonly('int64')}, int64, int64, int64[::1], int64[::1], int64[::1])")
def _pick(ids: I64, lengths: I64, max_entries: int, max_large: int, pick: I64, listed: I64, counts: I64) -> int:
    """Fill ``pick`` (keys whose rows go in the reply) and ``listed`` (keys of large rows) with key
    indexes, ``counts`` with how many of each; return where the reply stops (``ids``' length when
    it takes every key)."""
    taken = 0
    large = 0
    npick = 0
    nlisted = 0
    stop: int = ids.shape[0]
    for i in range(ids.shape[0]):
        r = ids[i]
        n = lengths[r] if r >= 0 else 0  # (a stored row is never empty: 0 is absent)
        if n > max_entries:
            large += 1
            if large > max_large:
                stop = i
                break
            listed[nlisted] = i
            nlisted += 1
        elif n > 0:
            if taken + n > max_entries:
                stop = i
                break
            taken += n
            pick[npick] = i
            npick += 1
    counts[0] = npick
    counts[1] = nlisted
    return stop


class BoundedPick(NamedTuple):
    """``pick_bounded``'s answer: key indexes (ascending) of the rows in the reply and of the large
    rows listed, and the index of the first key the reply does not reach (the key count when none)."""

    pick: I64
    listed: I64
    stop: int


def pick_bounded(ids: I64, lengths: I64, max_entries: int, max_large: int) -> BoundedPick:
    """The rows of a bounded read (module docstring). ``ids``: each requested key's row id, -1 when
    absent, keys in ascending order; ``lengths``: entries per row id (every id in ``ids`` below
    its length).

    Raises:
        ValueError: an id past ``lengths`` (the kernel reads without bounds checks).
    """
    ids = np.ascontiguousarray(ids, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    m = ids.shape[0]
    if m and int(ids.max()) >= lengths.shape[0]:
        raise ValueError("pick_bounded: a row id past the lengths")
    pick, listed, counts = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(2, np.int64)
    stop = int(_pick(ids, lengths, max_entries, max_large, pick, listed, counts))
    return BoundedPick(pick[: counts[0]], listed[: counts[1]], stop)
