"""Data-plane benchmark: our tcp/ucx transports against same-run baselines (prints a table).

Client and servers run in separate processes on loopback (the client pinned to cpu0, every server
to cpu1 when there are 2+ cpus). Baselines measured in the same run: numpy memcpy of the same
buffer into a touched destination; a raw asyncio ``BufferedProtocol`` receiver (8-byte length +
payload into a preallocated buffer, 1-byte ack) fed by an asyncio stream writer; raw ucxx
worker-address endpoints (error handling off, tag send/recv into a preallocated buffer, 1-byte
ack). Ours: one ``request`` with the buffer as bulk, answered by an empty response (so each
transfer is acknowledged, like the baselines). Latency: request/response with a 64-byte payload
vs a raw TCP 64-byte ping-pong (and a raw ucxx 64-byte tag ping-pong). Window: 4 KiB requests with
``--window`` of them in flight vs the raw socket with as many unacknowledged messages. Idle: CPU
seconds used by a connected pair in 2 s of doing nothing.

Interleaved: every server is up for the whole run and the client alternates between them in
blocks (``--blocks`` per figure, the first transfer of each block untimed), so a burst of load
from the machine's other users lands on raw and ours alike; a ratio is the median of the
per-block ratios. The machine is shared: read ratios, and repeat (``--repeat``).

Usage: python tools/bench/transport.py [--sizes 4K,64K,1M,16M,256M] [--transport tcp|ucx|all]
       [--repeat N] [--blocks 8] [--window 16] [--quick] [--json]

``--json`` prints one ``{"figure", "value", "target"}`` object per figure instead of tables (the
ratios issue 19 sets targets for carry them; ``target`` is null elsewhere), with the 1-minute
load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peers.transport.ucx import UCX_ENV_DEFAULTS  # noqa: E402  (sets no env by itself)
from tools.bench.report import emit_figure  # noqa: E402

KEY = [b"bench-key-0123456789abcdef012345"]
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
#: Targets of issue 19 (ratios to the raw socket measured in the same run).
TARGETS = {"tcp.request_p50_vs_raw": "<= 1.5", "tcp.bulk_4KiB_vs_raw": ">= 0.6",
           "tcp.bulk_64KiB_vs_raw": ">= 0.75"}
LAT_BYTES = 64
WINDOW_BYTES = 4096


def _size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def _label(n: int) -> str:
    for unit, mult in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}iB"
    return f"{n}B"


def _iterations(size: int, quick: bool) -> int:
    budget = (128 if quick else 1024) * 2**20
    return max(3 if quick else 5, min(2000, budget // size))


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


# ---- server processes -------------------------------------------------------------------------------

class _RawReceiver(asyncio.BufferedProtocol):
    def __init__(self, max_size: int) -> None:
        self.buf = np.zeros(max_size + 8, np.uint8)  # touched
        self.view = self.buf.data  # (a memoryview of the array)
        self.want = 8
        self.got = 0
        self.in_header = True

    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        self.t = transport

    def get_buffer(self, sizehint):  # type: ignore[no-untyped-def]
        return self.view[self.got:self.want]

    def buffer_updated(self, n):  # type: ignore[no-untyped-def]
        self.got += n
        if self.got < self.want:
            return
        if self.in_header:
            (length,) = struct.unpack_from("<Q", self.view, 0)
            self.in_header, self.got, self.want = False, 0, length
            if length:
                return
        self.t.write(b"\x01")
        self.in_header, self.got, self.want = True, 0, 8


def _server(kind: str, max_size: int, pipe) -> None:  # type: ignore[no-untyped-def]
    _pin(1)
    loop = _loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(_serve(kind, max_size, pipe))


async def _serve(kind: str, max_size: int, pipe) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    if kind == "raw_tcp":
        server = await loop.create_server(lambda: _RawReceiver(max_size), "127.0.0.1", 0)
        pipe.send(server.sockets[0].getsockname()[1])
    elif kind == "raw_ucx":
        from peers.transport.ucx import UcxRuntime
        ucxx = UcxRuntime.get().ucxx  # blocking mode, with the idle re-arm fix
        UcxRuntime.get().ensure_progress()
        pipe.send(ucxx.get_worker_address().tobytes())
        peer = await loop.run_in_executor(None, pipe.recv)
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(peer),
                                                            endpoint_error_handling=False)
        dest = np.zeros(max_size, np.uint8)
        ack = np.ones(1, np.uint8)
        while True:  # one (size, count) per block; (0, 0) ends
            size, count = await loop.run_in_executor(None, pipe.recv)
            if size == 0:
                break
            for _ in range(count):
                await ucxx.recv(dest[:size], 2)
                await ep.send(ack, 3, force_tag=True)
        return
    else:
        from peers.transport import Identity, Reply, make_transport

        async def sink(incoming):  # type: ignore[no-untyped-def]
            return Reply()

        transport = make_transport(kind.removeprefix("ours_"), Identity("server", "bench", KEY))
        listener = await transport.listen(f"{kind.removeprefix('ours_')}://127.0.0.1:0", sink)
        pipe.send(listener.address)
    await loop.run_in_executor(None, pipe.recv)  # until told to stop


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- clients: the same four operations on every path ------------------------------------------------

class _Client:
    """``bulk(buf, n)``: seconds for n acknowledged transfers; ``ping(n)``: n round-trip times of
    a 64-byte message; ``window(buf, n, w)``: seconds for n transfers with w in flight."""

    async def bulk(self, buf: np.ndarray, n: int) -> float:
        raise NotImplementedError

    async def ping(self, n: int) -> list[float]:
        raise NotImplementedError

    async def window(self, buf: np.ndarray, n: int, w: int) -> float:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class _RawTcp(_Client):
    async def open(self, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)

    async def bulk(self, buf: np.ndarray, n: int) -> float:
        header, data = struct.pack("<Q", buf.nbytes), buf.data
        t0 = time.perf_counter()
        for _ in range(n):
            self.writer.write(header)
            self.writer.write(data)
            await self.reader.readexactly(1)
        return time.perf_counter() - t0

    async def ping(self, n: int) -> list[float]:
        msg, out = struct.pack("<Q", LAT_BYTES - 8) + bytes(LAT_BYTES - 8), []
        for _ in range(n):
            t = time.perf_counter()
            self.writer.write(msg)
            await self.reader.readexactly(1)
            out.append(time.perf_counter() - t)
        return out

    async def window(self, buf: np.ndarray, n: int, w: int) -> float:
        header, data = struct.pack("<Q", buf.nbytes), buf.data
        t0 = time.perf_counter()
        for _ in range(min(w, n)):
            self.writer.write(header)
            self.writer.write(data)
        for i in range(n):
            await self.reader.readexactly(1)
            if i + w < n:
                self.writer.write(header)
                self.writer.write(data)
        return time.perf_counter() - t0

    async def close(self) -> None:
        self.writer.close()


class _Ours(_Client):
    async def open(self, scheme: str, address: str) -> None:
        from peers.transport import Identity, connect, make_transport
        self.transport = make_transport(scheme, Identity("client", "bench", KEY))
        self.conn = await connect(self.transport, address, timeout_s=30)

    async def bulk(self, buf: np.ndarray, n: int) -> float:
        request, bulk = self.conn.request, [buf]
        t0 = time.perf_counter()
        for _ in range(n):
            await request(None, bulk, timeout_s=60)
        return time.perf_counter() - t0

    async def ping(self, n: int) -> list[float]:
        # a 64-byte msgpack bin, pre-encoded (bytes are taken as encoded msgpack)
        request, payload, out = self.conn.request, msgspec.msgpack.encode(bytes(LAT_BYTES - 2)), []
        for _ in range(n):
            t = time.perf_counter()
            await request(payload, timeout_s=10)
            out.append(time.perf_counter() - t)
        return out

    async def window(self, buf: np.ndarray, n: int, w: int) -> float:
        request, bulk = self.conn.request, [buf]

        async def worker(count: int) -> None:
            for _ in range(count):
                await request(None, bulk, timeout_s=60)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(n // w + (i < n % w)) for i in range(w)))
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self.conn.close()


class _RawUcx(_Client):
    async def open(self, pipe) -> None:  # type: ignore[no-untyped-def]
        from peers.transport.ucx import UcxRuntime
        self.ucxx = UcxRuntime.get().ucxx
        UcxRuntime.get().ensure_progress()
        self.pipe = pipe
        peer = pipe.recv()
        pipe.send(self.ucxx.get_worker_address().tobytes())
        self.ep = await self.ucxx.create_endpoint_from_worker_address(
            self.ucxx.get_ucx_address_from_buffer(peer), endpoint_error_handling=False)
        self.ack = np.empty(1, np.uint8)

    async def bulk(self, buf: np.ndarray, n: int) -> float:
        self.pipe.send((buf.nbytes, n + 1))
        await self.ep.send(buf, 2, force_tag=True)  # untimed: waits until the server has the block
        await self.ucxx.recv(self.ack, 3)
        t0 = time.perf_counter()
        for _ in range(n):
            await self.ep.send(buf, 2, force_tag=True)
            await self.ucxx.recv(self.ack, 3)
        return time.perf_counter() - t0

    async def ping(self, n: int) -> list[float]:
        small, out = np.ones(LAT_BYTES, np.uint8), []
        self.pipe.send((LAT_BYTES, n + 1))
        await self.ep.send(small, 2, force_tag=True)
        await self.ucxx.recv(self.ack, 3)
        for _ in range(n):
            t = time.perf_counter()
            await self.ep.send(small, 2, force_tag=True)
            await self.ucxx.recv(self.ack, 3)
            out.append(time.perf_counter() - t)
        return out

    async def close(self) -> None:
        self.pipe.send((0, 0))


# ---- one run: every path up at once, alternated in blocks ---------------------------------------------

async def _run(kinds: list[str], sizes: list[int], pipes: dict[str, Any], pids: dict[str, int],
               args: argparse.Namespace) -> dict[str, Any]:
    clients: dict[str, _Client] = {}
    for kind in kinds:
        pipe = pipes[kind]
        if kind == "raw_tcp":
            raw = _RawTcp()
            await raw.open(pipe.recv())
            clients[kind] = raw
        elif kind == "raw_ucx":
            rawu = _RawUcx()
            await rawu.open(pipe)
            clients[kind] = rawu
        else:
            ours = _Ours()
            await ours.open(kind.removeprefix("ours_"), pipe.recv())
            clients[kind] = ours
    blocks = max(1, args.blocks)
    out: dict[str, Any] = {"time": {k: {} for k in kinds}, "block_ratio": {}, "lat": {k: [] for k in kinds},
                           "window": {}, "window_ratio": {}, "idle": {}}

    def order(b: int) -> list[str]:  # rotate who goes first in each block
        return kinds[b % len(kinds):] + kinds[:b % len(kinds)]

    for size in sizes:
        buf = np.ones(size, np.uint8)
        per = max(1, _iterations(size, args.quick) // blocks)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for b in range(blocks):
            for kind in order(b):
                await clients[kind].bulk(buf, 1)  # untimed: the switch between paths
                times[kind].append(await clients[kind].bulk(buf, per))
        for kind in kinds:
            out["time"][kind][size] = (size * per * blocks, sum(times[kind]))
        for kind in kinds:
            base = "raw_tcp" if kind in ("ours_tcp", "raw_tcp") else "raw_ucx"
            out["block_ratio"][(kind, size)] = statistics.median(
                r / o for r, o in zip(times[base], times[kind]))
    count = max(10, (300 if args.quick else 2000) // blocks)
    for b in range(blocks):
        for kind in order(b):
            await clients[kind].ping(5)
            out["lat"][kind] += await clients[kind].ping(count)
    if args.window:
        buf = np.ones(WINDOW_BYTES, np.uint8)
        n = max(args.window, _iterations(WINDOW_BYTES, args.quick) * 2 // blocks)
        wtimes: dict[str, list[float]] = {k: [] for k in kinds if k != "raw_ucx"}
        for b in range(blocks):
            for kind in order(b):
                if kind in wtimes:
                    await clients[kind].window(buf, args.window, args.window)
                    wtimes[kind].append(await clients[kind].window(buf, n, args.window))
        for kind, ts in wtimes.items():
            out["window"][kind] = WINDOW_BYTES * n * blocks / sum(ts) / 1e9
            out["window_ratio"][kind] = statistics.median(r / o for r, o in zip(wtimes["raw_tcp"], ts))
    for kind in kinds:
        if kind.startswith("ours"):  # idle: a connected pair doing nothing
            c0, s0 = time.process_time(), _server_cpu(pids[kind])
            await asyncio.sleep(2.0)
            out["idle"][kind] = (time.process_time() - c0, _server_cpu(pids[kind]) - s0)
    for client in clients.values():
        await client.close()
    return out


def run_once(kinds: list[str], sizes: list[int], args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    procs, pipes, pids = [], {}, {}
    max_size = max(*sizes, LAT_BYTES, WINDOW_BYTES)
    try:
        for kind in kinds:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_server, args=(kind, max_size, child), daemon=True)
            proc.start()
            assert proc.pid is not None  # (set by start)
            procs.append(proc)
            pipes[kind], pids[kind] = parent, proc.pid
        _pin(0)
        loop = _loop()
        try:
            return loop.run_until_complete(_run(kinds, sizes, pipes, pids, args))
        finally:
            loop.close()
    finally:
        for kind, pipe in pipes.items():
            if kind != "raw_ucx":
                try:
                    pipe.send("stop")
                except OSError:
                    pass
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def memcpy_gbps(sizes: list[int], quick: bool) -> dict[int, float]:
    out = {}
    for size in sizes:
        src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        n = _iterations(size, quick)
        np.copyto(dst, src)
        t0 = time.perf_counter()
        for _ in range(n):
            np.copyto(dst, src)
        out[size] = size * n / (time.perf_counter() - t0) / 1e9
    return out


def checksum_gbps(sizes: list[int]) -> dict[int, float]:
    import xxhash
    out = {}
    for size in sizes:
        buf = np.ones(size, np.uint8).data  # (a memoryview of the array)
        n = max(3, min(1000, 2**28 // size))
        t0 = time.perf_counter()
        for _ in range(n):
            xxhash.xxh3_64_intdigest(buf)
        out[size] = size * n / (time.perf_counter() - t0) / 1e9
    return out


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e6


def _summarise(runs: list[dict[str, Any]], kinds: list[str], sizes: list[int]) -> dict[str, Any]:
    """Medians over the runs of each run's figures."""
    med = statistics.median
    res: dict[str, Any] = {}
    for kind in kinds:
        base = "raw_tcp" if kind in ("ours_tcp", "raw_tcp") else "raw_ucx"
        res[kind] = {
            "gbps": {s: med(r["time"][kind][s][0] / r["time"][kind][s][1] / 1e9 for r in runs) for s in sizes},
            "ratio": {s: med(r["block_ratio"][(kind, s)] for r in runs) for s in sizes},
            "base": base,
            "p50": med(_pct(r["lat"][kind], .5) for r in runs),
            "p99": med(_pct(r["lat"][kind], .99) for r in runs),
            "p50_vs_raw_tcp": med(_pct(r["lat"][kind], .5) / _pct(r["lat"]["raw_tcp"], .5) for r in runs),
            "window": med(r["window"][kind] for r in runs) if kind in runs[0]["window"] else None,
            "window_ratio": med(r["window_ratio"][kind] for r in runs) if kind in runs[0]["window"] else None,
            "idle": max((r["idle"][kind] for r in runs if kind in r["idle"]), default=None),
        }
        if kind == "ours_ucx":
            res[kind]["p50_vs_raw_ucx"] = med(_pct(r["lat"][kind], .5) / _pct(r["lat"]["raw_ucx"], .5) for r in runs)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,256M")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    parser.add_argument("--transport", choices=["tcp", "ucx", "all"], default="all",
                        help="ours over tcp, over ucx, or both (the raw TCP baseline always runs)")
    parser.add_argument("--skip-ucx", action="store_true", help="the same as --transport tcp")
    parser.add_argument("--blocks", type=int, default=8, help="alternations per figure (see the docstring)")
    parser.add_argument("--window", type=int, default=16,
                        help="requests in flight for the window figure (0: skip it)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run everything N times (fresh processes); report medians (noisy VM)")
    parser.add_argument("--json", action="store_true", help="one JSON object per figure, no tables")
    args = parser.parse_args()
    for key, value in UCX_ENV_DEFAULTS.items():  # before any ucxx import, here and in children
        os.environ.setdefault(key, value)
    sizes = [_size(s) for s in args.sizes.split(",")]
    transport = "tcp" if args.skip_ucx else args.transport
    kinds = ["raw_tcp"]
    kinds += ["ours_tcp"] if transport in ("tcp", "all") else []
    kinds += ["raw_ucx", "ours_ucx"] if transport in ("ucx", "all") else []
    load = [os.getloadavg()[0]]
    runs, mems, xxhs = [], [], []
    for _ in range(args.repeat):
        runs.append(run_once(kinds, sizes, args))
        mems.append(memcpy_gbps(sizes, args.quick))
        xxhs.append(checksum_gbps(sizes))
    load.append(os.getloadavg()[0])
    res = _summarise(runs, kinds, sizes)
    mem = {s: statistics.median(m[s] for m in mems) for s in sizes}
    xxh = {s: statistics.median(x[s] for x in xxhs) for s in sizes}
    ours = [k for k in kinds if k.startswith("ours")]
    if args.json:
        _emit_json(res, mem, sizes, kinds, load, args.repeat)
        return
    print("\nOne-way bulk GB/s (1e9 B/s; each transfer acknowledged), two processes on loopback;"
          " ratios: median of per-block ratios")
    cols = ["size", "memcpy", "xxh3", *kinds]
    cols += ["ours_tcp/raw_tcp"] if "ours_tcp" in ours else []
    cols += ["ours_ucx/raw_ucx", "ours_ucx/memcpy"] if "ours_ucx" in ours else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for s in sizes:
        row = [_label(s), f"{mem[s]:.2f}", f"{xxh[s]:.2f}"] + [f"{res[k]['gbps'][s]:.2f}" for k in kinds]
        if "ours_tcp" in ours:
            row.append(f"{res['ours_tcp']['ratio'][s]:.2f}×")
        if "ours_ucx" in ours:
            row.append(f"{res['ours_ucx']['ratio'][s]:.2f}×")
            row.append(f"{res['ours_ucx']['gbps'][s] / mem[s]:.2f}×")
        print("| " + " | ".join(row) + " |")
    print(f"\nRequest/response latency (µs), {LAT_BYTES}-byte payload (median over runs)")
    print("| path | p50 | p99 | p50 vs raw TCP ping-pong |\n|---|---|---|---|")
    for k in kinds:
        print(f"| {k} | {res[k]['p50']:.0f} | {res[k]['p99']:.0f} | {res[k]['p50_vs_raw_tcp']:.2f}× |")
    if "ours_ucx" in ours:
        print(f"\nours_ucx p50 vs raw ucxx ping-pong: {res['ours_ucx']['p50_vs_raw_ucx']:.2f}×")
    if args.window:
        print(f"\n{WINDOW_BYTES // 1024} KiB requests, {args.window} in flight (GB/s)")
        print("| path | GB/s | vs raw TCP |\n|---|---|---|")
        for k in kinds:
            if res[k]["window"] is not None:
                print(f"| {k} | {res[k]['window']:.3f} | {res[k]['window_ratio']:.2f}× |")
    print("\nIdle CPU of a connected pair over 2 s (CPU seconds: client, server)")
    for k in ours:
        if res[k]["idle"] is not None:
            c, s = res[k]["idle"]
            print(f"| {k} | {c:.3f} | {s:.3f} |")
    print(f"\n{args.repeat} run(s), {args.blocks} alternated blocks per figure; cpus={os.cpu_count()}; "
          f"load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after")


