"""Cluster-job upload benchmark (issue 15 item 1): what a corpus costs the storage nodes' RAM.

    python -m tools.bench.register_upload [--sentences 40000] [--k 256] [--json]

Two fresh local clusters, one after the other (tools/local_cluster: real ``giaannd`` processes,
tcp, 3 storage daemons at R = 3, W = 2, one compute daemon, ``compute.cluster-jobs``):

- **baseline**: every register value in RAM (``storage.register-spill-bytes`` 2 MiB, the largest
  value: nothing spills; ``register-ram-bytes`` raised to 1 GiB so the corpus fits) - the store as
  it was before values moved to disk;
- **spill**: the defaults (values of 4 KiB or more, i.e. every corpus chunk, stay on disk).

Per cluster: one ``train start`` of the same CoNLL-U corpus (the bundled sentences repeated up to
``--sentences``), timed from the request to the job leaving ``phase: uploading``; then the job is
cancelled. Figures: **upload MB/s** (chunk bytes, ``register_bytes``: the msgpack the registers
hold, once, over the upload's wall time) and **storage RSS per MB uploaded** (the mean growth of
the three storage daemons' VmRSS over the upload, per MB of chunks: each holds every chunk at R = 3
on 3 nodes). Targets: RSS per MB with spilling at most 0.1 (bookkeeping only, no value bytes);
upload MB/s at least 0.8x the baseline's (the same CAS rounds; reads back nothing).
With ``--json`` one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from giaannd.compute.cluster_jobs.corpus_chunks import encode_window
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.sdk.local_cluster import LocalCluster, Node
from tools.bench.report import emit_figure, print_table

__all__ = ["main"]

#: Whole-upload wait: a stuck upload fails the bench instead of hanging it.
UPLOAD_TIMEOUT_S = 600.0
_MB = 1e6


def _rss_bytes(node: Node) -> int:
    assert node.proc is not None
    for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _upload(root: Path, corpus: Path, spill: bool, k: int) -> dict[str, Any]:
    storage_options: dict[str, Any] = {} if spill else {"register_spill_bytes": 2**21,
                                                         "register_ram_bytes": 2**30}
    cluster = LocalCluster(root / ("spill" if spill else "ram"), storage=3, compute=1, transport="tcp",
                           log_level="warning", storage_options=storage_options,
                           compute_options={"cluster_jobs": True, "coalesce_k": k})
    try:
        cluster.start()
        cluster.wait_converged()
        storage = [n for n in cluster.nodes if "storage" in n.roles]
        shutil.copy(corpus, cluster.corpus_dir / corpus.name)
        rss0 = [_rss_bytes(n) for n in storage]
        admin = cluster.compute_nodes[0].admin
        started = time.perf_counter()
        job = admin.json("POST", "/v1/train", {"corpus": str(cluster.corpus_dir / corpus.name)})
        deadline = time.monotonic() + UPLOAD_TIMEOUT_S
        while (doc := admin.json("GET", f"/v1/jobs/{job['job_id']}"))["phase"] == "uploading" and \
                doc["state"] == "running":
            if time.monotonic() > deadline:
                raise TimeoutError(f"upload of job {job['job_id']} not done after {UPLOAD_TIMEOUT_S} s")
            time.sleep(0.05)
        wall = time.perf_counter() - started
        if doc["state"] != "running":
            raise RuntimeError(f"job {job['job_id']} {doc['state']} while uploading: {doc.get('error')}")
        rss = [_rss_bytes(n) - r for n, r in zip(storage, rss0, strict=True)]
        admin.json("POST", f"/v1/jobs/{job['job_id']}/cancel", {})
        return {"wall_s": wall, "rss_growth": sum(rss) / len(rss)}
    finally:
        cluster.stop()
        cluster.kill_all()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.register_upload", description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=40_000, help="CoNLL-U sentences (default 40000)")
    ap.add_argument("--k", type=int, default=256, help="sentences per window (default 256)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    base = load_bundled_corpus()
    sentences = (base * (args.sentences // len(base) + 1))[:args.sentences]
    chunk_bytes = sum(len(part) for w in range(0, len(sentences), args.k)
                      for part in encode_window(sentences[w:w + args.k]))
    root = Path(tempfile.mkdtemp(prefix="giaannd-bench-upload-"))
    try:
        corpus = root / "train.conllu"
        write_conllu(sentences, corpus)
        ram = _upload(root, corpus, False, args.k)
        spill = _upload(root, corpus, True, args.k)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = chunk_bytes / _MB
    rows = []
    for name, r, target_rss, target_speed in (("all values in RAM (baseline)", ram, "-", "-"),
                                              ("chunks on disk (default)", spill, "<= 0.1", ">= 0.8x")):
        rows.append([name, f"{mb / r['wall_s']:.2f}", f"{(mb / r['wall_s']) / (mb / ram['wall_s']):.2f}x",
                     target_speed, f"{r['rss_growth'] / chunk_bytes:.3f}", target_rss])
    if args.json:
        emit_figure("upload_mb_per_s_baseline", mb / ram["wall_s"])
        emit_figure("upload_mb_per_s", mb / spill["wall_s"])
        emit_figure("upload_speed_x_baseline", ram["wall_s"] / spill["wall_s"], ">= 0.8")
        emit_figure("storage_rss_per_mb_baseline", ram["rss_growth"] / chunk_bytes)
        emit_figure("storage_rss_per_mb", spill["rss_growth"] / chunk_bytes, "<= 0.1")
    else:
        print_table(f"Upload of {len(sentences):,} sentences ({mb:.1f} MB of chunks, K = {args.k}), "
                    "3 storage daemons R = 3", ["registers", "upload MB/s", "x baseline", "target",
                                                 "storage RSS MB per MB", "target"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
