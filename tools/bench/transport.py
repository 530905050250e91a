"""Data-plane benchmark: our tcp/ucx transports against same-run baselines (prints a table).

Two processes on loopback (client pinned to cpu0, server to cpu1 when there are 2+ cpus).
Baselines measured in the same run: numpy memcpy of the same buffer into a touched destination; a
raw asyncio ``BufferedProtocol`` sender/receiver (8-byte length + payload into a preallocated
buffer, 1-byte ack); raw ucxx worker-address endpoints (error handling off, tag send/recv into a
preallocated buffer, 1-byte ack). Ours: one ``request`` with the buffer as bulk, answered by an
empty response (so each transfer is acknowledged, like the baselines). Latency: request/response
with a small payload vs a raw TCP 64-byte ping-pong (and, for ucx, a raw ucxx 64-byte tag
ping-pong). Window: 4 KiB requests with ``--window`` of them in flight vs the raw socket with as
many unacknowledged messages. Idle: CPU seconds used by a connected pair in 2 s of doing nothing.

Usage: python tools/bench/transport.py [--sizes 4K,64K,1M,16M,256M] [--transport tcp|ucx|all]
       [--repeat N] [--window 16] [--quick] [--json]

``--json`` prints one ``{"figure", "value", "target"}`` object per figure instead of tables (the
ratios the issue sets targets for carry them; ``target`` is null elsewhere). The 1-minute load
average is printed with the figures: the machine is shared, read ratios of the same run.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peers.transport.ucx import UCX_ENV_DEFAULTS  # noqa: E402  (sets no env by itself)
from tools.bench.report import emit_figure  # noqa: E402

#: Targets of issue 19 (ratios to the raw socket measured in the same run).
TARGETS = {"tcp.request_p50_vs_raw": "<= 1.5", "tcp.bulk_4KiB_vs_raw": ">= 0.6",
           "tcp.bulk_64KiB_vs_raw": ">= 0.75"}
LAT_BYTES = 64
WINDOW_BYTES = 4096

KEY = [b"bench-key-0123456789abcdef012345"]
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


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


# ---- server process ---------------------------------------------------------------------------------

class _RawReceiver(asyncio.BufferedProtocol):
    def __init__(self, max_size: int) -> None:
        self.buf = np.zeros(max_size + 8, np.uint8)  # touched
        self.view = memoryview(self.buf)
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
            (length,) = struct.unpack_from("<Q", self.buf, 0)
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
        peer = pipe.recv()
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(peer),
                                                            endpoint_error_handling=False)
        dest = np.zeros(max_size, np.uint8)
        ack = np.ones(1, np.uint8)
        while True:
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


# ---- client side ----------------------------------------------------------------------------------

def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(kind: str, sizes: list[int], pipe, pid: int, quick: bool,  # type: ignore[no-untyped-def]
                  window: int) -> dict:
    out: dict = {"gbps": {}, "lat": None, "idle": None, "window": None}
    bufs = {s: np.ones(s, np.uint8) for s in sizes}
    if kind == "raw_tcp":
        port = pipe.recv()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for size in sizes:
            n = _iterations(size, quick)
            header = struct.pack("<Q", size)
            for i in range(n + 1):
                if i == 1:
                    t0 = time.perf_counter()
                writer.write(header)
                writer.write(bufs[size].data)
                await reader.readexactly(1)
            out["gbps"][size] = size * n / (time.perf_counter() - t0) / 1e9
        lat = []
        msg = struct.pack("<Q", LAT_BYTES - 8) + bytes(LAT_BYTES - 8)
        for _ in range(2000 if not quick else 300):
            t = time.perf_counter()
            writer.write(msg)
            await reader.readexactly(1)
            lat.append(time.perf_counter() - t)
        out["lat"] = lat[50:]
        if window:  # as many messages unacknowledged as ours has requests in flight
            n = max(window, _iterations(WINDOW_BYTES, quick) * 2 // window * window)
            header, wbuf = struct.pack("<Q", WINDOW_BYTES), np.ones(WINDOW_BYTES, np.uint8).data
            for _round in range(2):  # warm-up, then timed
                t0 = time.perf_counter()
                for _ in range(window):
                    writer.write(header)
                    writer.write(wbuf)
                for i in range(n):
                    await reader.readexactly(1)
                    if i + window < n:
                        writer.write(header)
                        writer.write(wbuf)
            out["window"] = WINDOW_BYTES * n / (time.perf_counter() - t0) / 1e9
        writer.close()
    elif kind == "raw_ucx":
        from peers.transport.ucx import UcxRuntime
        ucxx = UcxRuntime.get().ucxx
        UcxRuntime.get().ensure_progress()
        peer = pipe.recv()
        pipe.send(ucxx.get_worker_address().tobytes())
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(peer),
                                                            endpoint_error_handling=False)
        ack = np.empty(1, np.uint8)
        for size in sizes:
            n = _iterations(size, quick)
            pipe.send((size, n + 1))
            for i in range(n + 1):
                if i == 1:
                    t0 = time.perf_counter()
                await ep.send(bufs[size], 2, force_tag=True)
                await ucxx.recv(ack, 3)
            out["gbps"][size] = size * n / (time.perf_counter() - t0) / 1e9
        count = 2000 if not quick else 300
        pipe.send((LAT_BYTES, count))
        small, lat = np.ones(LAT_BYTES, np.uint8), []
        for _ in range(count):
            t = time.perf_counter()
            await ep.send(small, 2, force_tag=True)
            await ucxx.recv(ack, 3)
            lat.append(time.perf_counter() - t)
        out["lat"] = lat[50:]
        pipe.send((0, 0))
        return out
    else:
        from peers.transport import Identity, connect, make_transport
        scheme = kind.removeprefix("ours_")
        transport = make_transport(scheme, Identity("client", "bench", KEY))
        conn = await connect(transport, pipe.recv(), timeout_s=30)
        for size in sizes:
            n = _iterations(size, quick)
            for i in range(n + 1):
                if i == 1:
                    t0 = time.perf_counter()
                await conn.request(None, [bufs[size]], timeout_s=60)
            out["gbps"][size] = size * n / (time.perf_counter() - t0) / 1e9
        lat = []
        for i in range(2000 if not quick else 300):
            t = time.perf_counter()
            await conn.request(i, timeout_s=10)
            lat.append(time.perf_counter() - t)
        out["lat"] = lat[50:]
        if window:
            wbuf = np.ones(WINDOW_BYTES, np.uint8)
            per_worker = max(1, _iterations(WINDOW_BYTES, quick) * 2 // window)

            async def worker() -> None:
                for _ in range(per_worker):
                    await conn.request(None, [wbuf], timeout_s=60)

            await asyncio.gather(*(worker() for _ in range(window)))  # warm-up
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(window)))
            out["window"] = WINDOW_BYTES * per_worker * window / (time.perf_counter() - t0) / 1e9
        # idle: a connected pair doing nothing
        c0, s0 = time.process_time(), _server_cpu(pid)
        await asyncio.sleep(2.0)
        out["idle"] = (time.process_time() - c0, _server_cpu(pid) - s0)
        await conn.close()
    pipe.send("stop")
    return out


def run_kind(kind: str, sizes: list[int], quick: bool, window: int = 0) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(kind, max(*sizes, LAT_BYTES, WINDOW_BYTES), child), daemon=True)
    proc.start()
    _pin(0)
    loop = _loop()
    try:
        return loop.run_until_complete(_client(kind, sizes, parent, proc.pid, quick, window))
    finally:
        loop.close()
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
        buf = np.ones(size, np.uint8)
        n = max(3, min(1000, 2**28 // size))
        t0 = time.perf_counter()
        for _ in range(n):
            xxhash.xxh3_64_intdigest(buf)
        out[size] = size * n / (time.perf_counter() - t0) / 1e9
    return out


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,256M")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    parser.add_argument("--transport", choices=["tcp", "ucx", "all"], default="all",
                        help="ours over tcp, over ucx, or both (the raw TCP baseline always runs)")
    parser.add_argument("--skip-ucx", action="store_true", help="the same as --transport tcp")
    parser.add_argument("--window", type=int, default=16,
                        help="requests in flight for the window figure (0: skip it)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every configuration N times, interleaved; report medians (noisy VM)")
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
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    mems, xxhs = [], []
    for _ in range(args.repeat):  # interleaved, so a noisy minute hits every configuration
        for k in kinds:
            runs[k].append(run_kind(k, sizes, args.quick, 0 if k == "raw_ucx" else args.window))
        mems.append(memcpy_gbps(sizes, args.quick))
        xxhs.append(checksum_gbps(sizes))
    load.append(os.getloadavg()[0])
    med = statistics.median
    res = {k: {"gbps": {s: med(r["gbps"][s] for r in rs) for s in sizes},
               "lat": [x for r in rs if r["lat"] for x in r["lat"]],
               "p50": med(_pct(r["lat"], .5) for r in rs),  # median of the runs' own p50s
               "window": med(r["window"] for r in rs) if all(r["window"] for r in rs) else None,
               "idle": max((r["idle"] for r in rs if r["idle"]), default=None)} for k, rs in runs.items()}
    mem = {s: med(m[s] for m in mems) for s in sizes}
    xxh = {s: med(x[s] for x in xxhs) for s in sizes}
    ours = [k for k in kinds if k.startswith("ours")]
    if args.json:
        _emit_json(res, mem, sizes, ours, load, args.repeat)
        return
    print("\nOne-way bulk GB/s (1e9 B/s; each transfer acknowledged), two processes on loopback")
    cols = ["size", "memcpy", "xxh3", *kinds]
    cols += [f"{k}/raw_tcp" for k in ours if k == "ours_tcp"]
    cols += ["ours_ucx/raw_ucx", "ours_ucx/memcpy"] if "ours_ucx" in ours else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for s in sizes:
        row = [_label(s), f"{mem[s]:.2f}", f"{xxh[s]:.2f}"] + [f"{res[k]['gbps'][s]:.2f}" for k in kinds]
        if "ours_tcp" in ours:
            row.append(f"{res['ours_tcp']['gbps'][s] / res['raw_tcp']['gbps'][s]:.2f}×")
        if "ours_ucx" in ours:
            row.append(f"{res['ours_ucx']['gbps'][s] / res['raw_ucx']['gbps'][s]:.2f}×")
            row.append(f"{res['ours_ucx']['gbps'][s] / mem[s]:.2f}×")
        print("| " + " | ".join(row) + " |")
    raw = res["raw_tcp"]["p50"]
    print(f"\nRequest/response latency (µs), {LAT_BYTES}-byte payload; p50 = median of the runs' p50s")
    print("| path | p50 | p99 (all runs) | p50 ratio vs raw TCP ping-pong |\n|---|---|---|---|")
    for k in ["raw_tcp", *[k for k in kinds if k != "raw_tcp"]]:
        if res[k]["lat"]:
            print(f"| {k} | {res[k]['p50']:.0f} | {_pct(res[k]['lat'], .99):.0f} | {res[k]['p50'] / raw:.2f}× |")
    if args.window and res["raw_tcp"]["window"]:
        print(f"\n{WINDOW_BYTES // 1024} KiB requests, {args.window} in flight (GB/s)")
        print("| path | GB/s | vs raw TCP |\n|---|---|---|")
        for k in ["raw_tcp", *ours]:
            w = res[k]["window"]
            print(f"| {k} | {w:.3f} | {w / res['raw_tcp']['window']:.2f}× |")
    print("\nIdle CPU of a connected pair over 2 s (CPU seconds: client, server)")
    for k in kinds:
        if res[k]["idle"] is not None:
            c, s = res[k]["idle"]
            print(f"| {k} | {c:.3f} | {s:.3f} |")
    print(f"\neach cell: median over {args.repeat} run(s) of N acknowledged transfers after one warm-up; "
          f"cpus={os.cpu_count()}; load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after")


def _emit_json(res: dict, mem: dict[int, float], sizes: list[int], ours: list[str],  # type: ignore[type-arg]
               load: list[float], repeat: int) -> None:
    emit_figure("load_avg_1m_before", load[0])
    emit_figure("load_avg_1m_after", load[1])
    emit_figure("repeat", repeat)
    for k, r in res.items():
        emit_figure(f"{k}.request_p50_us", r["p50"])
        for s in sizes:
            emit_figure(f"{k}.bulk_{_label(s)}_gbps", r["gbps"][s])
        if r["window"]:
            emit_figure(f"{k}.window_{_label(WINDOW_BYTES)}_gbps", r["window"])
    raw = res["raw_tcp"]
    for k in ours:
        scheme = k.removeprefix("ours_")
        name = f"{scheme}.request_p50_vs_raw"
        emit_figure(name, res[k]["p50"] / raw["p50"], TARGETS.get(name))
        base = raw if scheme == "tcp" else res["raw_ucx"]
        for s in sizes:
            name = f"{scheme}.bulk_{_label(s)}_vs_raw"
            emit_figure(name, res[k]["gbps"][s] / base["gbps"][s], TARGETS.get(name))
            emit_figure(f"{scheme}.bulk_{_label(s)}_vs_memcpy", res[k]["gbps"][s] / mem[s])
        if res[k]["window"] and raw["window"]:
            emit_figure(f"{scheme}.window_{_label(WINDOW_BYTES)}_vs_raw_tcp", res[k]["window"] / raw["window"])
    if "raw_ucx" in res:
        emit_figure("raw_ucx.request_p50_vs_raw_tcp", res["raw_ucx"]["p50"] / raw["p50"])


if __name__ == "__main__":
    main()
