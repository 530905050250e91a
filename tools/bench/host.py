"""What the host charges for new memory and for durable writes, measured in the calling run.

A stream's receiver keeps the rows it gets (its memory grows by the bytes moved) and logs them
(durable writes); the raw transport it is compared with does neither, so these are floors under
any receiver, whatever its code, on the machine the benchmark runs on (tools/bench/topology.py
prints them beside its stream rates). Figures:

- ``fresh_copy_ms_per_mb``: copying into memory the process never touched, kept: the receiver's
  growth;
- ``recycled_copy_ms_per_mb``: the same copies into one buffer used again: what the raw transport
  pays, and what new memory would cost if the host had it ready;
- ``new_buffer_ms_per_mb``: new buffers kept, their pages written (``fill(0)``, the transport
  pool before Dec 1, a third session) and mapped by the kernel (``MADV_POPULATE_WRITE``, the pool
  now for buffers of 1 MiB or more), interleaved so both meet the same host state;
- ``synced_write_bytes_per_s``: sequential writes made durable the way the update log does
  (``fdatasync`` every few writes, the synced bytes then dropped from the page cache);
- ``free_page_reporting``: whether a virtio balloon reports freed guest pages to the hypervisor
  (``VIRTIO_BALLOON_F_REPORTING``). Where it does (this project's Firecracker VMs), memory the
  guest frees goes back to the host within seconds, and its next first touch is a fault that the
  hypervisor serves too: on this VM 1.4-2.4 ms/MB against ~0.12 right after the same memory was
  touched (docs/topology.md "What the host allows a receiver").
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from peers import madvise

__all__ = ["fresh_copy_ms_per_mb", "free_page_reporting", "new_buffer_ms_per_mb", "recycled_copy_ms_per_mb",
           "synced_write_bytes_per_s"]

CHUNK = 4 * 2**20

#: virtio device id of a memory balloon, and its feature bit "free page reporting" (virtio spec 5.5.3)
_BALLOON_DEVICE = 0x0005
_F_REPORTING = 5


def fresh_copy_ms_per_mb(nbytes: int, chunk: int = CHUNK) -> float:
    """CPU ms per MB to copy ``nbytes`` into memory this process never touched, kept until the end
    (as a receiver's store keeps what it gets), in ``chunk``-sized arrays."""
    src = np.ones(chunk, np.uint8)
    kept = []
    start = time.thread_time()
    for _ in range(max(1, nbytes // chunk)):
        fresh = np.empty(chunk, np.uint8)
        fresh[:] = src
        kept.append(fresh)
    return (time.thread_time() - start) * 1e3 / (len(kept) * chunk / 1e6)


def recycled_copy_ms_per_mb(nbytes: int, chunk: int = CHUNK) -> float:
    """CPU ms per MB of the same copies into one buffer used again (its pages mapped once)."""
    src = np.ones(chunk, np.uint8)
    dst = np.empty(chunk, np.uint8)
    dst[:] = 0
    count = max(1, nbytes // chunk)
    start = time.thread_time()
    for _ in range(count):
        dst[:] = src
    return (time.thread_time() - start) * 1e3 / (count * chunk / 1e6)


def new_buffer_ms_per_mb(nbytes: int, chunk: int = CHUNK) -> tuple[float, float]:
    """(written, mapped by the kernel): CPU ms per MB to make the pages of new ``chunk``-byte
    buffers resident, kept until the end, ``nbytes`` each way, one of each in turn. The second is
    nan where the kernel refuses ``MADV_POPULATE_WRITE``."""
    kept, spent = [], [0.0, 0.0]
    refused = False
    for _ in range(max(1, nbytes // chunk)):
        for way in (0, 1):
            buf = np.empty(chunk, np.uint8)
            start = time.thread_time()
            if way == 0:
                buf.fill(0)
            elif not madvise.populate(buf, 0, chunk):
                refused = True
            spent[way] += time.thread_time() - start
            kept.append(buf)
    per_mb = 1e3 / (len(kept) // 2 * chunk / 1e6)
    return spent[0] * per_mb, float("nan") if refused else spent[1] * per_mb


def synced_write_bytes_per_s(directory: Path, nbytes: int, chunk: int = CHUNK, sync_every: int = 4) -> float:
    """Bytes per second (wall) of writing ``nbytes`` to a new file in ``directory`` in ``chunk``
    writes, ``fdatasync`` every ``sync_every`` of them and at the end, each synced range then
    dropped from the page cache (``POSIX_FADV_DONTNEED``), as the update log does
    (storage/engine/update_log.py ``drop_synced``). The file is removed."""
    buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    path = directory / f"host-write-probe-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    count = max(1, nbytes // chunk)
    try:
        start = time.perf_counter()
        for i in range(count):
            os.write(fd, buf.data)
            if (i + 1) % sync_every == 0 or i + 1 == count:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return count * chunk / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def free_page_reporting(devices: Path = Path("/sys/bus/virtio/devices")) -> bool | None:
    """True when a virtio balloon here negotiated free page reporting, False when there is a
    balloon without it or no balloon, None where ``devices`` cannot be read (not Linux)."""
    try:
        entries = list(devices.iterdir())
    except OSError:
        return None if not devices.exists() else False
    for dev in entries:
        try:
            if int((dev / "device").read_text().strip(), 16) != _BALLOON_DEVICE:
                continue
            features = (dev / "features").read_text().strip()  # one character per bit, bit 0 first
        except (OSError, ValueError):
            continue
        if len(features) > _F_REPORTING and features[_F_REPORTING] == "1":
            return True
    return False
