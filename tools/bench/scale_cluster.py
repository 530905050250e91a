"""Rows at scale on a loopback cluster: issue 14's cluster checkpoints (``tools.bench.scale --cluster``).

    python -m tools.bench.scale --cluster [--cluster-checkpoints 10000,100000,300000] [--json]
    python -m tools.bench.scale_cluster [--checkpoints 10000,100000,300000] [--snapshot-interval-s 20]
                                        [--snapshot-min-log-ratio R]
                                        [--export-max-entries 100000000] [--seed 0] [--json]

Three storage daemons (R = 3, W = 2) and one compute daemon, real processes on loopback tcp
(``giaannd.LocalCluster``), fed the scale bench's synthetic Zipf stream (tools/bench/zipf_stream.py)
as CoNLL-U: one cluster training job per interval between checkpoints. The interval files are
written before the cluster starts, in one pass over the stream, so each job continues the stream
where the one before ended. At each checkpoint:

- **throughput** of the interval: sentences/s (wall clock of its job, submitted to succeeded) and
  sentences per CPU second (every daemon's user + system CPU over the job, less the cluster's idle
  CPU over the same time, measured once after start: gossip, probes, job watchers), and CPU µs per
  sentence split into the compute daemon and the three storage daemons together (at R = 3 on three
  nodes each holds a replica of every row);
- **rows**: entries and rows per storage node, the largest row's size class (``GET /v1/ring/usage``
  row_sizes: powers of two), and RSS growth per entry (each storage daemon's VmRSS minus just
  after start, over the entries it holds; the worst node) read twice: right after the job, and
  *settled* — after the export, once every storage node has been seen with no snapshot running
  and then has done a heap trim (``storage.heap-trim-interval-s``) with no snapshot between:
  what an idle node holds for its rows once the job's merge temporaries and the snapshot's view
  are returned (a bounded wait, ``SETTLE_TIMEOUT_S``; ``—`` if a node did not settle in it);
- **apply latency during snapshots**: the storage nodes' ``giaannd_storage_apply_duration_seconds``
  histograms (and the update log's ``fsync_duration_seconds``, a part of an apply's time) are
  sampled every ``SAMPLE_S`` during the job; a sample window counts as *during a snapshot* when
  ``giaannd_storage_snapshot_running`` was 1 at either end of it or a snapshot was written in it
  (``snapshot_duration_seconds_count`` moved), else *without*. The p99 of each is the upper bound
  of the histogram bucket it falls in (``metrics.STORAGE_WRITE_BUCKETS_S``: steps of 2^(1/4), so
  each p99 is within ×1.19 of the true one and the ratio within ×1.19 either way; the daemons
  before Nov 28's last session had 1-2.5-5 buckets, ×2–2.5); ``tools.bench.snapshot`` measures it
  apply by apply in one process;
- **event-loop lag**: the same samples of the storage nodes' ``giaannd_event_loop_lag_seconds``
  (how late a timer on the loop fires, four times a second; runtime/loop_watch.py), the job's
  p99 over all three nodes as its bucket's upper bound: what a request waits on a node's loop
  beyond its own work;
- **restart**: ``storage-3`` killed (SIGKILL: no final snapshot, so its log since the last timer
  snapshot is replayed) and started again: wall time from the start to ready, over its rows' bytes
  (entries × 21), in s/GB, and its RSS per entry once ready (a fresh process, against the node's
  RSS just after the first start); and the store's part of it, the recovery (snapshot load + log
  replay, the node's ``giaannd_storage_recovery_*`` metrics) in s per GB read from disk, and how
  much of that was the log (none when a timer snapshot came after the job's last write) — the rest
  of a restart is the process's start-up (interpreter, imports, compiled-kernel cache) and joining,
  shown apart from the victim's own log lines (``tools.bench.restart.timeline``: seconds from the
  spawn until the ring is synced and the recovery begins, and from the recovery's end to ready),
  and the share of the victim's newest snapshot the page cache held just before the kill
  (``tools.bench.page_cache``: below 1, the load pages it in from disk, at disk speed);
- **export**: ``Client.export`` of the whole model (JSONL written by the compute node, merged from
  the owners' pages), MB/s of row bytes, while the model holds at most ``--export-max-entries``
  entries (the JSONL is ~9× the row bytes on disk; it is deleted after).

Not measured here: the LIF step (the compute node runs the core's step: ``tools.bench.scale`` and
``tools.bench.lif`` measure it on the same rows) and cluster inference (``tools.bench.cluster``).

Targets (issue 14): sentences/s at the last checkpoint ≥ 0.7× the first; RSS growth ≤ 32 B per
entry at ≥ 4·10^7 entries; apply p99 during a snapshot ≤ 2× without; restart ≤ 1 s/GB. Five
daemons share this 2-core machine: compare ratios from one run, with the load it prints.
``--json`` prints one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from giaannd.model.tokens import write_conllu
from giaannd.sdk.client import Client
from giaannd.sdk.errors import ClientError
from giaannd.sdk.local_cluster import LocalCluster, Node
from giaannd.storage.engine.snapshot import list_snapshots
from giaannd.storage.replication.service import STORE_DIR
from peers.membership.config import MembershipConfig
from tools.bench.cluster_jobs import cpu_s
from tools.bench.page_cache import cached_share
from tools.bench.report import emit_figure, print_table
from tools.bench.restart import timeline
from tools.bench.zipf_stream import ZipfStream

__all__ = ["CHECKPOINTS", "ApplyLatency", "add_arguments", "check_arguments", "main", "p99_bound", "run",
           "run_from_args", "targets", "write_intervals"]

#: The issue's cluster checkpoints (input sentences).
CHECKPOINTS = (10_000, 100_000, 300_000)
#: Seconds between two scrapes of the storage nodes' metrics during a job.
SAMPLE_S = 0.5
#: Seconds of idle CPU measured after the cluster starts.
IDLE_S = 3.0
#: Bytes of one entry on the wire and in a snapshot (docs/storage.md).
ENTRY_BYTES = 21
#: Bound on one job, one restart or one export: a stuck cluster fails the bench, never hangs it.
STEP_TIMEOUT_S = 4 * 3600.0
#: Storage capacity per node: far above what 300k sentences make (~9·10^7 entries per replica).
CAPACITY_BYTES = 16 << 30
TARGET_THROUGHPUT_RATIO = 0.7
TARGET_RSS_BYTES_PER_ENTRY = 32.0
TARGET_RSS_MIN_ENTRIES = 4 * 10**7
TARGET_SNAPSHOT_P99_RATIO = 2.0
TARGET_RESTART_S_PER_GB = 1.0

#: The membership's LAN timings (probe every 1 s, 0.5 s timeout, suspicion ×4) instead of the
#: local cluster's loopback ones (0.2 s, 0.1 s, ×3): five daemons busy on two cores, beside other
#: work, missed loopback probes long enough to be declared dead mid-job in a first run.
_LAN_TIMINGS = {f: getattr(MembershipConfig.lan(), f) for f in MembershipConfig.__struct_fields__
                if getattr(MembershipConfig.lan(), f) != getattr(MembershipConfig.loopback(), f)}

_APPLY = "giaannd_storage_apply_duration_seconds"
_FSYNC = "giaannd_storage_fsync_duration_seconds"
_LAG = "giaannd_event_loop_lag_seconds"
_HISTOGRAMS = (_APPLY, _FSYNC, _LAG)
_RUNNING = "giaannd_storage_snapshot_running"
_SNAPSHOTS = "giaannd_storage_snapshot_duration_seconds"
_TRIMS = "giaannd_storage_heap_trim_duration_seconds"
#: Seconds a settled RSS reading waits at most for every node's snapshot to end and a heap trim
#: to follow it (a few snapshot and trim intervals at the bench's settings).
SETTLE_TIMEOUT_S = 180.0


def write_intervals(directory: Path, checkpoints: Sequence[int], seed: int) -> list[tuple[int, Path]]:
    """One CoNLL-U file per interval between checkpoints, from one pass over ``ZipfStream(seed)``:
    (sentences, path) each."""
    stream = iter(ZipfStream(seed))
    out, done = [], 0
    for cp in checkpoints:
        path = directory / f"zipf-{done}-{cp}.conllu"
        write_conllu(itertools.islice(stream, cp - done), path)
        out.append((cp - done, path))
        done = cp
    return out


def _scrape(node: Node) -> tuple[dict[str, dict[float, float]], float, float, float]:
    """(histograms by name: cumulative count per bucket bound, of ``_HISTOGRAMS``; snapshot running
    0/1; snapshots written; heap trims done)."""
    raw, _ = node.admin.request("GET", "/metrics")
    hists: dict[str, dict[float, float]] = {}
    running = written = trims = 0.0
    for fam in text_string_to_metric_families(raw.decode()):
        if fam.name in _HISTOGRAMS:
            hists[fam.name] = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
        elif fam.name == _RUNNING:
            running = sum(s.value for s in fam.samples)
        elif fam.name == _SNAPSHOTS:
            written = sum(s.value for s in fam.samples if s.name.endswith("_count"))
        elif fam.name == _TRIMS:
            trims = sum(s.value for s in fam.samples if s.name.endswith("_count"))
    return hists, running, written, trims


def settled_rss(nodes: Sequence[Node], timeout_s: float = SETTLE_TIMEOUT_S,
                poll_s: float = SAMPLE_S) -> dict[str, int | None]:
    """Each node's VmRSS once it has settled: seen with no snapshot running, then a heap trim with
    no snapshot begun or written since (so the trim saw the job's and the snapshot's freed
    temporaries). The nodes are polled together; None for a node that did not settle within
    ``timeout_s`` (e.g. one whose trim interval is 0)."""
    deadline = time.monotonic() + timeout_s
    marks: dict[str, tuple[float, float] | None] = {n.name: None for n in nodes}  # (written, trims) seen idle
    out: dict[str, int | None] = {}
    while len(out) < len(nodes) and time.monotonic() < deadline:
        for node in nodes:
            if node.name in out:
                continue
            _, running, written, trims = _scrape(node)
            mark = marks[node.name]
            if running or (mark is not None and written != mark[0]):
                marks[node.name] = None  # a snapshot ran: wait for a trim after it
            elif mark is None:
                marks[node.name] = (written, trims)
            elif trims > mark[1]:
                out[node.name] = _rss_bytes(node)
        time.sleep(poll_s)
    return {n.name: out.get(n.name) for n in nodes}


def _recovery(node: Node) -> tuple[float, float, float, float, float]:
    """(wall seconds, of them the log replay's, CPU seconds, bytes read, of them the update log's)
    of the node's recovery at its last start: snapshot load plus log replay
    (``giaannd_storage_recovery_*``), the store's part of a restart."""
    raw, _ = node.admin.request("GET", "/metrics")
    seconds = replay_s = cpu_s = read = log_read = 0.0
    for fam in text_string_to_metric_families(raw.decode()):
        if fam.name == "giaannd_storage_recovery_duration_seconds":
            seconds = sum(s.value for s in fam.samples)
            replay_s = sum(s.value for s in fam.samples if s.labels.get("phase") == "log_replay")
        elif fam.name == "giaannd_storage_recovery_cpu_seconds":
            cpu_s = sum(s.value for s in fam.samples)
        elif fam.name == "giaannd_storage_recovery_bytes":
            read = sum(s.value for s in fam.samples)
            log_read = sum(s.value for s in fam.samples if s.labels.get("phase") == "log_replay")
    return seconds, replay_s, cpu_s, read, log_read


