"""Tables for the pure maths, checked against memberlist's own test tables."""

import math

import pytest

from peers.membership.awareness import Awareness
from peers.membership.broadcast import BroadcastQueue, retransmit_limit
from peers.membership.suspicion import (
    Suspicion,
    push_pull_scale,
    remaining_suspicion_s,
    suspicion_timeout_s,
)


@pytest.mark.parametrize(("n", "expected"), [
    (0, 1.0), (1, 1.0), (5, 1.0), (10, 1.0), (50, 1.698), (100, 2.0), (500, 2.698),
    (1000, 3.0),
])
def test_suspicion_timeout_table(n, expected):
    # memberlist util_test.go TestSuspicionTimeout: suspicionTimeout(3, n, 1s) / 3
    assert suspicion_timeout_s(3, n, 1.0) / 3 == pytest.approx(expected, abs=1e-9)


def test_suspicion_timeout_scales_with_interval_and_mult():
    assert suspicion_timeout_s(4, 100, 0.5) == pytest.approx(4.0)
    assert suspicion_timeout_s(6, 1000, 5.0) == pytest.approx(90.0)


@pytest.mark.parametrize(("c", "k", "elapsed", "expected"), [
    # memberlist suspicion_test.go TestSuspicion_remainingSuspicionTime (min 2 s, max 30 s)
    (0, 3, 0.0, 30.0), (1, 3, 2.0, 14.0), (2, 3, 3.0, 4.81), (3, 3, 4.0, -2.0),
    (4, 3, 5.0, -3.0), (5, 3, 10.0, -8.0),
    (0, 0, 0.0, 2.0), (3, 0, 1.0, 1.0),  # k < 1: the minimum, no decay
])
def test_remaining_suspicion_table(c, k, elapsed, expected):
    assert remaining_suspicion_s(c, k, elapsed, 2.0, 30.0) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(("mult", "n", "expected"), [
    (3, 0, 0), (3, 1, 3), (3, 9, 3), (3, 10, 6), (3, 99, 6), (3, 100, 9), (4, 999, 12),
    (4, 1000, 16),
])
def test_retransmit_limit_table(mult, n, expected):
    assert retransmit_limit(mult, n) == expected


@pytest.mark.parametrize(("n", "expected"), [
    (1, 1.0), (32, 1.0), (33, 2.0), (64, 2.0), (65, 3.0), (128, 3.0), (129, 4.0),
    (1000, 6.0),
])
def test_push_pull_scale_table(n, expected):
    assert push_pull_scale(1.0, n) == pytest.approx(expected)


@pytest.mark.parametrize(("deltas", "expected_score", "expected_scale"), [
    ([], 0, 1.0), ([1], 1, 2.0), ([3, 3, 3], 8, 9.0), ([-1], 0, 1.0), ([5, -2], 3, 4.0),
    ([100, -100, 2], 2, 3.0),
])
def test_awareness_table(deltas, expected_score, expected_scale):
    a = Awareness(8)
    for d in deltas:
        a.apply_delta(d)
    assert a.score == expected_score
    assert a.scale(1.0) == expected_scale


def test_suspicion_confirmations_shorten_and_cap():
    s = Suspicion("a", k=3, min_s=2.0, max_s=30.0, start=100.0)
    assert s.deadline() == pytest.approx(130.0)
    assert not s.confirm("a")  # the first accuser is not a confirmation
    assert s.confirm("b")
    assert not s.confirm("b")  # nor is the same accuser twice
    assert s.deadline() == pytest.approx(116.0)
    assert s.confirm("c") and s.confirm("d")
    assert s.deadline() == pytest.approx(102.0)
    assert not s.confirm("e")  # past k: no change, nothing to re-gossip
    assert s.deadline() == pytest.approx(102.0)


def test_suspicion_without_expected_confirmations_is_min():
    s = Suspicion("a", k=0, min_s=2.0, max_s=30.0, start=0.0)
    assert s.deadline() == pytest.approx(2.0)
    assert not s.confirm("b")


def test_broadcast_queue_invalidates_older_message_about_same_member():
    q: BroadcastQueue[str] = BroadcastQueue()
    q.queue("x", "old", 10)
    q.queue("x", "new", 10)
    assert len(q) == 1
    assert q.get(0, 100, 5) == [("new", 10)]


def test_broadcast_queue_retransmit_limit_and_order():
    q: BroadcastQueue[str] = BroadcastQueue()
    q.queue("a", "A", 10)
    assert q.get(0, 100, 2) == [("A", 10)]
    q.queue("b", "B", 10)
    # least transmitted first: B (0 sends) before A (1 send)
    assert [m for m, _ in q.get(0, 100, 2)] == ["B", "A"]
    assert len(q) == 1  # A reached its limit of 2 and is gone
    assert q.transmits("b") == 1


def test_broadcast_queue_respects_budget():
    q: BroadcastQueue[int] = BroadcastQueue()
    for i in range(100):
        q.queue(str(i), i, 50)
    got = q.get(2, 500, 10)
    assert len(got) == math.floor(500 / 52)
    assert sum(size + 2 for _, size in got) <= 500
