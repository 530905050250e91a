"""tools.bench.replay_before (the snapshot bench's "as before" replay baselines) still runs on
today's engine and recovery, and replays to the same rows: a baseline that no longer runs would
leave ``tools.bench.snapshot`` failing, as it did until Nov 29 (``replay``'s window and thread
parameters, the engine's delta lookups, the snapshot's ``mapping``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from giaannd.storage import DurableStore
from tests.unit.storage._gen import same_state
from tools.bench import replay_before, restart


def test_open_as_before_replays_a_training_like_log_to_the_same_rows(tmp_path: Path) -> None:
    restart.build_store(tmp_path / "store", entries=60_000, log_share=0.2)
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    before = replay_before.open_as_before(tmp_path / "copy", restart.BIG, close=False)
    now = DurableStore.open(tmp_path / "store", restart.BIG, map_snapshot=False)
    assert before is not None and before.recovery.records_replayed == now.recovery.records_replayed > 0
    assert same_state(before.store, now.store)
    before.close()
    now.close()
