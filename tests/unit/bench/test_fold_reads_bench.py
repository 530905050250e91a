"""tools.bench.fold_reads runs small: both modes measured, every read equal to the stored rows, and
the folding node answered reads at once only when the client went around it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from giaannd.storage.engine.recovery import DurableStore
from tools.bench.fold_reads import _main

#: How long each fold lasts at least: at 2·10^5 entries a fold takes a few ms, so whether any read
#: of the bench's timeline (one every 10 ms) reached the node while it folded was luck (the test
#: failed 2 runs in 8); a fold of 0.15 s is met by about 15 of them.
FOLD_AT_LEAST_S = 0.15


def test_fold_reads_bench_measures_both_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    fold = DurableStore.fold_deltas

    def slow_fold(self: DurableStore, *args: Any, **kwargs: Any) -> int:
        time.sleep(FOLD_AT_LEAST_S)  # a worker thread's (BackgroundFold): the node is folding meanwhile
        return fold(self, *args, **kwargs)

    monkeypatch.setattr(DurableStore, "fold_deltas", slow_fold)
    results = asyncio.run(_main(200_000, 1, 0))
    assert [mode for mode, _, _ in results] == ["wait", "around"]
    wait, around = results[0][1], results[1][1]
    assert wait["bad"] == 0 and around["bad"] == 0
    assert wait["during"] > 0 and around["during"] > 0
    assert wait["redirected"] == 0 < around["redirected"]
    assert all(r["fold_s"] >= FOLD_AT_LEAST_S and r["p99_outside"] > 0 for _, r, _ in results)
