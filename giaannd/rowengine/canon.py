"""One compiled pass that checks a row's entries are canonical (jit.py's kernels).

A row's entries are canonical when every segment is below the number of segments, every strength
is finite and the keys ``(segment, target_column, target_feature)`` are strictly ascending (the
entry order of giaannd/model/rows.py). ``first_non_canonical`` walks the four arrays once and
stops at the first entry that breaks a rule.

Why compiled: in numpy the same check is about ten whole-array passes with temporaries (the
comparisons, their combination, the reductions); even in cache-sized blocks it cost 33 ms per
10^7 entries, on the thread that receives the row (a large row read by parts checks each part as
it arrives, giaannd/client/row_parts.py). One loop reads each entry once.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly

__all__ = ["first_non_canonical"]


@kernel(f"int64({readonly('uint8')}, {readonly('uint64')}, {readonly('uint64')}, {readonly('float32')}, int64)")
def _first_bad(seg: NDArray[np.uint8], tc: NDArray[np.uint64], tf: NDArray[np.uint64], st: NDArray[np.float32],
               num_segments: int) -> int:
    n = seg.shape[0]
    for i in range(n):
        s = seg[i]
        if s >= num_segments or not np.isfinite(st[i]):
            return i
        if i > 0:
            ps = seg[i - 1]
            if s < ps:
                return i
            if s == ps:
                c, pc = tc[i], tc[i - 1]
                if c < pc or (c == pc and tf[i] <= tf[i - 1]):
                    return i
    return -1


def first_non_canonical(seg: NDArray[np.uint8], tc: NDArray[np.uint64], tf: NDArray[np.uint64],
                        strength: NDArray[np.float32], num_segments: int) -> int:
    """The index of the first entry that is out of range (its segment), not finite (its strength)
    or not strictly after the entry before it, -1 when there is none. The four arrays are 1-d,
    contiguous and of equal length (the caller checked)."""
    return int(_first_bad(seg, tc, tf, strength, num_segments))