def p99_bound(cumulative: dict[float, float]) -> float | None:
    """The upper bound of the histogram bucket holding the 99th percentile (inf: beyond the last
    bound; None: no observations)."""
    total = cumulative.get(math.inf, 0.0)
    if total <= 0:
        return None
    return next(le for le in sorted(cumulative) if cumulative[le] >= 0.99 * total)


def _summed(a: dict[float, float], b: dict[float, float]) -> dict[float, float]:
    """Two cumulative histograms (bucket bound -> count) of the same buckets as one (either may be
    empty: no window of its kind)."""
    return {le: a.get(le, 0.0) + b.get(le, 0.0) for le in a.keys() | b.keys()}


class ApplyLatency:
    """The storage nodes' apply- and fsync-latency histograms over a job, split into windows during
    a snapshot and without (module docstring), sampled by a thread while it is entered."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)
        #: per histogram, cumulative bucket counts in windows during a snapshot / without
        self.during: dict[str, dict[float, float]] = {name: {} for name in _HISTOGRAMS}
        self.without: dict[str, dict[float, float]] = {name: {} for name in _HISTOGRAMS}
        self.snapshots = 0.0
        self._last = {n.name: _scrape(n) for n in self.nodes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="apply-latency", daemon=True)

    def __enter__(self) -> ApplyLatency:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        for node in self.nodes:
            try:
                now = _scrape(node)
            except (ClientError, OSError):
                continue  # a node that does not answer now: its window grows to the next scrape
            before = self._last[node.name]
            self._last[node.name] = now
            wrote = now[2] - before[2]
            self.snapshots += wrote
            into = self.during if before[1] or now[1] or wrote else self.without
            for name, hist in now[0].items():
                was, acc = before[0].get(name, {}), into[name]
                for le, count in hist.items():
                    acc[le] = acc.get(le, 0.0) + count - was.get(le, 0.0)


def _rss_bytes(node: Node) -> int:
    assert node.proc is not None
    for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {node.name}")


def rss_per_entry(rss: dict[str, int | None], rss0: dict[str, int], entries: dict[str, int]) -> float | None:
    """The worst node's RSS growth (``rss`` less ``rss0``) per entry it holds; None if a node has no
    reading."""
    if any(v is None for v in rss.values()):
        return None
    return max(((rss[name] or 0) - rss0[name]) / max(entries[name], 1) for name in rss)


def _cpus(nodes: Sequence[Node]) -> dict[str, float]:
    return {n.name: cpu_s(n) for n in nodes}


def _usage(client: Client) -> dict[str, dict[str, Any]]:
    return {u["name"]: u for u in client.usage()}


def _largest_class(usage: dict[str, dict[str, Any]]) -> int:
    """The lower bound 2^k of the largest row's size class over the storage nodes."""
    ks = [max((k for k, n in enumerate(u.get("row_sizes") or []) if n), default=0) for u in usage.values()]
    return 1 << max(ks, default=0)


