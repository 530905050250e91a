"""Write-path latency buckets are fine enough that a p99 read as its bucket's upper bound tells a
2× target apart (issue 14 item 3): each bucket spans at most 2^(1/4), over the whole range."""

from __future__ import annotations

import math

import pytest

from giaannd.metrics import STORAGE_WRITE_BUCKETS_S, log_buckets


def test_log_buckets_span_equal_ratios_from_low_to_high() -> None:
    b = log_buckets(0.001, 1.0, 2)
    assert b[0] == 0.001 and b[-1] >= 1.0 and b[-2] < 1.0
    ratios = [hi / lo for lo, hi in zip(b, b[1:], strict=False)]
    assert all(r == pytest.approx(math.sqrt(2), rel=1e-5) for r in ratios)
    assert list(b) == sorted(set(b))


def test_storage_write_buckets_resolve_a_ratio_of_two() -> None:
    b = STORAGE_WRITE_BUCKETS_S
    assert b[0] <= 25e-6 and b[-1] >= 10.0
    assert max(hi / lo for lo, hi in zip(b, b[1:], strict=False)) <= 2 ** 0.25 * (1 + 1e-5)
    # 1.3x and 2.5x a 10 ms p99 land in different buckets (the 1-2.5-5 steps put both in 25 ms).
    def upper(x: float) -> float:
        return next(le for le in b if le >= x)
    assert upper(0.013) / upper(0.010) < 1.5 and upper(0.025) / upper(0.010) > 2.0


@pytest.mark.parametrize("args", [(0.0, 1.0, 4), (1.0, 1.0, 4), (2.0, 1.0, 4), (0.1, 1.0, 0)])
def test_log_buckets_refuse_bad_arguments(args: tuple[float, float, int]) -> None:
    with pytest.raises(ValueError, match="log_buckets"):
        log_buckets(*args)
