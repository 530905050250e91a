"""numpy's huge-page advice off for a block: the row engine's fresh memory faults in small pages.

Theory of operation
-------------------
numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every array of
4 MiB or more it allocates. The engine makes such arrays all the time as it grows: a delta merge's
or a fold's output, the key index's table when it doubles, the base when it outgrows its room.
Each is fresh memory that its writer touches once, front to back. On this project's VM (2 cores,
Firecracker; ``transparent_hugepage/enabled = madvise``) a huge page's first touch cost far more
than the 512 small ones it replaces, with no compaction involved (``compact_stall`` stayed 0):
the core to 10^5 Zipf sentences spent 3.1 s of system time with numpy's advice against 1.0 s in
small pages (more faults, 0.62 M against 0.18 M, each far cheaper), and apply 87 → 65 µs per
sentence (docs/model.md, "Fresh memory in small pages"). So every engine method that writes new
arrays runs inside ``small_pages`` (engine.py ``_in_small_pages``).

What huge pages would buy after the fact (fewer TLB misses on the searches' random reads) is
left to ``khugepaged``: a storage node offers its store to it after a recovery or a fold
(storage/engine/page_advice.py ``allow_huge_pages``).

The switch is numpy's own, process-wide (``_set_madvise_hugepage``, a private function of its
multiarray module since 1.20): another thread's arrays made meanwhile are not advised either,
which changes only their page size. Blocks may overlap and nest (a storage node's commit on its
event loop, a fold in a worker thread, a recovery opening several stores): the first block in
turns numpy's advice off, the last out restores what it was. Where this numpy has no such switch,
the block does nothing.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["small_pages"]


def _numpy_switch() -> Any:
    """numpy's process-wide switch of its ``MADV_HUGEPAGE`` on new arrays (``set(enabled) ->
    previous``), or None where this numpy has none."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        switch = getattr(module, "_set_madvise_hugepage", None)
        if switch is not None:
            return switch
    return None


_SWITCH = _numpy_switch()
_inside = 0  # blocks of ``small_pages`` entered and not left, in every thread
_restore = True  # numpy's setting when the first of them was entered
_lock = threading.Lock()


@contextmanager
def small_pages() -> Iterator[None]:
    """Arrays numpy creates inside the block fault in small pages (module docstring)."""
    global _inside, _restore
    switch = _SWITCH
    if switch is None:
        yield
        return
    with _lock:
        if _inside == 0:
            _restore = bool(switch(False))
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                switch(_restore)
