"""Topology benchmarks (issue 8): each measurement next to its baseline from the same run.

    python -m tools.bench.topology [--mb 600] [--quick] [--window 4] [--profile] [--json]

Prints Markdown tables (``--json``: one ``{"figure", "value", "target"}`` object per figure):

1. streaming rate: a join's row streams (chunk read, checksum, send, apply + group-commit fsync on
   the receiver, verification) with ``--window`` items in flight (``storage.stream-window``), and
   the same join stop-and-wait (a window of one: the baseline, same run), vs the raw transport
   sending the same bytes in the same chunk size, one request at a time, to a handler that only
   acknowledges (all tcp on loopback, in one process, on uvloop as the daemon runs); also by CPU:
   bytes per CPU-second of the process (both ends), steadier than wall rates on a shared host,
   where the raw rate alone swings 3x between runs. Issue 19's
   targets: >= 0.3x raw at 50 entries/row, >= 0.6x at 5,000. Beside them, what the receiver must
   do whatever the stream: the same rows applied to an empty durable store in the same chunks,
   an fsync per window of them, no network and no source (its rate against the raw transport is
   the most any stream could reach on this host). The join moves about a third of
   ``--mb`` (2 -> 3 nodes): the default (600 MB held, a ~200 MB join of ~50 chunks per source)
   is big enough that a stream's fixed costs (plan, hellos, the writers file's fsync, the last
   round trip, verification's key listing) are a few percent; ``--quick`` (8 MB: ~1 chunk per
   source) measures mostly those fixed costs;
2. rows moved when the (N+1)-th node joins: the planner's moved replica bytes vs 1/(N+1), and the
   measured bytes moved by the join of table 1 vs the same bound;
``--processes``: instead, joins whose two sources are ``giaannd`` processes (the newcomer in this
   process), so sender and receiver each have a core as between machines, vs the raw transport
   between two processes;
``--profile``: one more join per row size, under cProfile (CPU of the event loop's thread), as CPU
   milliseconds per MB moved by phase, both ends together (they share the process), fsyncs (in the
   group commit's thread: wall time) apart, with a same-run floor (copying the bytes moved into
   memory never touched before: what a receiver's growth costs on this host); then a receiver's
   store applying chunks of new rows, the general path (plan, delta runs, folds: the baseline) vs
   straight into the base (``ColumnStore.append_writers``), CPU ms/MB, no network;
3. time to restore R after a node dies (``removenode`` re-replicating from the survivors) vs
   bytes moved / the stream rate of table 1. Failure *detection* is membership's job (its suspicion
   timeout, docs/membership.md) and adds to this; it is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from giaannd.cli import loop_factory
from giaannd.cluster.view import StorageNode
from giaannd.config import StorageConfig
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ROW_OVERHEAD_BYTES, ColumnStore
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.rebalance import source_control as sc
from giaannd.storage.rebalance.local_control import LocalClusterControl
from giaannd.storage.rebalance.operations import Rebalance, members_after
from giaannd.storage.rebalance.plan import plan_transfers
from peers.placement import Member, Placement
from peers.transport import Identity, Incoming, Reply, connect, make_transport
from tools.bench import host
from tools.bench.report import emit_figure, print_table
from tools.cluster_harness import Cluster, free_tcp_address

CHUNK = 4 * 2**20


def _big_batch(rng: np.random.Generator, columns: np.ndarray, rows: int, per_row: int) -> RowBatch:
    n = rows * per_row
    sc = np.repeat(rng.choice(columns, rows), per_row)
    sf = np.repeat(rng.integers(0, 1 << 20, rows, dtype=np.uint64), per_row)
    return RowBatch.from_entries(sc, sf, rng.integers(0, 9, n).astype(np.uint8),
                                 rng.integers(1, 1 << 30, n, dtype=np.uint64),
                                 rng.integers(0, 1 << 30, n, dtype=np.uint64),
                                 rng.integers(1, 5, n).astype(np.float32))


async def _fill(cluster: Cluster, mb: float, rng: np.random.Generator, per_row: int) -> None:
    columns = rng.integers(1, 2**63, 2000, dtype=np.uint64)
    rows = max(1, 100_000 // per_row)
    for _ in range(max(1, int(mb * 2**20 / (rows * per_row * 21)))):
        b = _big_batch(rng, columns, rows, per_row)
        await cluster.client.write(b)
    await cluster.client.flush()


async def _raw_rate(total_bytes: int, chunk: int) -> tuple[float, float]:
    """Bytes/s of the raw transport (same chunking, one request in flight, a handler that acks),
    and bytes per CPU-second of this process (both ends)."""
    key = b"bench-raw-transport-key-01234567"
    server, client = make_transport("tcp", Identity("raw", "bench", [key])), \
        make_transport("tcp", Identity("raw-c", "bench", [key]))

    async def handler(incoming: Incoming) -> Reply:
        return Reply(b"\x90")

    listener = await server.listen(free_tcp_address(), handler)
    conn = await connect(client, listener.address, timeout_s=5)
    buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    await conn.request(b"\x90", [buf])
    sent, start, cpu0 = 0, time.perf_counter(), time.process_time()
    while sent < total_bytes:
        await conn.request(b"\x90", [buf])
        sent += chunk
    rate, per_cpu = sent / (time.perf_counter() - start), sent / max(1e-9, time.process_time() - cpu0)
    await conn.close()
    await listener.close()
    return rate, per_cpu


def _store_apply_rate(batch: RowBatch, root: Path, window: int) -> float:
    """Bytes/s of applying ``batch`` (new rows) to an empty DurableStore in CHUNK-sized pieces,
    synced every ``window`` pieces (as the receiver's group commit makes a window of items durable
    together): what the receiver must do anyway, without the network. The pieces are cut before
    the clock starts (a slice of rows each, as a source's chunk is read: not timed here)."""
    store = DurableStore.open(root, 8 << 30)
    store.store.reserve(batch.nbytes)  # as a stream's receiver does (StreamHello.expected_bytes)
    store.store.append_writers.add(1)  # ... and its items' new rows go straight into the base
    sizes = np.diff(batch.offsets) * 21
    bounds = np.searchsorted(np.cumsum(sizes), np.arange(CHUNK, int(sizes.sum()) + CHUNK, CHUNK))
    cuts = [0, *np.unique(np.minimum(bounds + 1, batch.num_rows)).tolist()]
    pieces = []
    for lo, hi in zip(cuts, cuts[1:]):
        mask = np.zeros(batch.num_rows, bool)
        mask[lo:hi] = True
        pieces.append(batch.select_rows(mask))
    start = time.perf_counter()
    for i, piece in enumerate(pieces):
        store.apply(BatchId(1, i + 1), piece)
        if (i + 1) % max(1, window) == 0:
            store.sync()
    store.sync()
    rate = batch.nbytes / (time.perf_counter() - start)
    store.close()
    return rate


async def _join_rate(root: Path, mb: float, per_row: int, window: int, apply: bool = True,
                     profile: cProfile.Profile | None = None, cpu_s: list[float] | None = None
                     ) -> tuple[float, int, int, float, float]:
    """(stream bytes/s, bytes moved, bytes held before, seconds, store-apply bytes/s or 0) of one
    join, R=1, 2 -> 3 nodes, the sources sending ``window`` items at once; ``profile``: enabled
    while the join streams; ``cpu_s``: the process CPU seconds of that time appended to it."""
    cluster = await Cluster(root, 2, scheme="tcp", replicas=1, capacity_bytes=8 << 30).start()
    try:
        for service in cluster.services.values():
            service.settings = msgspec.structs.replace(service.settings, stream_window=window)
        await _fill(cluster, mb, np.random.default_rng(1), per_row)
        # the rows' bytes (the store's used bytes less its per-row accounting overhead)
        held = sum(s.usage().used_bytes - ROW_OVERHEAD_BYTES * s.usage().num_rows for s in cluster.services.values())
        await cluster.add_node("s2")
        op = Rebalance(cluster.control(), "join", members_after(
            cluster.client_topology, add=[StorageNode("s2", cluster.addresses["s2"])]), chunk_bytes=CHUNK)
        start, cpu0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        task = asyncio.create_task(op.run())
        while not op.runners:
            await asyncio.sleep(0)
        await asyncio.gather(*(r.caught_up.wait() for r in op.runners))
        streamed = time.perf_counter() - start  # plan + every chunk applied + verified
        if profile is not None:
            profile.disable()
        if cpu_s is not None:
            cpu_s.append(time.process_time() - cpu0)
        progress = await task
        total = time.perf_counter() - start
        moved = progress["bytes_done"]
        apply_rate = (_store_apply_rate(cluster.column_store("s2").read_all(), root / "apply", window)
                      if apply else 0.0)
        return moved / streamed, moved, held, total, apply_rate
    finally:
        await cluster.close()


class _SourcesAreProcesses(LocalClusterControl):
    """Topology control when only the newcomer runs in this process (its sources are giaannd
    processes: their streams are driven through their stream endpoints, source_control.py)."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        svc = cluster.services[name]
        super().__init__(cluster.transport("coordinator"), {name: svc}, {name: cluster.topologies[name]},
                         [cluster.client_topology], [cluster.client], cluster.stream_addresses, drain_grace_s=0.05)

    async def hints_held_for(self, names: Any) -> int:
        return sum([await sc.hints_held(self.transport, a, names) for a in self.stream_addresses.values()])

    async def deliver_hints(self) -> None:
        for a in self.stream_addresses.values():
            await sc.deliver_hints(self.transport, a)

    async def drop_hints_for(self, name: str) -> int:
        return sum([await sc.drop_hints(self.transport, a, name) for a in self.stream_addresses.values()])


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _join_rate_processes(root: Path, mb: float, per_row: int, window: int) -> tuple[float, int, float]:
    """(stream bytes/s, bytes moved, CPU s of all processes) of one join, R=1, 2 -> 3 nodes: the
    two sources are ``giaannd`` processes (``storage.stream-window`` = ``window``), the newcomer
    runs in this process: sender and receiver each on their own core, as between machines."""
    cluster = Cluster(root, 2, processes=True, names=["p0", "p1"], replicas=1, capacity_bytes=8 << 30,
                      request_timeout_s=30.0)
    await cluster.start(stream_window=window)
    try:
        await _fill(cluster, mb, np.random.default_rng(1), per_row)
        await cluster.add_node("s2")
        op = Rebalance(_SourcesAreProcesses(cluster, "s2"), "join", members_after(
            cluster.client_topology, add=[StorageNode("s2", cluster.addresses["s2"])]), chunk_bytes=CHUNK)
        pids = [n.proc.pid for n in cluster.procs.values() if n.proc is not None]
        cpu0 = time.process_time() + sum(map(_proc_cpu_s, pids))
        start = time.perf_counter()
        task = asyncio.create_task(op.run())
        while not op.runners:
            await asyncio.sleep(0.001)
        await asyncio.gather(*(r.caught_up.wait() for r in op.runners))
        streamed = time.perf_counter() - start
        cpu = time.process_time() + sum(map(_proc_cpu_s, pids)) - cpu0
        moved = (await task)["bytes_done"]
        return moved / streamed, moved, cpu
    finally:
        await cluster.close()


_RAW_KEY = b"bench-raw-transport-key-01234567"


async def _raw_server(address: str) -> None:
    """``--raw-server``: the raw transport's acknowledging end, in its own process; prints its
    address, serves until stdin closes."""
    server = make_transport("tcp", Identity("raw", "bench", [_RAW_KEY]))

    async def handler(incoming: Incoming) -> Reply:
        return Reply(b"\x90")

    listener = await server.listen(address, handler)
    print(listener.address, flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await listener.close()


async def _raw_rate_processes(total_bytes: int, chunk: int) -> tuple[float, float]:
    """``_raw_rate`` with the acknowledging end in another process: (bytes/s, bytes per CPU-s of both)."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench.topology", "--raw-server", free_tcp_address()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        address = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)).decode().strip()
        client = make_transport("tcp", Identity("raw-c", "bench", [_RAW_KEY]))
        conn = await connect(client, address, timeout_s=5)
        buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
        await conn.request(b"\x90", [buf])
        cpu0 = time.process_time() + _proc_cpu_s(proc.pid)
        sent, start = 0, time.perf_counter()
        while sent < total_bytes:
            await conn.request(b"\x90", [buf])
            sent += chunk
        elapsed = time.perf_counter() - start
        cpu = time.process_time() + _proc_cpu_s(proc.pid) - cpu0
        await conn.close()
        return sent / elapsed, sent / max(1e-9, cpu)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def _processes_table(mb: float, window: int, tmp: Path, as_json: bool) -> None:
    """``--processes``: join rates with the sources in their own processes, vs the raw transport
    between two processes, for 50 and 5,000 entries per row."""
    table = []
    for per_row in (50, 5000):
        r, moved, cpu = await _join_rate_processes(tmp / f"proc{per_row}", mb, per_row, window)
        raw, raw_cpu = await _raw_rate_processes(max(moved, CHUNK * 4), CHUNK)
        r_cpu, target = moved / max(1e-9, cpu), TARGETS.get(per_row)
        if as_json:
            emit_figure(f"join stream vs raw, processes, window {window}, {per_row} entries/row", r / raw, target)
            emit_figure(f"join stream vs raw by CPU, processes, window {window}, {per_row} entries/row",
                        r_cpu / raw_cpu, target)
            continue
        table += [[f"{per_row}", f"join stream, window {window}, sources in their own processes",
                   f"{r / 1e6:.1f}", f"{r / raw:.2f}x", f"{r_cpu / 1e6:.0f}", f"{r_cpu / raw_cpu:.2f}x", target or ""],
                  [f"{per_row}", "raw transport, two processes, same bytes and chunking",
                   f"{raw / 1e6:.1f}", "1.00x", f"{raw_cpu / 1e6:.0f}", "1.00x", ""]]
    if not as_json:
        print_table(f"Streaming rate, sender and receiver in separate processes (tcp loopback, 4 MiB chunks; "
                    f"joins of ~{mb / 3:.0f} MB)",
                    ["entries/row", "path", "MB/s", "vs raw", "MB per CPU-s", "vs raw (CPU)", "target"], table)