def run(checkpoints: Sequence[int], *, seed: int = 0, snapshot_interval_s: float = 20.0,
        snapshot_min_log_ratio: float | None = None, export_max_entries: int = 10**8,
        root: Path | None = None) -> list[dict[str, Any]]:
    """The cluster run (module docstring): one record of figures per checkpoint."""
    base = Path(tempfile.mkdtemp(prefix="giaannd-scale-")) if root is None else root
    cluster = LocalCluster(base / "cluster", storage=3, compute=1, transport="tcp", log_level="info",
                           replication_factor=3, write_quorum=2,
                           storage_options={"capacity_bytes": CAPACITY_BYTES,
                                            "snapshot_interval_s": snapshot_interval_s,
                                            **({} if snapshot_min_log_ratio is None
                                               else {"snapshot_min_log_ratio": snapshot_min_log_ratio})},
                           compute_options={"cluster_jobs": True},
                           membership_options=_LAN_TIMINGS)
    cluster.corpus_dir.mkdir(parents=True, exist_ok=True)
    intervals = write_intervals(cluster.corpus_dir, checkpoints, seed)
    records: list[dict[str, Any]] = []
    try:
        cluster.start()
        cluster.wait_converged()
        storage = [n for n in cluster.nodes if "storage" in n.roles]
        compute = cluster.compute_nodes[0]
        client = Client(data_dir=compute.data_dir, environ={}, timeout_s=STEP_TIMEOUT_S)
        rss0 = {n.name: _rss_bytes(n) for n in storage}
        before = _cpus(cluster.nodes)
        time.sleep(IDLE_S)
        idle = {k: (v - before[k]) / IDLE_S for k, v in _cpus(cluster.nodes).items()}
        for (count, path), cp in zip(intervals, checkpoints, strict=True):
            record: dict[str, Any] = {"sentences": cp}
            cpu0 = _cpus(cluster.nodes)
            started = time.perf_counter()
            with ApplyLatency(storage) as latency:
                doc = client.train(path).wait(progress=False, timeout_s=STEP_TIMEOUT_S)
            wall = time.perf_counter() - started
            cpu1 = _cpus(cluster.nodes)
            used = {k: cpu1[k] - cpu0[k] - idle[k] * wall for k in cpu0}
            storage_cpu = sum(used[n.name] for n in storage)
            record.update(sent_per_s=count / wall, sent_per_cpu_s=count / max(sum(used.values()), 1e-9),
                          cpu_us_compute=1e6 * used[compute.name] / count, cpu_us_storage=1e6 * storage_cpu / count,
                          trained=int(doc.get("done") or 0))
            p_during, p_without = p99_bound(latency.during[_APPLY]), p99_bound(latency.without[_APPLY])
            record.update(apply_p99_snapshot_s=p_during, apply_p99_without_s=p_without,
                          snapshots=int(latency.snapshots),
                          apply_p99_ratio=(p_during / p_without) if p_during and p_without else None,
                          fsync_p99_snapshot_s=p99_bound(latency.during[_FSYNC]),
                          fsync_p99_without_s=p99_bound(latency.without[_FSYNC]),
                          loop_lag_p99_s=p99_bound(_summed(latency.during[_LAG], latency.without[_LAG])))
            usage = _usage(client)
            entries = {n.name: int(usage[n.name]["entries"]) for n in storage}
            record.update(entries=max(entries.values()), rows=max(int(usage[n.name]["rows"]) for n in storage),
                          largest_row_class=_largest_class(usage),
                          rss_per_entry=rss_per_entry({n.name: _rss_bytes(n) for n in storage}, rss0, entries))
            if record["entries"] <= export_max_entries:
                name = f"scale-{cp}.jsonl"
                t = time.perf_counter()
                exported = client.export(name, overwrite=True)
                seconds = time.perf_counter() - t
                record["export_mb_s"] = int(exported.get("entries") or 0) * ENTRY_BYTES / 1e6 / seconds
                (cluster.export_dir / name).unlink(missing_ok=True)
            record["rss_per_entry_settled"] = rss_per_entry(settled_rss(storage), rss0, entries)
            victim = storage[-1]
            snapshots = list_snapshots(victim.data_dir / "storage" / STORE_DIR)
            # page cache or disk: what the restart's snapshot load runs at (page_cache.py)
            record["restart_snapshot_cached"] = cached_share(snapshots[-1][1]) if snapshots else None
            cluster.kill(victim)
            t, exec_at = time.perf_counter(), time.time()
            cluster.restart(victim, timeout_s=STEP_TIMEOUT_S)
            seconds = time.perf_counter() - t
            stages = timeline(victim.log_path.read_text(encoding="utf-8", errors="replace"), exec_at)
            # the daemon's own log: seconds until the recovery begins (imports, services, listeners,
            # join, ring sync) and from its end to ready
            record.update(restart_startup_s=stages.get("ring synced"),
                          restart_after_recovery_s=(stages["ready"] - stages["recovered"]
                                                    if "ready" in stages and "recovered" in stages else None))
            cluster.wait_converged()
            held = max(entries[victim.name], 1)
            recovery_s, replay_s, recovery_cpu_s, recovery_bytes, log_bytes = _recovery(victim)
            record.update(recovery_s=recovery_s, recovery_replay_s=replay_s, recovery_cpu_s=recovery_cpu_s,
                          recovery_gb=recovery_bytes / 1e9,
                          recovery_log_gb=log_bytes / 1e9,
                          recovery_s_per_gb=recovery_s / max(recovery_bytes / 1e9, 1e-9))
            record.update(restart_s=seconds, restart_s_per_gb=seconds / (held * ENTRY_BYTES / 1e9),
                          rss_per_entry_restarted=(_rss_bytes(victim) - rss0[victim.name]) / held)
            records.append(record)
        return records
    finally:
        cluster.stop()
        cluster.kill_all()
        if root is None:
            shutil.rmtree(base, ignore_errors=True)


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "> 10 s"
    return f"{x:,.{digits}f}"


