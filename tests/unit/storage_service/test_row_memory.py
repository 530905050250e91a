"""RowMemory (client/row_memory.py): a dropped large row's memory is received into again, only
once nothing refers to it, within the idle bound."""

import asyncio
import gc

import numpy as np

from giaannd.client.row_memory import RowMemory
from giaannd.client.row_parts import read_chunked
from tests.unit.storage_service.test_row_parts import FakeCall, big_row, core, same  # noqa: F401


def _addr(a):
    return a.__array_interface__["data"][0]


def test_row_memory_dropped_row_is_reused_and_fields_are_laid_out():
    mem = RowMemory(1 << 20)
    (seg, tc, tf, st), fresh = mem.fields(1000)
    assert fresh and [a.dtype for a in (seg, tc, tf, st)] == [np.uint8, np.uint64, np.uint64, np.float32]
    assert all(a.shape == (1000,) and a.flags.writeable and a.flags.c_contiguous for a in (seg, tc, tf, st))
    at = _addr(tc)
    del seg, tc, tf
    gc.collect()
    assert mem.idle_bytes == 0  # the strengths still refer to it
    del st
    assert mem.idle_bytes == 21_000
    out, fresh = mem.fields(900)  # fits, and is not more than twice as large
    assert not fresh and _addr(out[1]) == at and mem.reused == 1 and mem.idle_bytes == 0


def test_row_memory_keeps_within_its_bound_and_not_for_much_smaller_rows():
    mem = RowMemory(30_000)
    a, _ = mem.fields(1000)
    b, _ = mem.fields(1000)
    del a, b  # 42,000 bytes dropped: only the last fits the bound
    assert mem.idle_bytes == 21_000
    _, fresh = mem.fields(100)  # 2,100 bytes: not given a 21,000-byte array
    assert fresh
    nothing = RowMemory(0)
    c, _ = nothing.fields(1000)
    del c
    assert nothing.idle_bytes == 0


def test_row_memory_a_large_row_read_twice_reuses_the_first_ones_memory(core):  # noqa: F811
    region, expected = big_row(1_000)
    core.store.store.load_row((7, 3), region, 1)
    mem = RowMemory(1 << 20)

    def read():
        return asyncio.run(read_chunked(FakeCall(core), "s0", np.array([7], np.uint64), np.array([3], np.uint64),
                                        chunk_entries=195, epoch="", memory=mem))

    first = read()
    assert same(first, expected) and mem.fresh == 1
    first.target_column[:] = 0  # a caller scribbles on its row, then drops it
    del first
    second = read()
    assert same(second, expected) and mem.reused == 1
