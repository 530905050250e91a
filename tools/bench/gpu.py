"""GPU compute figures (issue 20 item 5), each device figure next to the CPU path measured in the same run.

    python -m tools.bench.gpu [--sentences N] [--sizes 10000,100000,1000000] [--json]

Figures:

* **training sentences/s**: ``train_batch`` over batches of bundled sentences (encoded once, outside
  the timing): the CPU path (numpy, what ``compute.device = cpu`` runs) vs the device path (torch
  on CUDA, ``compute.device = cuda``).
* **LIF steps/s** on a row of N entries fired at every step (tools/bench/lif.py's synthetic rows):
  the numpy ``LifSession`` vs ``TorchLifSession`` on the device, and the device step's effective
  bandwidth (bytes of state and row it touches per step / step time) against the issue's target of
  0.5x device memory bandwidth, for N >= 10^6 (the bandwidth is measured in the same run by a 1 GiB
  device-to-device copy, bytes read plus written, unless ``--peak-gbs`` gives it).
* **host-to-device row transfer GB/s**: ``PinnedStager.stage`` (one pooled pinned buffer, one
  copy) vs a plain ``tensor.to(device)`` of the same bytes from pageable memory (the issue's
  ``cudaMemcpy`` baseline: torch's ``to`` is a ``cudaMemcpyAsync`` and a sync); target >= 0.7x.

Without a CUDA device it says so, measures the CPU path, and lists every device figure as
**skipped**; ``--json`` then prints those with ``"value": null`` (never a number that was not
measured on a device). ``--torch-cpu`` adds the torch path run on the CPU, labelled "torch on CPU":
a check of its overhead, never a GPU figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from giaannd.model.columns import ColumnAssigner
from giaannd.model.gpu.device import cuda_usable
from giaannd.model.infer import TEST_SET, LifSession, NoDelimiters
from giaannd.model.rows import Row, RowBatch
from giaannd.model.sentence import EncodedSentence
from giaannd.model.tokens import load_bundled_corpus
from giaannd.model.train import train_batch
from tools.bench.lif import synthetic_row
from tools.bench.report import emit_figures, print_table

#: Issue 20's targets.
TARGET_LIF_BANDWIDTH_FRACTION = 0.5
TARGET_TRANSFER_RATIO = 0.7
#: Rows at least this long are held to the bandwidth target (the issue: "rows of >= 10^6 entries").
BANDWIDTH_TARGET_MIN_ENTRIES = 10**6
#: The source node every step fires (its row is the synthetic row).
_SOURCE = (1, 1)


def _encoded(n: int) -> list[EncodedSentence]:
    assigner = ColumnAssigner()
    return [e for t in load_bundled_corpus(n) if (e := assigner.encode(t, update_flags=True)) is not None]


def training_rate(sentences: Sequence[EncodedSentence], batch: int, run: Callable[[list[EncodedSentence]], object],
                  sync: Callable[[], None], repeat: int) -> float:
    """Sentences per second of ``run`` over ``sentences`` in batches of ``batch``, best of ``repeat``."""
    batches = [list(sentences[i:i + batch]) for i in range(0, len(sentences), batch)]
    run(batches[0])  # warm-up (torch: kernels, allocator)
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for b in batches:
            run(b)
        sync()
        best = min(best, time.perf_counter() - t)
    return len(sentences) / best


def lif_rate(make: Callable[[list[tuple[int, int]]], LifSession], row: Row, steps: int, repeat: int) -> float:
    """Steps per second of a session firing ``row`` at every step (after a warm-up session)."""
    best = float("inf")
    for i in range(repeat + 1):
        session = make([_SOURCE] * (steps + 1))
        t = time.perf_counter()
        while session.needs_row() is not None:
            session.step(row)
        elapsed = time.perf_counter() - t
        if i:  # the first run warms caches, the slot table's growth path and (torch) the kernels
            best = min(best, elapsed)
    return steps / best


def lif_step_bytes(entries: int) -> int:
    """Bytes one firing step moves at least: the row's slot indices and deposits (8 + 8 B per entry),
    and a read and a write of the touched float64 state (16 B per entry)."""
    return 32 * entries


def transfer_rates(batch: RowBatch, device: str, repeat: int) -> tuple[float, float]:
    """(staged GB/s, plain ``.to`` GB/s) moving ``batch``'s bytes to ``device``, best of ``repeat``."""
    import torch

    from giaannd.model.gpu.rows import PinnedStager

    stager = PinnedStager(device)
    nbytes = sum(a.nbytes for a in batch.buffers())
    flat = torch.from_numpy(np.concatenate([a.reshape(-1).view(np.uint8) for a in batch.buffers()]))
    stager.stage(batch)
    flat.to(device)
    torch.cuda.synchronize()
    staged = plain = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        stager.stage(batch)
        torch.cuda.synchronize()
        staged = min(staged, time.perf_counter() - t)
        t = time.perf_counter()
        flat.to(device)
        torch.cuda.synchronize()
        plain = min(plain, time.perf_counter() - t)
    return nbytes / staged / 1e9, nbytes / plain / 1e9


