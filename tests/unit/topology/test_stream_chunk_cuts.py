"""Where a stream source cuts its chunks (``StreamSender.read_chunk``): from the cursor, the rows
whose sizes add up to at most the limit, at least one. Found by one binary search in the rows'
running sizes, made once (before, each chunk summed every row left)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.model.rows import RowBatch
from giaannd.storage.streaming.stream import StreamSender


def _reader(got):
    """A reader of one-entry rows that records which rows it was asked for (the keys are their places)."""

    def read(cols, feats):
        got.append((int(cols[0]), int(cols[-1]) + 1))
        n = cols.shape[0]
        return RowBatch.from_entries(cols, feats, np.zeros(n, np.uint8), np.ones(n, np.uint64),
                                     np.ones(n, np.uint64), np.ones(n, np.float32))

    return read


def _expected_cut(sizes, start, limit):
    """The definition: the longest run of rows from ``start`` of at most ``limit`` bytes, at least one row."""
    total, stop = 0, start
    while stop < len(sizes) and total + sizes[stop] <= limit:
        total += sizes[stop]
        stop += 1
    return max(stop, start + 1)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 300), chunk_bytes=st.integers(1, 5000))
def test_chunks_hold_the_rows_that_fit_their_limit(seed, rows, chunk_bytes):
    """Rows of any size (none, small, larger than a chunk), limits changing from chunk to chunk (a
    throttled stream's ``max_bytes``): every chunk is the rows the definition takes, in order."""
    rng = np.random.default_rng(seed)
    sizes = rng.choice([0, 1, 21, 64, 1050, 4000, 9000], rows)
    keys = np.arange(rows, dtype=np.uint64)
    sender = StreamSender(5, keys, keys, np.zeros(rows, np.uint64), sizes, chunk_bytes=chunk_bytes,
                          max_pending_bytes=1 << 62)
    assert sender.total_bytes_estimate == int(sizes.sum())
    got, want, start = [], [], 0
    read = _reader(got)
    while sender.chunks_left:
        max_bytes = [None, int(rng.integers(1, 6000))][int(rng.integers(0, 2))]
        limit = chunk_bytes if max_bytes is None else max(1, min(chunk_bytes, max_bytes))
        stop = _expected_cut(sizes.tolist(), start, limit)
        want.append((start, stop))
        sender.read_chunk(read, max_bytes)
        start = stop
    assert got == want
    assert sender.read_chunk(read) is None


def test_a_stream_without_rows_has_no_chunks():
    empty = np.zeros(0, np.uint64)
    sender = StreamSender(5, empty, empty, empty, np.zeros(0, np.int64))
    assert sender.total_bytes_estimate == 0 and not sender.chunks_left
    assert sender.read_chunk(_reader([])) is None
