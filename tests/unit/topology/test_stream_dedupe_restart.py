"""streaming/dedupe.py: a target restarted between a direct batch and its D marker (a crash, or a
torn log tail that kept the batch's record and lost the marker's) still dedupes the delayed original
once the writer retries (it had no ack: the ack waits for the marker)."""

import numpy as np

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import StorageRequests, WaitDurable
from giaannd.storage.streaming.dedupe import StreamScopes, direct_marker_id, install_direct_filter, marker_id


def test_a_retry_after_a_restart_that_lost_the_d_marker_writes_it(tmp_path):
    b, stream = BatchId(3, 1), 9
    share = RowBatch.from_entries(  # b's share here: two rows of column 5, a column the open stream carries
        np.array([5, 5], np.uint64), np.array([1, 1], np.uint64), np.zeros(2, np.uint8),
        np.array([1, 2], np.uint64), np.zeros(2, np.uint64), np.ones(2, np.float32))
    scopes = StreamScopes.open(tmp_path)
    scopes.add_columns(stream, np.array([5], np.uint64))
    # the direct batch reached the log, the target crashed before its D marker (no ack was sent)
    store = DurableStore.open(tmp_path / "store", 1 << 24)
    store.apply(b, share, track=True)
    store.sync()
    store.close()

    store = DurableStore.open(tmp_path / "store", 1 << 24)  # the target restarts
    hints = HintStore.open(tmp_path / "hints")
    core = StorageRequests(store, hints, "", lambda: None, lambda k, n: None)
    install_direct_filter(core, StreamScopes.open(tmp_path), lambda: store.store.applied)
    step = core.serve(p.ApplyBatch(b.writer, b.seq), share.buffers())  # the writer's retry, same id
    assert isinstance(step, WaitDurable)
    # the delayed original then arrives as a forwarded delta: the endpoint (rebalance/endpoint.py,
    # ``_apply_item``) applies it empty iff D(b, stream) is there, else marks F and applies its rows
    if direct_marker_id(b, stream) not in store.store.applied:
        store.apply(marker_id(b, stream), RowBatch.empty())
        store.apply(BatchId(77, 1), share)
    try:
        assert store.store.read_all().strength.tolist() == [1.0, 1.0]  # b counted once
    finally:
        store.close()
        hints.close()


def test_a_new_streams_columns_file_is_made_durable_with_its_directory_entry(tmp_path, monkeypatch):
    """``add_columns`` fsyncs the file, but a new file's name lives in its directory: without a
    fsync of ``streams/`` (and of the data dir when ``streams/`` is new) a power loss can drop the
    whole ``.cols`` file while the F markers of the items it preceded are in the log; the restarted
    node then has no scope for the stream and a retry after the forward counts twice."""
    import os
    import stat

    synced: set[int] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            synced.add(st.st_ino)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    StreamScopes.open(tmp_path).add_columns(9, np.array([5], np.uint64))
    assert (tmp_path / "streams").stat().st_ino in synced  # the .cols file's entry
    assert tmp_path.stat().st_ino in synced  # the new streams/ directory's entry


def test_a_d_marker_that_cannot_be_written_is_not_acknowledged(tmp_path, monkeypatch):
    """The D marker's append failed (a full disk): the direct batch must not be acknowledged, else
    no retry comes to write the marker and the delayed original counts twice; the writer's retry
    (a duplicate here) writes it once the log takes appends again."""
    b, stream = BatchId(3, 1), 9
    share = RowBatch.from_entries(
        np.array([5, 5], np.uint64), np.array([1, 1], np.uint64), np.zeros(2, np.uint8),
        np.array([1, 2], np.uint64), np.zeros(2, np.uint64), np.ones(2, np.float32))
    scopes = StreamScopes.open(tmp_path)
    scopes.add_columns(stream, np.array([5], np.uint64))
    store = DurableStore.open(tmp_path / "store", 1 << 24)
    hints = HintStore.open(tmp_path / "hints")
    core = StorageRequests(store, hints, "", lambda: None, lambda k, n: None)
    install_direct_filter(core, scopes, lambda: store.store.applied)
    real_apply = store.apply

    def marker_fails(batch_id, batch, *args, **kwargs):
        if batch_id == direct_marker_id(b, stream):
            raise OSError(28, "No space left on device")
        return real_apply(batch_id, batch, *args, **kwargs)

    try:
        with monkeypatch.context() as m:
            m.setattr(store, "apply", marker_fails)
            step = core.serve(p.ApplyBatch(b.writer, b.seq), share.buffers())
        assert not isinstance(step, WaitDurable)  # refused: the writer retries
        assert direct_marker_id(b, stream) not in store.store.applied
        step = core.serve(p.ApplyBatch(b.writer, b.seq), share.buffers())  # the retry
        assert isinstance(step, WaitDurable)
        assert direct_marker_id(b, stream) in store.store.applied
        assert store.store.read_all().strength.tolist() == [1.0, 1.0]
    finally:
        store.close()
        hints.close()
