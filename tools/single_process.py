"""Train the single-process GIAANN engine on the bundled corpus, evaluate, generate, print figures.

    python -m tools.single_process [--sentences 8000] [--heldout 500] [--prompts 500]
                                   [--prompt "In the beginning, God created the heavens"] [--max-new 20]
                                   [--corpus FILE] [--tag-cache DIR] [--lexicon FILE]
                                   [--prompts-file FILE] [--constants train|test]
                                   [--jsonl OUT] [--snapshot OUT] [--profile word|giaann-v2]

* trains on the first ``--sentences`` usable sentences (in corpus order) of the bundled excerpt or
  of ``--corpus``: CoNLL-U (``.conllu``, ``.conllu.gz``) as is, any other file as UTF-8 text tagged
  as the training path tags it (articles split at blank lines, the reference's sentencizer, each
  sentence tagged alone; cached under ``--tag-cache`` when given);
* train-set evaluation: teacher-forced top-1 (§7) on the first ``--prompts`` *training* sentences
  with the train-set constants; test-set evaluation: on the ``--heldout`` sentences that follow the
  training ones, never trained, with the test-set constants (the reference's two protocols);
* generation: free-running continuation of ``--prompt`` (tagged with spaCy when it is installed;
  without spaCy, the first tokens of a held-out sentence are used and said so);
* ``--prompts-file FILE`` replaces both evaluations and the generation: every non-blank line is one
  prompt, tagged whole as the reference tags a prompt line (a CoNLL-U file: one sentence per
  prompt), evaluated teacher-forced with 8 seed tokens and the ``--constants`` set (default
  ``train``); each prompt is printed with its predictions, then the top-1 over all of them;
* ``--profile giaann-v2``: the reference's v2 profile (giaann-algorithm.md §2.7, docs/model.md): o200k
  subwords, 3-sentence sequences (text is split and tagged a group at a time; CoNLL-U sentences are
  joined three by three and their text rebuilt), fixed dictionaries; ``word`` (default) is the
  word-level, single-sentence core;
* ``--lexicon FILE``: the ever-POS lexicon (the reference's ``everPos.wordnet.pkl.gz``, a
  ``word<TAB>UPOS`` file, or giaannd's format) instead of the shipped one.

Exit status 0 on success, 2 on bad arguments, unreadable input or an export that cannot be written.
A ``--prompt`` that column assignment skips (no noun) skips the generation, said so.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from giaannd.errors import GiaannError
from giaannd.model.columns import EncodeStats
from giaannd.model.engine import Engine, constants_named
from giaannd.model.export import save_snapshot, write_jsonl
from giaannd.model.infer import SEED_TOKENS, TEST_SET, TRAIN_SET
from giaannd.model.lexicon import load_lexicon
from giaannd.model.subwords import PROFILES, Profile, group_sentences, make_assigner, tag_groups, tag_prompt_lines
from giaannd.model.tokens import (
    TaggedSentence,
    TaggedText,
    load_bundled_corpus,
    read_conllu,
    read_prompt_lines,
    tag_file,
    tag_file_cached,
)

#: File names read as CoNLL-U; anything else is text to tag.
CONLLU_SUFFIXES = (".conllu", ".conllu.gz")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=8000, help="training sentences (default 8000)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out test sentences (default 500)")
    ap.add_argument("--prompts", type=int, default=500, help="train-set evaluation prompts (default 500)")
    ap.add_argument("--prompt", default="In the beginning, God created the heavens", help="generation prompt")
    ap.add_argument("--max-new", type=int, default=20, help="tokens to generate (default 20)")
    ap.add_argument("--corpus", default=None,
                    help="a CoNLL-U or UTF-8 text file instead of the bundled excerpt (text is tagged)")
    ap.add_argument("--tag-cache", default=None, help="cache tagged text files here (.conllu.gz)")
    ap.add_argument("--lexicon", default=None, help="ever-POS lexicon file instead of the shipped one")
    ap.add_argument("--prompts-file", default=None,
                    help="evaluate these prompts (one per non-blank line) instead of the default runs")
    ap.add_argument("--constants", choices=("train", "test"), default="train",
                    help="constant set for --prompts-file (default train)")
    ap.add_argument("--jsonl", default=None, help="write the JSONL export of all rows here")
    ap.add_argument("--snapshot", default=None, help="write a binary row snapshot here")
    ap.add_argument("--profile", choices=PROFILES, default="word",
                    help="model profile: word (default) or giaann-v2 (subwords, 3-sentence sequences)")
    args = ap.parse_args(argv)
    for name in ("sentences", "heldout", "prompts", "max_new"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    return args


def _prompt(text: str, heldout: list[Seq], profile: Profile) -> tuple[Seq | None, str]:
    try:
        from giaannd.model.tokens import tag_lines

        # one sequence, as the reference tags a prompt
        tagged: Seq | None
        if profile == "giaann-v2":
            tagged = next(iter(tag_prompt_lines([text])), None)
        else:
            tagged = next(iter(tag_lines([text])), None)
        if tagged:
            return tagged, "tagged with spaCy"
    except Exception as exc:  # spaCy or its model missing: say so, fall back
        note = f"spaCy unavailable ({type(exc).__name__}: {exc})"
    else:
        note = "spaCy returned no sentence"
    if heldout:
        first = heldout[0]
        words = first.words if isinstance(first, TaggedText) else first
        return words[:6], f"{note}; using the first 6 tokens of a held-out sentence"
    return None, note


#: A sequence as a profile reads it: tagged tokens, or (giaann-v2, from text) tokens with their text.
Seq = TaggedSentence | TaggedText


def _read(path: str, tag_cache: str | None, *, lines: bool, profile: Profile = "word") -> list[Seq]:
    """Sequences of a CoNLL-U file as is, or of a text file tagged (articles, or one per line);
    giaann-v2 groups sentences three by three (prompt lines stay one sequence each)."""
    if profile == "giaann-v2":
        if path.endswith(CONLLU_SUFFIXES):
            sentences = read_conllu(path)
            return list(sentences) if lines else list(group_sentences(sentences))
        if lines:
            return list(tag_prompt_lines(read_prompt_lines(path)))
        return list(tag_groups(_articles_of(path)))
    out: list[Seq] = []
    if path.endswith(CONLLU_SUFFIXES):
        out.extend(read_conllu(path))
    elif tag_cache:
        out.extend(read_conllu(tag_file_cached(path, tag_cache, lines=lines)))
    else:
        out.extend(tag_file(path, lines=lines))
    return out


def _show(words: Iterator[str] | list[str], sep: str = " ") -> str:
    # whitespace tokens (the reference keeps runs of tabs/spaces) are shown escaped; giaann-v2
    # subwords carry their own spaces, so they are shown between "|"
    return sep.join(repr(w)[1:-1] if w.isspace() else w for w in words)


def _articles_of(path: str) -> list[str]:
    """A text file's articles: blocks separated by blank lines (as tokens.tag_file reads them)."""
    text = Path(path).read_text(encoding="utf-8")
    return [p for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def _evaluate_prompt_file(engine: Engine, path: str, tag_cache: str | None, constants_name: str,
                          profile: Profile) -> None:
    prompts = _read(path, tag_cache, lines=True, profile=profile)
    constants = constants_named(constants_name)
    vocab = engine.assigner.vocab
    total = skipped = 0
    matches = tokens = none = 0
    t0 = time.perf_counter()
    for number, tagged in enumerate(prompts, 1):
        enc = engine.assigner.encode(tagged, update_flags=False)
        if enc is None or len(enc) < SEED_TOKENS + 1:
            skipped += 1
            n_words = len(tagged.words if isinstance(tagged, TaggedText) else tagged)
            print(f"prompt {number}: skipped ({n_words} tokens; column assignment kept "
                  f"{0 if enc is None else len(enc)}, {SEED_TOKENS + 1} needed, with a noun)")
            continue
        r = engine.evaluate([enc], constants=constants, keep_details=True)
        total += 1
        matches, tokens, none = matches + r.matches, tokens + r.prediction_tokens, none + r.no_prediction
        predicted = ["-" if p is None else vocab.word_of(*p) for p in r.predictions[0]]
        sep = "|" if profile == "giaann-v2" else " "
        print(f"prompt {number}: {_show(list(enc.words), sep)}")
        print(f"  targets:   {_show([enc.target_word(k) for k in range(SEED_TOKENS, len(enc))], sep)}")
        print(f"  predicted: {_show(predicted, sep)}")
        print(f"  top-1 {r.matches}/{r.prediction_tokens}")
    dt = time.perf_counter() - t0
    top1 = matches / tokens if tokens else 0.0
    print(f"top-1 prompt file ({constants_name} constants): {top1:.4f} ({matches}/{tokens} prediction tokens, "
          f"{total} prompts, {skipped} skipped, {none} without prediction; {dt:.2f}s)")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    t0 = time.perf_counter()
    try:
        assigner = make_assigner(args.profile, load_lexicon(args.lexicon) if args.lexicon else None)
        source: Iterator[Seq] = iter(
            _read(args.corpus, args.tag_cache, lines=False, profile=args.profile) if args.corpus
            else load_bundled_corpus() if args.profile == "word" else group_sentences(load_bundled_corpus()))
        if args.prompts_file and not Path(args.prompts_file).is_file():
            raise FileNotFoundError(f"prompt file {args.prompts_file} does not exist or is not a file")
    except (GiaannError, OSError) as exc:
        print(f"single_process: {exc}", file=sys.stderr)
        return 2
    engine = Engine(assigner)
    # Take sentences in order until --sentences are usable for training; the next ones are held out.
    train_tagged: list[Seq] = []
    usable = 0
    for tagged in source if args.sentences > 0 else ():  # --sentences 0: train on nothing
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
    print(f"profile: {args.profile}")
    print(f"corpus: {len(train_tagged)} tagged sequences read in {load_s:.1f}s; trained "
          f"{stats.sentences_trained} ({engine.assigner.stats.skipped} skipped: "
          f"{engine.assigner.stats.as_dict()})")
    print(f"training: {stats.sentences_trained / max(train_s, 1e-9):.0f} sentences/s "
          f"({stats.tokens} tokens, {train_s:.2f}s incl. column assignment)")
    print(f"rows: {len(store)} rows in {store.num_columns} columns, {store.num_entries} entries, "
          f"{store.nbytes / 2**20:.1f} MiB; vocabulary {engine.assigner.vocab.num_columns} columns, "
          f"{engine.assigner.vocab.num_features} features")

    if args.prompts_file:
        try:
            _evaluate_prompt_file(engine, args.prompts_file, args.tag_cache, args.constants, args.profile)
        except (GiaannError, OSError) as exc:
            print(f"single_process: {exc}", file=sys.stderr)
            return 2
        return _finish(engine, args, t0)

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

    prompt, how = _prompt(args.prompt, heldout, args.profile)
    if prompt is not None:
        words = (prompt.text if isinstance(prompt, TaggedText) else " ".join(t.form for t in prompt))
        try:
            out = engine.generate(prompt, args.max_new, constants=TRAIN_SET)
        except ValueError as exc:  # column assignment skipped the prompt: no noun
            print(f"generate: skipped ({how}: {words!r}: {exc})")
        else:
            shown = "".join(out) if args.profile == "giaann-v2" else " ".join(out)  # subwords carry their spaces
            print(f"generate ({how}): {words!r} -> {shown!r}")
    else:
        print(f"generate: skipped ({how})")
    return _finish(engine, args, t0)


def _finish(engine: Engine, args: argparse.Namespace, t0: float) -> int:
    """Write the exports asked for and print the totals; 2 when an export cannot be written."""
    try:
        _exports(engine, args)
    except (GiaannError, OSError) as exc:
        print(f"single_process: {exc}", file=sys.stderr)
        return 2
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"total {time.perf_counter() - t0:.1f}s")
    return 0


def _exports(engine: Engine, args: argparse.Namespace) -> None:
    if args.jsonl:
        n = write_jsonl(engine.store, engine.assigner.vocab, args.jsonl)
        print(f"wrote {n} JSONL lines to {args.jsonl}")
    if args.snapshot:
        size = save_snapshot(engine.store, args.snapshot)
        print(f"wrote a {size / 2**20:.1f} MiB snapshot to {args.snapshot}")


if __name__ == "__main__":
    sys.exit(main())
