"""The storage views behind the status page: disk use of a storage directory and ring owner counts."""

from __future__ import annotations

from pathlib import Path

from giaannd.services.storage_usage import OWNER_SAMPLE, owner_counts
from giaannd.storage.engine.disk_usage import disk_usage
from peers.placement import Member, Placement


def test_disk_usage_sums_files_recursively_and_reports_the_file_system(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "seg-1").write_bytes(b"x" * 1000)
    (tmp_path / "hints").mkdir()
    (tmp_path / "hints" / "h").write_bytes(b"y" * 24)
    (tmp_path / "link").symlink_to(tmp_path / "store" / "seg-1")  # counted as a link, not twice
    u = disk_usage(tmp_path)
    assert 1024 <= u.files_bytes < 1024 + 200 and not u.partial
    assert 0 < u.free_bytes <= u.total_bytes
    capped = disk_usage(tmp_path, max_files=1)
    assert capped.partial and capped.files_bytes <= u.files_bytes
    assert disk_usage(tmp_path / "absent").files_bytes == 0


def test_owner_counts_are_replicas_and_primaries_over_the_sample() -> None:
    members = tuple(Member(f"s{i}", 1.0) for i in range(4))
    counts = owner_counts(Placement(members, 2))
    assert sum(c["owned"] for c in counts.values()) == 2 * OWNER_SAMPLE
    assert sum(c["primary"] for c in counts.values()) == OWNER_SAMPLE
    # equal weights: each holds about half the sampled ids (binomial: within a few standard errors)
    assert all(abs(c["owned"] / OWNER_SAMPLE - 0.5) < 0.05 for c in counts.values()), counts
    heavy = owner_counts(Placement((Member("big", 3.0), Member("small", 1.0)), 1, "weighted"))
    assert heavy["big"]["primary"] > 2 * heavy["small"]["primary"]