async def _restore_rf(root: Path, mb: float) -> tuple[float, int]:
    """(seconds, bytes) of removenode after a death: 3 nodes, R=2."""
    cluster = await Cluster(root, 3, scheme="tcp", replicas=2, capacity_bytes=8 << 30).start()
    try:
        await _fill(cluster, mb, np.random.default_rng(2), 500)
        await cluster.kill("s2")
        op = Rebalance(cluster.control(), "removenode", members_after(cluster.client_topology, remove=["s2"]),
                       chunk_bytes=CHUNK)
        start = time.perf_counter()
        progress = await op.run()
        return time.perf_counter() - start, progress["bytes_done"]
    finally:
        await cluster.close()


def _moved_fraction_rows() -> list[list[str]]:
    rng = np.random.default_rng(3)
    cols = rng.integers(1, 2**63, 100_000, dtype=np.uint64)
    size = dict(zip(cols.tolist(), rng.integers(1, 1000, cols.size).tolist()))
    total = sum(size.values())
    out = []
    for n, r in ((4, 1), (4, 3), (9, 3), (19, 3)):
        names = [f"n{i}" for i in range(n + 1)]
        old = Placement(tuple(Member(x) for x in names[:n]), r)
        new = Placement(tuple(Member(x) for x in names), r)
        plan = plan_transfers(old, new, cols, names)
        moved = sum(size[c] for t in plan.transfers for c in t.columns.tolist())
        frac = moved / (total * r)  # of all replica bytes
        out.append([f"{n} -> {n + 1}", str(r), f"{frac:.4f}", f"{1 / (n + 1):.4f}", f"{frac * (n + 1):.3f}"])
    return out


