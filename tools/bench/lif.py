"""The LIF step on long rows (issue 14 item 6, "Inference steps at memory speed"), with a breakdown.

    python -m tools.bench.lif [--sizes 10000,100000,1000000] [--repeat 5] [--seed 0]
                              [--sentences 5000 --prompts 300] [--json]

Builds canonical rows of the given lengths with realistic target ids (columns Zipf(1) over 10^6, features
Zipf(1) over 10^5, both turned into uniform 64-bit ids as ``giaannd.model.ids`` makes them, 9 segments)
and times ``LifSession.step`` per row entry on a fresh session where the row fires once (``first``:
the figure tools/bench/scale.py reports on the store's longest rows) and then once more (``again``:
every target already has a slot), with both constant sets; the target (≤ 10 ns) is for each. Three
steps, timed alternately in the same run: ``now`` (this tree's session), ``previous`` (the same
session remembering no fired rows, ``remember_bytes=0``: the step before rows fired again skipped
the slot map) and ``baseline`` (the step before this item, tools/bench/baseline_lif.py). The
baseline shares this tree's ``KeyIndex`` (its ``lookup_or_add`` is a compiled kernel now), so its
column compares the steps' designs, not the code before the kernels: for that, run this module
from a worktree of the older commit too (docs/model.md, "The LIF step"). Then the
new step's phases, each timed alone on the same row (best of ``--repeat``; a fresh session each time):

- ``slot map``: ``KeyIndex.ids_of`` on a fresh index (every target new: the insert path, with the
  table's allocation);
- ``slot check``: ``KeyIndex.holds`` of the slots found (what a row fired again costs instead);
- ``state grow``: allocating the ``float64[9, slots]`` state for the row's neurons;
- ``deposits``: numpy's part of g(strength) in float64, exp(s / -100) (test-set constants; train-set
  is one float);
- ``scatter``: the deposit kernel (``infer._deposit``: the rest of g and the adds) into the fresh
  state (its first touch: page faults);
- ``dense step``: a whole step with an empty row on a session holding the row's neurons (the
  propagation, the column transition and the soma decay over every slot), per slot; and the same
  for the old step.

Then ``KeyIndex`` alone: bulk calls on as many uniform random keys as each row has entries, ns per
key (``keyindex_ns``). Then whole sessions as evaluation runs them: ``--sentences`` of the bundled corpus trained into a
``RowStore``, teacher-forced sessions over the first ``--prompts`` of them (train-set and test-set
constants), the three sessions alternately per prompt: steps per CPU second and ns per entry of the
rows fired. (0 sentences skips it.)

Times are CPU time of this process (``time.process_time``), best of ``--repeat``: on a shared, loaded
machine wall-clock times also count the waits for a CPU. Target: ≤ 10 ns per entry (the issue).
Compare ratios from one run; the machine load is printed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from giaannd.model.infer import TEST_SET, TRAIN_SET, LifConstants, LifSession, NoDelimiters, _deposit
from giaannd.model.rows import NUM_SEGMENTS, Row, RowBatch
from giaannd.rowengine import KeyIndex
from tools.bench.baseline_lif import BaselineLifSession
from tools.bench.report import print_table

TARGET_LIF_NS_PER_ENTRY = 10.0
_SOURCE = (1, 1)
#: The steps compared (module docstring): the baseline, the previous step, this tree's.
_STEPS: tuple[tuple[str, Callable[..., LifSession | BaselineLifSession]], ...] = (
    ("old", BaselineLifSession), ("prev", functools.partial(LifSession, remember_bytes=0)), ("new", LifSession))
_STEP_NAMES = {"old": "baseline", "prev": "previous", "new": "now"}


def _splitmix(x: np.ndarray[Any, np.dtype[np.uint64]], salt: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Uniform 64-bit ids from ranks (what xxh3 of distinct strings looks like), never 0."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(salt)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    z[z == 0] = 1
    return z


def _zipf_ranks(rng: np.random.Generator, vocab: int, k: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1, dtype=np.float64))
    cdf /= cdf[-1]
    return np.searchsorted(cdf, rng.random(k)).astype(np.uint64)


def synthetic_row(n: int, seed: int = 0) -> Row:
    """A canonical row of exactly ``n`` entries (module docstring). Draws until n distinct keys."""
    rng = np.random.default_rng(seed)
    draw = n + n // 2 + 16
    while True:
        seg = rng.integers(0, NUM_SEGMENTS, draw).astype(np.uint8)
        col = _splitmix(_zipf_ranks(rng, 10**6, draw), 0x1234)
        feat = _splitmix(_zipf_ranks(rng, 10**5, draw), 0x5678)
        strength = (rng.random(draw) * 9.0 + 0.1).astype(np.float32)
        zeros = np.zeros(draw, np.uint64)
        batch = RowBatch.from_entries(zeros, zeros + np.uint64(1), seg, col, feat, strength)
        if batch.num_entries >= n:
            break
        draw *= 2
    keep = np.sort(rng.choice(batch.num_entries, n, replace=False))  # a sub-row stays canonical
    return Row(batch.segment[keep], batch.target_column[keep], batch.target_feature[keep], batch.strength[keep])


def _best(fn: Callable[[], Callable[[], object]], repeat: int) -> float:
    """Best wall time of the timed callable that ``fn`` prepares (set-up outside the timing)."""
    best = float("inf")
    for _ in range(repeat):
        timed = fn()
        t = time.process_time()
        timed()
        best = min(best, time.process_time() - t)
    return best


def steps_ns(row: Row, constants: LifConstants, repeat: int) -> dict[str, float]:
    """ns per entry of a step on a fresh session whose first node fires ``row`` (``first``), and of the
    next step firing it again (``again``: every target already has its slot), for the three steps
    (``old_*``, ``prev_*``, ``new_*``: module docstring), timed alternately (the machine's load moves
    between them alike), best of ``repeat`` each."""
    best: dict[str, float] = {}
    for _ in range(repeat):
        for name, make in _STEPS:
            session = make([_SOURCE] * 3, NoDelimiters(), constants)
            for when in ("first", "again"):
                t = time.process_time()
                session.step(row)
                key = f"{name}_{when}"
                best[key] = min(best.get(key, float("inf")), time.process_time() - t)
    per = 1e9 / max(len(row), 1)
    return {key: value * per for key, value in best.items()}


def phases_ns(row: Row, repeat: int) -> dict[str, float]:
    """The new step's phases on ``row`` (module docstring), ns per entry (dense step: per slot)."""
    n = max(len(row), 1)
    counted = KeyIndex()
    counted.ids_of(row.target_column, row.target_feature)
    neurons = len(counted)

    def fresh() -> LifSession:
        return LifSession([_SOURCE, _SOURCE], NoDelimiters(), TEST_SET)

    def slot_map() -> Callable[[], object]:
        index = KeyIndex()
        return lambda: index.ids_of(row.target_column, row.target_feature)

    def check() -> Callable[[], object]:
        index = KeyIndex()
        slots = index.ids_of(row.target_column, row.target_feature)
        return lambda: index.holds(row.target_column, row.target_feature, slots)

    def grow() -> Callable[[], object]:
        session = fresh()
        return lambda: session._grow(neurons)

    def deposits() -> Callable[[], object]:
        session = fresh()
        return lambda: session._deposits(row.strength)

    def scatter() -> Callable[[], object]:
        session = fresh()
        slots = session._slots_of(row)  # mapped, and the state grown (not yet touched)
        mode, value = session._deposits(row.strength)
        lane = np.array(session._lane, np.int64)
        return lambda: _deposit(session._act, lane, row.segment, slots, row.strength, value, mode)

    def dense(cls: type[LifSession] | type[BaselineLifSession]) -> Callable[[], Callable[[], object]]:
        def prepare() -> Callable[[], object]:
            session = cls([_SOURCE, _SOURCE, (2, 2), (3, 3)], NoDelimiters(), TEST_SET)
            session.step(row)
            empty = Row.empty()
            return lambda: session.step(empty)
        return prepare

    out = {name: _best(fn, repeat) * 1e9 / n for name, fn in
           (("slot map", slot_map), ("slot check", check), ("state grow", grow), ("deposits", deposits),
            ("scatter", scatter))}
    out["dense step (per slot)"] = _best(dense(LifSession), repeat) * 1e9 / max(neurons, 1)
    out["dense step, old (per slot)"] = _best(dense(BaselineLifSession), repeat) * 1e9 / max(neurons, 1)
    out["neurons per entry"] = neurons / n
    return out


