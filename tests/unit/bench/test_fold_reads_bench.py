"""tools.bench.fold_reads runs small: both modes measured, every read equal to the stored rows, and
the folding node answered reads at once only when the client went around it."""

from __future__ import annotations

import asyncio

from tools.bench.fold_reads import _main


def test_fold_reads_bench_measures_both_modes() -> None:
    results = asyncio.run(_main(200_000, 1, 0))
    assert [mode for mode, _, _ in results] == ["wait", "around"]
    wait, around = results[0][1], results[1][1]
    assert wait["bad"] == 0 and around["bad"] == 0
    assert wait["redirected"] == 0 < around["redirected"] or around["during"] == 0
    assert all(r["fold_s"] >= 0 and r["p99_outside"] > 0 for _, r, _ in results)