TARGETS = {50: ">= 0.3", 5000: ">= 0.6"}  # issue 19, item 3 (vs the raw transport)

#: Phases of a join's CPU (``--profile``): name -> the functions whose cumulative time is that
#: phase, as (file suffix, function name); none of them calls another. Both ends run in the one
#: process, so each phase is both ends' time.
PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "plan + key listing": (("rebalance/operations.py", "make_plan"), ("sender.py", "row_keys_of")),
    "page build (rows out of the engine)": (("column_store.py", "read_rows"),),
    "checksum (both ends)": (("stream.py", "item_checksum"),),
    "send (frame writes, socket)": (("peers/transport/tcp.py", "write"),),
    "decode + validate": (("model/rows.py", "from_buffers"),),
    "apply: update-log append": (("engine/update_log.py", "append_batch"),),
    "apply: engine plan + commit + fold": (("column_store.py", "prepare"), ("column_store.py", "commit")),
    "verification digests (both ends)": (("column_store.py", "rows_digest"), ("sender.py", "_page_digest"),
                                         ("sender.py", "_kept_pages")),
}
#: Own time of these is "receive": socket reads and the framing around them.
_RECEIVE = ("peers/transport/session.py", "peers/transport/connection.py", "peers/transport/eager.py")


def _phase_rows(stats: pstats.Stats, moved: int, cpu_s: float, fsync: list[float]) -> list[list[str]]:
    """CPU ms per MB moved by phase (``PHASES``; the profile's timer is the thread's CPU clock)."""
    raw = stats.stats  # type: ignore[attr-defined]
    per_mb = 1e3 / (moved / 1e6)
    got = {name: sum(v[3] for (f, _, fn), v in raw.items() if any(f.endswith(x) and fn == y for x, y in funcs))
           for name, funcs in PHASES.items()}
    got["receive (socket reads, framing)"] = sum(
        v[2] for (f, _, fn), v in raw.items() if f.endswith(_RECEIVE) or "recv_into" in fn)
    thread = sum(v[2] for v in raw.values())
    got["the rest (event loop, stream glue)"] = thread - sum(got.values())
    return [[name, f"{v * per_mb:.2f}"] for name, v in got.items()] + [
        ["all (process CPU, every thread)", f"{cpu_s * per_mb:.2f}"],
        ["fsync (group commit's thread; wall, not CPU)", f"{fsync[1] * per_mb:.2f} ({int(fsync[0])} fsyncs)"]]