def _emit_json(res: dict[str, Any], mem: dict[int, float], sizes: list[int], kinds: list[str],
               load: list[float], repeat: int) -> None:
    emit_figure("load_avg_1m_before", load[0])
    emit_figure("load_avg_1m_after", load[1])
    emit_figure("repeat", repeat)
    for kind in kinds:
        r = res[kind]
        emit_figure(f"{kind}.request_p50_us", r["p50"])
        emit_figure(f"{kind}.request_p99_us", r["p99"])
        for s in sizes:
            emit_figure(f"{kind}.bulk_{_label(s)}_gbps", r["gbps"][s])
        if r["window"] is not None:
            emit_figure(f"{kind}.window_{_label(WINDOW_BYTES)}_gbps", r["window"])
    for kind in kinds:
        if not kind.startswith("ours"):
            continue
        scheme, r = kind.removeprefix("ours_"), res[kind]
        name = f"{scheme}.request_p50_vs_raw"
        emit_figure(name if scheme == "tcp" else f"{name}_tcp", r["p50_vs_raw_tcp"], TARGETS.get(name))
        if scheme == "ucx":
            emit_figure("ucx.request_p50_vs_raw_ucx", r["p50_vs_raw_ucx"])
        for s in sizes:
            name = f"{scheme}.bulk_{_label(s)}_vs_raw"
            emit_figure(name, r["ratio"][s], TARGETS.get(name))
            emit_figure(f"{scheme}.bulk_{_label(s)}_vs_memcpy", r["gbps"][s] / mem[s])
        if r["window_ratio"] is not None:
            emit_figure(f"{scheme}.window_{_label(WINDOW_BYTES)}_vs_raw_tcp", r["window_ratio"])
    if "raw_ucx" in res:
        emit_figure("raw_ucx.request_p50_vs_raw_tcp", res["raw_ucx"]["p50_vs_raw_tcp"])
        for s in sizes:
            emit_figure(f"raw_ucx.bulk_{_label(s)}_vs_raw_tcp", res["raw_ucx"]["gbps"][s] / res["raw_tcp"]["gbps"][s])


if __name__ == "__main__":
    main()