def targets(records: list[dict[str, Any]]) -> list[tuple[str, float | None, str]]:
    """(figure, value, target) of the issue's targets on a run's records."""
    first, last = records[0], records[-1]
    big = [r for r in records if r["entries"] >= TARGET_RSS_MIN_ENTRIES]
    ratios = [r["apply_p99_ratio"] for r in records if r["apply_p99_ratio"] is not None]
    return [
        (f"cluster sentences/s at {last['sentences']:,} / at {first['sentences']:,}",
         last["sent_per_s"] / first["sent_per_s"], f">= {TARGET_THROUGHPUT_RATIO}"),
        (f"cluster sentences/CPU-s at {last['sentences']:,} / at {first['sentences']:,}",
         last["sent_per_cpu_s"] / first["sent_per_cpu_s"], f">= {TARGET_THROUGHPUT_RATIO}"),
        (f"storage RSS growth B/entry at >= {TARGET_RSS_MIN_ENTRIES:.0e} entries, right after a job",
         big[-1]["rss_per_entry"] if big else None, f"<= {TARGET_RSS_BYTES_PER_ENTRY:.0f}"),
        (f"storage RSS growth B/entry at >= {TARGET_RSS_MIN_ENTRIES:.0e} entries, settled (idle, after a heap trim)",
         big[-1].get("rss_per_entry_settled") if big else None, f"<= {TARGET_RSS_BYTES_PER_ENTRY:.0f}"),
        ("apply p99 during a snapshot / without, worst checkpoint (bucket bounds)",
         max(ratios) if ratios else None, f"<= {TARGET_SNAPSHOT_P99_RATIO:.0f}"),
        (f"storage restart s/GB at {last['sentences']:,}", last["restart_s_per_gb"],
         f"<= {TARGET_RESTART_S_PER_GB:.0f}"),
        (f"storage recovery (snapshot load + log replay) s per GB read at {last['sentences']:,}",
         last["recovery_s_per_gb"], f"<= {TARGET_RESTART_S_PER_GB:.0f}"),
        (f"share of the restarted node's snapshot in the page cache at {last['sentences']:,} (0-1; "
         "below 1 the load reads the disk)", last.get("restart_snapshot_cached"), "-"),
    ]