def keyindex_ns(n: int, repeat: int, seed: int) -> dict[str, float]:
    """``KeyIndex`` bulk calls on ``n`` uniform random keys, ns per key (best of ``repeat``, set-up
    untimed): ``append`` into an empty index, ``lookup`` of held / absent keys, ``lookup_or_add``
    with half the keys new, ``ids_of`` on a fresh index at the LIF session's load (every key new), and
    ``append_new`` of n/2 new keys into an index holding the other half (per key appended)."""
    rng = np.random.default_rng(seed)
    a, b, other = (rng.integers(0, 2**63, n, dtype=np.uint64) for _ in range(3))
    half = n // 2
    held = KeyIndex()
    held.append(a, b)

    def fresh(fill: int = 0, load: float = 0.5) -> KeyIndex:
        index = KeyIndex(max_load=load)
        index.append(a[:fill], b[:fill])
        return index

    def timed(name: str) -> Callable[[], Callable[[], object]]:
        def prepare() -> Callable[[], object]:
            if name == "append":
                index = fresh()
                return lambda: index.append(a, b)
            if name == "lookup (held)":
                return lambda: held.lookup(a, b)
            if name == "lookup (absent)":
                return lambda: held.lookup(other, b)
            if name == "lookup_or_add (half new)":
                index = fresh(half)
                return lambda: index.lookup_or_add(a, b)
            if name == "ids_of (fresh, load 1/4)":
                index = fresh(0, 0.25)
                return lambda: index.ids_of(a, b)
            index = fresh(half)
            return lambda: index.append_new(a[half:], b[half:])
        return prepare

    names = ["append", "lookup (held)", "lookup (absent)", "lookup_or_add (half new)", "ids_of (fresh, load 1/4)",
             "append_new"]
    out = {name: _best(timed(name), repeat) * 1e9 / max(n, 1) for name in names}
    out["append_new"] *= n / max(n - half, 1)
    return out


