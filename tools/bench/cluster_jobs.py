"""Cluster-job benchmark (issue 15): one job on B = 1, 2, 4 compute daemons with 3 storage daemons.

    python -m tools.bench.cluster_jobs [--sentences 2000] [--text-sentences 300] [--nodes 1,4]
                                       [--repeats 3] [--eval-prompts 0] [--json]

One local cluster per B (tools/local_cluster: real ``giaannd`` processes, tcp, R = 3, W = 2,
``compute.cluster-jobs``, ``compute.tag-processes`` = 1), all started first and kept up for the
whole run. Each cluster runs one warm-up job first (a fresh cluster's first job costs ~25 % more
CPU: imports, caches, connections; it was what the old single-shot figure mostly measured), then
its idle CPU is measured (every daemon, ``IDLE_S``). Then ``--repeats`` rounds, the clusters
*interleaved* in each round (the order reversed every other round, so load drifting over the run
falls on every B alike); per round and cluster:

- **conllu**: a job from CoNLL-U (``--sentences``);
- **text**: a job from raw text (the same sentences' words, tagged by the flag pass on the
  compute nodes), once the taggers are loaded (``text_cold``: the first text job of each cluster,
  each node's tagger start included, run once, before the rounds);
- **local**: on the baseline cluster only, the same CoNLL-U job node-local (``"cluster": false``,
  ``giaannctl train start --local``): what a cluster job costs over the one-node path.

Per job: sentences/s (wall time from ``POST /v1/train`` to ``succeeded``), CPU ms per sentence of
every daemon (``/proc/PID/stat`` user + system) from the request until the register changes stop
(``QUIET_S``: the job's chunks are emptied after it succeeded, and that is its cost, not the next
job's) less the cluster's idle CPU over that time (gossip, probes, the job watchers: a fixed cost
per daemon, unrelated to the job), split into storage and
compute daemons, and register changes (promises + accepts written, all storage nodes) per window
and stage. A ratio is taken per round between jobs of the same round (paired), and the table gives
the median ratio with its spread (min-max over rounds).

Target (the issue): total CPU per sentence at B = 4 at most 1.1x B = 1; wall time cannot scale on
a 2-core machine. No target for cluster against local (reported). With ``--eval-prompts N`` (> 0)
one eval per cluster, on the receiving node only and spread over the B daemons (issue 15 item 5),
after the rounds. With ``--json`` one ``{"figure", "value", "target"}`` object per figure
(tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.sdk.local_cluster import LocalCluster, Node
from tools.bench.report import emit_figure, print_table

__all__ = ["JobRun", "cpu_s", "main", "metric_sum", "paired_ratios", "spread"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
#: Whole-job wait: a stuck job fails the bench instead of hanging it.
JOB_TIMEOUT_S = 600.0
#: Seconds of idle CPU measured per cluster (after its warm-up): long enough for several gossip
#: probe intervals (loopback profile: 0.2-1 s), short beside the run.
IDLE_S = 3.0
#: The kinds of job each round runs on every cluster (``local`` runs on the baseline only).
KINDS = ("conllu", "text")
#: A job's CPU is taken once the storage nodes' register changes stopped for this long after it
#: succeeded: the node that ended it empties its corpus chunks then (one CAS per window), work of
#: this job that otherwise fell into the next job's figures (polled every ``QUIET_S / 2``).
QUIET_S = 0.5
#: Bound on that wait (a cluster that never goes quiet fails the bench instead of hanging it).
QUIET_TIMEOUT_S = 60.0


def cpu_s(node: Node) -> float:
    """User + system CPU seconds of a live daemon (0 for one that is not running)."""
    if node.proc is None or node.proc.poll() is not None:
        return 0.0
    fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _cpus(cluster: LocalCluster) -> dict[str, float]:
    return {n.name: cpu_s(n) for n in cluster.nodes}


def metric_sum(node: Node, name: str) -> float:
    raw, _ = node.admin.request("GET", "/metrics")
    return sum(float(line.rpartition(" ")[2]) for line in raw.decode().splitlines()
               if not line.startswith("#") and line.split(" ")[0].split("{")[0] == name)


@dataclass(frozen=True)
class JobRun:
    """One job's figures (CPU already less the cluster's idle CPU over its wall time)."""

    sentences: int
    wall_s: float
    storage_cpu_s: float
    compute_cpu_s: float
    register_changes_per_window: float
    by_node: dict[str, Any]

    @property
    def sentences_per_s(self) -> float:
        return self.sentences / self.wall_s

    @property
    def cpu_ms_per_sentence(self) -> float:
        return 1000 * (self.storage_cpu_s + self.compute_cpu_s) / self.sentences


def paired_ratios(runs: dict[int, list[JobRun]], base: int, figure: str) -> dict[int, list[float]]:
    """Per B, the ratio of ``figure`` to the baseline's in the same round (round i with round i)."""
    return {b: [getattr(r, figure) / getattr(ref, figure) for r, ref in zip(rs, runs[base], strict=True)]
            for b, rs in runs.items()}


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values`` (one value: itself three times)."""
    return statistics.median(values), min(values), max(values)


class _Bench:
    """One cluster of B compute daemons and what it measured."""

    def __init__(self, root: Path, b: int, args: argparse.Namespace) -> None:
        self.b = b
        self.cluster = LocalCluster(root / f"b{b}", storage=3, compute=b, transport="tcp", log_level="warning",
                                    compute_options={"cluster_jobs": True, "tag_processes": 1,
                                                     "coalesce_k": args.k, "lease_s": 5.0})
        self.idle_cpu_per_s: dict[str, float] = {}
        self.runs: dict[str, list[JobRun]] = {kind: [] for kind in (*KINDS, "local", "text_cold")}
        self.corpus: dict[str, Path] = {}

    def start(self, args: argparse.Namespace) -> None:
        c = self.cluster
        c.start()
        c.wait_converged()
        self.corpus["conllu"] = self.corpus["local"] = c.corpus_dir / "train.conllu"
        write_conllu(load_bundled_corpus(args.sentences), self.corpus["conllu"])
        if args.text_sentences:
            self.corpus["text"] = self.corpus["text_cold"] = c.corpus_dir / "train.txt"
            _text_corpus(self.corpus["text"], args.text_sentences)

    def _register_changes(self) -> float:
        return sum(metric_sum(n, "giaannd_storage_register_changes_total") for n in self.cluster.nodes
                   if "storage" in n.roles)

    def _quiet(self) -> float:
        """Wait until no register changes for ``QUIET_S`` (module docstring); returns them."""
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        last, since = self._register_changes(), time.monotonic()
        while time.monotonic() - since < QUIET_S:
            if time.monotonic() > deadline:
                raise TimeoutError(f"register changes still growing {QUIET_TIMEOUT_S} s after the job")
            time.sleep(QUIET_S / 2)
            now = self._register_changes()
            if now != last:
                last, since = now, time.monotonic()
        return last

    def warm_up(self) -> None:
        """One job (not counted), then the idle CPU of every daemon."""
        self.job("conllu", record=False)
        before = _cpus(self.cluster)
        time.sleep(IDLE_S)
        after = _cpus(self.cluster)
        self.idle_cpu_per_s = {k: (after[k] - before[k]) / IDLE_S for k in before}

    def job(self, kind: str, *, record: bool = True) -> None:
        cluster = self.cluster
        cpu0 = _cpus(cluster)
        reg0 = self._register_changes()
        admin = cluster.compute_nodes[0].admin
        started = time.perf_counter()
        body: dict[str, Any] = {"corpus": str(self.corpus[kind])}
        if kind == "local":
            body["cluster"] = False
        job = admin.json("POST", "/v1/train", body)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while (doc := admin.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job['job_id']} still running after {JOB_TIMEOUT_S} s: {doc}")
            time.sleep(0.02)
        wall = time.perf_counter() - started
        if doc["state"] != "succeeded":
            raise RuntimeError(f"job {job['job_id']} {doc['state']}: {doc.get('error')}")
        reg = self._quiet() - reg0
        cpu1 = _cpus(cluster)
        spent = time.perf_counter() - started  # the idle CPU of the whole interval measured
        used = {k: cpu1[k] - cpu0[k] - self.idle_cpu_per_s.get(k, 0.0) * spent for k in cpu0}
        roles = {n.name: "storage" in n.roles for n in cluster.nodes}
        windows = int(doc.get("windows") or 0)
        if record:
            self.runs[kind].append(JobRun(
                int(doc["total"]), wall, sum(v for k, v in used.items() if roles[k]),
                sum(v for k, v in used.items() if not roles[k]),
                reg / (2 * windows) if windows else 0.0, doc.get("by_node") or {}))

    def eval(self, prompts: int, spread: bool) -> dict[str, Any]:
        cpu0 = sum(_cpus(self.cluster).values())
        started = time.perf_counter()
        doc = self.cluster.compute_nodes[0].admin.json("POST", "/v1/eval", {"limit": prompts, "spread": spread})
        wall = time.perf_counter() - started
        return {"wall_s": wall, "cpu_s": sum(_cpus(self.cluster).values()) - cpu0, "doc": doc}

    def stop(self) -> None:
        self.cluster.stop()
        self.cluster.kill_all()


def _text_corpus(path: Path, n: int) -> None:
    sentences = [" ".join(t.form for t in s) for s in load_bundled_corpus(n)]
    path.write_text("\n\n".join(" ".join(sentences[i:i + 5]) for i in range(0, n, 5)) + "\n", encoding="utf-8")


def _run(benches: list[_Bench], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    for bench in benches:
        bench.start(args)
    for bench in benches:
        bench.warm_up()
        if args.text_sentences:
            bench.job("text_cold")
    kinds = [k for k in KINDS if k in benches[0].corpus]
    for r in range(args.repeats):
        for bench in benches if r % 2 == 0 else benches[::-1]:
            for kind in kinds:
                bench.job(kind)
            if bench is benches[0]:
                bench.job("local")
    evals: dict[str, dict[str, Any]] = {}
    if args.eval_prompts:
        for bench in benches:
            bench.eval(min(50, args.eval_prompts), False)  # warm: every node's row cache path
            evals[f"b{bench.b}_local"] = bench.eval(args.eval_prompts, False)
            evals[f"b{bench.b}_spread"] = bench.eval(args.eval_prompts, True)
    return evals


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.cluster_jobs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=2000, help="CoNLL-U sentences (default 2000)")
    ap.add_argument("--text-sentences", type=int, default=300, help="raw-text sentences (default 300; 0: none)")
    ap.add_argument("--nodes", default="1,4", help="compute daemon counts, the first is the baseline (default 1,4)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--k", type=int, default=32, help="sentences per window (default 32)")
    ap.add_argument("--eval-prompts", type=int, default=0, help="prompts of the eval figures (default 0: none)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--dir", type=Path, default=None, help="root directory (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    counts = [int(x) for x in args.nodes.split(",")]
    root = args.dir or Path(tempfile.mkdtemp(prefix="giaann-cluster-jobs-"))
    load0 = os.getloadavg()[0]
    benches: list[_Bench] = []
    try:
        benches = [_Bench(root, b, args) for b in counts]
        evals = _run(benches, args)
    finally:
        for bench in benches:
            bench.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    load = f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    _job_tables(benches, args, load)
    if evals:
        _eval_table(evals, counts, args.json)
    return 0


def _job_tables(benches: list[_Bench], args: argparse.Namespace, load: str) -> None:
    base = benches[0]
    kinds = [k for k in ("conllu", "text", "text_cold") if base.runs[k]]
    for kind in kinds:
        runs = {bench.b: bench.runs[kind] for bench in benches}
        cpu = paired_ratios(runs, base.b, "cpu_ms_per_sentence")
        rate = paired_ratios(runs, base.b, "sentences_per_s")
        rows = []
        for bench in benches:
            b, rs = bench.b, runs[bench.b]
            target = "<= 1.1" if b == 4 else None
            med, lo, hi = spread(cpu[b])
            cpu_ms = statistics.median(r.cpu_ms_per_sentence for r in rs)
            if args.json:
                emit_figure(f"{kind}_b{b}_sentences_per_s", statistics.median(r.sentences_per_s for r in rs))
                emit_figure(f"{kind}_b{b}_cpu_ms_per_sentence", cpu_ms)
                emit_figure(f"{kind}_b{b}_cpu_per_sentence_vs_b{base.b}", med, target)
                emit_figure(f"{kind}_b{b}_cpu_per_sentence_vs_b{base.b}_min", lo)
                emit_figure(f"{kind}_b{b}_cpu_per_sentence_vs_b{base.b}_max", hi)
                emit_figure(f"{kind}_b{b}_register_changes_per_window",
                            statistics.median(r.register_changes_per_window for r in rs))
            idle = sum(bench.idle_cpu_per_s.values())
            rows.append([str(b), f"{statistics.median(r.sentences_per_s for r in rs):.0f} "
                                 f"({statistics.median(rate[b]):.2f}x)",
                         f"{cpu_ms:.2f}", f"{statistics.median(1000 * r.storage_cpu_s / r.sentences for r in rs):.2f}"
                         f" / {statistics.median(1000 * r.compute_cpu_s / r.sentences for r in rs):.2f}",
                         f"**{med:.2f}** ({lo:.2f}-{hi:.2f})", target or "-", f"{1000 * idle:.0f}",
                         f"{statistics.median(r.register_changes_per_window for r in rs):.1f}",
                         " / ".join(str(p.get("sentences", 0)) for _, p in sorted(rs[-1].by_node.items()))])
        if not args.json:
            print_table(f"cluster job from {kind} ({rs[0].sentences} sentences, {len(rs)} round(s), {load})",
                        ["B", "sentences/s (x B1)", "CPU ms/sentence, all daemons less idle",
                         "storage / compute", f"CPU/sentence vs B = {base.b}, median (spread)", "target",
                         "idle CPU ms/s", "register changes/window", "sentences by node (last round)"], rows)
    _local_table(base, args, load)


def _local_table(base: _Bench, args: argparse.Namespace, load: str) -> None:
    """The baseline cluster's CoNLL-U cluster job against the same job node-local, same round."""
    runs = {0: base.runs["local"], 1: base.runs["conllu"]}
    cpu, rate = spread(paired_ratios(runs, 0, "cpu_ms_per_sentence")[1]), \
        spread(paired_ratios(runs, 0, "sentences_per_s")[1])
    if args.json:
        emit_figure(f"conllu_b{base.b}_cluster_vs_local_sentences_per_s", rate[0])
        emit_figure(f"conllu_b{base.b}_cluster_vs_local_cpu_per_sentence", cpu[0])
        return
    local = base.runs["local"]
    print_table(f"B = {base.b} cluster job against the node-local job (CoNLL-U, same cluster, same round; {load})",
                ["job", "sentences/s", "CPU ms/sentence (storage / compute)", "x local, median (spread)"],
                [["local", f"{statistics.median(r.sentences_per_s for r in local):.0f}",
                  f"{statistics.median(r.cpu_ms_per_sentence for r in local):.2f} "
                  f"({statistics.median(1000 * r.storage_cpu_s / r.sentences for r in local):.2f} / "
                  f"{statistics.median(1000 * r.compute_cpu_s / r.sentences for r in local):.2f})", "1"],
                 ["cluster", f"{statistics.median(r.sentences_per_s for r in runs[1]):.0f}",
                  f"{statistics.median(r.cpu_ms_per_sentence for r in runs[1]):.2f}",
                  f"sentences/s {rate[0]:.2f} ({rate[1]:.2f}-{rate[2]:.2f}); CPU {cpu[0]:.2f} "
                  f"({cpu[1]:.2f}-{cpu[2]:.2f})"]])


