"""streaming/dedupe.py: markers and per-stream columns decide which rows of a direct batch to drop."""

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.streaming.dedupe import StreamScopes, filter_direct, marker_id, scoped_writer


def rows(cols):
    n = len(cols)
    return RowBatch.from_entries(np.array(cols, np.uint64), np.zeros(n, np.uint64), np.zeros(n, np.uint8),
                                 np.ones(n, np.uint64), np.arange(n, dtype=np.uint64), np.ones(n, np.float32))


def test_filter_drops_rows_of_marked_streams_only(tmp_path):
    scopes = StreamScopes.open(tmp_path)
    scopes.add_columns(7, np.array([1, 2], np.uint64))
    scopes.add_columns(8, np.array([3], np.uint64))
    applied = AppliedSet()
    b = BatchId(42, 5)
    batch = rows([1, 2, 3, 4])
    assert filter_direct(b, batch, applied, scopes) is None  # nothing forwarded: keep all
    applied.add(marker_id(b, 7))
    assert filter_direct(b, batch, applied, scopes).row_column.tolist() == [3, 4]
    applied.add(marker_id(b, 8))
    assert filter_direct(b, batch, applied, scopes).row_column.tolist() == [4]
    assert filter_direct(BatchId(42, 6), batch, applied, scopes) is None  # another batch
    assert filter_direct(b, rows([1]), applied, scopes).num_rows == 0


def test_scopes_survive_restart_and_markers_are_scoped(tmp_path):
    scopes = StreamScopes.open(tmp_path)
    scopes.add_columns(7, np.array([5, 1], np.uint64))
    scopes.add_columns(7, np.array([1, 9], np.uint64))
    again = StreamScopes.open(tmp_path)
    assert dict((k, v.tolist()) for k, v in again.items()) == {7: [1, 5, 9]}
    assert scoped_writer(1, 7) != scoped_writer(1, 8) != scoped_writer(2, 7)
    assert marker_id(BatchId(1, 3), 7) == BatchId(scoped_writer(1, 7), 3)


def test_open_streams_and_close_survive_restart(tmp_path):
    from giaannd.storage.streaming.dedupe import direct_marker_id

    scopes = StreamScopes.open(tmp_path)
    scopes.add_columns(7, np.array([1, 2], np.uint64))
    scopes.add_columns(8, np.array([3], np.uint64))
    assert scopes.open_streams_touching(np.array([2, 3], np.uint64)) == [7, 8]
    scopes.close(7)
    assert StreamScopes.open(tmp_path).open_streams_touching(np.array([2, 3], np.uint64)) == [8]
    assert direct_marker_id(BatchId(1, 3), 7) != marker_id(BatchId(1, 3), 7)
