"""Random canonical rows and delta batches for storage tests (seeded)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

from giaannd.model.rows import Row, RowBatch
from giaannd.storage import ColumnStore


def random_row(rng: np.random.Generator, n: int, key_space: int = 50) -> Row:
    b = RowBatch.from_entries(
        np.zeros(n, np.uint64), np.zeros(n, np.uint64),
        rng.integers(0, 9, n), rng.integers(0, key_space, n), rng.integers(0, key_space, n),
        rng.random(n, dtype=np.float32),
    )
    return b.row(0) if b.num_rows else Row.empty()


def random_batch(
    rng: np.random.Generator, entries: int = 200, columns: int = 6, features: int = 4, key_space: int = 30
) -> RowBatch:
    """Entries over a small key space, so batches overlap (merge-adds) as well as add new keys."""
    big = np.uint64(1) << np.uint64(63)
    return RowBatch.from_entries(
        rng.integers(0, columns, entries).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) | big,
        rng.integers(0, features, entries),
        rng.integers(0, 9, entries),
        rng.integers(0, key_space, entries).astype(np.uint64) * np.uint64(0x100000001B3),
        rng.integers(0, key_space, entries),
        rng.random(entries, dtype=np.float32),
    )


def same_state(a: ColumnStore, b: ColumnStore) -> bool:
    """Rows bit-identical and applied sets equal."""
    x, y = a.read_all(), b.read_all()
    return all(np.array_equal(p, q) for p, q in zip(x.buffers(), y.buffers())) and a.applied == b.applied


def cached_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file): ``mincore`` over a read-only
    mapping of it (mapping it faults nothing in)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        vec = (ctypes.c_ubyte * pages)()
        view = np.frombuffer(mm, np.uint8)
        ok = ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
        assert ok == 0
        return sum(v & 1 for v in vec), pages
    finally:
        mm.close()


def direct_io_supported(directory: Path) -> bool:
    """Whether ``directory``'s file system takes an ``O_DIRECT`` write of one aligned block (tmpfs
    on older kernels and some others refuse it with EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, 4096) as block:
            os.pwrite(fd, memoryview(block), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()
