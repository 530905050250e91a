"""An apply's delta-run lookups (issue 14 item 1): the row engine with its key filter against the
same engine searching every delta run for every key the base lacks (the same-run baseline).

    python -m tools.bench.delta_lookups [--checkpoints 10000,50000,150000] [--batch 256] [--json]

Two ``RowEngine``s get the same training batches of the Zipf stream (tools/bench/zipf_stream.py:
the core's deltas, one ``train_batch`` per ``--batch`` sentences, what a storage node owning every
column applies), batch by batch, the engine that goes first alternating. One holds the filter
(rowengine/deltafilter.py, what the code does); the baseline's filter rules nothing out, so every
such key is searched in every delta run, each run's position index made for it, as before the
filter. Per interval between checkpoints: CPU ns per entry of ``plan`` and of ``plan`` + ``commit``
(thread CPU time), the share of the keys that reach a delta-run search, and the filter's bytes per
stored entry at the checkpoint. At the end both engines' rows are compared (a sample of 2,000 rows,
every field bit for bit). ``--json`` prints one ``{"figure", "value", "target"}`` object per figure.

The issue's target is throughput, not this figure (sentences/s at the last checkpoint ≥ 0.7× the
first: tools/bench/scale.py); an apply's growth from the first interval to the last is printed
next to that target for reference.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.rowengine import Entries, RowEngine
from giaannd.rowengine.deltafilter import DeltaFilter
from tools.bench.report import emit_figures, print_table
from tools.bench.zipf_stream import ZipfStream, training_deltas

__all__ = ["CountedFilter", "main", "run"]

CHECKPOINTS = (10_000, 50_000, 150_000)
TARGET_THROUGHPUT_RATIO = 0.7


class CountedFilter(DeltaFilter):
    """The engine's filter, counting the keys it lets through to a delta-run search; with
    ``rules_out`` False it answers "maybe" for every key, so the engine searches every delta run
    as before the filter (the baseline)."""

    __slots__ = ("passed", "rules_out")

    def __init__(self, rules_out: bool = True) -> None:
        super().__init__()
        self.rules_out = rules_out
        self.passed = 0

    def maybe(self, row: Any, seg: Any, tc: Any, tf: Any, at: Any) -> Any:
        out = super().maybe(row, seg, tc, tf, at) if self.rules_out else np.ones(at.shape[0], np.bool_)
        self.passed += int(out.sum())
        return out


def _engine(rules_out: bool) -> tuple[RowEngine, CountedFilter]:
    engine = RowEngine()
    counted = CountedFilter(rules_out)
    engine._delta_keys = counted  # noqa: SLF001 - the one seam the bench needs
    return engine, counted


@dataclass
class _Clock:
    """CPU seconds of one engine's plans and applies (plan + commit) over an interval, and the keys
    that reached a delta-run search."""

    plan: float = 0.0
    apply: float = 0.0
    entries: int = 0
    searched: int = 0
    marks: list[dict[str, float]] = field(default_factory=list)

    def mark(self, **extra: float) -> None:
        n = max(self.entries, 1)
        self.marks.append({"plan_ns": self.plan * 1e9 / n, "apply_ns": self.apply * 1e9 / n,
                           "searched": self.searched / n, **extra})
        self.plan = self.apply = 0.0
        self.entries = self.searched = 0


def _apply(engine: RowEngine, counted: CountedFilter, batch: RowBatch, clock: _Clock) -> None:
    entries = Entries(batch.segment, batch.target_column, batch.target_feature, batch.strength)
    passed = counted.passed
    t0 = time.thread_time()
    plan = engine.plan(batch.row_column, batch.row_feature, batch.offsets, entries)
    t1 = time.thread_time()
    engine.commit(plan)
    t2 = time.thread_time()
    clock.plan += t1 - t0
    clock.apply += t2 - t0
    clock.entries += int(batch.strength.shape[0])
    clock.searched += counted.passed - passed


def _same_rows(a: RowEngine, b: RowEngine, sample: int = 2_000) -> bool:
    if a.num_rows != b.num_rows or a.num_entries != b.num_entries:
        return False
    ka, kb = a.keys()
    ids = np.random.default_rng(0).choice(a.num_rows, min(sample, a.num_rows), replace=False).astype(np.int64)
    other = b.row_ids(ka[ids], kb[ids])
    oa, ea = a.read_many(ids)
    ob, eb = b.read_many(other)
    fields = ("seg", "tc", "tf", "st")
    return bool(np.array_equal(oa, ob)
                and all(np.array_equal(getattr(ea, f).view(np.uint8), getattr(eb, f).view(np.uint8)) for f in fields))


def _warm_up() -> None:
    """Load the compiled kernels both engines call (numba's disk cache) before anything is timed:
    three batches of one row into scratch engines, the later ones adding to its delta runs."""
    for rules_out in (True, False):
        engine, _ = _engine(rules_out)
        for k in range(3):
            n = 64
            engine.apply(np.array([1], np.uint64), np.array([1], np.uint64), np.array([0, n], np.int64),
                         Entries(np.zeros(n, np.uint8), np.arange(k, k + 2 * n, 2, dtype=np.uint64),
                                 np.zeros(n, np.uint64), np.ones(n, np.float32)))


def run(checkpoints: list[int], batch: int = 256, seed: int = 0) -> dict[str, Any]:
    """Both engines through the stream to the last checkpoint (one training stream: one column
    assigner throughout); their figures per interval."""
    _warm_up()
    engines = {"now": _engine(True), "before": _engine(False)}
    clocks = {"now": _Clock(), "before": _Clock()}
    load0 = os.getloadavg()[0]
    marked = 0
    for k, rows in enumerate(training_deltas(iter(ZipfStream(seed)), checkpoints[-1], batch)):
        for name in (("now", "before") if k % 2 == 0 else ("before", "now")):
            _apply(*engines[name], rows, clocks[name])
        while marked < len(checkpoints) and min((k + 1) * batch, checkpoints[-1]) >= checkpoints[marked]:
            for name, (engine, counted) in engines.items():
                clocks[name].mark(entries=engine.num_entries, filter_b=counted.nbytes / max(engine.num_entries, 1))
            marked += 1
    return {"checkpoints": checkpoints, "now": clocks["now"].marks, "before": clocks["before"].marks,
            "same": _same_rows(engines["now"][0], engines["before"][0]),
            "load": f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after"}


def _figures(res: dict[str, Any]) -> list[tuple[str, float | None, str | None]]:
    out: list[tuple[str, float | None, str | None]] = []
    for c, now, before in zip(res["checkpoints"], res["now"], res["before"]):
        out += [(f"plan ns/entry to {c:,}, before / now", before["plan_ns"] / now["plan_ns"], None),
                (f"apply ns/entry to {c:,}, before / now", before["apply_ns"] / now["apply_ns"], None),
                (f"plan ns/entry to {c:,}, now", now["plan_ns"], None),
                (f"apply ns/entry to {c:,}, now", now["apply_ns"], None),
                (f"keys searched in delta runs to {c:,}, now", now["searched"], None),
                (f"filter bytes per stored entry at {c:,}", now["filter_b"], None)]
    first, last = res["now"][0], res["now"][-1]
    out.append((f"apply throughput at {res['checkpoints'][-1]:,} / first interval, now",
                first["apply_ns"] / last["apply_ns"], f">= {TARGET_THROUGHPUT_RATIO} (for reference: the issue's "
                "target is tools.bench.scale's sentences/s)"))
    out.append(("rows equal (2,000 sampled, every field)", 1.0 if res["same"] else 0.0, "== 1"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", default=",".join(str(c) for c in CHECKPOINTS),
                    help="input sentences at which the intervals end (default 10000,50000,150000)")
    ap.add_argument("--batch", type=int, default=256, help="sentences per training batch (default 256)")
    ap.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    try:
        checkpoints = [int(x) for x in args.checkpoints.split(",")]
    except ValueError:
        ap.error(f"--checkpoints: comma-separated integers, not {args.checkpoints!r}")
    if not checkpoints or any(c <= 0 for c in checkpoints) or checkpoints != sorted(set(checkpoints)):
        ap.error("--checkpoints: positive, ascending, distinct")
    if args.batch <= 0:
        ap.error("--batch must be positive")
    res = run(checkpoints, args.batch, args.seed)
    if args.json:
        emit_figures([("machine load", None, res["load"]), *_figures(res)])
        return 0 if res["same"] else 1
    print(f"machine: {res['load']} on {os.cpu_count()} CPUs")
    rows = []
    for c, now, before in zip(res["checkpoints"], res["now"], res["before"]):
        rows.append([f"{c:,}", f"{now['entries']:,.0f}", f"{before['plan_ns']:.0f}", f"{now['plan_ns']:.0f}",
                     f"{before['plan_ns'] / now['plan_ns']:.2f}", f"{before['apply_ns']:.0f}",
                     f"{now['apply_ns']:.0f}", f"{before['apply_ns'] / now['apply_ns']:.2f}",
                     f"{before['searched']:.3f} / {now['searched']:.3f}", f"{now['filter_b']:.2f}"])
    print_table("Delta-run lookups of an apply: every run searched (before) vs the key filter (now), CPU ns "
                "per entry over each interval",
                ["sentences", "entries", "plan before", "plan now", "before/now", "apply before", "apply now",
                 "before/now", "keys searched in delta runs, before / now", "filter B per stored entry"], rows)
    print_table("Targets", ["figure", "value", "target"],
                [[f, "—" if v is None else f"{v:.3f}", t or "—"] for f, v, t in _figures(res)
                 if f.startswith(("apply throughput", "rows equal"))])
    return 0 if res["same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
