"""Seeded fuzzing of the update log and snapshot files (STYLE.md item 12).

Invariant: after random truncations or bit flips, ``DurableStore.open`` either raises
CorruptLogError / CorruptSnapshotError, or recovers a state equal to the state after some prefix of
the records; a prefix shorter than everything is allowed only when a torn tail was reported. Any
other exception, or any other state, fails.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, CorruptLogError, CorruptSnapshotError, DurableStore
from giaannd.storage.engine.snapshot import list_snapshots
from giaannd.storage.engine.update_log import list_segments
from tests.unit.storage._gen import random_batch

BIG = 1 << 40
RECORDS = 8


def _fingerprint(store: ColumnStore) -> tuple[bytes, ...]:
    batch = store.read_all()
    applied = store.applied.to_arrays()
    return tuple(a.tobytes() for a in (*batch.buffers(), *applied))


def _build(root: Path, snapshot_after: int | None, segment_max_bytes: int) -> list[tuple[bytes, ...]]:
    """A store directory with RECORDS records (batches, one drop); returns the fingerprint after each prefix
    0..RECORDS."""
    rng = np.random.default_rng(42)
    ref = ColumnStore(BIG)
    prefixes = [_fingerprint(ref)]
    ds = DurableStore.open(root, BIG, segment_max_bytes=segment_max_bytes)
    for i in range(1, RECORDS + 1):
        if i == 4:  # a drop record (log format version 2) among the batches
            victim = ref.held_columns()[:2]
            ds.drop_columns(victim)
            ref.drop_columns(victim)
        else:
            b: RowBatch = random_batch(rng, entries=60)
            ds.apply(BatchId(1, i), b)
            ref.apply(BatchId(1, i), b)
        prefixes.append(_fingerprint(ref))
        if snapshot_after == i:
            ds.snapshot()
    ds.close()
    return prefixes


def _mutate(rnd: random.Random, path: Path) -> str:
    data = bytearray(path.read_bytes())
    if rnd.random() < 0.5 and data:
        cut = rnd.randrange(len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"truncate {path.name} to {cut}"
    for _ in range(rnd.choice((1, 1, 2, 8))):
        i = rnd.randrange(len(data))
        data[i] ^= 1 << rnd.randrange(8)
    path.write_bytes(bytes(data))
    return f"flip bits in {path.name}"


@pytest.mark.parametrize(
    ("snapshot_after", "segment_max_bytes"), [(None, 1 << 20), (None, 3000), (5, 1 << 20)]
)
def test_fuzz_storage_files_torn_or_clean_error(
    tmp_path: Path, snapshot_after: int | None, segment_max_bytes: int
) -> None:
    pristine = tmp_path / "pristine"
    prefixes = _build(pristine, snapshot_after, segment_max_bytes)
    rnd = random.Random(1234 + (snapshot_after or 0) + segment_max_bytes)
    files = [p for _, p in list_segments(pristine)] + [p for _, p in list_snapshots(pristine)]
    files = [p for p in files if p.stat().st_size > 0]
    outcomes = {"error": 0, "torn": 0, "intact": 0}
    for trial in range(150):
        work = tmp_path / f"t{trial}"
        shutil.copytree(pristine, work)
        victim = work / rnd.choice(files).name
        what = _mutate(rnd, victim)
        try:
            ds = DurableStore.open(work, BIG)
        except (CorruptLogError, CorruptSnapshotError) as exc:
            assert exc.file_path == str(victim), what
            outcomes["error"] += 1
        else:
            state = _fingerprint(ds.store)
            assert state in prefixes, what
            k = prefixes.index(state)
            if ds.recovery.torn_tail_bytes:
                outcomes["torn"] += 1
                assert k < RECORDS, what
            else:
                outcomes["intact"] += 1
                # Only a cut exactly at a record boundary of the last segment loses records silently
                # (indistinguishable from those records never having been written).
                assert k == RECORDS or what.startswith("truncate"), what
            ds.close()
        shutil.rmtree(work)
    assert outcomes["error"] > 0 and outcomes["torn"] > 0, outcomes


def test_fuzz_storage_log_truncated_at_every_offset(tmp_path: Path) -> None:
    """h11-style byte by byte: a cut of a small log recovers exactly the whole records before it."""
    rng = np.random.default_rng(5)
    pristine = tmp_path / "pristine"
    ds = DurableStore.open(pristine, BIG)
    ref = ColumnStore(BIG)
    prefixes, ends = [_fingerprint(ref)], [0]
    for i in range(1, 4):
        b = random_batch(rng, entries=4, columns=2, features=1)
        ds.apply(BatchId(2, i), b)
        ref.apply(BatchId(2, i), b)
        prefixes.append(_fingerprint(ref))
        ds.sync()
        ends.append(list_segments(pristine)[-1][1].stat().st_size)
    ds.close()
    (_, seg), = list_segments(pristine)
    data = seg.read_bytes()
    work = tmp_path / "work"
    # Every offset near a record boundary (headers), every 5th inside payloads: each open fsyncs.
    cuts = [c for c in range(len(data)) if min(abs(c - e) for e in ends) <= 48 or c % 5 == 0]
    for cut in cuts:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        (work / seg.name).write_bytes(data[:cut])
        opened = DurableStore.open(work, BIG)
        whole = max(k for k, e in enumerate(ends) if e <= cut)
        assert _fingerprint(opened.store) == prefixes[whole], cut
        assert opened.recovery.torn_tail_bytes == cut - ends[whole], cut
        opened.close()
