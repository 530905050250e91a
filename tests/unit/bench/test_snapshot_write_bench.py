"""tools.bench.snapshot's snapshot writes with delta runs run small and print every writer's figures."""

from __future__ import annotations

import json

from tools.bench.snapshot import bench_write_delta_runs


def test_snapshot_write_bench_prints_every_writer(tmp_path, capsys) -> None:
    bench_write_delta_runs(tmp_path, 3000, 1, True)
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [f["figure"].split(", ", 2)[-1] for f in figures[:2]] == [
        "through the page cache (baseline), CPU s/GB", "dropped from the page cache, CPU s/GB"]
    assert figures[2]["figure"].endswith("CPU s/GB") and "direct" in figures[2]["figure"]
    assert figures[3]["figure"] == "snapshot write, direct / through the page cache"
    assert all(f["value"] > 0 for f in figures) and not list(tmp_path.iterdir())  # files removed


def test_apply_during_snapshot_bench_measures_lazy_and_eager_freezes(tmp_path, capsys) -> None:
    """Section 2 runs small: the lazy freeze (now) and the copies made in the freeze (baseline) are
    both measured, with and without a touched room, and the first apply after each."""
    import numpy as np

    from giaannd.protocol import BatchId
    from giaannd.storage import DurableStore
    from tools.bench.snapshot import bench_apply_during_snapshot, realistic_batch

    ds = DurableStore.open(tmp_path, 1 << 40)
    rng = np.random.default_rng(2)
    for i in range(3):
        ds.apply(BatchId(1, i + 1), realistic_batch(rng, 2000, 1000 * i), validate=False)
    try:
        bench_apply_during_snapshot(ds, 0.0, 6, 1.0, True, neighbours=1)
    finally:
        ds.close()
    figures = {f["figure"]: f["value"] for f in
               (json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{"))}
    assert figures["apply p99 during a snapshot / without"] > 0
    for name in ("freeze (applies held off), lazy copies (now), max (ms)",
                 "baseline: freeze, copies made in it into a touched room, max (ms)",
                 "freeze + the first apply after it, lazy copies (now), max (ms)",
                 "baseline: freeze + the first apply after it, copies made in the freeze, max (ms)"):
        assert figures[name] > 0, name