def _receiver_apply_ms_per_mb(per_row: int, straight: bool, mb: float = 100.0) -> float:
    """CPU ms per MB (this thread) of a receiver's store applying ``mb`` of stream chunks of new
    rows into room reserved up front (``ColumnStore.reserve``), through the general path (plan,
    delta runs, tier merges, folds: before) or straight into the base (``append_writers``)."""
    rng = np.random.default_rng(11)
    columns = rng.integers(1, 2**63, 2000, dtype=np.uint64)
    rows = max(1, CHUNK // (21 * per_row))
    chunks = []
    for i in range(max(1, int(mb * 1e6 / CHUNK))):
        b = _big_batch(rng, columns, rows, per_row)  # each chunk its own features: rows never repeat
        chunks.append(RowBatch(b.row_column, b.row_feature + np.uint64(i << 21), b.offsets, b.segment,
                               b.target_column, b.target_feature, b.strength))
    store = ColumnStore(1 << 40)
    if straight:
        store.append_writers.add(1)
    total = sum(b.nbytes for b in chunks)
    store.reserve(total)
    start = time.thread_time()
    for i, b in enumerate(chunks):
        store.apply(BatchId(1, i + 1), b, validate=False)
    return (time.thread_time() - start) * 1e3 / (total / 1e6)


def _receiver_apply_rows() -> list[list[str]]:
    """The receiver's apply, general path (the same-run baseline) vs straight, best of two each."""
    out = []
    for per_row in (50, 5000):
        general = min(_receiver_apply_ms_per_mb(per_row, False) for _ in range(2))
        straight = min(_receiver_apply_ms_per_mb(per_row, True) for _ in range(2))
        out.append([str(per_row), f"{general:.2f}", f"{straight:.2f}", f"{straight / general:.2f}x"])
    return out


def _host_bound(directory: Path, nbytes: int, raw: float, window: int, as_json: bool) -> list[list[str]]:
    """Rows (or ``--json`` figures) of what the host charges a receiver for what any receiver does
    that the raw transport does not (tools/bench/host.py), as rates against ``raw`` (bytes/s of
    the raw transport in this run): its growth, copies into fresh memory kept; its log, writes
    synced every ``window`` chunks; and the bound they set together, the slower of the two (as
    if everything else a receiver does were free and the syncs fully overlapped)."""
    fresh = 1e9 / host.fresh_copy_ms_per_mb(nbytes, CHUNK)  # bytes/s
    recycled = 1e9 / host.recycled_copy_ms_per_mb(nbytes, CHUNK)
    disk = host.synced_write_bytes_per_s(directory, nbytes, CHUNK, window)
    bound = min(fresh, disk)
    reporting = host.free_page_reporting()
    targets = " / ".join(TARGETS.values())
    figures = [
        ("copy into fresh memory, kept (a receiver's growth)", fresh, ""),
        ("copy into one buffer used again (the raw transport's memory)", recycled, ""),
        (f"writes synced every {window} chunks, then dropped from the page cache (the log)", disk, ""),
        ("bound: the slower of fresh memory and synced writes", bound, targets),
    ]
    written, mapped = host.new_buffer_ms_per_mb(nbytes // 4, 2 * CHUNK)  # (a stream's 8 MiB-class leases)
    if as_json:
        for name, value, _ in figures:
            emit_figure(f"host: {name}, vs raw", value / raw, None)
        emit_figure("host: free page reporting (1 yes, 0 no)", None if reporting is None else float(reporting), None)
        emit_figure("host: new 8 MiB buffers, pages written, CPU ms/MB", written, None)
        emit_figure("host: new 8 MiB buffers, pages mapped by the kernel / written (the pool's way)",
                    mapped / written, None)
        return []
    rows = [[name, f"{value / 1e6:.0f}", f"{value / raw:.2f}x", target] for name, value, target in figures]
    rows.append(["new 8 MiB buffers, pages written / mapped by the kernel (the transport pool's new leases), "
                 "CPU ms/MB", f"{written:.2f} / {mapped:.2f}", f"{mapped / written:.2f}x", ""])
    rows.append(["free page reporting to the hypervisor (virtio balloon)",
                 {True: "yes", False: "no", None: "unknown"}[reporting], "", ""])
    return rows


@contextmanager
def _timed_fsync(acc: list[float]) -> Iterator[None]:
    """Count os.fsync calls and their wall time into ``acc`` ([calls, seconds]) meanwhile."""
    real = os.fsync

    def fsync(fd: Any) -> None:
        t = time.perf_counter()
        try:
            real(fd)
        finally:
            acc[0] += 1
            acc[1] += time.perf_counter() - t

    os.fsync = fsync
    try:
        yield
    finally:
        os.fsync = real


async def _profiled_join(root: Path, mb: float, per_row: int, window: int) -> list[list[str]]:
    """Phase rows (``_phase_rows``) of one join under cProfile."""
    prof, fsync, cpu = cProfile.Profile(time.thread_time), [0.0, 0.0], [0.0]
    with _timed_fsync(fsync):
        _, moved, _, _, _ = await _join_rate(root, mb, per_row, window, apply=False, profile=prof, cpu_s=cpu)
    return _phase_rows(pstats.Stats(prof), moved, cpu[-1], fsync) + [
        ["floor: fresh memory for the bytes moved (same run)", f"{host.fresh_copy_ms_per_mb(moved, CHUNK):.2f}"]]


async def main(mb: float, window: int, as_json: bool, profile: bool = False, processes: bool = False,
               per_rows: tuple[int, ...] = (50, 500, 5000)) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if processes:
            await _processes_table(mb, window, Path(tmp), as_json)
            return
        if profile:
            phases = {per_row: await _profiled_join(Path(tmp) / f"prof{per_row}", mb, per_row, window)
                      for per_row in (50, 5000)}
            print_table(f"CPU per MB moved by phase (ms/MB; join of ~{mb / 3:.0f} MB, window {window}, "
                        "both ends in one process)", ["phase", "50 entries/row", "5000 entries/row"],
                        [[r50[0], r50[1], r5k[1]] for r50, r5k in zip(phases[50], phases[5000])])
            print_table("A receiver's store applying ~100 MB of chunks of new rows into reserved room "
                        "(CPU ms/MB, no network, no log)",
                        ["entries/row", "general path (plan, delta runs, folds)", "straight into the base",
                         "ratio"], _receiver_apply_rows())
            return
        table = []
        raws: list[float] = []
        rate, moved, held, seconds = 0.0, 0, 0, 0.0
        for per_row in per_rows:
            cpu_b: list[float] = []
            cpu_r: list[float] = []
            base, m_b, _, _, _ = await _join_rate(Path(tmp) / f"base{per_row}", mb, per_row, 1, apply=False,
                                                  cpu_s=cpu_b)
            r, m, h, sec, apply_rate = await _join_rate(Path(tmp) / f"join{per_row}", mb, per_row, window,
                                                        cpu_s=cpu_r)
            raw, raw_cpu = await _raw_rate(max(m, CHUNK * 4), CHUNK)
            # bytes per CPU-second (both ends, this process): steadier than wall rates on a shared host
            r_cpu, base_cpu = m / max(1e-9, cpu_r[0]), m_b / max(1e-9, cpu_b[0])
            target = TARGETS.get(per_row)
            if as_json:
                emit_figure(f"join stream vs raw, window {window}, {per_row} entries/row", r / raw, target)
                emit_figure(f"join stream vs raw by CPU, window {window}, {per_row} entries/row", r_cpu / raw_cpu,
                            target)
                emit_figure(f"join stream vs raw, window 1 (baseline), {per_row} entries/row", base / raw, None)
                emit_figure(f"join stream MB/s, window {window}, {per_row} entries/row", r / 1e6, None)
                emit_figure(f"receiver's store apply + fsync (no network, no source) vs raw, {per_row} entries/row",
                            apply_rate / raw, None)
            table += [[f"{per_row}", f"join stream, window {window} (read, checksum, send, apply, fsync; verify)",
                       f"{r / 1e6:.1f}", f"{r / raw:.2f}x", f"{r_cpu / 1e6:.0f}", f"{r_cpu / raw_cpu:.2f}x",
                       target or "", f"{r / base:.2f}x", f"{r / apply_rate:.2f}x"],
                      [f"{per_row}", "join stream, window 1 (stop and wait: the baseline)",
                       f"{base / 1e6:.1f}", f"{base / raw:.2f}x", f"{base_cpu / 1e6:.0f}",
                       f"{base_cpu / raw_cpu:.2f}x", "", "1.00x", f"{base / apply_rate:.2f}x"],
                      [f"{per_row}", f"store apply + fsync every {window} chunks of the same rows, no network",
                       f"{apply_rate / 1e6:.1f}", f"{apply_rate / raw:.2f}x", "", "", "", "", "1.00x"],
                      [f"{per_row}", "raw transport, same bytes and chunking",
                       f"{raw / 1e6:.1f}", "1.00x", f"{raw_cpu / 1e6:.0f}", "1.00x", "", "", ""]]
            raws.append(raw)
            if per_row == 500 or not rate:
                rate, moved, held, seconds = r, m, h, sec
        bound_rows = _host_bound(Path(tmp), max(moved, CHUNK * 4), float(np.median(raws)), window, as_json)
        if as_json:
            return
        print_table(f"Streaming rate (tcp loopback, one process, 4 MiB chunks; join of {moved / 1e6:.0f} MB "
                    f"here, ~{mb / 3:.0f} MB each)",
               ["entries/row", "path", "MB/s", "vs raw", "MB per CPU-s", "vs raw (CPU)", "target", "vs window 1",
                "vs store apply"], table)
        print_table("What this host allows a stream's receiver (same run; docs/topology.md \"What the host "
                    "allows a receiver\")", ["figure", "MB/s", "vs raw", "targets (50 / 5,000 entries a row)"],
                    bound_rows)
        rows = _moved_fraction_rows()
        rows.append(["2 -> 3 (measured join above)", "1", f"{moved / max(1, held):.4f}", f"{1 / 3:.4f}",
                     f"{moved / max(1, held) * 3:.3f}"])
        print_table("Data moved when the (N+1)-th node joins (planner over 100k columns, random sizes)",
               ["nodes", "R", "moved / all replica bytes", "1/(N+1)", "ratio"], rows)
        rf_s, rf_bytes = await _restore_rf(Path(tmp) / "rf", mb)
        bound = rf_bytes / rate
        print_table("Time to restore R after a death (removenode, 3 -> 2 nodes, R=2)",
               ["bytes re-replicated", "seconds", "bytes / stream rate (s)", "ratio"],
               [[f"{rf_bytes / 1e6:.1f} MB", f"{rf_s:.2f}", f"{bound:.2f}", f"{rf_s / bound:.2f}x"]])
        print(f"\n(join: {moved / 1e6:.1f} MB; streaming phase at the rate above, whole operation "
              f"with cutover {seconds:.2f} s; detection time not included)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=600.0,
                    help="rows held before the join (MB; the join moves about a third)")
    ap.add_argument("--quick", action="store_true", help="8 MB instead")
    ap.add_argument("--window", type=int, default=StorageConfig().stream_window,
                    help="items in flight per stream (storage.stream-window); 1 is the baseline")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure (streaming rates only)")
    ap.add_argument("--profile", action="store_true", help="only the CPU per MB by phase of one join per row size")
    ap.add_argument("--processes", action="store_true",
                    help="only the join rates with the sources as giaannd processes (and a raw transport between "
                         "two processes)")
    ap.add_argument("--per-row", type=int, nargs="+", default=[50, 500, 5000],
                    help="entries per row of the joins of the streaming table")
    ap.add_argument("--raw-server", metavar="ADDRESS", help=argparse.SUPPRESS)  # (--processes' raw baseline)
    a = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the daemon runs
        if a.raw_server:
            runner.run(_raw_server(a.raw_server))
        else:
            runner.run(main(8.0 if a.quick else a.mb, a.window, a.json, a.profile, a.processes, tuple(a.per_row)))
