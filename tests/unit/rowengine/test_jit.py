"""giaannd/rowengine/jit.py: kernels compile eagerly, and still compile where nothing is writable."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from giaannd.rowengine import jit


def test_kernel_compiles_at_definition_for_its_signature():
    @jit.kernel("void(int64[:], int64)")
    def fill(out, value):  # type: ignore[no-untyped-def]
        for i in range(out.shape[0]):
            out[i] = value

    assert len(fill.signatures) == 1  # compiled when defined, not at the first call
    out = np.zeros(5, np.int64)
    fill(out[::2], 7)  # any layout (the signature's arrays are "A")
    assert out.tolist() == [7, 0, 7, 0, 7]
    with pytest.raises(TypeError):
        fill(np.zeros(3, np.float32), 1)  # no other signature is compiled on the fly


def test_kernel_without_a_writable_cache_compiles_uncached_and_warns(monkeypatch, caplog):
    from numba.core import caching

    for cls in caching.CacheImpl._locator_classes:  # no location can hold a cache
        monkeypatch.setattr(cls, "from_function", classmethod(lambda cls, py_func, py_file: None))
    monkeypatch.setattr(jit, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=jit.__name__):
        @jit.kernel("int64(int64)")
        def inc(x):  # type: ignore[no-untyped-def]
            return x + 1

        @jit.kernel("int64(int64)")
        def dec(x):  # type: ignore[no-untyped-def]
            return x - 1

    assert inc(2) == 3 and dec(2) == 1
    assert len(caplog.records) == 1  # warned once, not per kernel
    assert "NUMBA_CACHE_DIR" in caplog.records[0].getMessage()
