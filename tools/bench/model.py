"""Benchmark of the fast GIAANN core against the plain oracle (tests/oracle), same corpus, same run.

    python -m tools.bench.model [--sentences 5000] [--prompts 1000] [--corpus FILE.conllu[.gz]]
                                [--profile-sentences 3000] [--profile-prompts 300] [--profiles-only] [--json]

Each phase runs in its own child process so that its peak RSS is its own. Phases:

* ``fast-train-torch`` / ``fast-train-numpy``: ``train_batch`` (either backend) over 256-sentence
  batches + ``RowStore.apply`` (the RowBatch build and the merge included; imports warmed up first);
* ``plain-train``: the per-pair oracle into a dict, then grouped into rows;
* ``fast-lif-*`` / ``plain-lif-*``: teacher-forced LIF over the first ``--prompts`` sentences with the
  train-set or test-set constants, on the rows the fast core trained (steps = tokens after the first
  of each prompt).

Column assignment (tagging is already done: the corpus is pre-tagged CoNLL-U) is timed separately
and is the same code for both.

Then the two model profiles on the same text (``profile-word`` / ``profile-giaann-v2``, issue 17):
the first ``--profile-sentences`` sentences of the corpus train the single-process engine (``word``:
one sentence a sequence; ``giaann-v2``: the same sentences joined three by three, text rebuilt from
the tokens, o200k subwords), sentences/s counts *source* sentences through column assignment and
training; top-1 (teacher-forced, §7) on the first ``--profile-prompts`` training sequences (train-set
constants) and on the sequences made of the next ``--profile-prompts`` sentences, never trained
(test-set constants). The baseline of each ratio is ``word``, measured in the same run.

Prints Markdown tables, or with ``--json`` one ``{"figure", "value", "target"}`` line per figure
(tools/bench/report.py). Not a test.
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

from tools.bench.report import emit_figure, print_table


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
        store.apply(train_batch(encoded[i:i + 256], backend=backend).rows, validate=False)  # type: ignore[arg-type]
    return store


def _profile_phase(args: argparse.Namespace, profile: str) -> dict[str, Any]:
    from giaannd.model.engine import Engine
    from giaannd.model.infer import TEST_SET, TRAIN_SET
    from giaannd.model.subwords import group_sentences, make_assigner
    from giaannd.model.tokens import load_bundled_corpus, read_conllu

    n, p = args.profile_sentences, args.profile_prompts
    tagged = (list(itertools.islice(read_conllu(args.corpus), n + p)) if args.corpus
              else load_bundled_corpus(limit=n + p))
    train_src, held_src = tagged[:n], tagged[n:n + p]
    if profile == "giaann-v2":
        train_seq, held_seq = list(group_sentences(train_src)), list(group_sentences(held_src))
    else:
        train_seq, held_seq = train_src, held_src
    engine = Engine(make_assigner(profile))  # type: ignore[arg-type]
    engine.train(train_seq[:3])  # imports, encoding load and first-call warm-up, outside the timing
    engine = Engine(make_assigner(profile))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    stats = engine.train(train_seq)
    train_s = time.perf_counter() - t0
    out: dict[str, Any] = {"sentences": len(train_src), "sequences": len(train_seq),
                           "trained": stats.sentences_trained, "tokens": stats.tokens, "train_s": train_s,
                           "rows": len(engine.store), "entries": engine.store.num_entries}
    # train-set prompts: the sequences made of the first p training sentences (p, or p / 3 groups)
    train_prompts = p if profile == "word" else max(1, p // 3)
    for label, seqs, constants in (("train", train_seq[:train_prompts], TRAIN_SET), ("heldout", held_seq, TEST_SET)):
        prompts = engine.encode_prompts(seqs)
        t1 = time.perf_counter()
        r = engine.evaluate(prompts, constants=constants)
        out[f"{label}_top1"] = r.top1
        out[f"{label}_tokens"] = r.prediction_tokens
        out[f"{label}_prompts"] = r.prompts
        out[f"{label}_s"] = time.perf_counter() - t1
    return out


def _phase(args: argparse.Namespace) -> dict[str, Any]:
    if args.phase.startswith("profile-"):
        res = _profile_phase(args, args.phase.removeprefix("profile-"))
        res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return res
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


def _run(phase: str, args: argparse.Namespace) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "tools.bench.model", "--phase", phase, "--sentences", str(args.sentences),
           "--prompts", str(args.prompts), "--profile-sentences", str(args.profile_sentences),
           "--profile-prompts", str(args.profile_prompts)] + (["--corpus", args.corpus] if args.corpus else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _core_table(r: dict[str, dict[str, Any]], as_json: bool) -> None:
    first = r["fast-train-torch"]
    rows = []
    for label, a, b in (("training sent/s (torch)", "fast-train-torch", "plain-train"),
                        ("training sent/s (numpy)", "fast-train-numpy", "plain-train"),
                        ("LIF steps/s (train-set)", "fast-lif-train", "plain-lif-train"),
                        ("LIF steps/s (test-set)", "fast-lif-test", "plain-lif-test")):
        fa = r[a]["items"] / r[a]["seconds"]
        fb = r[b]["items"] / r[b]["seconds"]
        if as_json:
            emit_figure(f"core {label}", fa, None)
            emit_figure(f"core {label} vs oracle", fa / fb, None)
        rows.append([label, f"{fa:.0f}", f"{fb:.0f}", f"{fa / fb:.1f}x", f"{r[a]['peak_rss_mib']:.0f}",
                     f"{r[b]['peak_rss_mib']:.0f}"])
    if as_json:
        return
    print(f"corpus: {first['sentences']} sentences, {first['tokens']} tokens; column assignment "
          f"{first['sentences'] / first['encode_s']:.0f} sentences/s (shared, not in the table)")
    print(f"rows: {first['rows']} rows, {first['entries']} entries (oracle: {r['plain-train']['entries']})")
    print_table("Fast core vs the plain oracle (same run)",
                ["measure", "fast core", "plain oracle", "ratio", "fast RSS MiB", "oracle RSS MiB"], rows)


def _profile_table(word: dict[str, Any], v2: dict[str, Any], as_json: bool) -> None:
    def sps(r: dict[str, Any]) -> float:
        return float(r["sentences"]) / float(r["train_s"])

    # No targets: issue 17 keeps `word` the default "until the profile is measured better".
    figures = (("top-1 train-set", "train_top1", "{:.4f}"), ("top-1 held-out", "heldout_top1", "{:.4f}"))
    rows = []
    for label, key, fmt in figures:
        a, b = float(word[key]), float(v2[key])
        rows.append([label, fmt.format(a), fmt.format(b), f"{b / a:.2f}x" if a else "-", "none (measured)"])
        if as_json:
            emit_figure(f"profile word {label}", a, None)
            emit_figure(f"profile giaann-v2 {label}", b, None)
    a, b = sps(word), sps(v2)
    rows.append(["training sentences/s", f"{a:.0f}", f"{b:.0f}", f"{b / a:.2f}x", "none (measured)"])
    if as_json:
        emit_figure("profile word training sentences/s", a, None)
        emit_figure("profile giaann-v2 training sentences/s", b, None)
        return
    rows.append(["sequences trained / prompts (train, held-out)",
                 f"{word['trained']} / {word['train_prompts']}, {word['heldout_prompts']}",
                 f"{v2['trained']} / {v2['train_prompts']}, {v2['heldout_prompts']}", "", ""])
    rows.append(["prediction tokens (train, held-out)", f"{word['train_tokens']}, {word['heldout_tokens']}",
                 f"{v2['train_tokens']}, {v2['heldout_tokens']}", "", ""])
    rows.append(["rows / entries", f"{word['rows']} / {word['entries']}", f"{v2['rows']} / {v2['entries']}",
                 f"{v2['entries'] / max(word['entries'], 1):.2f}x", ""])
    print_table(f"Model profiles on the same {word['sentences']} sentences (ratio: giaann-v2 / word, same run)",
                ["measure", "word", "giaann-v2", "ratio", "target"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=5000, help="training sentences (default 5000)")
    ap.add_argument("--prompts", type=int, default=1000, help="LIF prompts (default 1000)")
    ap.add_argument("--corpus", default=None, help="a CoNLL-U file instead of the bundled excerpt")
    ap.add_argument("--profile-sentences", type=int, default=3000,
                    help="source sentences trained per model profile (default 3000)")
    ap.add_argument("--profile-prompts", type=int, default=300,
                    help="sentences evaluated per profile, train-set and held out (default 300)")
    ap.add_argument("--profiles-only", action="store_true", help="only the model-profile comparison")
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        print(json.dumps(_phase(args)))
        return 0
    core = () if args.profiles_only else (
        "fast-train-torch", "fast-train-numpy", "plain-train", "fast-lif-train", "plain-lif-train",
        "fast-lif-test", "plain-lif-test")
    results = {}
    for phase in (*core, "profile-word", "profile-giaann-v2"):
        got = _run(phase, args)
        if got is None:
            return 1
        results[phase] = got
    if core:
        _core_table(results, args.json)
    _profile_table(results["profile-word"], results["profile-giaann-v2"], args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
