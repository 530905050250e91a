"""Train the single-process GIAANN engine on the bundled corpus, evaluate, generate, print figures.

    python -m tools.single_process [--sentences 8000] [--heldout 500] [--prompts 500]
                                   [--prompt "In the beginning, God created the heavens"] [--max-new 20]
                                   [--corpus FILE.conllu[.gz]] [--jsonl OUT] [--snapshot OUT]

* trains on the first ``--sentences`` usable sentences (in corpus order);
* train-set evaluation: teacher-forced top-1 (§7) on the first ``--prompts`` *training* sentences
  with the train-set constants; test-set evaluation: on the ``--heldout`` sentences that follow the
  training ones, never trained, with the test-set constants (the reference's two protocols);
* generation: free-running continuation of ``--prompt`` (tagged with spaCy when it is installed;
  without spaCy, the first tokens of a held-out sentence are used and said so).

Exit status 0 on success, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import sys
import time

from giaannd.model.columns import EncodeStats
from giaannd.model.engine import Engine
from giaannd.model.export import save_snapshot, write_jsonl
from giaannd.model.infer import TEST_SET, TRAIN_SET
from giaannd.model.tokens import TaggedSentence, load_bundled_corpus, read_conllu


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=8000, help="training sentences (default 8000)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out test sentences (default 500)")
    ap.add_argument("--prompts", type=int, default=500, help="train-set evaluation prompts (default 500)")
    ap.add_argument("--prompt", default="In the beginning, God created the heavens", help="generation prompt")
    ap.add_argument("--max-new", type=int, default=20, help="tokens to generate (default 20)")
    ap.add_argument("--corpus", default=None, help="a CoNLL-U file instead of the bundled excerpt")
    ap.add_argument("--jsonl", default=None, help="write the JSONL export of all rows here")
    ap.add_argument("--snapshot", default=None, help="write a binary row snapshot here")
    args = ap.parse_args(argv)
    for name in ("sentences", "heldout", "prompts", "max_new"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    return args


def _prompt(engine: Engine, text: str, heldout: list[TaggedSentence]) -> tuple[TaggedSentence | None, str]:
    try:
        from giaannd.model.tokens import tag_texts

        tagged = next(iter(tag_texts([text])), None)
        if tagged:
            return tagged, "tagged with spaCy"
    except Exception as exc:  # spaCy or its model missing: say so, fall back
        note = f"spaCy unavailable ({type(exc).__name__}: {exc})"
    else:
        note = "spaCy returned no sentence"
    if heldout:
        return heldout[0][:6], f"{note}; using the first 6 tokens of a held-out sentence"
    return None, note


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    t0 = time.perf_counter()
    source = read_conllu(args.corpus) if args.corpus else iter(load_bundled_corpus())
    engine = Engine()
    # Take sentences in order until --sentences are usable for training; the next ones are held out.
    train_tagged: list[TaggedSentence] = []
    usable = 0
    for tagged in source:
        train_tagged.append(tagged)
        if engine.assigner.encode(tagged, update_flags=False) is not None:
            usable += 1
            if usable >= args.sentences:
                break
    heldout = list(itertools.islice(source, args.heldout * 2))
    load_s = time.perf_counter() - t0
    engine.assigner.stats = EncodeStats()  # count only the training pass below

    t1 = time.perf_counter()
    stats = engine.train(train_tagged)
    train_s = time.perf_counter() - t1
    store = engine.store
    print(f"corpus: {len(train_tagged)} tagged sentences read in {load_s:.1f}s; trained "
          f"{stats.sentences_trained} ({engine.assigner.stats.skipped} skipped: "
          f"{engine.assigner.stats.as_dict()})")
    print(f"training: {stats.sentences_trained / max(train_s, 1e-9):.0f} sentences/s "
          f"({stats.tokens} tokens, {train_s:.2f}s incl. column assignment)")
    print(f"rows: {len(store)} rows in {store.num_columns} columns, {store.num_entries} entries, "
          f"{store.nbytes / 2**20:.1f} MiB; vocabulary {engine.assigner.vocab.num_columns} columns, "
          f"{engine.assigner.vocab.num_features} features")

    train_prompts = engine.encode_prompts(train_tagged)[: args.prompts]
    held = engine.encode_prompts(heldout)[: args.heldout]
    for label, prompts, constants in (("train-set", train_prompts, TRAIN_SET),
                                      ("test-set (held out)", held, TEST_SET)):
        t2 = time.perf_counter()
        r = engine.evaluate(prompts, constants=constants)
        dt = time.perf_counter() - t2
        print(f"top-1 {label}: {r.top1:.4f} ({r.matches}/{r.prediction_tokens} prediction tokens, "
              f"{r.prompts} prompts, {r.no_prediction} without prediction; {r.steps / max(dt, 1e-9):.0f} "
              f"LIF steps/s)")

    prompt, how = _prompt(engine, args.prompt, heldout)
    if prompt is not None:
        words = " ".join(t.form for t in prompt)
        out = engine.generate(prompt, args.max_new, constants=TRAIN_SET)
        print(f"generate ({how}): {words!r} -> {' '.join(out)!r}")
    else:
        print(f"generate: skipped ({how})")
    if args.jsonl:
        n = write_jsonl(store, engine.assigner.vocab, args.jsonl)
        print(f"wrote {n} JSONL lines to {args.jsonl}")
    if args.snapshot:
        size = save_snapshot(store, args.snapshot)
        print(f"wrote a {size / 2**20:.1f} MiB snapshot to {args.snapshot}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"total {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
