"""The storage service gives the C heap's free pages back on a timer (storage.heap-trim-interval-s):
a running node's applies leave freed temporaries that glibc keeps mapped (a cluster run measured
47-54 B of RSS per entry without it, 29 after one trim)."""

from __future__ import annotations

import asyncio
import platform
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import giaannd.storage.replication.service as service_module
from tools.cluster_harness import Cluster, make_batch


def _counting(result: bool) -> tuple[list[int], Callable[[], bool]]:
    """A stand-in for ``return_freed_heap`` answering ``result``, and the list its calls go to."""
    calls: list[int] = []

    def trim() -> bool:
        calls.append(1)
        return result

    return calls, trim


def _trims_observed(cluster: Cluster, name: str) -> float:
    text = cluster.nodes[name].metrics.render().decode()
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "giaannd_storage_heap_trim_duration_seconds_count")


@pytest.mark.asyncio
@pytest.mark.parametrize("interval_s", [0.05, 0.0])
async def test_storage_heap_trimmed_on_its_timer(tmp_path, monkeypatch, interval_s):
    calls, counted = _counting(True)
    monkeypatch.setattr(service_module, "return_freed_heap", counted)
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=interval_s)
    try:
        await cluster.client.write(make_batch(np.random.default_rng(0), 20))
        await asyncio.sleep(0.5)
        if interval_s:
            assert len(calls) >= 3 and _trims_observed(cluster, "s0") >= 3
        else:  # 0: never
            assert not calls and _trims_observed(cluster, "s0") == 0
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_heap_trim_stops_where_the_c_library_has_none(tmp_path, monkeypatch):
    calls, missing = _counting(False)
    monkeypatch.setattr(service_module, "return_freed_heap", missing)
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=0.02)
    try:
        await asyncio.sleep(0.3)
        assert len(calls) == 1 and _trims_observed(cluster, "s0") == 0
    finally:
        await cluster.close()


def _rows(batch) -> dict[tuple[int, int], list[tuple[int, int, int, float]]]:
    """Every row of a read, as comparable Python values."""
    out = {}
    for i in range(batch.num_rows):
        lo, hi = int(batch.offsets[i]), int(batch.offsets[i + 1])
        out[(int(batch.row_column[i]), int(batch.row_feature[i]))] = list(zip(
            batch.segment[lo:hi].tolist(), batch.target_column[lo:hi].tolist(),
            batch.target_feature[lo:hi].tolist(), batch.strength[lo:hi].tolist()))
    return out


@pytest.mark.asyncio
async def test_idle_storage_folds_its_delta_runs_at_a_trim(tmp_path, monkeypatch):
    # A settled cluster node held its recent entries in delta runs, 16-32 B each more than in the
    # base (base position, position index, buffer room): 1.4-4.5 B per stored entry of its RSS.
    calls, counted = _counting(True)
    monkeypatch.setattr(service_module, "return_freed_heap", counted)
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=0.05)
    svc = cluster.services["s0"]
    try:
        rng = np.random.default_rng(2)
        await cluster.client.write(make_batch(rng, 400, 8))
        await cluster.client.write(make_batch(rng, 5, 2))  # new rows, small: a delta run
        engine = svc.store.store.engine
        expected = _rows(svc.store.store.read_all())
        deadline = asyncio.get_running_loop().time() + 5
        while engine.num_deltas and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert engine.num_deltas == 0 and engine.delta_entries == 0
        assert _rows(svc.store.store.read_all()) == expected
        assert len(calls) >= 2
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_busy_storage_keeps_its_delta_runs(tmp_path):
    # The fold waits for a trim interval with nothing logged: a node taking writes folds as before.
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=0.0)  # no timer: called here
    svc = cluster.services["s0"]
    try:
        rng = np.random.default_rng(3)
        await cluster.client.write(make_batch(rng, 400, 8))
        seen = svc.store.log.last_seq
        await cluster.client.write(make_batch(rng, 5, 2))
        engine = svc.store.store.engine
        assert engine.num_deltas
        assert await svc.fold_when_idle(seen) == svc.store.log.last_seq and engine.num_deltas  # logged since: kept
        async with svc._snapshot_running:  # a snapshot's view holds the runs: kept
            assert await svc.fold_when_idle(svc.store.log.last_seq) and engine.num_deltas
        await svc.fold_when_idle(svc.store.log.last_seq)
        assert engine.num_deltas == 0
    finally:
        await cluster.close()


_MMAPPED_AFTER_FREES = """
import ctypes, sys
import numpy as np
from giaannd.storage.engine.recovery import fix_mmap_threshold

def mmapped(a):  # IS_MMAPPED (0x2) in the size word of glibc's chunk header, before numpy's pointer
    return bool(ctypes.c_size_t.from_address(a.ctypes.data - 8).value & 2)

if int(sys.argv[1]):
    assert fix_mmap_threshold(int(sys.argv[1]))
out = []
for size in (8 << 20, 2 << 20, 8 << 20, 2 << 20):  # each freed before the next
    block = np.empty(size, np.uint8)
    out.append(mmapped(block))
    del block
print(out)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("threshold", [1 << 20, 0])
def test_blocks_from_the_fixed_threshold_get_their_own_mapping(threshold):
    # glibc's sliding threshold served an apply's 1-32 MiB temporaries from the main arena, where a
    # settled node kept 100-316 MB of them resident: a freed mapped block raised the threshold
    # (0: glibc's default, shown for contrast). A fresh process: in this one, freed chunks that
    # earlier tests left in the arena would serve the blocks whatever the threshold.
    out = subprocess.run([sys.executable, "-c", _MMAPPED_AFTER_FREES, str(threshold)], capture_output=True,
                         text=True, check=True, timeout=120)
    mapped = [word == "True" for word in out.stdout.strip().strip("[]").split(", ")]
    assert len(mapped) == 4
    assert all(mapped) if threshold else not all(mapped)


@pytest.mark.asyncio
@pytest.mark.parametrize("threshold", [3 << 20, 0])
async def test_storage_start_fixes_the_configured_mmap_threshold(tmp_path, monkeypatch, threshold):
    calls: list[int] = []
    monkeypatch.setattr(service_module, "fix_mmap_threshold", lambda nbytes: calls.append(nbytes) or True)
    cluster = await Cluster(tmp_path, 1, replicas=1).start(heap_trim_interval_s=0.0,
                                                           malloc_mmap_threshold_bytes=threshold)
    try:
        assert calls == ([threshold] if threshold else [])
    finally:
        await cluster.close()
