"""Cluster-job benchmark (issue 15): one job on B = 1, 2, 4 compute daemons with 3 storage daemons.

    python -m tools.bench.cluster_jobs [--sentences 2000] [--text-sentences 600] [--nodes 1,2,4]
                                       [--eval-prompts 1000] [--json]

Each B gets a fresh local cluster (tools/local_cluster: real ``giaannd`` processes, tcp, R = 3,
W = 2, ``compute.cluster-jobs``, ``compute.tag-processes`` = 1). One job from CoNLL-U, then two
from raw text (the same sentences' words, tagged by the flag pass on the compute nodes: the first,
``text_cold``, includes each node's tagger start, a spawned process loading spaCy) run one after
the other; per job it measures:

- **sentences/s**: the job's sentences over the wall time from ``POST /v1/train`` to ``succeeded``
  (upload, flag pass and tagging included);
- **CPU ms per sentence**: user + system CPU of every daemon (storage and compute, from
  ``/proc/PID/stat``) over the job, per sentence;
- **register changes per window**: promises and accepts the storage nodes wrote
  (``giaannd_storage_register_changes_total``, all three nodes) per window and stage: the lease
  traffic, the chunk uploads and the findings together.

Then, on the trained cluster, one evaluation (``POST /v1/eval``, teacher-forced, the corpus's
first ``--eval-prompts`` sentences) run on the receiving node only (``"spread": false``, the
baseline) and spread over the B compute daemons (issue 15 item 5: shares over the data plane):
wall time from the request to the reply, CPU of every daemon, and whether the figures are equal
(they must be). No speed target is set for it: on 2 cores B daemons cannot run B times the
sessions at once, so the figure to watch is what spreading costs.

The baseline is B = 1 of the same run (ratios in the tables). Target (the issue): total CPU per
sentence at B = 4 at most 1.1x B = 1; wall time cannot scale on a 2-core machine. With ``--json``
one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.sdk.local_cluster import LocalCluster, Node
from tools.bench.report import emit_figure, print_table

__all__ = ["main"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
#: Whole-job wait: a stuck job fails the bench instead of hanging it.
JOB_TIMEOUT_S = 600.0


def _cpu_s(node: Node) -> float:
    """User + system CPU seconds of a live daemon (0 for one that is not running)."""
    if node.proc is None or node.proc.poll() is not None:
        return 0.0
    fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _metric(node: Node, name: str) -> float:
    raw, _ = node.admin.request("GET", "/metrics")
    return sum(float(line.rpartition(" ")[2]) for line in raw.decode().splitlines()
               if line.startswith(name) and not line.startswith("#") and line.split(" ")[0].split("{")[0] == name)


def _run_job(cluster: LocalCluster, corpus: Path) -> dict[str, Any]:
    storage = [n for n in cluster.nodes if "storage" in n.roles]
    cpu0 = sum(_cpu_s(n) for n in cluster.nodes)
    reg0 = sum(_metric(n, "giaannd_storage_register_changes_total") for n in storage)
    admin = cluster.compute_nodes[0].admin
    started = time.perf_counter()
    job = admin.json("POST", "/v1/train", {"corpus": str(corpus)})
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (doc := admin.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job['job_id']} still running after {JOB_TIMEOUT_S} s: {doc}")
        time.sleep(0.05)
    wall = time.perf_counter() - started
    if doc["state"] != "succeeded":
        raise RuntimeError(f"job {job['job_id']} {doc['state']}: {doc.get('error')}")
    cpu = sum(_cpu_s(n) for n in cluster.nodes) - cpu0
    reg = sum(_metric(n, "giaannd_storage_register_changes_total") for n in storage) - reg0
    n = int(doc["total"])
    return {"sentences": n, "wall_s": wall, "sentences_per_s": n / wall, "cpu_ms_per_sentence": 1000 * cpu / n,
            "register_changes_per_window": reg / (2 * int(doc["windows"])), "by_node": doc["by_node"]}


def _run_eval(cluster: LocalCluster, prompts: int, spread: bool) -> dict[str, Any]:
    cpu0 = sum(_cpu_s(n) for n in cluster.nodes)
    started = time.perf_counter()
    doc = cluster.compute_nodes[0].admin.json("POST", "/v1/eval", {"limit": prompts, "spread": spread})
    wall = time.perf_counter() - started
    return {"wall_s": wall, "cpu_s": sum(_cpu_s(n) for n in cluster.nodes) - cpu0, "doc": doc}


def _text_corpus(path: Path, n: int) -> None:
    sentences = [" ".join(t.form for t in s) for s in load_bundled_corpus(n)]
    path.write_text("\n\n".join(" ".join(sentences[i:i + 5]) for i in range(0, n, 5)) + "\n", encoding="utf-8")


def _bench(root: Path, b: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    cluster = LocalCluster(root / f"b{b}", storage=3, compute=b, transport="tcp", log_level="warning",
                           compute_options={"cluster_jobs": True, "tag_processes": 1,
                                            "coalesce_k": args.k, "lease_s": 5.0})
    try:
        cluster.start()
        cluster.wait_converged()
        conllu = cluster.corpus_dir / "train.conllu"
        write_conllu(load_bundled_corpus(args.sentences), conllu)
        text = cluster.corpus_dir / "train.txt"
        _text_corpus(text, args.text_sentences)
        out = {"conllu": _run_job(cluster, conllu), "text_cold": _run_job(cluster, text)}
        out["text"] = _run_job(cluster, text)  # again: the nodes' taggers are loaded now
        _run_eval(cluster, min(50, args.eval_prompts), False)  # warm: every node's row cache path
        out["eval_local"] = _run_eval(cluster, args.eval_prompts, False)
        out["eval_spread"] = _run_eval(cluster, args.eval_prompts, True)
        return out
    finally:
        cluster.stop()
        cluster.kill_all()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.cluster_jobs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=2000, help="CoNLL-U sentences (default 2000)")
    ap.add_argument("--text-sentences", type=int, default=600, help="raw-text sentences (default 600)")
    ap.add_argument("--nodes", default="1,2,4", help="compute daemon counts, the first is the baseline")
    ap.add_argument("--k", type=int, default=32, help="sentences per window (default 32)")
    ap.add_argument("--eval-prompts", type=int, default=1000, help="prompts of the eval figures (default 1000)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--dir", type=Path, default=None, help="root directory (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.nodes.split(",")]
    root = args.dir or Path(tempfile.mkdtemp(prefix="giaann-cluster-jobs-"))
    try:
        results = {b: _bench(root, b, args) for b in counts}
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    base = counts[0]
    for kind in ("conllu", "text_cold", "text"):
        ref = results[base][kind]
        rows = []
        for b in counts:
            r = results[b][kind]
            cpu_ratio = r["cpu_ms_per_sentence"] / ref["cpu_ms_per_sentence"]
            target = "<= 1.1" if b == 4 else None
            if args.json:
                emit_figure(f"{kind}_b{b}_sentences_per_s", r["sentences_per_s"])
                emit_figure(f"{kind}_b{b}_cpu_ms_per_sentence", r["cpu_ms_per_sentence"])
                emit_figure(f"{kind}_b{b}_cpu_per_sentence_vs_b{base}", cpu_ratio, target)
                emit_figure(f"{kind}_b{b}_register_changes_per_window", r["register_changes_per_window"])
            spread = " / ".join(str(p.get("sentences", 0)) for _, p in sorted(r["by_node"].items()))
            rows.append([str(b), f"{r['sentences_per_s']:.0f} ({r['sentences_per_s'] / ref['sentences_per_s']:.2f}x)",
                         f"{r['cpu_ms_per_sentence']:.2f} ({cpu_ratio:.2f}x)", target or "-",
                         f"{r['register_changes_per_window']:.1f}", spread])
        if not args.json:
            print_table(f"cluster job from {kind} ({ref['sentences']} sentences; baseline B = {base}, same run)",
                        ["B", "sentences/s", "CPU ms/sentence (all daemons)", "target", "register changes/window",
                         "sentences by node"], rows)
    _eval_table(results, counts, args.json)
    return 0


_EVAL_FIGURES = ("prompts", "prediction_tokens", "matches", "top1", "steps")


def _eval_table(results: dict[int, dict[str, dict[str, Any]]], counts: Sequence[int], as_json: bool) -> None:
    rows = []
    for b in counts:
        local, spread = results[b]["eval_local"], results[b]["eval_spread"]
        ratio = spread["wall_s"] / local["wall_s"]
        equal = all(local["doc"][k] == spread["doc"][k] for k in _EVAL_FIGURES)
        if as_json:
            emit_figure(f"eval_b{b}_local_wall_s", local["wall_s"])
            emit_figure(f"eval_b{b}_spread_wall_s", spread["wall_s"])
            emit_figure(f"eval_b{b}_spread_wall_vs_local", ratio)
            emit_figure(f"eval_b{b}_spread_cpu_vs_local", spread["cpu_s"] / local["cpu_s"])
            emit_figure(f"eval_b{b}_figures_equal", float(equal), "== 1")
        by_node = " / ".join(str(p["prompts"]) for _, p in sorted(spread["doc"]["by_node"].items()))
        rows.append([str(b), str(local["doc"]["prompts"]), f"{local['wall_s']:.2f}",
                     f"{spread['wall_s']:.2f} ({ratio:.2f}x)",
                     f"{local['cpu_s']:.2f} / {spread['cpu_s']:.2f}", "yes" if equal else "**no**", "-", by_node,
                     str(len(spread["doc"].get("redone", [])))])
    if not as_json:
        print_table("one eval spread over the B compute daemons (baseline: the same eval on the receiving node only, "
                    "same cluster)", ["B", "prompts", "local wall s", "spread wall s (x local)",
                                      "CPU s local / spread (all daemons)", "figures equal", "target",
                                      "prompts by node", "shares redone"], rows)


if __name__ == "__main__":
    raise SystemExit(main())
