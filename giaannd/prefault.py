"""Map fresh memory's pages in a thread, ahead of the thread that fills it.

The kernel maps and zeroes each page of fresh memory on its first write, and where freed guest
memory goes back to the hypervisor (a balloon with free page reporting, this project's VMs) the
hypervisor serves that fault too: 1.4-2.4 ms/MB here against ~0.1 for memory touched before
(docs/topology.md "What the host allows a receiver"). Two fillers know their destination before
they write it: a large row read by parts (client/row_parts.py: the socket fills it) and a stream
receiver's reserved room in the base (storage/engine/column_store.py ``reserve``: the stream's
chunks fill it). ``Prefault`` asks the kernel to map the pages ahead of them, chunk by chunk in a
thread, with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): it faults the pages in writable
without writing to them, so it may run over a chunk the filler is already writing, and nothing
waits for it; the faults are paid on another core than the filler's. The call goes through
``ctypes``, which releases the GIL for the system call (``mmap.madvise`` does not, and only takes
mappings of its own). Where the kernel refuses (older kernels, other systems) the thread stops at
once and the filler faults its own pages, as without it.

Before this, a thread *wrote* a byte per page, and a part was requested only once its chunk was
written (a receive must not be overwritten): a descheduled thread on a loaded host then held the
reads back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

from numpy.typing import NDArray

from peers.madvise import populate

__all__ = ["Prefault"]


#: Seconds between two looks at ``Prefault``'s bound while the filler has not caught up: the
#: first, doubled at each look that finds it where it was, up to the second (a stalled or
#: abandoned filler costs ~10 wake-ups a second, a moving one is followed within ~2 ms).
_BOUND_POLL_S: Final = 0.002
_BOUND_POLL_MAX_S: Final = 0.1


class Prefault:
    """Populates the pages of elements ``[start, len)`` of each of ``out`` (contiguous arrays of
    one length), chunk by chunk (``chunk`` elements of each array), in a thread. ``bound``: a
    chunk is mapped only once it ends at or below ``bound()`` (the filler's position plus the
    lead it is given: the memory made resident ahead of the filler stays bounded, whatever the
    destination's size), and a negative ``bound()`` stops the thread (the destination is no
    longer filled); None maps as fast as it can."""

    def __init__(self, out: Sequence[NDArray[Any]], chunk: int, start: int = 0,
                 bound: Callable[[], int] | None = None) -> None:
        self._stop = threading.Event()
        #: elements of each array mapped so far: ``[start, mapped)`` (a progress mark; another
        #: thread may read it)
        self.mapped = max(0, start)
        self._thread = threading.Thread(target=self._run, args=(list(out), chunk, start, bound), daemon=True)
        self._thread.start()

    def _run(self, out: list[NDArray[Any]], chunk: int, start: int, bound: Callable[[], int] | None) -> None:
        n = int(out[0].shape[0])
        for a in range(max(0, start), n, chunk):
            b = min(a + chunk, n)
            wait, last = _BOUND_POLL_S, None
            while bound is not None and (now := bound()) < b:
                if now < 0:
                    return
                wait = _BOUND_POLL_S if now != last else min(2 * wait, _BOUND_POLL_MAX_S)
                last = now
                if self._stop.wait(wait):
                    return
            for o in out:
                if self._stop.is_set() or not populate(o, a, b):
                    return
            self.mapped = b

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to map everything (or to stop at a
        refusal); whether it is done."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

