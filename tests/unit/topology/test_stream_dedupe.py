"""streaming/dedupe.py: markers and per-stream columns decide which rows of a direct batch to drop."""

import numpy as np
import pytest

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


@pytest.mark.parametrize("forwarded_first", [True, False], ids=["retry_after_forward", "retry_before_forward"])
def test_direct_retry_during_a_fold_leaves_what_served_live_leaves(tmp_path, forwarded_first):
    """A writer's direct retry that arrives while a fold moves the rows (``serve_during_fold``) goes
    through the direct filter as a live one does: applied once, with the same markers."""
    from giaannd import protocol as p
    from giaannd.storage.engine.recovery import DurableStore
    from giaannd.storage.replication.hints import HintStore
    from giaannd.storage.replication.requests import StorageRequests, WaitDurable
    from giaannd.storage.streaming.dedupe import direct_marker_id, install_direct_filter

    b, stream = BatchId(3, 1), 9
    retry = RowBatch.from_entries(  # b's share here: two rows of column 5
        np.array([5, 5], np.uint64), np.array([1, 1], np.uint64), np.zeros(2, np.uint8),
        np.array([1, 2], np.uint64), np.zeros(2, np.uint64), np.ones(2, np.float32))

    def run(during: bool) -> tuple:
        d = tmp_path / ("fold" if during else "live")
        store = DurableStore.open(d / "store", 1 << 24)
        core = StorageRequests(store, HintStore.open(d / "hints"), "", lambda: None, lambda k, n: None)
        scopes = StreamScopes(d / "streams")
        scopes.add_columns(stream, np.array([5], np.uint64))  # an open stream carries column 5
        install_direct_filter(core, scopes, lambda: store.store.applied)
        if forwarded_first:  # the stream brought b's rows: its F marker, then the delta under the stream's writer
            store.apply(marker_id(b, stream), RowBatch.empty())
            store.apply(BatchId(77, 1), retry)
        msg = p.ApplyBatch(b.writer, b.seq)
        step = core.serve_during_fold(msg, retry.buffers()) if during else None
        if step is None:  # waits for the fold (as the service does), then served live
            store.apply_deferred()
            step = core.serve(msg, retry.buffers())
        assert isinstance(step, WaitDurable) and step.ack.applied
        store.apply_deferred()  # the fold ends
        got = store.store.read_all()
        applied = store.store.applied
        state = (got.strength.tolist(), direct_marker_id(b, stream) in applied,
                 tuple(a.tobytes() for a in (*got.buffers(), *applied.to_arrays(), *applied.column_arrays())))
        store.close()
        core.hints.close()
        return state

    live, fold = run(False), run(True)
    assert live[0] == [1.0, 1.0]
    assert live[1] is not forwarded_first  # a D marker when the retry brought the rows itself
    assert fold[0] == live[0]  # applied once: the rows it already had through the stream not again
    assert fold[1] == live[1]  # the same D marker
    assert fold[2] == live[2]  # the same rows and applied set, bit for bit
