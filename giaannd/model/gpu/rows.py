"""Rows in device memory (issue 20 item 2): a RowBatch's arrays as torch tensors on the compute device.

Theory of operation
-------------------
A storage read hands back a host :class:`~giaannd.model.rows.RowBatch` (its buffers received by the
transport and checked on the host: ``RowBatch.validate`` is what keeps a peer's garbage out of the
session, and it runs on numpy). :class:`PinnedStager` then moves the batch to the device in **one**
host-to-device copy: the seven arrays are packed at 64-byte aligned offsets into one page-locked
(pinned) host buffer, which is copied with ``non_blocking=True`` (a DMA the driver can start at
once; from pageable memory CUDA first copies through its own bounce buffer), and the device copy
is cut back into seven typed views. The pack is torch's ``copy_`` (parallel over its intra-op
threads), since a single-threaded memcpy into the staging buffer ran slower than the DMA after it.
The staging buffer is pooled: allocated once, grown by doubling, reused for every batch, because
pinning memory costs a system call and page faults per allocation (milliseconds for megabytes),
more than the copy it speeds up.

Reuse rule: the staging buffer is overwritten by the next ``stage`` only after the previous copy
finished (``ready.synchronize()``, a CUDA event recorded after the copy), so a batch already handed
out never sees the next batch's bytes.

Typed views: torch has no arithmetic on uint64, so the uint64 id arrays arrive as int64 tensors
with the same bits (``DeviceRows.to_host`` gives the exact uint64 back); segments stay uint8,
strengths float32, offsets int64.

What this does not do yet (README, "Known gaps"): receive a read reply straight into device memory
over UCX. The transport can (``recv_into`` a CUDA tensor, tests/gpu/test_cuda_bulk.py), but only into
a buffer whose size is known before the request, and a ``ReadRows`` reply's sizes are not; and
the reply would then have to be validated on the device. Both paths (tcp and ucx) stage through
pinned host memory today.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from giaannd.model.gpu.device import torch_module
from giaannd.model.rows import RowBatch

if TYPE_CHECKING:
    import torch

__all__ = ["STAGING_ALIGN_BYTES", "DeviceRows", "PinnedStager", "rows_to_device"]

#: Offset alignment of each array in the staging buffer (and so in the device copy): 64 bytes is a
#: cache line and above every dtype's alignment, so each typed view is legal on both sides.
STAGING_ALIGN_BYTES = 64
#: The smallest staging buffer: small reads (a few rows) do not grow it one power of two at a time.
_MIN_STAGING_BYTES = 1 << 20
#: RowBatch's field order, the order of ``RowBatch.buffers()``.
_FIELDS = ("row_column", "row_feature", "offsets", "segment", "target_column", "target_feature", "strength")
#: The dtype each field has on the device (uint64 as int64: module docstring).
_DEVICE_DTYPES = {np.dtype(np.uint64): np.dtype(np.int64)}


@dataclass(frozen=True, slots=True, eq=False)
class DeviceRows:
    """A RowBatch whose arrays are torch tensors on one device (fields as :class:`RowBatch`)."""

    row_column: torch.Tensor
    row_feature: torch.Tensor
    offsets: torch.Tensor
    segment: torch.Tensor
    target_column: torch.Tensor
    target_feature: torch.Tensor
    strength: torch.Tensor

    @property
    def device(self) -> Any:
        return self.strength.device

    @property
    def num_rows(self) -> int:
        return int(self.row_column.shape[0])

    @property
    def num_entries(self) -> int:
        return int(self.strength.shape[0])

    def to_host(self) -> RowBatch:
        """The same batch as host numpy arrays (uint64 ids restored bit for bit)."""
        arrays = [getattr(self, f).cpu().numpy() for f in _FIELDS]
        for i in (0, 1, 4, 5):
            arrays[i] = arrays[i].view(np.uint64)
        return RowBatch(*arrays)


def _aligned(n: int) -> int:
    return -(-n // STAGING_ALIGN_BYTES) * STAGING_ALIGN_BYTES


class PinnedStager:
    """Moves host RowBatches to ``device`` through one pooled pinned host buffer (module docstring).

    Args:
        device: a torch device string (``"cuda"``; ``"cpu"`` in tests).
        pin: page-lock the staging buffer; None: when CUDA is available (pinning needs a CUDA
            context; on a CPU-only torch it cannot, and nothing would gain from it).
    """

    def __init__(self, device: str, pin: bool | None = None) -> None:
        self._torch = torch_module()
        self.device = self._torch.device(device)
        self.pin = self._torch.cuda.is_available() if pin is None else pin
        self._buf: torch.Tensor | None = None
        self._ready: Any = None  # the CUDA event recorded after the last copy out of ``_buf``
        #: batches staged, and bytes copied to the device (for tools/bench/gpu.py and metrics)
        self.batches = 0
        self.bytes = 0

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.shape[0])

    @property
    def staging_buffer(self) -> torch.Tensor | None:
        """The pooled host buffer (tests check it is pinned, and reused)."""
        return self._buf

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._ready is not None:  # the reuse rule: the previous copy has left the buffer
            self._ready.synchronize()
            self._ready = None
        if self._buf is None or self._buf.shape[0] < nbytes:
            cap = max(_MIN_STAGING_BYTES, self.capacity)
            while cap < nbytes:
                cap *= 2
            self._buf = self._torch.empty(cap, dtype=self._torch.uint8, pin_memory=self.pin)
        return self._buf

    def stage(self, batch: RowBatch) -> DeviceRows:
        """Copy ``batch`` to the device: pack into the staging buffer, one copy, typed views."""
        torch = self._torch
        arrays = [np.ascontiguousarray(getattr(batch, f)) for f in _FIELDS]
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total = _aligned(total + a.nbytes)
        buf = self._staging(max(total, 1))
        with warnings.catch_warnings():  # a row array received from the wire is read-only; only read here
            warnings.simplefilter("ignore", UserWarning)
            for a, off in zip(arrays, starts):
                # torch's copy_ packs large arrays on all its threads (numpy's assignment is one
                # thread): on an H100 host that made the pack, not the DMA, the smaller half of a stage
                buf[off:off + a.nbytes].copy_(torch.from_numpy(a.reshape(-1).view(np.uint8)))
        # copy=True: on device "cpu" .to() would otherwise alias the staging buffer, which the next
        # batch overwrites
        dev = buf[:total].to(self.device, non_blocking=self.pin, copy=True)
        if self.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()
        views = []
        for a, off in zip(arrays, starts):
            dtype = _DEVICE_DTYPES.get(a.dtype, a.dtype)
            views.append(dev[off:off + a.nbytes].view(_torch_dtype(torch, dtype)))
        self.batches += 1
        self.bytes += total
        return DeviceRows(*views)


def _torch_dtype(torch: Any, dtype: np.dtype[Any]) -> Any:
    """The torch dtype of a numpy dtype (the four a RowBatch uses on the device)."""
    return {np.dtype(np.int64): torch.int64, np.dtype(np.uint8): torch.uint8,
            np.dtype(np.float32): torch.float32}[dtype]


def rows_to_device(batch: RowBatch, device: str, stager: PinnedStager | None = None) -> DeviceRows:
    """``batch`` on ``device`` (through ``stager``, or a one-off one: pass a stager to reuse its buffer)."""
    return (stager or PinnedStager(device)).stage(batch)
