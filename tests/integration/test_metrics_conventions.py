"""``/metrics`` follows the Prometheus naming conventions (issue 18 item 3), as an operator's
promtool would check them: one in-process daemon with both roles (as ``giaannd`` wires it) trains
on a few bundled sentences and answers an evaluation, so the counters move; its scrape is then
parsed with ``prometheus_client``'s parser and every family linted (``lint_exposition``).

Rules (https://prometheus.io/docs/practices/naming/, promtool's ``check metrics``): counters end in
``_total`` and only counters do; no ``_created`` series; names ``giaannd_[a-z0-9_]+`` (the
library's process_/python_ collectors aside); base units only as the last word (before ``_total``
for counters, or the ``_info`` family); HELP says what is counted (>= 20 characters); no label
that multiplexes different quantities (``figure``, ``counter``, ``kind``); histograms complete.
Real loopback sockets; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from giaannd.config import ClusterConfig, Config, TransportConfig
from giaannd.daemon import Daemon, build_role_services
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.runtime.node import NodeRuntime
from giaannd.services.membership import MembershipService
from tests.integration.test_cluster_inprocess import Node

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
JOB_WAIT_S = 60.0

NAME = re.compile(r"^giaannd_[a-z0-9_]+$")
#: the library's own collectors (ProcessCollector, PlatformCollector, GCCollector)
LIBRARY_PREFIXES = ("process_", "python_")
#: base units (https://prometheus.io/docs/practices/naming/#base-units) and the words we must not
#: abbreviate them to; any of these may appear only as a name's last word
UNIT_WORDS = {"seconds", "bytes", "ratio", "percent", "celsius", "meters", "grams", "volts",
              "amperes", "joules", "secs", "ms", "milliseconds", "microseconds", "kb", "mb",
              "kilobytes", "megabytes"}
ALLOWED_LAST_UNITS = {"seconds", "bytes", "ratio", "celsius", "meters", "grams", "volts",
                      "amperes", "joules"}
MULTIPLEXING_LABELS = {"figure", "counter", "kind"}
MIN_HELP_CHARS = 20


def lint_exposition(text: str) -> list[str]:
    """Every convention breach in a Prometheus text scrape, as readable lines (empty: clean)."""
    problems: list[str] = []
    families = list(text_string_to_metric_families(text))
    assert families, "empty scrape"
    for fam in families:
        # The parser strips a counter's _total (and histogram suffixes) from ``fam.name``; the
        # exposed sample names are what dashboards query.
        library = fam.name.startswith(LIBRARY_PREFIXES)
        if not library and not NAME.match(fam.name):
            problems.append(f"{fam.name}: not giaannd_[a-z0-9_]+")
        if len(fam.documentation.strip()) < MIN_HELP_CHARS:
            problems.append(f"{fam.name}: HELP {fam.documentation!r} under {MIN_HELP_CHARS} chars")
        sample_names = {s.name for s in fam.samples}
        if any(n.endswith("_created") for n in sample_names):
            problems.append(f"{fam.name}: exports _created series")
        if fam.type == "counter":
            if not all(n.endswith("_total") for n in sample_names):
                problems.append(f"{fam.name}: counter samples {sorted(sample_names)} lack _total")
            base = fam.name
        elif fam.type == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                if fam.name + suffix not in sample_names:
                    problems.append(f"{fam.name}: histogram without {suffix}")
            if not any(s.labels.get("le") == "+Inf" for s in fam.samples):
                problems.append(f"{fam.name}: histogram without a +Inf bucket")
            base = fam.name
        else:
            if fam.name.endswith("_total") or any(n.endswith("_total") for n in sample_names):
                problems.append(f"{fam.name}: a {fam.type} named _total (only counters are)")
            base = fam.name
        if library:
            continue
        words = base.split("_")
        last = words[-1]
        if last == "info" and fam.type in ("gauge", "info"):
            words = words[:-1]
            last = words[-1]
        for word in words[:-1]:
            if word in UNIT_WORDS:
                problems.append(f"{fam.name}: unit {word!r} mid-name (units go last)")
        if last in UNIT_WORDS and last not in ALLOWED_LAST_UNITS:
            problems.append(f"{fam.name}: {last!r} is not a base unit")
        for sample in fam.samples:
            bad = MULTIPLEXING_LABELS & set(sample.labels)
            if bad:
                problems.append(f"{fam.name}: label {sorted(bad)} multiplexes quantities")
                break
    return problems


def test_lint_exposition_catches_each_rule() -> None:
    """The linter itself: each rule fires on a scrape that breaks it, and a clean one passes."""
    clean = ("# HELP giaannd_x_sent_bytes_total Bytes sent to peers since start.\n"
             "# TYPE giaannd_x_sent_bytes_total counter\ngiaannd_x_sent_bytes_total 3.0\n"
             "# HELP giaannd_x_used_bytes Bytes the store accounts for now.\n"
             "# TYPE giaannd_x_used_bytes gauge\ngiaannd_x_used_bytes 1.0\n")
    assert lint_exposition(clean) == []
    bad = {
        "# HELP giaannd_a_hits Row cache hits since start.\n# TYPE giaannd_a_hits gauge\n"
        "giaannd_a_hits_total 1.0\n": "_total",
        "# HELP giaannd_b_total Figures summed over all jobs.\n# TYPE giaannd_b_total counter\n"
        'giaannd_b_total{figure="x"} 1.0\n': "multiplexes",
        "# HELP giaannd_c_bytes_sent_total Bytes sent to peers since start.\n"
        "# TYPE giaannd_c_bytes_sent_total counter\ngiaannd_c_bytes_sent_total 1.0\n": "mid-name",
        "# HELP giaannd_d_total short\n# TYPE giaannd_d_total counter\ngiaannd_d_total 1.0\n": "HELP",
        "# HELP giaannd_e_total Events counted since start.\n# TYPE giaannd_e_total counter\n"
        "giaannd_e_total 1.0\ngiaannd_e_created 1.7e9\n": "_created",
        "# HELP other_f Some other family entirely.\n# TYPE other_f gauge\nother_f 1.0\n": "not giaannd",
        "# HELP giaannd_g_latency_ms Latency of something measured.\n# TYPE giaannd_g_latency_ms gauge\n"
        "giaannd_g_latency_ms 1.0\n": "base unit",
    }
    for text, rule in bad.items():
        problems = lint_exposition(text)
        assert any(rule in p for p in problems), (rule, problems)


class BothRolesNode(Node):
    """``Node`` of test_cluster_inprocess with both roles: a one-node cluster (R = 1)."""

    def __init__(self, root: Path, name: str) -> None:
        base = Config.loopback(str(root / name), name=name, roles=["storage", "compute"])
        self.config = msgspec.structs.replace(
            base, cluster=ClusterConfig(name="metrics", key_file="", seeds=[]),
            transport=TransportConfig(bind=["tcp://127.0.0.1:0"]),
            storage=msgspec.structs.replace(base.storage, join_mode="bootstrap"))
        self.runtime = NodeRuntime(self.config)
        self.membership = MembershipService(self.runtime)
        services, unavailable = build_role_services(self.config, self.runtime)
        assert not unavailable, unavailable
        self.daemon = Daemon(self.config, [self.runtime, self.membership, *services],
                             handle_signals=False, runtime=self.runtime)
        self.task = None
        self.session = None


async def _finished_job(node: Node, job_id: str) -> dict[str, Any]:
    async with asyncio.timeout(JOB_WAIT_S):
        while True:
            status, doc = await node.call("GET", f"/v1/jobs/{job_id}")
            assert status == 200, doc
            if doc["state"] != "running":
                return dict(doc)
            await asyncio.sleep(0.05)


def _samples(text: str) -> dict[str, float]:
    """Unlabelled sample name -> value (labelled ones keyed ``name{k=v,...}``)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                            if s.labels else "")
            out[key] = s.value
    return out


