"""Compute-role benchmark: the loopback cluster against the single-process core, same run.

    python -m tools.bench.cluster [--sentences 2000] [--prompts 64] [--in-process] [--quick]

Storage: 3 storage nodes (R = 3, W = 2) over tcp on loopback — real processes
(``python -m giaannd.storage.replication.service``, static membership) by default, or StorageServices inside
this process with ``--in-process``. Compute: this process (the pipeline of giaannd/compute).
Baseline: ``giaannd.model.engine.Engine`` (encode → train_batch → in-memory RowStore) on the same
sentences, in the same run. Prints Markdown tables:

1. training sentences/s: cluster (1 and 2 workers, with and without ``offload``) vs the core;
2. bytes sent per sentence vs the coalescing window K (K = 1 is "uncoalesced": one batch per
   sentence, summed within the sentence only), and the coalescing ratio (pair increments / entries);
3. inference steps/s (teacher-forced, train-set constants): one session at a time and 8 concurrent
   sessions on the cluster vs the core's sequential sessions; row-cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.compute.infer import Inference, RowCache, RowFetcher
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.service import ComputeService
from giaannd.compute.train import TrainingJob, TrainSettings
from giaannd.config import ComputeConfig
from giaannd.model.engine import Engine
from giaannd.model.infer import TRAIN_SET
from giaannd.model.lexicon import Lexicon
from giaannd.model.rows import RowBatch
from giaannd.model.tokens import TaggedSentence, load_bundled_corpus
from giaannd.protocol import BatchId
from peers.transport import Identity, make_transport
from tools.bench.report import print_table

CLUSTER = "bench-cluster"
KEY = bytes(range(32))
START_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def storage_processes(root: Path, n: int = 3, replicas: int = 3) -> Iterator[dict[str, str]]:
    """n storage processes with static membership; yields name -> address; always stops them."""
    addrs = {f"s{i}": f"tcp://127.0.0.1:{_free_port()}" for i in range(n)}
    members = [a for name, addr in addrs.items() for a in ("--member", f"{name}={addr}")]
    procs: list[subprocess.Popen[str]] = []
    try:
        for name, addr in addrs.items():
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "giaannd.storage.replication.service", "--listen", addr, "--data-dir",
                 str(root / name), "--cluster", CLUSTER, "--key-hex", KEY.hex(), "--name", name,
                 "--replicas", str(replicas), *members],
                stdout=subprocess.PIPE, text=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc in procs:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""  # "LISTENING <addr>", or EOF if it died
            if not line.startswith("LISTENING"):
                raise RuntimeError(f"storage process did not start in {START_TIMEOUT_S} s (exit {proc.poll()})")
        yield addrs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@contextlib.asynccontextmanager
async def in_process_storage(root: Path, n: int = 3, replicas: int = 3) -> Any:
    from giaannd.storage.replication.service import StorageService

    addrs = {f"s{i}": f"tcp://127.0.0.1:{_free_port()}" for i in range(n)}
    services = []
    try:
        for name, addr in addrs.items():
            topo = ClusterView(local=name, replicas=replicas)
            topo.set_members([StorageNode(k, v) for k, v in addrs.items()])
            svc = StorageService(root / name, 1 << 30, [addr], identity=Identity(name, CLUSTER, [KEY]),
                                 topology=topo, node_name=name)
            await svc.open()
            services.append(svc)
        yield addrs
    finally:
        for svc in services:
            await svc.stop(graceful=False)


def make_client(addrs: dict[str, str], replicas: int = 3) -> StorageClient:
    topo = ClusterView(local=None, replicas=replicas)
    topo.set_members([StorageNode(k, v) for k, v in addrs.items()])
    return StorageClient(topo, {"tcp": make_transport("tcp", Identity("bench-compute", CLUSTER, [KEY]))},
                         write_quorum=replicas // 2 + 1)


class NullStorage:
    """A storage client stand-in that acknowledges every write at once and holds nothing."""

    def __init__(self) -> None:
        self._seq = 0

    def next_batch_id(self) -> BatchId:
        self._seq += 1
        return BatchId(1, self._seq)

    def abandon(self, batch_id: BatchId) -> None:
        pass

    async def write(self, batch: RowBatch, batch_id: BatchId | None = None) -> None:
        await asyncio.sleep(0)

    async def read_rows(self, cols: object, feats: object) -> RowBatch:
        return RowBatch.empty()

    async def put_vocab(self, entries: Sequence[tuple[int, int, str]]) -> int:
        await asyncio.sleep(0)
        return len(entries)

    async def get_vocab(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
        return {}


def core_rate(sentences: list[TaggedSentence]) -> tuple[float, Engine]:
    """Single-process baseline: sentences/s of Engine.train (lexicon loaded beforehand)."""
    Lexicon.default()
    t0 = time.perf_counter()
    engine = Engine()
    engine.train(sentences)
    return len(sentences) / (time.perf_counter() - t0), engine


async def bench(addrs: dict[str, str], replicas: int, sentences: list[TaggedSentence], n_prompts: int, tmp: Path,
                mode: str, quick: bool, full: bool) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """Training rows (and, when ``full``, the bytes-vs-K and inference tables) on one cluster."""
    client = make_client(addrs, replicas)
    svc = ComputeService(ComputeConfig(row_cache_bytes=256 << 20), tmp / f"compute-r{replicas}", storage=client)
    await svc.start()
    n = len(sentences)
    rows: list[list[str]] = []
    krows: list[list[str]] = []
    infer_rows: list[list[str]] = []
    try:
        configs = [(1, False)] if quick or not full else [(1, False), (1, True), (2, False), (2, True)]
        for workers, offload in configs:
            core, engine = core_rate(sentences)  # baseline measured next to each run (noisy host)
            progress = TrainProgress()
            t0 = time.perf_counter()
            await svc.train(sentences, TrainSettings(workers=workers, coalesce_sentences=256, offload=offload),
                            progress)
            rate = n / (time.perf_counter() - t0)
            rows.append([f"{mode}, R={replicas} W={replicas // 2 + 1}, {workers} worker(s), offload={offload}",
                         f"{rate:,.0f}", f"{core:,.0f}", f"{rate / core:.2f}"])
            if full and workers == 1 and not offload:
                # inference on the state of exactly one training pass (before the others add to it)
                infer_rows = await bench_inference(client, svc, engine, sentences[:n_prompts])
        if full:
            # the compute side alone: the same pipeline against storage that acknowledges at once
            core, _ = core_rate(sentences)
            t0 = time.perf_counter()
            await TrainingJob(sentences, NullStorage(), TrainSettings(coalesce_sentences=256)).run()  # type: ignore[arg-type]
            rate = n / (time.perf_counter() - t0)
            rows.append(["compute pipeline only (storage acks at once, no network)", f"{rate:,.0f}", f"{core:,.0f}",
                         f"{rate / core:.2f}"])
            sub = sentences[: min(n, 600)]
            base_bps = 0.0
            for k in (1, 16, 256, len(sub)):
                progress = TrainProgress()
                await svc.train(sub, TrainSettings(workers=1, coalesce_sentences=k), progress)
                bps = progress.bytes_sent / len(sub)
                base_bps = base_bps or bps
                krows.append([str(k), f"{bps:,.0f}", f"{bps / base_bps:.2f}", f"{progress.coalescing_ratio:.2f}",
                              str(progress.batches)])
    finally:
        await client.close()
    return rows, krows, infer_rows


async def bench_inference(client: StorageClient, svc: ComputeService, engine: Engine,
                          prompts: list[TaggedSentence]) -> list[list[str]]:
    encoded = engine.encode_prompts(prompts)
    t0 = time.perf_counter()
    ref = engine.evaluate(encoded)
    core_s = time.perf_counter() - t0
    core = ref.steps / core_s
    rows = [["single-process core, sequential", f"{core:,.0f}", "1.00", "-", "-"]]
    assigner = await svc.prompt_assigner()
    for label, sessions, cache_bytes, one_at_a_time in (
            ("cluster, 1 session at a time, cache", 1, 256 << 20, True),
            ("cluster, 1 session at a time, no cache", 1, 0, True),
            ("cluster, 8 concurrent sessions, cache", 8, 256 << 20, False),
            ("cluster, 8 concurrent sessions, no cache", 8, 0, False)):
        fetcher = RowFetcher(client.read_rows, RowCache(cache_bytes))
        inference = Inference(fetcher, max_sessions=sessions)
        t0 = time.perf_counter()
        if one_at_a_time:
            matches = 0
            for e in encoded:
                matches += (await inference.evaluate([e], assigner, TRAIN_SET)).result.matches
        else:
            matches = (await inference.evaluate(encoded, assigner, TRAIN_SET)).result.matches
        dt = time.perf_counter() - t0
        if matches != ref.matches:
            raise AssertionError(f"cluster top-1 matches {matches} != core {ref.matches}")
        rate = inference.steps / dt
        rows.append([label, f"{rate:,.0f}", f"{rate / core:.2f}", f"{fetcher.cache.stats()['hit_rate']:.2f}",
                     str(fetcher.requests)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--in-process", action="store_true", help="storage services inside this process")
    ap.add_argument("--quick", action="store_true", help="one training configuration only")
    args = ap.parse_args()
    sentences = load_bundled_corpus(args.sentences)
    tmp = Path(tempfile.mkdtemp(prefix="giaannd-bench-cluster-"))
    mode = "in-process storage" if args.in_process else "3 storage processes"
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; storage: 3 nodes ({mode}), "
          "tcp loopback; compute: this process")

    async def one(replicas: int, full: bool) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
        root = tmp / f"r{replicas}"
        if args.in_process:
            async with in_process_storage(root, replicas=replicas) as addrs:
                return await bench(addrs, replicas, sentences, args.prompts, tmp, mode, args.quick, full)
        with storage_processes(root, replicas=replicas) as addrs:
            return await bench(addrs, replicas, sentences, args.prompts, tmp, mode, args.quick, full)

    try:
        rows, krows, infer_rows = asyncio.run(one(3, True))
        rows += asyncio.run(one(1, False))[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(f"Training, {len(sentences)} sentences (bundled corpus), K=256",
           ["cluster", "sentences/s", "core sentences/s (same run)", "× core"], rows)
    print_table("Bytes sent per sentence vs K (600 sentences; delta payload, before ×R replication)",
           ["K (sentences per batch)", "bytes/sentence", "× K=1", "pair increments / entry sent", "batches"], krows)
    print_table(f"Inference, teacher-forced, train-set constants, {args.prompts} prompts (R=3)",
           ["runner", "steps/s", "× core", "row-cache hit rate", "row requests"], infer_rows)


if __name__ == "__main__":
    main()
