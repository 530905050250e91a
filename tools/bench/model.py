"""Benchmark of the fast GIAANN core against the plain oracle (tests/oracle), same corpus, same run.

    python -m tools.bench.model [--sentences 5000] [--prompts 1000] [--corpus FILE.conllu[.gz]]

Each phase runs in its own child process so that its peak RSS is its own. Phases:

* ``fast-train-torch`` / ``fast-train-numpy``: ``train_batch`` (either backend) over 256-sentence
  batches + ``RowStore.apply`` (the RowBatch build and the merge included; imports warmed up first);
* ``plain-train``: the per-pair oracle into a dict, then grouped into rows;
* ``fast-lif-*`` / ``plain-lif-*``: teacher-forced LIF over the first ``--prompts`` sentences with the
  train-set or test-set constants, on the rows the fast core trained (steps = tokens after the first
  of each prompt).

Column assignment (tagging is already done: the corpus is pre-tagged CoNLL-U) is timed separately
and is the same code for both. Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import time
from typing import Any


def _load(args: argparse.Namespace) -> tuple[Any, list[Any], float]:
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.tokens import load_bundled_corpus, read_conllu

    want = int(args.sentences * 1.5) + 200
    tagged = (list(itertools.islice(read_conllu(args.corpus), want)) if args.corpus
              else load_bundled_corpus(limit=want))
    assigner = ColumnAssigner()
    t0 = time.perf_counter()
    encoded = list(itertools.islice(assigner.encode_many(tagged, update_flags=True), args.sentences))
    return assigner, encoded, time.perf_counter() - t0


def _fast_store(encoded: list[Any], backend: str = "torch") -> Any:
    from giaannd.model.rowstore import RowStore
    from giaannd.model.train import train_batch

    store = RowStore()
    for i in range(0, len(encoded), 256):
        store.apply(train_batch(encoded[i:i + 256], backend=backend).rows)  # type: ignore[arg-type]
    return store


def _phase(args: argparse.Namespace) -> dict[str, Any]:
    assigner, encoded, encode_s = _load(args)
    out: dict[str, Any] = {"sentences": len(encoded), "tokens": sum(len(s) for s in encoded),
                           "encode_s": encode_s}
    if args.phase.startswith("fast-train"):
        backend = args.phase.rsplit("-", 1)[1]
        _fast_store(encoded[:20], backend)  # imports and first-call warm-up, outside the timing
        t0 = time.perf_counter()
        store = _fast_store(encoded, backend)
        out.update(seconds=time.perf_counter() - t0, items=len(encoded), entries=store.num_entries,
                   rows=len(store))
    elif args.phase == "plain-train":
        from tests.oracle.plain import plain_train, rows_of

        t0 = time.perf_counter()
        entries: dict[Any, float] = {}
        for s in encoded:
            plain_train(s, entries)
        rows = rows_of(entries)
        out.update(seconds=time.perf_counter() - t0, items=len(encoded), entries=len(entries), rows=len(rows))
    else:
        from giaannd.model.infer import TEST_SET, TRAIN_SET, LifSession, run_session

        store = _fast_store(encoded)
        prompts = [list(zip(s.column.tolist(), s.feature.tolist())) for s in encoded[: args.prompts]]
        steps = sum(len(p) - 1 for p in prompts)
        constants = TRAIN_SET if args.phase.endswith("train") else TEST_SET
        tup = (0.004, True, 1.0, 1.0, True) if constants is TRAIN_SET else (0.008, False, 0.75, 0.75, False)
        if args.phase.startswith("fast-lif"):
            t0 = time.perf_counter()
            for p in prompts:
                run_session(LifSession(p, assigner, constants), store)
        else:
            from tests.oracle.plain import plain_lif

            rows = {k: [(int(a), int(b), int(c), float(v)) for a, b, c, v in
                        zip(r.segment, r.target_column, r.target_feature, r.strength)] for k, r in store}
            t0 = time.perf_counter()
            for p in prompts:
                plain_lif(p, rows, assigner.is_deterministic, assigner.is_probabilistic, tup)
        out.update(seconds=time.perf_counter() - t0, items=steps)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=5000, help="training sentences (default 5000)")
    ap.add_argument("--prompts", type=int, default=1000, help="LIF prompts (default 1000)")
    ap.add_argument("--corpus", default=None, help="a CoNLL-U file instead of the bundled excerpt")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        print(json.dumps(_phase(args)))
        return 0
    results = {}
    for phase in ("fast-train-torch", "fast-train-numpy", "plain-train", "fast-lif-train", "plain-lif-train",
                  "fast-lif-test", "plain-lif-test"):
        cmd = [sys.executable, "-m", "tools.bench.model", "--phase", phase, "--sentences", str(args.sentences),
               "--prompts", str(args.prompts)] + (["--corpus", args.corpus] if args.corpus else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return 1
        results[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
    r = results
    first = r["fast-train-torch"]
    print(f"corpus: {first['sentences']} sentences, {first['tokens']} tokens; column assignment "
          f"{first['sentences'] / first['encode_s']:.0f} sentences/s (shared, not in the table)")
    print(f"rows: {first['rows']} rows, {first['entries']} entries (oracle: {r['plain-train']['entries']})")
    print()
    print(f"{'measure':<28}{'fast core':>14}{'plain oracle':>14}{'ratio':>8}{'fast RSS MiB':>14}{'oracle RSS MiB':>16}")
    for label, a, b in (("training sent/s (torch)", "fast-train-torch", "plain-train"),
                        ("training sent/s (numpy)", "fast-train-numpy", "plain-train"),
                        ("LIF steps/s (train-set)", "fast-lif-train", "plain-lif-train"),
                        ("LIF steps/s (test-set)", "fast-lif-test", "plain-lif-test")):
        fa = r[a]["items"] / r[a]["seconds"]
        fb = r[b]["items"] / r[b]["seconds"]
        print(f"{label:<28}{fa:>14.0f}{fb:>14.0f}{fa / fb:>7.1f}x{r[a]['peak_rss_mib']:>14.0f}"
              f"{r[b]['peak_rss_mib']:>16.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
