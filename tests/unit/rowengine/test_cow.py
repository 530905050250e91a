"""``PendingCopies`` (rowengine/cow.py): copies of arrays as they were when named, made chunk by
chunk by the reader or, first, by the writers that announce their writes; the same bytes whatever
the interleaving, in one thread or two."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.rowengine.cow import CHUNK, READER_CHUNKS, PendingCopies, PendingSet


def _sources(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.random(3 * CHUNK + 17, dtype=np.float32), rng.integers(0, 1 << 40, CHUNK // 2 + 3, dtype=np.int64),
            np.zeros(0, np.float32)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 30))
def test_copies_are_the_arrays_as_named_whatever_the_writes_between(seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    src = _sources(rng)
    want = [s.copy() for s in src]
    n = [s.shape[0] - int(rng.integers(0, 5)) if s.shape[0] > 5 else s.shape[0] for s in src]  # a prefix
    dst = [np.empty(k, s.dtype) for s, k in zip(src, n)]
    pending = PendingCopies(list(zip(src, n, dst)))
    for _ in range(steps):
        i = int(rng.integers(0, 2))
        at = rng.integers(0, src[i].shape[0], int(rng.integers(1, 50)))
        if rng.random() < 0.3:  # through another view of the same memory (an append's longer view)
            view = src[i].base[: src[i].shape[0]] if src[i].base is not None else src[i][:]
            pending.before_write(view, at)
            view[at] += 1
        else:
            pending.before_write(src[i], at)
            src[i][at] += 1
    pending.finish()
    assert pending.done
    for d, w, k in zip(dst, want, n):
        assert np.array_equal(d, w[:k])


def test_a_write_copies_only_the_chunks_it_touches_and_unannounced_arrays_are_ignored() -> None:
    rng = np.random.default_rng(1)
    src = rng.random(4 * CHUNK, dtype=np.float32)
    dst = np.empty_like(src)
    pending = PendingCopies([(src, src.shape[0], dst)])
    other = src.copy()
    pending.before_write(other, np.array([0, 1]))  # another array: nothing
    assert pending.copied_by_writers == 0
    pending.before_write(src, np.array([5, CHUNK + 1, CHUNK + 2]))
    assert pending.copied_by_writers == 2 and not pending.done
    pending.before_write(src, np.array([6]))  # copied already
    assert pending.copied_by_writers == 2
    pending.finish()
    assert pending.done and np.array_equal(dst, src)


def test_cancel_stops_the_copies_and_lets_the_sources_go() -> None:
    src = np.ones(2 * CHUNK, np.float32)
    pending = PendingCopies([(src, src.shape[0], np.empty_like(src))])
    pending.cancel()
    assert pending.done
    pending.before_write(src, np.array([0]))  # no copy, no error
    assert pending.copied_by_writers == 0


def test_a_destination_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError):
        PendingCopies([(np.ones(10, np.float32), 10, np.empty(9, np.float32))])


def test_a_reader_thread_and_a_writer_thread_leave_the_copy_as_named() -> None:
    """The reader copies in its thread while the writer announces and writes in another, many
    rounds: each chunk is copied once, before the first write to it or after none."""
    rng = np.random.default_rng(7)
    for _ in range(5):
        src = rng.random(40 * CHUNK, dtype=np.float32)
        want = src.copy()
        dst = np.empty_like(src)
        pending = PendingCopies([(src, src.shape[0], dst)])
        stop = threading.Event()

        def write() -> None:
            w = np.random.default_rng(8)
            while not stop.is_set():
                at = w.integers(0, src.shape[0], 64)
                pending.before_write(src, at)
                src[at] += 1

        writer = threading.Thread(target=write)
        writer.start()
        try:
            pending.finish()
        finally:
            stop.set()
            writer.join(10)
        assert np.array_equal(dst, want)


def test_a_reader_whose_group_a_writer_copied_meanwhile_goes_on_to_the_next() -> None:
    """The reader looks at a group of ``READER_CHUNKS`` chunks without the lock, then takes it: a
    writer may copy the group's last chunks in between. The reader then has nothing left to copy
    there and goes on (it raised IndexError: the snapshot failed), and the copy is as named."""
    src = np.arange(2 * READER_CHUNKS * CHUNK, dtype=np.float32)  # two groups: one left after the first
    want = src.copy()
    dst = np.empty_like(src)
    pending = PendingCopies([(src, src.shape[0], dst)])
    lock = pending._lock  # noqa: SLF001 - the interleaving under test

    class WriterFirst:
        """The pending copy's lock, before whose first hold a writer copies (and writes) the whole
        first group: the reader has looked at it and found chunks to copy, not taken the lock yet."""

        fired = False

        def __enter__(self) -> None:
            if not WriterFirst.fired:
                WriterFirst.fired = True
                at = np.arange(0, READER_CHUNKS * CHUNK, CHUNK)
                pending.before_write(src, at)
                src[at] += 1
            lock.__enter__()

        def __exit__(self, *exc: object) -> None:
            lock.__exit__(*exc)

    pending._lock = WriterFirst()  # type: ignore[assignment]  # noqa: SLF001
    pending.finish()
    assert WriterFirst.fired and pending.done
    assert pending.copied_by_writers == READER_CHUNKS
    assert np.array_equal(dst, want)


def test_a_pending_set_announces_to_every_freeze_and_forgets_the_done_ones() -> None:
    """Two lazy freezes of one array at different moments: a write announced once reaches both, each
    keeps its own moment; ``finish`` makes what is left and empties the set."""
    src = np.arange(3 * CHUNK, dtype=np.float32)
    first, second = np.empty_like(src), np.empty_like(src)
    pending = PendingSet()
    pending.add(a := PendingCopies([(src, src.shape[0], first)]))
    want_first = src.copy()
    at = np.array([1, CHUNK + 1])
    pending.before_write(src, at)
    src[at] += 1
    pending.add(b := PendingCopies([(src, src.shape[0], second)]))
    want_second = src.copy()
    pending.before_write(src, np.array([2]))
    src[2] += 1
    a.finish()  # a reader finishes one: the set forgets it at the next write
    pending.before_write(src, np.array([3]))
    src[3] += 1
    assert pending._pending == [b]  # noqa: SLF001 - the property under test
    pending.finish()
    assert b.done and pending._pending == []  # noqa: SLF001
    assert np.array_equal(first, want_first) and np.array_equal(second, want_second)