def device_copy_gbs(repeat: int, nbytes: int = 1 << 30) -> float:
    """The device's memory bandwidth as measured here: a device-to-device copy of ``nbytes``,
    counting bytes read plus bytes written, timed with CUDA events, best of ``repeat`` (the ceiling
    the LIF bandwidth fraction is measured against when ``--peak-gbs`` is not given)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(max(repeat, 3)):
        # (torch.cuda.Event.__new__ is unannotated upstream)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e9


def _torch_session(device: str) -> Callable[[list[tuple[int, int]]], LifSession]:
    from giaannd.model.gpu.lif import TorchLifSession

    return lambda targets: TorchLifSession(targets, NoDelimiters(), TEST_SET, device=device)


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Every figure this host can measure; device figures absent when there is no device."""
    has_cuda, why = cuda_usable()
    out: dict[str, Any] = {}
    sentences = _encoded(args.sentences)
    repeat = max(args.repeat, 1)
    cpu_sync: Callable[[], None] = lambda: None  # noqa: E731
    out["train cpu"] = training_rate(sentences, args.batch, lambda b: train_batch(b, backend="numpy"), cpu_sync,
                                     repeat)
    paths: list[tuple[str, str, Callable[[], None]]] = []
    if args.torch_cpu:
        paths.append(("torch on CPU", "cpu:0", cpu_sync))
    if has_cuda:
        import torch

        paths.append(("cuda", "cuda", torch.cuda.synchronize))
    for label, device, sync in paths:
        out[f"train {label}"] = training_rate(
            sentences, args.batch,
            functools.partial(train_batch, backend="torch", device="cuda" if device == "cuda" else "cpu"), sync, repeat)
    for n in args.sizes:
        row = synthetic_row(n, args.seed)
        steps = max(2, args.steps if n < 10**6 else args.steps // 4)
        out[f"lif cpu @{n}"] = lif_rate(lambda t: LifSession(t, NoDelimiters(), TEST_SET), row, steps, repeat)
        for label, device, _ in paths:
            out[f"lif {label} @{n}"] = lif_rate(_torch_session(device), row, steps, repeat)
    if has_cuda:
        batch = RowBatch.from_rows({(1, 1): synthetic_row(max(args.sizes), args.seed)})
        out["transfer staged"], out["transfer plain"] = transfer_rates(batch, "cuda", repeat)
        import torch

        out["device"] = torch.cuda.get_device_name()
        out["peak"] = args.peak_gbs or device_copy_gbs(repeat)
    return out, "" if has_cuda else why


def _fmt(v: float | None, cuda: bool) -> str:
    if v is None:
        return "not measured" if cuda else "skipped (no CUDA device)"
    return f"{v:,.2f}" if v < 10 else f"{v:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=2000, help="bundled sentences trained (default 2000)")
    ap.add_argument("--batch", type=int, default=256, help="sentences per train_batch (default 256)")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[10_000, 100_000, 1_000_000],
                    help="LIF row lengths (default 10000,100000,1000000)")
    ap.add_argument("--steps", type=int, default=40, help="LIF steps per timing (a quarter at >= 10^6)")
    ap.add_argument("--repeat", type=int, default=3, help="timings per figure, best kept (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-gbs", type=float, default=0.0,
                    help="the device's memory bandwidth in GB/s for the LIF target (default: measured here "
                         "by a device-to-device copy)")
    ap.add_argument("--torch-cpu", action="store_true", help="also run the torch path on the CPU (labelled)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    out, no_device = measure(args)
    cuda = not no_device
    lif_target = f">= {TARGET_LIF_BANDWIDTH_FRACTION} x peak"
    transfer_target = f">= {TARGET_TRANSFER_RATIO} x plain .to()"
    figures: list[tuple[str, float | None, str | None]] = [("training sentences/s cpu (numpy)", out["train cpu"], None)]
    if args.torch_cpu:
        figures.append(("training sentences/s torch on CPU", out["train torch on CPU"], None))
    figures.append(("training sentences/s cuda", out.get("train cuda"), None))
    figures.append(("training cuda/cpu", out["train cuda"] / out["train cpu"] if cuda else None, None))
    for n in args.sizes:
        figures.append((f"LIF steps/s cpu @{n}", out[f"lif cpu @{n}"], None))
        if args.torch_cpu:
            figures.append((f"LIF steps/s torch on CPU @{n}", out[f"lif torch on CPU @{n}"], None))
        dev = out.get(f"lif cuda @{n}")
        figures.append((f"LIF steps/s cuda @{n}", dev, None))
        figures.append((f"LIF cuda/cpu @{n}", dev / out[f"lif cpu @{n}"] if dev else None, None))
        if n >= BANDWIDTH_TARGET_MIN_ENTRIES:
            frac = dev * lif_step_bytes(n) / 1e9 / out["peak"] if dev and out.get("peak") else None
            figures.append((f"LIF cuda bandwidth fraction @{n}", frac, lif_target))
    figures.append(("device copy GB/s (read + write; the bandwidth ceiling)", out.get("peak"), None))
    staged, plain = out.get("transfer staged"), out.get("transfer plain")
    figures.append(("H2D rows GB/s staged (pinned)", staged, None))
    figures.append(("H2D rows GB/s plain .to()", plain, None))
    figures.append(("H2D staged/plain", staged / plain if staged and plain else None, transfer_target))
    if args.json:
        print(json.dumps({"figure": "device", "value": out.get("device", f"none: {no_device}"), "target": None}))
        emit_figures(figures)
        return 0
    load = f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    if no_device:
        print(f"\nno CUDA device found ({no_device}): device figures are skipped, not measured. {load}")
    else:
        print(f"\ndevice: {out['device']}; {load}")
    print_table("GPU compute (ratios against the CPU path of the same run)", ["figure", "value", "target"],
                [[name, _fmt(value, cuda), target or ""] for name, value, target in figures])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