def measure(sizes: list[int], repeat: int, seed: int) -> list[dict[str, Any]]:
    records = []
    for n in sizes:
        row = synthetic_row(n, seed)
        rec: dict[str, Any] = {"entries": n}
        for name, constants in (("train", TRAIN_SET), ("test", TEST_SET)):
            for key, value in steps_ns(row, constants, repeat).items():
                rec[f"{name}_{key}_ns"] = value
        rec["phases"] = phases_ns(row, repeat)
        rec["keyindex"] = keyindex_ns(n, repeat, seed)
        records.append(rec)
    return records


def sessions(sentences: int, prompts: int) -> dict[str, float]:
    """Teacher-forced evaluation sessions on the bundled corpus, the three steps alternately."""
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.rowstore import RowStore
    from giaannd.model.tokens import load_bundled_corpus
    from giaannd.model.train import train_batch

    assigner = ColumnAssigner()
    encoded = list(assigner.encode_many(load_bundled_corpus(limit=int(sentences * 1.5) + 200),
                                        update_flags=True))[:sentences]
    store = RowStore()
    for i in range(0, len(encoded), 256):
        store.apply(train_batch(encoded[i:i + 256]).rows)
    targets = [list(zip(s.column.tolist(), s.feature.tolist())) for s in encoded[:prompts]]
    out: dict[str, float] = {}
    for name, constants in (("train", TRAIN_SET), ("test", TEST_SET)):
        cpu = {which: 0.0 for which, _ in _STEPS}
        steps = entries = 0
        for prompt in targets:
            for which, make in _STEPS:
                session = make(prompt, assigner, constants)
                t = time.process_time()
                while (key := session.needs_row()) is not None:
                    row = store.get_row(*key)
                    if which == "new":
                        steps += 1
                        entries += len(row)
                    session.step(row)  # the fetch is in both timings alike
                cpu[which] += time.process_time() - t
        for which, seconds in cpu.items():
            out[f"{name}_{which}_steps_per_s"] = steps / max(seconds, 1e-9)
            out[f"{name}_{which}_ns_per_entry"] = seconds * 1e9 / max(entries, 1)
        out[f"{name}_entries_per_step"] = entries / max(steps, 1)
    return out


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x]
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError("sizes: positive integers, comma-separated")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=_ints, default=_ints("10000,100000,1000000"), help="row lengths")
    ap.add_argument("--repeat", type=int, default=5, help="timings per figure, best kept (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="row seed (default 0)")
    ap.add_argument("--sentences", type=int, default=5000, help="bundled sentences trained for the "
                    "session figures (default 5000; 0 skips them)")
    ap.add_argument("--prompts", type=int, default=300, help="teacher-forced prompts (default 300)")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    load = f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    records = measure(args.sizes, max(args.repeat, 1), args.seed)
    sess = sessions(args.sentences, max(args.prompts, 1)) if args.sentences > 0 else {}
    load += f" before, {os.getloadavg()[0]:.2f} after"
    target = f"<= {TARGET_LIF_NS_PER_ENTRY:.0f}"
    figures = [(r["entries"], name, when) for r in records for name in ("train", "test")
               for when in ("first", "again")]
    by_size = {r["entries"]: r for r in records}
    if args.json:
        print(json.dumps({"figure": "machine load", "value": load, "target": None}))
        for n, name, when in figures:
            r = by_size[n]
            for which, _ in _STEPS:
                print(json.dumps({"figure": f"LIF step ns/entry {_STEP_NAMES[which]} {name}-set {when} @{n}",
                                  "value": round(r[f"{name}_{which}_{when}_ns"], 2),
                                  "target": target if which == "new" else None}))
            for which in ("old", "prev"):
                ratio = r[f"{name}_{which}_{when}_ns"] / r[f"{name}_new_{when}_ns"]
                print(json.dumps({"figure": f"LIF step {_STEP_NAMES[which]}/now {name}-set {when} @{n}",
                                  "value": round(ratio, 2), "target": None}))
        for r in records:
            for phase, value in r["phases"].items():
                print(json.dumps({"figure": f"LIF phase {phase} @{r['entries']}", "value": round(value, 2),
                                  "target": None}))
            for call, value in r["keyindex"].items():
                print(json.dumps({"figure": f"KeyIndex {call} ns/key @{r['entries']}", "value": round(value, 2),
                                  "target": None}))
        for key, value in sess.items():
            print(json.dumps({"figure": f"LIF sessions {key}", "value": round(value, 2), "target": None}))
        return 0
    print(f"\nmachine: {load}")
    rows = []
    for n, name, when in figures:
        old, prev, new = (by_size[n][f"{name}_{which}_{when}_ns"] for which in ("old", "prev", "new"))
        rows.append([f"{n:,}", f"{name}-set", when, f"{old:.1f}", f"{prev:.1f}", f"{new:.1f}", target,
                     "met" if new <= TARGET_LIF_NS_PER_ENTRY else "MISSED", f"{prev / new:.2f}x", f"{old / new:.2f}x"])
    print_table("LIF step, ns per row entry (fresh session: the row fires first, then again; the three steps "
                "alternately, best of each)",
                ["entries", "constants", "fire", "baseline", "previous", "now", "target", "verdict",
                 "previous/now", "baseline/now"], rows)
    names = list(records[0]["phases"])
    print_table("Now by phase (ns per entry; dense step per slot)", ["entries", *names],
                [[f"{r['entries']:,}", *(f"{r['phases'][p]:.2f}" for p in names)] for r in records])
    calls = list(records[0]["keyindex"])
    print_table("KeyIndex bulk calls (ns per key, uniform random keys)", ["keys", *calls],
                [[f"{r['entries']:,}", *(f"{r['keyindex'][c]:.1f}" for c in calls)] for r in records])
    if sess:
        print_table(f"Teacher-forced sessions ({args.sentences:,} bundled sentences, {args.prompts} prompts)",
                    ["constants", "entries/step", "steps/CPU-s baseline", "previous", "now", "now/previous",
                     "now/baseline", "ns/entry baseline", "previous", "now"],
                    [[f"{n}-set", f"{sess[f'{n}_entries_per_step']:,.0f}",
                      *(f"{sess[f'{n}_{w}_steps_per_s']:,.0f}" for w in ("old", "prev", "new")),
                      f"{sess[f'{n}_new_steps_per_s'] / sess[f'{n}_prev_steps_per_s']:.2f}x",
                      f"{sess[f'{n}_new_steps_per_s'] / sess[f'{n}_old_steps_per_s']:.2f}x",
                      *(f"{sess[f'{n}_{w}_ns_per_entry']:.1f}" for w in ("old", "prev", "new"))]
                     for n in ("train", "test")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
