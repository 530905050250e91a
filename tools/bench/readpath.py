"""Per-request cost of a small row read: ``StorageClient.read_rows`` against the raw transport request.

    python -m tools.bench.readpath [--nodes 3] [--replicas 3] [--rows 2000] [--iterations 2000] [--quick]
                                   [--profile] [--json]

Setup: ``--nodes`` storage nodes inside this process (the daemon's runtime and storage role, the
cluster harness, tools/cluster_harness) over tcp on loopback, R = ``--replicas``, holding ``--rows``
rows of 20-300 entries (a realistic inference row). The client is the harness's ``StorageClient``.

Figures, per read of 1 key and of 16 keys (p50 of ``--iterations`` reads, blocks of reads and of
baseline requests interleaved, so load from the machine's other users lands on both alike):

- ``read_rows``: the whole replicated read (placement, replica order, request, the node's
  handler, reply checks);
- baseline: the raw transport request of the same sizes, measured in the same run: the same
  ReadRows payload and key buffers to a ``peers.transport`` listener in this process that answers
  with a pre-built reply of the same bytes (a RowsReply and the seven row arrays), no storage layers;
- the ratio read / baseline (issue 19: the layers above the transport are what a read pays beyond it).

Breakdown (medians of each side replayed alone on the real code, same run): the requests one read
makes are recorded, then the client side is timed with the transport replaced by the recorded
replies (of which: placement, replica order and join, with ``read_from`` answering at once; the
reply checks, ``check_batch``), and the node side by replaying the requests into each node's
runtime dispatch (of which: the storage core, decode to the store's read). What is left of the
total: the other requests' transport, tasks and event-loop turns.

``--fewest-nodes``: the client's ``read_fewest_nodes`` on (``compute.read-fewest-nodes``: a read's
rows to as few nodes as possible). ``--profile``: a cProfile of the 16-key reads, top functions by
own time. ``--json``: one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py)
instead of the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from giaannd import protocol as p
from giaannd.cli import loop_factory
from giaannd.client.reads import read_replicated
from giaannd.model.rows import RowBatch
from peers.transport import Incoming, Reply, connect
from tools.bench.report import emit_figure, print_table
from tools.cluster_harness import Cluster

#: Issue 19 sets no target for this figure; the transport's own is p50 <= 1.5x a raw socket. The
#: read is held to a budget over the bare transport request of the same size instead (a small read's
#: layers above the transport should cost no more than the transport itself).
TARGET_RATIO = "<= 2.0"
BLOCK = 50  # requests per block; blocks of read and baseline alternate


def make_rows(n: int, rng: np.random.Generator) -> RowBatch:
    """``n`` rows of 20-300 entries each, columns spread over the ring."""
    sizes = rng.integers(20, 301, n)
    total = int(sizes.sum())
    cols = rng.choice(np.arange(1, 50 * n, dtype=np.uint64), n, replace=False)
    feats = rng.integers(0, 1 << 20, n).astype(np.uint64)
    src_c = np.repeat(cols, sizes)
    src_f = np.repeat(feats, sizes)
    return RowBatch.from_entries(src_c, src_f, rng.integers(0, 4, total).astype(np.uint8),
                                 rng.integers(0, 1 << 16, total).astype(np.uint64),
                                 rng.integers(0, 1 << 20, total).astype(np.uint64),
                                 rng.random(total, np.float32) + 0.1)


async def _p50(fn: Callable[[], Awaitable[Any]], n: int) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _sync_p50(fn: Callable[[], Any], n: int) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


async def _interleaved(a: Callable[[], Awaitable[Any]], b: Callable[[], Awaitable[Any]], n: int
                       ) -> tuple[float, float]:
    """p50 of ``a`` and of ``b``, in alternating blocks (after a warm-up of each)."""
    for fn in (a, b):
        for _ in range(20):
            await fn()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(max(1, n // BLOCK)):
        for fn, out in ((a, ta), (b, tb)):
            for _ in range(BLOCK):
                t = time.perf_counter()
                await fn()
                out.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


async def measure(cluster: Cluster, rows: RowBatch, keys: int, n: int, rng: np.random.Generator) -> dict[str, float]:
    """The figures and the breakdown of reads of ``keys`` keys (seconds)."""
    client = cluster.client
    pick = rng.choice(rows.num_rows, keys, replace=False)
    cols, feats = rows.row_column[pick].copy(), rows.row_feature[pick].copy()
    want = await client.read_rows(cols, feats)
    assert want.num_rows == keys, "rows written were not read back"

    # the baseline: the same request and reply bytes over the bare transport
    epoch = client.topology.epoch
    payload = p.encode(p.ReadRows(epoch, chunked=True))
    reply_payload = p.encode(p.RowsReply())
    reply_bulk = [b.copy() for b in want.buffers()]

    async def answer(incoming: Incoming) -> Reply:
        return Reply(reply_payload, reply_bulk)

    transport = cluster.transport("bench-baseline")
    listener = await transport.listen("tcp://127.0.0.1:0", answer)
    conn = await connect(transport, listener.address, timeout_s=10)
    try:
        async def base() -> None:
            await conn.request(payload, [cols, feats], timeout_s=10)

        async def read() -> None:
            await client.read_rows(cols, feats)

        read_s, base_s = await _interleaved(read, base, n)
    finally:
        await conn.close()
        await listener.close()

    # the pieces, each alone on the real code: record the requests one read makes (node, message,
    # keys, reply), then replay each side without the other
    calls: list[tuple[str, p.Request, list[np.ndarray], p.Reply, list[np.ndarray]]] = []
    real_call = client._call

    async def recording(node: str, msg: p.Request, bulk: Any = (), timeout_s: float | None = None, *,
                        recv_into: Any = None) -> tuple[p.Reply, list[np.ndarray]]:
        reply, got = await real_call(node, msg, bulk, timeout_s, recv_into=recv_into)
        calls.append((node, msg, [b.copy() for b in bulk], reply, [b.copy() for b in got]))
        return reply, got

    client._call = recording  # type: ignore[method-assign]
    try:
        await client.read_rows(cols, feats)
    finally:
        del client._call
    replies = {(node, tuple(bulk[0].tolist())): (p.encode(reply), got) for node, _, bulk, reply, got in calls}

    async def instant_call(node: str, msg: p.Request, bulk: Any = (), timeout_s: float | None = None, *,
                           recv_into: Any = None) -> tuple[p.Reply, list[np.ndarray]]:
        p.encode(msg)  # what ``_call`` does besides the transport: encode, decode the reply
        payload, got = replies[(node, tuple(bulk[0].tolist()))]
        return p.decode_reply(payload), got

    async def client_side() -> None:
        client._call = instant_call  # type: ignore[method-assign]
        try:
            await client.read_rows(cols, feats)
        finally:
            del client._call

    batches = {key: RowBatch.from_buffers(got) for key, (_, got) in replies.items()}

    async def instant_from(node: str, c: Any, f: Any, t: float | None, busy_ok: bool = False) -> RowBatch:
        return batches[(node, tuple(c.tolist()))]

    topology, ramp, clock = client.topology, client.read_ramp, client.clock

    async def placement() -> None:
        await read_replicated(topology, instant_from, ramp, clock, cols, feats, fewest=client.read_fewest_nodes)

    def checks() -> None:
        for _, got in replies.values():
            p.check_batch(got)

    requests = [(node, p.encode(msg), bulk) for node, msg, bulk, _, _ in calls]
    runtimes = {name: cluster.nodes[name].runtime for name in cluster.nodes}

    async def server_side() -> None:
        for node, payload, bulk in requests:
            await runtimes[node]._dispatch(Incoming(memoryview(payload), bulk, None, "bench"))

    def server_core() -> None:
        for node, payload, bulk in requests:
            core = cluster.services[node].core
            assert core is not None
            core.handle(payload, bulk)

    out = {"read": read_s, "baseline": base_s, "requests": float(len(calls))}
    out["client"] = await _p50(client_side, n)
    out["placement"] = await _p50(placement, n)
    out["checks"] = _sync_p50(checks, n)
    out["server"] = await _p50(server_side, n)
    out["core"] = _sync_p50(server_core, n)
    out["entries"] = float(want.num_entries)
    out["reply_bytes"] = float(want.nbytes)
    return out


async def run(args: argparse.Namespace) -> list[dict[str, float]]:
    rng = np.random.default_rng(19)
    with tempfile.TemporaryDirectory(prefix="bench-readpath-") as tmp:
        cluster = await Cluster(Path(tmp), args.nodes, scheme="tcp", replicas=args.replicas,
                                capacity_bytes=1 << 30, request_timeout_s=10.0, log_level="warning").start()
        try:
            cluster.client.read_fewest_nodes = args.fewest_nodes
            rows = make_rows(args.rows, rng)
            for a in range(0, rows.num_rows, 256):
                b = min(a + 256, rows.num_rows)
                e0, e1 = int(rows.offsets[a]), int(rows.offsets[b])
                await cluster.client.write(RowBatch(
                    rows.row_column[a:b], rows.row_feature[a:b], rows.offsets[a : b + 1] - e0,
                    rows.segment[e0:e1], rows.target_column[e0:e1], rows.target_feature[e0:e1],
                    rows.strength[e0:e1]))
            await cluster.client.flush()
            results = []
            for keys in (1, 16):
                r = await measure(cluster, rows, keys, args.iterations, rng)
                r["keys"] = float(keys)
                results.append(r)
            if args.profile:
                cols, feats = rows.row_column[:16].copy(), rows.row_feature[:16].copy()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.iterations):
                    await cluster.client.read_rows(cols, feats)
                prof.disable()
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
            return results
        finally:
            await cluster.close()


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} µs"


def report(results: list[dict[str, float]], as_json: bool) -> None:
    for r in results:
        k = int(r["keys"])
        ratio = r["read"] / r["baseline"]
        if as_json:
            emit_figure(f"readpath.read_rows_{k}key_p50_us", r["read"] * 1e6)
            emit_figure(f"readpath.transport_{k}key_p50_us", r["baseline"] * 1e6)
            emit_figure(f"readpath.read_rows_{k}key_vs_transport", ratio, TARGET_RATIO)
            for piece in ("client", "placement", "checks", "server", "core"):
                emit_figure(f"readpath.read_rows_{k}key_{piece}_us", r[piece] * 1e6)
    if as_json:
        return
    rows = []
    for r in results:
        rows.append([f"{int(r['keys'])} ({int(r['entries'])} entries, {r['reply_bytes'] / 1024:.1f} KiB)",
                     f"{int(r['requests'])}", _us(r["read"]), _us(r["baseline"]),
                     f"{r['read'] / r['baseline']:.2f}×", TARGET_RATIO])
    print_table("read_rows p50 vs one raw transport request of the same sizes (same run)",
                ["keys", "requests", "read_rows", "transport", "ratio", "target"], rows)
    pieces = [("client side (read_rows, no transport)", "client"),
              ("· placement, replica order, join", "placement"), ("· reply checks (check_batch)", "checks"),
              ("node side (runtime dispatch, storage handler)", "server"),
              ("· storage core: decode, ownership, store read", "core"),
              ("one transport request (baseline)", "baseline")]
    brows = [[label, *(_us(r[key]) for r in results)] for label, key in pieces]
    rest = [r["read"] - r["client"] - r["server"] - r["baseline"] for r in results]
    brows.append(["rest: further transport requests, tasks, loop", *(_us(max(0.0, g)) for g in rest)])
    brows.append(["total read_rows", *(_us(r["read"]) for r in results)])
    print_table("where a read's time goes (medians of each side alone; · is part of the line above)",
                ["piece", *(f"{int(r['keys'])} key(s)" for r in results)], brows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="200 rows, 300 iterations")
    ap.add_argument("--fewest-nodes", action="store_true",
                    help="the client sends a read's rows to as few nodes as possible (compute.read-fewest-nodes)")
    ap.add_argument("--profile", action="store_true", help="cProfile of the 16-key reads (to stderr)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.iterations = 200, 300
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the daemon runs
        report(runner.run(run(args)), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