@pytest.mark.asyncio
async def test_metrics_scrape_follows_prometheus_conventions(tmp_path: Path) -> None:
    node = BothRolesNode(tmp_path, "m")
    corpus = node.config.data_path("corpora") / "corpus.conllu"  # the default compute.corpus-dir
    corpus.parent.mkdir(parents=True)
    write_conllu(load_bundled_corpus(40), corpus)
    try:
        await node.start()
        status, reply = await node.call("POST", "/v1/train", {"corpus": str(corpus), "workers": 1, "cluster": False})
        assert status == 200, reply
        doc = await _finished_job(node, reply["job_id"])
        assert doc["state"] == "succeeded" and doc["done"] == 40, doc
        status, ev = await node.call("POST", "/v1/eval", {"corpus": str(corpus), "limit": 5})
        assert status == 200 and ev["steps"] > 0, ev

        status, text = await node.call("GET", "/metrics")
        assert status == 200 and isinstance(text, str)
        problems = lint_exposition(text)
        assert problems == [], "\n".join(problems)

        got = _samples(text)
        # The work moved the counters it should have (same meaning as the job document).
        assert got["giaannd_compute_train_sentences_total"] == 40
        assert got["giaannd_compute_train_sent_bytes_total"] == doc["bytes_sent"] > 0
        assert got["giaannd_compute_train_batches_total"] == doc["batches"] > 0
        assert got["giaannd_compute_infer_steps_total"] >= ev["steps"]
        assert got["giaannd_compute_row_cache_misses_total"] > 0
        assert got["giaannd_storage_applies_total"] >= doc["batches"]
        assert got["giaannd_storage_read_duration_seconds_count"] > 0
        assert got["giaannd_storage_apply_duration_seconds_count"] >= doc["batches"]
        assert 0 < got["giaannd_storage_fsync_duration_seconds_count"] <= got["giaannd_storage_applies_total"]
        assert got["giaannd_transport_sent_bytes_total{scheme=tcp}"] > 0
        assert got["process_resident_memory_bytes"] > 0 and "process_open_fds" in got
    finally:
        await node.stop()
