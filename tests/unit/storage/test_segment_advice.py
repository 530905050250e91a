"""A start-up maps the log's segments (update_log.SegmentMapper) and advises ``MADV_WILLNEED`` on
each mapping. Advice changes speed only (peers/madvise.py: a refusal returns False, never
raises), so a kernel, file system or sandbox that refuses it (EINVAL, ENOSYS, EPERM under a
seccomp filter) must not stop the recovery."""

from __future__ import annotations

import errno
import mmap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import DurableStore
from giaannd.storage.engine import update_log
from giaannd.storage.engine.update_log import SegmentMapper, list_segments

BIG = 1 << 44


@pytest.fixture
def refused(monkeypatch):
    """``update_log``'s ``mmap`` module with mappings whose ``madvise`` fails as ``code``; the
    list returned counts the refusals (so a test sees the advice was asked for)."""
    calls: list[int] = []

    def patch(code: int) -> list[int]:
        class Refusing(mmap.mmap):
            def madvise(self, *args):
                calls.append(args[0])
                raise OSError(code, "refused")

        module = SimpleNamespace(**{k: getattr(mmap, k) for k in dir(mmap) if not k.startswith("__")})
        module.mmap = Refusing
        monkeypatch.setattr(update_log, "mmap", module)
        return calls
    return patch


def _batch(rng: np.random.Generator, first_column: int) -> RowBatch:
    n = 30
    return RowBatch.from_entries(
        (first_column + rng.integers(0, 4, n)).astype(np.uint64), rng.integers(0, 3, n),
        rng.integers(0, 9, n), rng.integers(0, 40, n), rng.integers(0, 40, n),
        rng.random(n, dtype=np.float32) + np.float32(0.01))


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSYS, errno.EPERM])
def test_segment_mapper_read_goes_on_without_the_advice(tmp_path: Path, refused, code) -> None:
    path = tmp_path / "seg"
    path.write_bytes(bytes(range(256)) * 64)
    calls = refused(code)
    view = SegmentMapper().read(path)
    assert calls == [mmap.MADV_WILLNEED]
    assert bytes(view) == path.read_bytes()


def test_recovery_with_madvise_refused_replays_the_log(tmp_path: Path, refused) -> None:
    """Before: ``DurableStore.open`` raised the OSError of the first segment's advice."""
    rng = np.random.default_rng(3)
    ds = DurableStore.open(tmp_path / "s", BIG, segment_max_bytes=8_000)
    for i in range(1, 30):
        ds.apply(BatchId(9, i), _batch(rng, 100 * (i % 7)))
    ds.sync()
    live = ds.store.read_all()
    ds.close()
    assert len(list_segments(tmp_path / "s")) > 2
    calls = refused(errno.EINVAL)
    reopened = DurableStore.open(tmp_path / "s", BIG)
    try:
        assert calls  # the advice was asked for, and refused
        assert reopened.recovery.records_replayed == 29
        again = reopened.store.read_all()
        assert all(np.array_equal(p.view(np.uint8), q.view(np.uint8))
                   for p, q in zip(again.buffers(), live.buffers(), strict=True))
    finally:
        reopened.close()
