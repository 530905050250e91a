"""The cluster scale benchmark's pure parts (tools/bench/scale_cluster.py): the interval files, the
p99 of a sampled histogram, the split of apply latency by snapshot windows, the settled RSS
reading, the targets. The run
itself starts five daemons and is exercised by running the bench."""

import argparse
import itertools
import math

import pytest

from giaannd.model.tokens import read_conllu
from tools.bench import scale, scale_cluster
from tools.bench.zipf_stream import ZipfStream


def test_intervals_continue_the_stream(tmp_path):
    got = scale_cluster.write_intervals(tmp_path, [3, 7, 12], seed=2)
    assert [n for n, _ in got] == [3, 4, 5]
    sentences = [s for _, path in got for s in read_conllu(path)]
    assert sentences == list(itertools.islice(ZipfStream(2), 12))  # no sentence twice, none skipped


def test_p99_is_the_bound_of_the_bucket_that_holds_it():
    assert scale_cluster.p99_bound({}) is None
    assert scale_cluster.p99_bound({0.01: 0.0, 0.1: 0.0, math.inf: 0.0}) is None
    # 1,000 applies: 980 under 10 ms, 15 more under 100 ms, 5 beyond: the 990th is under 100 ms
    assert scale_cluster.p99_bound({0.01: 980.0, 0.1: 995.0, math.inf: 1000.0}) == 0.1
    assert scale_cluster.p99_bound({0.01: 990.0, 0.1: 995.0, math.inf: 1000.0}) == 0.01
    assert scale_cluster.p99_bound({0.01: 900.0, 0.1: 980.0, math.inf: 1000.0}) == math.inf


class _Scrapes:
    """Stands in for the metrics scrape: one (buckets, running, written, trims) per call."""

    def __init__(self, seq):
        self.seq = iter(seq)

    def __call__(self, node):
        return next(self.seq)


class _Node:
    name = "s"


def test_apply_windows_are_split_by_snapshot(monkeypatch):
    def h(fast, slow):  # apply histogram; the fsync one gets one observation per apply, all fast
        return {scale_cluster._APPLY: {0.01: fast, 1.0: fast + slow, math.inf: fast + slow},
                scale_cluster._FSYNC: {0.01: fast + slow, math.inf: fast + slow}}

    monkeypatch.setattr(scale_cluster, "_scrape", _Scrapes([
        (h(0, 0), 0.0, 0.0, 0.0),  # at the start
        (h(100, 0), 0.0, 0.0, 0.0),  # a window without: 100 fast applies
        (h(150, 1), 1.0, 0.0, 0.0),  # a snapshot running at its end: 50 fast, 1 slow
        (h(160, 2), 0.0, 1.0, 0.0),  # running at its start, written in it: 10 fast, 1 slow
        (h(260, 2), 0.0, 1.0, 0.0),  # without again: 100 fast
    ]))
    lat = scale_cluster.ApplyLatency([_Node()])
    for _ in range(4):
        lat.sample()
    apply, fsync = scale_cluster._APPLY, scale_cluster._FSYNC
    assert lat.without[apply] == {0.01: 200.0, 1.0: 200.0, math.inf: 200.0}
    assert lat.during[apply] == {0.01: 60.0, 1.0: 62.0, math.inf: 62.0}
    assert lat.during[fsync] == {0.01: 62.0, math.inf: 62.0}
    assert lat.snapshots == 1.0
    assert scale_cluster.p99_bound(lat.during[apply]) == 1.0 and scale_cluster.p99_bound(lat.without[apply]) == 0.01


def _record(sentences, sent_per_s, entries, ratio):
    return {"sentences": sentences, "sent_per_s": sent_per_s, "sent_per_cpu_s": sent_per_s / 2, "entries": entries,
            "rss_per_entry": 30.0, "rss_per_entry_settled": 28.0, "apply_p99_ratio": ratio, "restart_s_per_gb": 0.8,
            "recovery_s_per_gb": 0.5}


def test_targets_use_the_first_and_last_checkpoint():
    records = [_record(10, 100.0, 10**6, 1.0), _record(20, 80.0, 5 * 10**7, 2.5), _record(30, 75.0, 6 * 10**7, None)]
    got = {figure: value for figure, value, _ in scale_cluster.targets(records)}
    assert got["cluster sentences/s at 30 / at 10"] == pytest.approx(0.75)
    assert got["storage RSS growth B/entry at >= 4e+07 entries, right after a job"] == 30.0
    assert got["storage RSS growth B/entry at >= 4e+07 entries, settled (idle, after a heap trim)"] == 28.0
    assert got["apply p99 during a snapshot / without, worst checkpoint (bucket bounds)"] == 2.5
    assert got["storage restart s/GB at 30"] == 0.8
    assert got["storage recovery (snapshot load + log replay) s per GB read at 30"] == 0.5


