"""Big-row benchmark: one row of N entries read over tcp by the StorageClient, against a raw socket
moving the same bytes in the same run (issue 14 item 5, "Rows of any size").

The storage node runs in its own process (tools/cluster_harness: a storage service built as the
daemon builds it, tcp data plane), holding one row of ``--entries`` entries (default 10^8: 2.1 GB at
21 B an entry) put into its store directly (a region laid out in place: no write batch is that
big). The same process serves the raw baseline: on each connection it writes the row's region
(the same bytes) with one ``transport.write`` of its memoryview; the reader ``recv_into``s a
preallocated, touched buffer. Ours: ``StorageClient.read_rows`` of the row (a chunked ReadRows,
then ``ReadRowPart`` requests of ``storage.read-chunk-bytes`` each, several in flight, into one
row, validated), by two clients: one that keeps the memory of a row the caller dropped
(``keep_row_bytes`` = the row's size: client/row_memory.py), so each read after the first is
received into mapped memory as the raw reader's is, and one that keeps none (``fresh``: every read
into memory the kernel must map). After one untimed round of each (connections; first touches),
raw, raw into fresh memory, ours and ours fresh alternate ``--repeat`` times; figures are medians,
ratios the median of each repeat's ratio.

Memory: threads of the reader sample the node process's RSS and its own (/proc/PID/statm) every
2 ms during each read of ours; the figures are the peak minus the RSS just before the read. The
reader holds at most the kept row's memory and one fresh row at a time besides (the touched raw
buffer is dropped before the fresh reads).

Figures (targets from the issue): GB/s of each, ``ratio_vs_raw`` = ours / raw (>= 0.5),
``node_rss_peak_delta_mib`` (<= row size + 64 MiB). Without a target: ``raw_fresh``, the raw
reader into a buffer it allocates just before (``np.empty``): the kernel's first touch of fresh
memory (page faults, zeroing) costs as much as the transfer or more on a loaded host;
``ratio_fresh_vs_raw`` and ``ratio_fresh_vs_raw_fresh`` for the client that keeps nothing; the
client's RSS growth during a kept read and a fresh one.
``--json``: one ``{"figure", "value", "target"}`` object per figure (tools/bench/report.py).

Usage: python tools/bench/bigrow.py [--entries 100000000] [--repeat 3] [--chunk-bytes 8388608] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from giaannd.cli import loop_factory  # noqa: E402
from giaannd.client.storage_client import StorageClient  # noqa: E402
from giaannd.cluster.view import ClusterView, StorageNode  # noqa: E402
from giaannd.config import DEFAULT_READ_CHUNK_BYTES  # noqa: E402
from giaannd.storage.engine.regions import ENTRY_BYTES, new_region  # noqa: E402
from peers.keyring import Keyring  # noqa: E402
from peers.transport import Identity, make_transport  # noqa: E402
from tools.bench.report import emit_figures, print_table  # noqa: E402
from tools.cluster_harness import Cluster  # noqa: E402
from tools.cluster_harness.cluster import CLUSTER_NAME  # noqa: E402

ROW_KEY = (11, 2)
#: Targets of issue 14 item 5.
RATIO_TARGET = ">= 0.5"
RSS_SLACK_MIB = 64
SAMPLE_S = 0.002


def _fill_row(n: int) -> np.ndarray:
    """A canonical row of ``n`` entries as a region (targets ascending: canonical by construction)."""
    region, row = new_region(n)
    row.segment[:] = 0
    row.target_column[:] = np.arange(n, dtype=np.uint64)
    row.target_feature[:] = 1
    row.strength[:] = np.float32(0.5)
    return region


def _node(root: str, n: int, chunk_bytes: int, pipe: Any) -> None:
    """The storage node process: a one-node cluster holding the row, plus the raw sender."""

    async def main() -> None:
        cluster = await Cluster(Path(root), 1, scheme="tcp", replicas=1, capacity_bytes=ENTRY_BYTES * n + (1 << 30),
                                request_timeout_s=600.0).start(read_chunk_bytes=chunk_bytes)
        region = _fill_row(n)
        cluster.column_store("s0").load_row(ROW_KEY, region, 1)
        view = region.data  # (a memoryview of the array)

        def raw_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.write(view)  # the same bytes, one write (uvloop: writev, no copy)

        raw = await asyncio.start_server(raw_conn, "127.0.0.1", 0)
        raw_port = raw.sockets[0].getsockname()[1]
        pipe.send((cluster.addresses["s0"], str(cluster.key_file), raw_port, os.getpid()))
        await asyncio.to_thread(pipe.recv)  # "stop"
        raw.close()
        await cluster.close()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main())


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssPeak:
    """Samples a process's RSS in a thread until stopped; ``peak - before`` is the figure."""

    def __init__(self, pid: int) -> None:
        self.pid, self.before, self.peak = pid, _rss(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.pid))
            time.sleep(SAMPLE_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5.0)
        self.peak = max(self.peak, _rss(self.pid))
        return self.peak - self.before


def _raw_read(port: int, dest: np.ndarray) -> float:
    """Seconds to receive ``dest.nbytes`` bytes from the raw sender into ``dest``."""
    view = dest.data.cast("B")
    with socket.create_connection(("127.0.0.1", port), timeout=600) as s:
        t0 = time.perf_counter()
        got = 0
        while got < len(view):
            k = s.recv_into(view[got:])
            if not k:
                raise ConnectionError("raw sender closed early")
            got += k
        return time.perf_counter() - t0


