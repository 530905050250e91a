"""Rows staged to a device (giaannd/model/gpu/rows.py), the host parts on CPU torch: packing into
the pooled staging buffer, the typed views, reuse, growth; pinned memory only where torch has it."""

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.model.train import train_batch
from tests.oracle.sentences import synthetic_corpus

torch = pytest.importorskip("torch")

from giaannd.model.gpu.rows import STAGING_ALIGN_BYTES, PinnedStager, rows_to_device  # noqa: E402


def _batch(n, seed):
    return train_batch(synthetic_corpus(n, seed=seed)).rows


def _same(a: RowBatch, b: RowBatch):
    for x, y in zip(a.buffers(), b.buffers()):
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_stage_round_trips_bit_for_bit_with_device_dtypes():
    batch = _batch(50, 1)
    rows = PinnedStager("cpu", pin=False).stage(batch)
    assert rows.device.type == "cpu" and rows.num_rows == batch.num_rows and rows.num_entries == batch.num_entries
    assert rows.row_column.dtype == torch.int64 and rows.target_feature.dtype == torch.int64  # uint64 bits
    assert rows.segment.dtype == torch.uint8 and rows.strength.dtype == torch.float32
    assert rows.offsets.dtype == torch.int64
    _same(rows.to_host(), batch)
    # the ids' bits survive a value above 2**63 (int64 negative on the device)
    big = RowBatch.from_entries(np.array([2**64 - 5], np.uint64), np.array([7], np.uint64), np.array([8], np.uint8),
                                np.array([2**63 + 1], np.uint64), np.array([1], np.uint64), np.array([2.5], np.float32))
    _same(rows_to_device(big, "cpu").to_host(), big)


def test_stage_takes_read_only_arrays_as_received_from_the_wire():
    batch = _batch(80, 2)
    frozen = [b.copy() for b in batch.buffers()]
    for b in frozen:
        b.flags.writeable = False
    rows = PinnedStager("cpu", pin=False).stage(RowBatch(*frozen))  # no warning (warnings are errors here)
    _same(rows.to_host(), batch)


def test_staging_buffer_is_reused_and_grows_without_touching_earlier_batches():
    stager = PinnedStager("cpu", pin=False)
    small, other = _batch(20, 2), _batch(20, 3)
    first = stager.stage(small)
    buf = stager.staging_buffer
    second = stager.stage(other)
    assert stager.staging_buffer is buf  # pooled: no allocation per batch
    _same(first.to_host(), small)  # the second batch did not overwrite the first one handed out
    _same(second.to_host(), other)
    big = _batch(3000, 4)
    assert big.nbytes > stager.capacity
    third = stager.stage(big)
    assert stager.capacity >= big.nbytes and stager.capacity & (stager.capacity - 1) == 0
    _same(third.to_host(), big)
    assert stager.batches == 3 and stager.bytes >= small.nbytes + other.nbytes + big.nbytes


def test_views_are_aligned_in_one_copy():
    rows = PinnedStager("cpu", pin=False).stage(_batch(30, 5))
    base = rows.row_column.untyped_storage().data_ptr()
    for t in (rows.row_feature, rows.offsets, rows.segment, rows.target_column, rows.strength):
        assert t.untyped_storage().data_ptr() == base  # one device allocation, seven views
        assert (t.data_ptr() - base) % STAGING_ALIGN_BYTES == 0


def test_empty_batch():
    assert PinnedStager("cpu", pin=False).stage(RowBatch.empty()).to_host().num_rows == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs a CUDA device (torch reports none)")
def test_staging_buffer_is_pinned_when_cuda_is_available():
    stager = PinnedStager("cpu")
    assert stager.pin
    stager.stage(_batch(10, 6))
    assert stager.staging_buffer.is_pinned()


def test_without_cuda_the_default_does_not_pin():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the default pins")
    assert PinnedStager("cpu").pin is False
