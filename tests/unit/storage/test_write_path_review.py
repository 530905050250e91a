"""Write-path defects found in review (each test failed on the code before its fix)."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import APPLIED_ID_BYTES, ENTRY_BYTES, ROW_OVERHEAD_BYTES
from giaannd.storage.engine.errors import StoreFullError
from giaannd.storage.engine.recovery import DurableStore


def _one_row(column: int, entries: int) -> RowBatch:
    n = entries
    return RowBatch.from_entries(np.full(n, column, np.uint64), np.zeros(n, np.uint64), np.zeros(n, np.uint8),
                                 np.arange(1, n + 1, dtype=np.uint64), np.zeros(n, np.uint64),
                                 np.ones(n, np.float32))


def test_deferred_apply_checks_the_capacity_as_a_live_apply_does(tmp_path):
    """A writer new here whose first batch on this node has seq > 1 stores two ids (its floor 0
    beside the seq: docs/storage.md "Memory accounting"). A live apply counts both; a batch
    deferred during a fold must be refused (left to wait for the fold) on the same bound, or it is
    acknowledged and then applied past the capacity."""
    batch = _one_row(7, 4)
    exact = 2 * APPLIED_ID_BYTES + 4 * ENTRY_BYTES + ROW_OVERHEAD_BYTES
    capacity = exact - 1  # one byte short of what the batch takes
    live = DurableStore.open(tmp_path / "live", capacity)
    with pytest.raises(StoreFullError):
        live.apply(BatchId(5, 3), batch)
    assert live.store.used_bytes == 0
    live.close()

    held = DurableStore.open(tmp_path / "held", capacity)
    deferred = held.defer(BatchId(5, 3), batch)
    if deferred is not None:  # accepted: it must then fit
        held.apply_deferred()
        assert held.store.used_bytes <= capacity, (
            f"a deferred batch took used_bytes to {held.store.used_bytes} past capacity {capacity}")
    held.close()


def _fail_next_fdatasync(monkeypatch, module, error: OSError) -> list[int]:
    """The next fdatasync of ``module``'s ``os`` raises ``error``; later ones succeed, as Linux's
    do once it reported a writeback error and marked the lost pages clean ("fsyncgate")."""
    real = module.os.fdatasync
    failed: list[int] = []

    def fdatasync(fd: int) -> None:
        if not failed:
            failed.append(fd)
            raise error
        real(fd)
    monkeypatch.setattr(module.os, "fdatasync", fdatasync)
    return failed


def test_update_log_never_calls_records_durable_after_their_fsync_failed(tmp_path, monkeypatch):
    """After a failed fdatasync the kernel may have dropped the dirty pages and report the next
    fdatasync as a success: the log must not then call the records it failed to sync durable
    (group commit would acknowledge them), nor append after them as if they were on disk."""
    import errno

    from giaannd.storage.engine import update_log as ul

    ds = DurableStore.open(tmp_path, 1 << 24)
    ds.apply(BatchId(1, 1), _one_row(3, 2))
    ds.sync()
    ds.apply(BatchId(1, 2), _one_row(4, 2))
    seq = ds.log.last_seq
    _fail_next_fdatasync(monkeypatch, ul, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(OSError):
        ds.sync()
    try:
        durable = ds.sync()  # the kernel's second answer: "fine"
    except OSError:
        durable = ds.log.durable_seq
    assert durable < seq, "a record whose fsync failed was called durable by the next fsync"
    with pytest.raises(OSError):  # nothing appended after records that may not be on disk
        ds.apply(BatchId(1, 3), _one_row(5, 2))
    assert BatchId(1, 3) not in ds.store.applied

    # a snapshot covers what the failed fsync left in doubt: writes resume, and a restart has it all
    ds.snapshot()
    assert ds.sync() >= seq
    ds.apply(BatchId(1, 3), _one_row(5, 2))
    assert ds.sync() == ds.log.last_seq
    ds.close()
    again = DurableStore.open(tmp_path, 1 << 24)
    assert again.store.usage().num_rows == 3
    again.close()


def test_a_failed_fsync_at_a_snapshots_rotation_is_not_retried_as_a_success(tmp_path, monkeypatch):
    """The rotation that begins a snapshot fdatasyncs the segment it closes; when that fails, the
    records in it are in doubt as after a failed ``sync``: the next sync must not call them durable."""
    import errno

    from giaannd.storage.engine import update_log as ul

    ds = DurableStore.open(tmp_path, 1 << 24)
    ds.apply(BatchId(2, 1), _one_row(3, 2))
    seq = ds.log.last_seq
    _fail_next_fdatasync(monkeypatch, ul, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(OSError):
        ds.snapshot()
    try:
        durable = ds.sync()
    except OSError:
        durable = ds.log.durable_seq
    assert durable < seq, "a record whose fsync failed at a rotation was called durable by the next fsync"
    ds.snapshot()  # the retry covers them
    assert ds.sync() >= seq
    ds.close()
