"""tools/bench/host.py ``new_buffer_ms_per_mb``: both ways measured on as many bytes, and the
kernel's way reported as nan, not as a figure, where the kernel refuses it."""

from __future__ import annotations

import math
import sys

import pytest

from peers import madvise
from tools.bench import host


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_new_buffers_are_measured_both_ways():
    written, mapped = host.new_buffer_ms_per_mb(4 << 20, 1 << 20)
    assert written > 0 and mapped > 0 and math.isfinite(mapped)


def test_a_refused_populate_is_no_figure(monkeypatch):
    asked: list[int] = []

    def refuse(arr, a, b):  # type: ignore[no-untyped-def]
        asked.append(b - a)
        return False

    monkeypatch.setattr(madvise, "populate", refuse)
    written, mapped = host.new_buffer_ms_per_mb(3 << 20, 1 << 20)
    assert asked == [1 << 20] * 3 and written > 0 and math.isnan(mapped)