class _NamedNode:
    def __init__(self, name):
        self.name = name


def test_settled_rss_waits_for_a_trim_with_no_snapshot_since(monkeypatch):
    # per node, the scrapes it will see: (running, snapshots written, trims)
    seen = {"a": iter([(1.0, 4.0, 7.0),  # a snapshot running: not idle yet
                       (0.0, 5.0, 7.0),  # idle: the mark
                       (0.0, 5.0, 8.0)]),  # a trim since: settled here
            "b": iter([(0.0, 2.0, 3.0),  # idle: the mark
                       (0.0, 3.0, 4.0),  # a snapshot written since and a trim: the trim may precede it
                       (0.0, 3.0, 4.0),  # idle again: a new mark
                       (0.0, 3.0, 4.0),
                       (0.0, 3.0, 5.0)])}  # the trim after it: settled
    rss = {"a": iter([100, 101]), "b": iter([200, 201])}
    monkeypatch.setattr(scale_cluster, "_scrape", lambda node: ({}, *next(seen[node.name])))
    monkeypatch.setattr(scale_cluster, "_rss_bytes", lambda node: next(rss[node.name]))
    got = scale_cluster.settled_rss([_NamedNode("a"), _NamedNode("b")], timeout_s=60, poll_s=0)
    assert got == {"a": 100, "b": 200}
    assert next(seen["b"], None) is None  # b read to its last scrape: it settled no earlier


def test_settled_rss_gives_none_for_a_node_that_never_trims(monkeypatch):
    monkeypatch.setattr(scale_cluster, "_scrape", lambda node: ({}, 0.0, 1.0, 0.0))
    assert scale_cluster.settled_rss([_NamedNode("a")], timeout_s=0.05, poll_s=0.01) == {"a": None}
    assert scale_cluster.rss_per_entry({"a": None}, {"a": 0}, {"a": 10}) is None
    assert scale_cluster.rss_per_entry({"a": 330, "b": 100}, {"a": 10, "b": 0}, {"a": 10, "b": 10}) == 32.0


def test_recovery_figures_come_from_the_restarted_nodes_metrics(monkeypatch):
    text = (b"# TYPE giaannd_storage_recovery_duration_seconds gauge\n"
            b'giaannd_storage_recovery_duration_seconds{phase="snapshot_load"} 1.5\n'
            b'giaannd_storage_recovery_duration_seconds{phase="log_replay"} 2.0\n'
            b"# TYPE giaannd_storage_recovery_cpu_seconds gauge\n"
            b'giaannd_storage_recovery_cpu_seconds{phase="snapshot_load"} 1.0\n'
            b'giaannd_storage_recovery_cpu_seconds{phase="log_replay"} 1.25\n'
            b"# TYPE giaannd_storage_recovery_bytes gauge\n"
            b'giaannd_storage_recovery_bytes{phase="snapshot_load"} 3e9\n'
            b'giaannd_storage_recovery_bytes{phase="log_replay"} 5e8\n')

    class Admin:
        def request(self, method, path):
            assert (method, path) == ("GET", "/metrics")
            return text, 200

    class Node:
        admin = Admin()

    assert scale_cluster._recovery(Node()) == (3.5, 2.0, 2.25, 3.5e9, 5e8)


def test_scale_cluster_options_reach_the_cluster_run(monkeypatch):
    seen = {}
    monkeypatch.setattr(scale_cluster, "run_from_args", lambda args: seen.setdefault("args", args) and 0)
    assert scale.main(["--cluster", "--cluster-checkpoints", "5,9", "--snapshot-interval-s", "3"]) == 0
    args = seen["args"]
    assert isinstance(args, argparse.Namespace)
    assert args.cluster_checkpoints == [5, 9] and args.snapshot_interval_s == 3.0 and args.seed == 0
    with pytest.raises(SystemExit) as exc:
        scale.main(["--cluster", "--snapshot-interval-s", "0"])
    assert exc.value.code == 2


def test_two_cumulative_histograms_sum_bound_by_bound():
    """The job's loop-lag p99 sums the windows during snapshots and without (``_summed``): the
    same bucket bounds (one histogram), or no samples in one of them."""
    during = {0.001: 10.0, 0.01: 12.0, 0.1: 12.0, math.inf: 12.0}
    without = {0.001: 80.0, 0.01: 86.0, 0.1: 87.0, math.inf: 88.0}
    total = scale_cluster._summed(during, without)  # noqa: SLF001
    assert total == {0.001: 90.0, 0.01: 98.0, 0.1: 99.0, math.inf: 100.0}
    assert scale_cluster.p99_bound(total) == 0.1
    assert scale_cluster._summed({}, without) == without  # noqa: SLF001 (no window during a snapshot)
