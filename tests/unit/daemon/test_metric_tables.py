"""The metric tables cover every plain counter they export (a counter added later gets a named
metric with HELP, not a silent gap), and ``Metrics`` adds the process collector, drops
``_created`` series and exports scrape-time counters as counters. The conventions themselves are
checked on a live scrape: tests/integration/test_metrics_conventions.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from giaannd.compute.jobs import TrainProgress
from giaannd.compute.service import TRAIN_COUNTERS
from giaannd.metrics import Metrics
from giaannd.runtime.metrics import MEMBERSHIP_COUNTERS, TRANSPORT_COUNTERS, _membership_families
from giaannd.storage.replication.requests import StorageCounters
from giaannd.storage.replication.service import STORAGE_COUNTERS
from peers.transport.connection import Metrics as TransportMetrics

ROOT = Path(__file__).resolve().parents[3]


def _int_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.type in (int, "int")}


def test_metric_tables_cover_train_storage_and_transport_counters() -> None:
    # ``total`` is set once, not counted; ``fsync_batches`` is the fsync histogram's _count.
    assert set(TRAIN_COUNTERS) == _int_fields(TrainProgress) - {"total"}
    assert set(STORAGE_COUNTERS) == _int_fields(StorageCounters) - {"fsync_batches"}
    assert set(TRANSPORT_COUNTERS) == _int_fields(TransportMetrics)


def test_metric_tables_cover_every_membership_counter_in_peers() -> None:
    counted: set[str] = set()
    for path in (ROOT / "peers" / "membership").glob("*.py"):
        # every plain string literal among a _count(...) call's arguments (both branches of
        # ``_count("members_left" if left else "members_failed")``; not ``f"rejected_{reason}"``)
        for args in re.findall(r"_count\(([^)]*)\)", path.read_text()):
            counted |= set(re.findall(r'(?<!f)"([a-z_]+)"', args))
    assert counted, "no _count(...) calls found: did peers/membership move?"
    assert counted - set(MEMBERSHIP_COUNTERS) == set()


def test_membership_families_one_metric_each_rejections_by_reason() -> None:
    counters = {"probes": 3, "rejected_wrong_key": 2, "rejected_malformed": 1, "members_live": 4,
                "brand_new_thing": 5}
    families = {f.name: f for f in _membership_families(counters)}
    assert families["giaannd_membership_probes"].samples[0].value == 3
    assert families["giaannd_membership_suspicions"].samples[0].value == 0  # exported from zero
    by_reason = {s.labels["reason"]: s.value for s in families["giaannd_membership_packets_rejected"].samples}
    assert by_reason == {"wrong_key": 2, "malformed": 1}
    assert families["giaannd_membership_brand_new_thing"].samples[0].value == 5
    assert not any("members_live" in name for name in families)


def test_metrics_registry_process_collector_counter_function_no_created() -> None:
    metrics = Metrics()
    box = {"n": 0}
    metrics.counter_function("giaannd_test_things_total", "Things counted in a plain int.", lambda: box["n"])
    metrics.counter("giaannd_test_events_total", "Events counted by a Counter.").inc()
    metrics.histogram("giaannd_test_duration_seconds", "Durations of a test operation.").observe(0.1)
    box["n"] = 7
    text = metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["giaannd_test_things"].type == "counter"
    assert [s.value for s in families["giaannd_test_things"].samples] == [7]
    assert "_created" not in text
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert "process_open_fds" in families and "python_info" in families