def _print(records: list[dict[str, Any]], load: str) -> None:
    print(f"\nmachine: {load}")
    header = ["sentences", "sent/s (interval)", "sent/CPU-s", "CPU µs/sent compute", "storage (3 nodes)",
              "entries per node", "rows", "largest row ≥", "RSS growth B/entry after job / settled",
              "apply p99 snapshot / without",
              "log fsync p99 snapshot / without", "storage loop lag p99", "snapshots", "restart s (s/GB)",
              "of it: start-up / recovery / after",
              "recovery s (of it log replay; CPU s) / GB read (of it log); snapshot in the page cache",
              "RSS B/entry restarted",
              "export MB/s"]
    rows = [[f"{r['sentences']:,}", _fmt(r["sent_per_s"]), _fmt(r["sent_per_cpu_s"]), _fmt(r["cpu_us_compute"]),
             _fmt(r["cpu_us_storage"]), f"{r['entries']:,}", f"{r['rows']:,}", f"{r['largest_row_class']:,}",
             f"{_fmt(r['rss_per_entry'], 1)} / {_fmt(r.get('rss_per_entry_settled'), 1)}",
             f"{_fmt(r['apply_p99_snapshot_s'], 4)} / {_fmt(r['apply_p99_without_s'], 4)} s",
             f"{_fmt(r['fsync_p99_snapshot_s'], 4)} / {_fmt(r['fsync_p99_without_s'], 4)} s",
             f"{_fmt(r.get('loop_lag_p99_s'), 4)} s", str(r["snapshots"]),
             f"{r['restart_s']:.1f} ({r['restart_s_per_gb']:.2f})",
             f"{_fmt(r.get('restart_startup_s'), 2)} / {r['recovery_s']:.2f}"
             f" / {_fmt(r.get('restart_after_recovery_s'), 2)}",
             f"{r['recovery_s']:.1f} ({_fmt(r.get('recovery_replay_s'), 2)}; {_fmt(r.get('recovery_cpu_s'), 2)})"
             f" / {r['recovery_gb']:.2f}"
             f" ({r['recovery_log_gb']:.2f}); {_share(r.get('restart_snapshot_cached'))}",
             _fmt(r["rss_per_entry_restarted"], 1),
             _fmt(r.get("export_mb_s"), 1)] for r in records]
    print_table("Cluster rows at scale (3 storage daemons R=3 W=2 + 1 compute, tcp loopback, Zipf stream)",
                header, rows)
    print_table("Cluster targets", ["figure", "value", "target"],
                [[f, _fmt(v, 2), t] for f, v, t in targets(records)])


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: a p99 beyond the last bucket bound is written as null."""
    return None if value is None or not math.isfinite(value) else float(value)


def _json(records: list[dict[str, Any]], load: str) -> None:
    print(json.dumps({"figure": "machine load", "value": load, "target": None}))
    for r in records:
        for key, value in r.items():
            if key != "sentences":
                emit_figure(f"cluster/{key}@{r['sentences']}", _finite(value))
    for figure, value, target in targets(records):
        emit_figure(figure, _finite(value), target)


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x]
    if not out or any(x <= 0 for x in out) or out != sorted(set(out)):
        raise argparse.ArgumentTypeError("checkpoints: increasing positive integers, comma-separated")
    return out


def add_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The cluster run's options (``prefix``: ``cluster-`` when they sit beside the core's)."""
    ap.add_argument(f"--{prefix}checkpoints", dest="cluster_checkpoints", type=_ints, default=list(CHECKPOINTS),
                    help="input sentences at which the cluster is measured (default 10000,100000,300000)")
    ap.add_argument("--snapshot-interval-s", type=float, default=20.0,
                    help="the storage nodes' snapshot interval, so snapshots run during the jobs (default 20)")
    ap.add_argument("--snapshot-min-log-ratio", type=float, default=None,
                    help="the storage nodes' storage.snapshot-min-log-ratio (default: the config's; 0 "
                         "snapshots every interval, as before that key)")
    ap.add_argument("--export-max-entries", type=int, default=10**8,
                    help="export only while the model holds at most this many entries (default 10^8)")
    ap.add_argument(f"--{prefix}root", dest="cluster_root", type=Path, default=None,
                    help="directory for the cluster's nodes, kept after the run (their logs); "
                         "default: a temporary one, removed")


def check_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with a usage message on a bad option (``ap.error``)."""
    if args.snapshot_interval_s <= 0 or args.export_max_entries < 0:
        ap.error("--snapshot-interval-s must be > 0 and --export-max-entries >= 0")
    if args.snapshot_min_log_ratio is not None and not 0 <= args.snapshot_min_log_ratio <= 100:
        ap.error("--snapshot-min-log-ratio must be in [0, 100]")


def run_from_args(args: argparse.Namespace) -> int:
    """Run and print (a table, or ``--json``) from checked options."""
    load = f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    records = run(args.cluster_checkpoints, seed=args.seed, snapshot_interval_s=args.snapshot_interval_s,
                  snapshot_min_log_ratio=args.snapshot_min_log_ratio,
                  export_max_entries=args.export_max_entries, root=args.cluster_root)
    load += f" before, {os.getloadavg()[0]:.2f} after"
    (_json if args.json else _print)(records, load)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    check_arguments(ap, args)
    return run_from_args(args)


if __name__ == "__main__":
    raise SystemExit(main())