_EVAL_FIGURES = ("prompts", "prediction_tokens", "matches", "top1", "steps")


def _eval_table(evals: dict[str, dict[str, Any]], counts: Sequence[int], as_json: bool) -> None:
    rows = []
    for b in counts:
        local, spread_ = evals[f"b{b}_local"], evals[f"b{b}_spread"]
        ratio = spread_["wall_s"] / local["wall_s"]
        equal = all(local["doc"][k] == spread_["doc"][k] for k in _EVAL_FIGURES)
        if as_json:
            emit_figure(f"eval_b{b}_local_wall_s", local["wall_s"])
            emit_figure(f"eval_b{b}_spread_wall_s", spread_["wall_s"])
            emit_figure(f"eval_b{b}_spread_wall_vs_local", ratio)
            emit_figure(f"eval_b{b}_spread_cpu_vs_local", spread_["cpu_s"] / local["cpu_s"])
            emit_figure(f"eval_b{b}_figures_equal", float(equal), "== 1")
        by_node = " / ".join(str(p["prompts"]) for _, p in sorted(spread_["doc"]["by_node"].items()))
        rows.append([str(b), str(local["doc"]["prompts"]), f"{local['wall_s']:.2f}",
                     f"{spread_['wall_s']:.2f} ({ratio:.2f}x)",
                     f"{local['cpu_s']:.2f} / {spread_['cpu_s']:.2f}", "yes" if equal else "**no**", "-", by_node,
                     str(len(spread_["doc"].get("redone", [])))])
    if not as_json:
        print_table("one eval spread over the B compute daemons (baseline: the same eval on the receiving node only, "
                    "same cluster)", ["B", "prompts", "local wall s", "spread wall s (x local)",
                                      "CPU s local / spread (all daemons)", "figures equal", "target",
                                      "prompts by node", "shares redone"], rows)


if __name__ == "__main__":
    raise SystemExit(main())
