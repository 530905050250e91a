"""The export comparison the integration tests and the soak benchmark share
(tools/local_cluster/exports.py)."""

from __future__ import annotations

from typing import Any

from tools.local_cluster.exports import diff_exports


def entry(source: str, target: str, strength: float, segment: int = 0) -> dict[str, Any]:
    return {"source_word": source, "segment": segment, "target_word": target, "strength": strength}


def test_export_diff_counts_lost_extra_and_differing_entries() -> None:
    ref = [entry("a", "b", 1.0), entry("a", "c", 2.0), entry("b", "c", 3.0)]
    got = [entry("a", "b", 1.0 + 1e-7), entry("a", "c", 4.0), entry("c", "d", 1.0)]
    diff = diff_exports(ref, got)
    assert (diff.lost, diff.extra, diff.differing) == (1, 1, 1)
    assert not diff.clean


def test_export_diff_same_entries_within_tolerance_are_clean_and_order_is_checked() -> None:
    ref = [entry("a", "b", 1.0), entry("a", "c", 2.0)]
    assert diff_exports(ref, [entry("a", "b", 1.0), entry("a", "c", 2.0 * (1 + 1e-7))]).clean
    swapped = diff_exports(ref, ref[::-1])
    assert swapped.lost == swapped.differing == 0 and not swapped.in_order and not swapped.clean
