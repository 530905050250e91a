"""The disk-full state (pure), a snapshot that fails part-way, and the automatic repair's verdict."""

import errno

import numpy as np
import pytest

from giaannd.storage.engine import snapshot as snapshot_module
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.rebalance.auto_repair import summary, verdict
from giaannd.storage.replication.disk_full import DiskFull
from tools.cluster_harness import make_batch

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_enters_on_enospc_only_and_leaves_with_hysteresis() -> None:
    state = DiskFull(resume_free_bytes=1000)
    assert not state.write_failed("update_log", OSError(errno.EIO, "I/O error"), 1.0)  # not a space error
    assert not state.full
    assert state.write_failed("update_log", ENOSPC, 2.0)  # the transition
    assert state.full and state.since == 2.0 and "update_log" in state.cause and state.episodes == 1
    assert not state.write_failed("snapshot", ENOSPC, 3.0)  # already full: no second transition
    assert "disk full" in state.refusal() and state.refused == 1
    assert not state.space_checked(999)  # a few free bytes are not enough (no flapping)
    assert state.space_checked(1000) and not state.full and state.since is None
    assert not state.space_checked(10**9)  # not full: nothing to leave
    assert state.write_failed("hint_log", OSError(errno.EDQUOT, "Disk quota exceeded"), 4.0)


def test_disk_full_failed_snapshot_leaves_no_temporary(tmp_path, monkeypatch) -> None:
    ds = DurableStore.open(tmp_path, 64 << 20)
    ds.apply((1, 1), make_batch(np.random.default_rng(1), 8))
    ds.sync()

    def no_space(self: object, buf: object) -> None:  # the disk fills up part-way through
        raise ENOSPC
    monkeypatch.setattr(snapshot_module._HashingWriter, "write", no_space)
    with pytest.raises(OSError):
        ds.snapshot()
    monkeypatch.undo()
    assert not list(tmp_path.glob(".snapshot-*")) and not list(tmp_path.glob("snapshot-*"))
    ds.snapshot()  # and the next attempt works
    ds.close()
    again = DurableStore.open(tmp_path, 64 << 20)
    assert again.store.usage().num_rows == 8
    again.close()


def test_auto_repair_verdict_and_summary() -> None:
    clean = {"batches_shipped": 3, "rows_shipped": 9, "unrecoverable": {}, "unlogged": {}, "rows_compared": 20,
             "rows_divergent": [], "peers_failed": {}}
    assert verdict(clean) == "done"
    assert verdict({**clean, "peers_failed": {"b": "logged: timeout"}}) == "retry"
    assert verdict({**clean, "unlogged": {"c": {"a": 2}}}) == "incomplete"
    assert verdict({**clean, "rows_divergent": [(1, 2)]}) == "incomplete"
    short = summary({**clean, "rows_divergent": [(1, 2), (3, 4)], "unrecoverable": {"c": ["x", "y"]}})
    assert short["rows_divergent"] == 2 and short["unrecoverable"] == 2 and short["batches_shipped"] == 3


def test_disk_full_failed_log_rotation_keeps_the_current_segment(tmp_path, monkeypatch) -> None:
    """A rotation (every snapshot starts with one) that cannot create its new segment leaves the
    current one open and in use: appends go on, and recovery reads every record back."""
    from giaannd.storage.engine import update_log as update_log_module

    ds = DurableStore.open(tmp_path, 64 << 20)
    rng = np.random.default_rng(2)
    ds.apply((1, 1), make_batch(rng, 4))
    real_open = update_log_module.os.open

    def no_space(path, flags, mode=0o777):
        if str(path).endswith(".seg"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, flags, mode)
    monkeypatch.setattr(update_log_module.os, "open", no_space)
    with pytest.raises(OSError):
        ds.snapshot()
    monkeypatch.undo()
    ds.apply((1, 2), make_batch(rng, 4))  # into the segment still current
    ds.sync()
    ds.close()
    again = DurableStore.open(tmp_path, 64 << 20)
    assert again.recovery.records_replayed == 2 and again.recovery.torn_tail_bytes == 0
    assert (1, 2) in again.store.applied
    again.close()


def test_disk_full_a_partial_record_not_cut_at_once_is_cut_before_a_rotation_or_an_append(tmp_path,
                                                                                          monkeypatch) -> None:
    """An append that fails part-way leaves a partial record; when it cannot be cut off at once
    (the ftruncate fails too) the log refuses appends. It must not stay refusing once the disk
    has room again (the node resumes writes by itself), and a rotation (every snapshot's first
    step) must not leave the partial record behind in a segment that is no longer the last: there
    it is corruption at the next start, not a torn tail."""
    from giaannd.storage.engine import update_log as update_log_module

    ds = DurableStore.open(tmp_path, 64 << 20)
    rng = np.random.default_rng(3)
    ds.apply((1, 1), make_batch(rng, 4))
    real_writev = update_log_module.os.writev

    def half_then_no_space(fd, parts):
        real_writev(fd, [bytes(parts[0])[:20]])
        raise ENOSPC

    def no_cut(fd, length):
        raise ENOSPC
    monkeypatch.setattr(update_log_module.os, "writev", half_then_no_space)
    monkeypatch.setattr(update_log_module.os, "ftruncate", no_cut)
    with pytest.raises(OSError):
        ds.apply((1, 2), make_batch(rng, 4))
    monkeypatch.undo()  # room again

    def no_space(self: object, buf: object) -> None:
        raise ENOSPC
    monkeypatch.setattr(snapshot_module._HashingWriter, "write", no_space)
    with pytest.raises(OSError):
        ds.snapshot()  # rotates the log, then fails: the disk filled up again
    monkeypatch.undo()
    ds.apply((1, 3), make_batch(rng, 4))  # writes resume
    ds.sync()
    ds.close()
    again = DurableStore.open(tmp_path, 64 << 20)
    assert (1, 1) in again.store.applied and (1, 3) in again.store.applied
    assert (1, 2) not in again.store.applied and again.recovery.torn_tail_bytes == 0
    again.close()
