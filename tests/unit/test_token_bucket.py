"""peers/token_bucket.py: the GCRA bucket in tables (the clock is the ``now`` argument)."""

from __future__ import annotations

import math

import pytest

from peers.token_bucket import TokenBucket


@pytest.mark.parametrize(("rate", "burst_s", "sends", "waits"), [
    # no burst: the first send goes at once, each next one waits for the previous one's bytes
    (100.0, 0.0, [(0.0, 100), (0.0, 100), (0.0, 50)], [0.0, 1.0, 2.0]),
    # a send after the previous bytes are paid goes at once; idle time earns no credit
    (100.0, 0.0, [(0.0, 100), (5.0, 100), (5.0, 100)], [0.0, 0.0, 1.0]),
    # one second of burst: after idling, about a second's worth goes without waiting
    (100.0, 1.0, [(10.0, 60), (10.0, 60), (10.0, 60)], [0.0, 0.0, 0.2]),
    # a send larger than the bucket is not refused: it goes alone, the next pays for it
    (100.0, 0.5, [(0.0, 1000), (0.0, 10)], [0.0, 9.5]),
    # waiting callers that arrive late get less wait
    (100.0, 0.0, [(0.0, 100), (0.4, 100), (2.5, 100)], [0.0, 0.6, 0.0]),
    # zero-byte sends take no time
    (100.0, 0.0, [(0.0, 0), (0.0, 0), (0.0, 100), (0.0, 0)], [0.0, 0.0, 0.0, 1.0]),
])
def test_token_bucket_waits_table(rate: float, burst_s: float, sends: list[tuple[float, int]],
                                  waits: list[float]) -> None:
    bucket = TokenBucket(rate, 0.0, burst_s=burst_s)
    got = [bucket.reserve(now, n) for now, n in sends]
    assert got == pytest.approx(waits)


def test_token_bucket_long_run_rate_is_the_rate() -> None:
    """A greedy sender that always sends as soon as allowed moves rate · t (+ one burst) in t."""
    for burst_s in (0.0, 0.25, 2.0):
        bucket = TokenBucket(1000.0, 0.0, burst_s=burst_s)
        now, sent = 0.0, 0
        while now < 30.0:
            now += bucket.reserve(now, 37)
            sent += 37
        assert sent <= 1000.0 * (now + burst_s) + 37 + 1e-6
        assert sent >= 1000.0 * now - 37


def test_token_bucket_rate_change_applies_to_later_sends() -> None:
    bucket = TokenBucket(100.0, 0.0)
    assert bucket.reserve(0.0, 100) == 0.0  # paid for at 100/s: until 1.0
    bucket.rate = 1000.0
    assert bucket.reserve(0.0, 100) == pytest.approx(1.0)  # waits for the old booking
    assert bucket.start_at(0.0) == pytest.approx(1.1)  # its own 100 B took 0.1 s at the new rate
    bucket.rate = math.inf
    assert bucket.reserve(1.1, 10**9) == pytest.approx(0.0)
    assert bucket.start_at(1.1) == pytest.approx(1.1)


@pytest.mark.parametrize(("rate", "burst_s"), [(0.0, 0.0), (-1.0, 0.0), (math.nan, 0.0), (1.0, -0.1),
                                               (1.0, math.nan)])
def test_token_bucket_rejects_bad_parameters(rate: float, burst_s: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, 0.0, burst_s=burst_s)


def test_token_bucket_rejects_negative_amounts_and_a_zeroed_rate() -> None:
    bucket = TokenBucket(10.0, 0.0)
    with pytest.raises(ValueError):
        bucket.reserve(0.0, -1)
    bucket.rate = 0.0
    with pytest.raises(ValueError):
        bucket.reserve(0.0, 1)
