"""The runtime's per-peer rate limit on data-plane unreachability reports
(``NodeRuntime.report_unreachable``) while peers come and go for good under new names: it must keep
no more than the reports that can still hold one back.

Before (Nov 30): the time of the last report was kept for every peer name ever reported, for the
daemon's whole life (a name that left, even years ago)."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.config import Config
from giaannd.runtime.node import NodeRuntime

from .test_unreachable_hook import FakeMembership

ROUNDS = 2_000


def test_leak_unreachable_reports_of_peers_gone_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = NodeRuntime(Config.loopback(str(tmp_path), name="a", roles=["compute"]))
    rt.node_name = "a"
    fake = FakeMembership(1.0)
    rt.membership = fake  # type: ignore[assignment]
    now = [100.0]
    monkeypatch.setattr("giaannd.runtime.node.time.monotonic", lambda: now[0])
    kept = []
    for i in range(ROUNDS):  # each round a peer that was just replaced by a new one
        assert rt.report_unreachable(f"s{i}") is True
        assert rt.report_unreachable(f"s{i}") is False  # its burst: held back
        now[0] += 0.25
        kept.append(len(rt._unreachable_at))
    assert len(fake.reports) == ROUNDS
    # reports younger than the probe interval (4 here) are all that can still hold one back
    assert max(kept[ROUNDS // 2:]) <= max(kept[:ROUNDS // 2]), f"entries kept: {kept[::200]}"