def _client(address: str, key_file: str, chunk_bytes: int, keep_row_bytes: int) -> StorageClient:
    keys = list(Keyring.load(Path(key_file)).keys)
    topo = ClusterView(replicas=1)
    topo.set_members([StorageNode("s0", address)])
    return StorageClient(topo, {"tcp": make_transport("tcp", Identity("bench-reader", CLUSTER_NAME, keys))},
                         request_timeout_s=600.0, read_chunk_bytes=chunk_bytes, keep_row_bytes=keep_row_bytes)


async def _timed_read(client: StorageClient, n: int, pid: int, out: dict[str, list[float]], name: str) -> None:
    """One timed read of the row by ``client``: seconds, and the node's and this process's RSS
    growth (peak minus before) during it."""
    node, mine = _RssPeak(pid), _RssPeak(os.getpid())
    t0 = time.perf_counter()
    batch = await client.read_rows([ROW_KEY[0]], [ROW_KEY[1]])
    out[f"{name}_s"].append(time.perf_counter() - t0)
    out[f"{name}_node_rss"].append(node.stop())
    out[f"{name}_client_rss"].append(mine.stop())
    if batch.num_entries != n:
        raise RuntimeError(f"read {batch.num_entries} entries, expected {n}")


async def _ours(address: str, key_file: str, repeat: int, n: int, pid: int, raw_port: int,
                chunk_bytes: int) -> dict[str, list[float]]:
    keep = _client(address, key_file, chunk_bytes, ENTRY_BYTES * n)  # keeps the row's memory when dropped
    fresh_client = _client(address, key_file, chunk_bytes, 0)  # fresh memory for every row
    out: dict[str, list[float]] = {k: [] for k in ("raw_s", "raw_fresh_s", "ours_s", "ours_node_rss",
                                                   "ours_client_rss", "fresh_s", "fresh_node_rss",
                                                   "fresh_client_rss")}
    try:
        dest = np.ones(ENTRY_BYTES * n, np.uint8)
        await asyncio.to_thread(_raw_read, raw_port, dest)  # warm-up, untimed: connections, first-touch
        del dest
        for client in (keep, fresh_client):  # of memory the kernel has to find
            await client.read_rows([ROW_KEY[0]], [ROW_KEY[1]])
        for _ in range(repeat):  # at most row + kept row + one fresh row in this process at a time
            dest = np.ones(ENTRY_BYTES * n, np.uint8)  # touched: the raw reader's preallocated buffer
            out["raw_s"].append(await asyncio.to_thread(_raw_read, raw_port, dest))
            del dest
            t0 = time.perf_counter()  # the raw reader into memory it allocates, as a reader of a new row must
            fresh = np.empty(ENTRY_BYTES * n, np.uint8)
            await asyncio.to_thread(_raw_read, raw_port, fresh)
            out["raw_fresh_s"].append(time.perf_counter() - t0)
            del fresh
            await _timed_read(keep, n, pid, out, "ours")
            await _timed_read(fresh_client, n, pid, out, "fresh")
        if keep.row_memory.reused < repeat:
            raise RuntimeError(f"the kept client reused memory {keep.row_memory.reused} times in {repeat} reads")
    finally:
        await keep.close()
        await fresh_client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_READ_CHUNK_BYTES)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    n, row_bytes = args.entries, ENTRY_BYTES * args.entries
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bigrow-") as root:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_node, args=(root, n, args.chunk_bytes, child), daemon=True)
        proc.start()
        try:
            if not parent.poll(600):
                raise TimeoutError("storage node did not start in 600 s")
            address, key_file, raw_port, pid = parent.recv()
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                res = runner.run(_ours(address, key_file, args.repeat, n, pid, raw_port, args.chunk_bytes))
        finally:
            parent.send("stop")
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    med = {k: statistics.median(v) for k, v in res.items()}

    def ratio(num: str, den: str) -> float:  # median over the repeats of num / den throughput
        return statistics.median(d / m for d, m in zip(res[f"{den}_s"], res[f"{num}_s"]))

    rss_target = f"<= {row_bytes / 2**20 + RSS_SLACK_MIB:.0f}"
    mib = 2**20
    figures = [("bigrow.raw_gbps", row_bytes / med["raw_s"] / 1e9, None),
               ("bigrow.raw_fresh_gbps", row_bytes / med["raw_fresh_s"] / 1e9, None),
               ("bigrow.ours_gbps", row_bytes / med["ours_s"] / 1e9, None),
               ("bigrow.ours_fresh_gbps", row_bytes / med["fresh_s"] / 1e9, None),
               ("bigrow.ratio_vs_raw", ratio("ours", "raw"), RATIO_TARGET),
               ("bigrow.ratio_fresh_vs_raw", ratio("fresh", "raw"), None),
               ("bigrow.ratio_fresh_vs_raw_fresh", ratio("fresh", "raw_fresh"), None),
               ("bigrow.node_rss_peak_delta_mib", max(res["ours_node_rss"] + res["fresh_node_rss"]) / mib,
                rss_target),
               ("bigrow.client_rss_peak_delta_mib", max(res["ours_client_rss"]) / mib, None),
               ("bigrow.client_fresh_rss_peak_delta_mib", max(res["fresh_client_rss"]) / mib, None)]
    if args.json:
        emit_figures(figures)
        return 0
    print_table(f"Big row: {n:,} entries ({row_bytes / 1e9:.2f} GB), chunk {args.chunk_bytes // 2**20} MiB, "
                f"tcp loopback, median of {args.repeat}", ["figure", "value", "target"],
                [[fig, f"{value:.3f}", target or "-"] for fig, value, target in figures])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
