"""tools/bench/page_cache.py: the page cache's share of a file, before and after it is dropped."""

from __future__ import annotations

import os
import sys

import pytest

from tools.bench.page_cache import cached_share

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore (Linux)")


def test_a_file_just_read_is_cached_and_one_dropped_is_not(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    with path.open("rb") as f:
        os.fsync(f.fileno())
        assert f.read() is not None
    assert cached_share(path) == pytest.approx(1.0)
    with path.open("rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    share = cached_share(path)
    assert share is not None and share < 0.5


def test_a_missing_or_empty_file_has_no_share(tmp_path):
    assert cached_share(tmp_path / "missing") is None
    (tmp_path / "empty").write_bytes(b"")
    assert cached_share(tmp_path / "empty") is None
