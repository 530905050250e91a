"""ApplyBatch increments that would overflow a stored strength (float32) to inf are refused.

Found by tests/fuzz/test_storage_requests_fuzz.py: two batches of finite strengths near the float32
maximum, applied to one entry, summed to inf. The row then read back in no reply a client accepts
(``check_batch`` refuses non-finite strengths) and the node's next snapshot did not load (the
restart refused it as corrupt), so one writer's two requests made every row of the node unreadable.
"""

import warnings

import numpy as np

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import StorageRequests, WaitDurable


def _row(strength: float) -> RowBatch:
    u = lambda *v: np.array(v, np.uint64)  # noqa: E731
    return RowBatch(u(5), u(0), np.array([0, 1], np.int64), np.array([1], np.uint8), u(7), u(8),
                    np.array([strength], np.float32))


def test_apply_increments_that_would_overflow_are_refused_and_the_rows_stay_readable(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 20)
    hints = HintStore.open(tmp_path / "hints")
    core = StorageRequests(store, hints, "", lambda: None)
    acked = np.float32(2.0)
    try:
        assert isinstance(core.handle(p.encode(p.ApplyBatch(1, 1)), _row(2.0).buffers()), WaitDurable)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (what a daemon does: no warning filter)
            for seq in (2, 3, 4):
                step = core.handle(p.encode(p.ApplyBatch(1, seq)), _row(3.0e38).buffers())
                assert isinstance(step, WaitDurable) or isinstance(step.reply, p.BadRequest), step
                if isinstance(step, WaitDurable):
                    acked = np.float32(acked + np.float32(3.0e38))
        read = core.handle(p.encode(p.ReadRows()), [np.array([5], np.uint64), np.array([0], np.uint64)])
        got = p.check_batch(read.bulk)  # what a client accepts
        assert got.strength.tolist() == [float(acked)]
        store.snapshot()
    finally:
        store.close()
        hints.close()
    reopened = DurableStore.open(tmp_path / "store", 1 << 20)  # the snapshot loads
    try:
        assert reopened.store.read_all().strength.tolist() == [float(acked)]
    finally:
        reopened.close()
