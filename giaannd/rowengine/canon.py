"""Compiled checks that rows are canonical (jit.py's kernels).

A row's entries are canonical when every segment is below the number of segments, every strength
is finite and the keys ``(segment, target_column, target_feature)`` are strictly ascending (the
entry order of giaannd/model/rows.py); a batch's rows also ascend, and its offsets partition its
entries. ``batch_fault`` checks a batch (``RowBatch.validate``) in loops without early exits, which
LLVM vectorises; ``first_non_canonical`` checks one row the same way and, only when it breaks a
rule, walks to the first entry that does.

Why compiled: in numpy the same check is about ten whole-array passes with temporaries (the
comparisons, their combination, the reductions); even in cache-sized blocks it cost 33 ms per
10^7 entries, on the thread that receives the row (a large row read by parts checks each part as
it arrives, giaannd/client/row_parts.py). One loop reads each entry once.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.jit import kernel, readonly

__all__ = ["BATCH_FAULTS", "batch_fault", "entries_fault", "first_non_canonical"]


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


#: The row key of a batch of one row (``first_non_canonical``: a row's key is not checked).
_ONE_KEY = np.zeros(1, np.uint64)


def first_non_canonical(seg: NDArray[np.uint8], tc: NDArray[np.uint64], tf: NDArray[np.uint64],
                        strength: NDArray[np.float32], num_segments: int) -> int:
    """The index of the first entry that is out of range (its segment), not finite (its strength)
    or not strictly after the entry before it, -1 when there is none. The four arrays are 1-d,
    contiguous and of equal length (the caller checked). A clean row is ``batch_fault``'s
    vectorised passes, as a batch of one row (0.63 against 1.6 ns per entry for the walk that
    stops at the first fault, which runs only when there is one)."""
    if not _batch_fault(_ONE_KEY, _ONE_KEY, np.array([0, seg.shape[0]], np.int64), seg, tc, tf, strength,
                        num_segments, True):
        return -1
    return int(_first_bad(seg, tc, tf, strength, num_segments))


#: What ``batch_fault`` finds, by code (0: nothing), in the order the checks take precedence.
BATCH_FAULTS = ("", "offsets are not a partition of the entries", "segment out of range", "non-finite strength",
                "rows not sorted and unique", "entries of a row not sorted and unique")


@kernel(f"int64({readonly('uint64')}, {readonly('uint64')}, {readonly('int64')}, {readonly('uint8')},"
        f" {readonly('uint64')}, {readonly('uint64')}, {readonly('float32')}, int64, boolean)")
def _batch_fault(rc: NDArray[np.uint64], rf: NDArray[np.uint64], offsets: NDArray[np.int64], seg: NDArray[np.uint8],
                 tc: NDArray[np.uint64], tf: NDArray[np.uint64], st: NDArray[np.float32], num_segments: int,
                 rows_too: bool) -> int:
    # Simple loops without early exits, so that LLVM vectorises them; a fault is the rare case.
    # ``rows_too`` False: the row keys are not looked at (``entries_fault``), ``len(offsets) - 1`` rows.
    r = offsets.shape[0] - 1
    n = seg.shape[0]
    if offsets[0] != 0 or offsets[r] != n:
        return 1
    down = 0
    for i in range(r):
        down += offsets[i + 1] < offsets[i]
    if down:
        return 1
    top = 0
    for j in range(n):
        top = max(top, seg[j])
    if top >= num_segments:
        return 2
    infinite = 0
    for j in range(n):
        infinite += not np.isfinite(st[j])
    if infinite:
        return 3
    unsorted = 0
    if rows_too:
        for i in range(1, r):
            unsorted += rc[i] < rc[i - 1] or (rc[i] == rc[i - 1] and rf[i] <= rf[i - 1])
    if unsorted:
        return 4
    # entries not after the one before: allowed only where a row starts
    later = 0
    for j in range(1, n):
        later += seg[j] < seg[j - 1] or (seg[j] == seg[j - 1] and (
            tc[j] < tc[j - 1] or (tc[j] == tc[j - 1] and tf[j] <= tf[j - 1])))
    if later:
        for i in range(1, r):
            j = offsets[i]
            if 0 < j < n and j != offsets[i - 1]:  # a row start (counted once where empty rows share it)
                later -= seg[j] < seg[j - 1] or (seg[j] == seg[j - 1] and (
                    tc[j] < tc[j - 1] or (tc[j] == tc[j - 1] and tf[j] <= tf[j - 1])))
        if later:
            return 5
    return 0


def batch_fault(rc: NDArray[np.uint64], rf: NDArray[np.uint64], offsets: NDArray[np.int64], seg: NDArray[np.uint8],
                tc: NDArray[np.uint64], tf: NDArray[np.uint64], st: NDArray[np.float32], num_segments: int) -> int:
    """The first rule a row batch's seven arrays break (an index into ``BATCH_FAULTS``; 0: none),
    in one compiled pass over the entries: the offsets partition the entries, every segment is
    below ``num_segments``, every strength is finite, the rows ``(rc, rf)`` strictly ascend, and
    so do the keys ``(seg, tc, tf)`` within each row. The arrays are 1-d of their dtypes, with
    ``len(rf) == len(rc)``, ``len(offsets) == len(rc) + 1`` and the entry arrays of one length
    (the caller checked); non-contiguous ones are copied."""
    c = np.ascontiguousarray
    return int(_batch_fault(c(rc), c(rf), c(offsets), c(seg), c(tc), c(tf), c(st), num_segments, True))


def entries_fault(offsets: NDArray[np.int64], seg: NDArray[np.uint8], tc: NDArray[np.uint64], tf: NDArray[np.uint64],
                  st: NDArray[np.float32], num_segments: int) -> int:
    """``batch_fault`` without the row keys (a snapshot's rows, whose keys are checked apart): the
    first of its rules but "rows not sorted and unique" that the entries of the rows
    ``offsets`` cut break (0: none)."""
    c = np.ascontiguousarray
    return int(_batch_fault(_ONE_KEY, _ONE_KEY, c(offsets, np.int64), c(seg), c(tc), c(tf), c(st), num_segments,
                            False))
