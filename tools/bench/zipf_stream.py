"""A seeded, streamed synthetic corpus with Zipf-distributed words (issue 14, "Rows at scale").

The stream keeps the *shape* of real text and the *vocabulary growth* of a big corpus: each sentence
is the POS skeleton of a bundled-corpus sentence (cycled in order), closed-class tokens (ADP, DET,
PRON, AUX, PUNCT, ...) kept as written, nouns (NOUN, PROPN) replaced by ``n<rank>`` with the rank
drawn Zipf(1) over 10^6 lemmas, and the other open-class words (VERB, ADJ, ADV, INTJ) replaced by
``w<rank>``, Zipf(1) over 10^5. That is the stream scale-notes.md measured at 17f4a90: a few hundred
new entries and ~10 new rows per sentence, while the Zipf head's rows grow without bound.

Nothing but the skeletons (the 10k bundled sentences) is held: sentences are made in chunks of
``chunk`` as they are consumed, so a stream of 10^7 sentences costs the memory of one chunk. The
same seed gives the same sentences, whatever the chunk size (numpy's PCG64, one generator per
vocabulary, drawn in token order).

    python -m tools.bench.zipf_stream OUT.conllu[.gz] N [--seed 0]

writes the first N sentences as CoNLL-U (for the command-line tools: tools/single_process.py
``--corpus``, the daemon's job submission).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch
from giaannd.model.tokens import TaggedSentence, Token, load_bundled_corpus, write_conllu

__all__ = ["NOUN_VOCAB", "OPEN_VOCAB", "ZipfStream", "training_deltas", "write_stream"]

#: Distinct noun lemmas the stream draws from (Zipf(1) ranks 1..NOUN_VOCAB).
NOUN_VOCAB = 10**6
#: Distinct other open-class words (VERB, ADJ, ADV, INTJ), Zipf(1) ranks 1..OPEN_VOCAB.
OPEN_VOCAB = 10**5
_NOUN_UPOS = frozenset({"NOUN", "PROPN"})
_OPEN_UPOS = frozenset({"VERB", "ADJ", "ADV", "INTJ"})
_KEEP, _NOUN, _OPEN = 0, 1, 2


def _zipf_cdf(k: int) -> NDArray[np.float64]:
    """Cumulative probabilities of ranks 1..k under Zipf(1) truncated at k (the last one is 1)."""
    cdf = np.cumsum(1.0 / np.arange(1, k + 1, dtype=np.float64))
    cdf /= cdf[-1]
    return cdf


class ZipfStream:
    """An endless, seeded stream of tagged sentences (module docstring).

    Args:
        seed: the random seed (same seed, same stream).
        skeletons: the sentences whose POS sequences are reused (default: the bundled corpus).
        nouns: the noun vocabulary size; words: the other open-class vocabulary size.
        chunk: sentences made per draw (memory of the stream: one chunk).
    """

    def __init__(self, seed: int = 0, skeletons: Sequence[TaggedSentence] | None = None, *,
                 nouns: int = NOUN_VOCAB, words: int = OPEN_VOCAB, chunk: int = 1024) -> None:
        if nouns < 1 or words < 1 or chunk < 1:
            raise ValueError("nouns, words and chunk must be >= 1")
        sk = list(skeletons) if skeletons is not None else load_bundled_corpus()
        if not sk:
            raise ValueError("no skeleton sentences")
        self._skeletons = [tuple(s) for s in sk]
        self._kinds = [np.array([_NOUN if t.upos in _NOUN_UPOS else _OPEN if t.upos in _OPEN_UPOS else _KEEP
                                 for t in s], np.int8) for s in self._skeletons]
        self._noun_cdf = _zipf_cdf(nouns)
        self._open_cdf = _zipf_cdf(words)
        self._seed = seed
        self._chunk = chunk

    def __iter__(self) -> Iterator[TaggedSentence]:
        # one generator per vocabulary, consumed in token order: the chunk size is not part of the stream
        noun_rng, open_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(self._seed).spawn(2))
        n_sk = len(self._skeletons)
        for first in itertools.count(0, self._chunk):
            picks = [(first + i) % n_sk for i in range(self._chunk)]
            kinds = np.concatenate([self._kinds[p] for p in picks])
            noun_at = np.flatnonzero(kinds == _NOUN)
            open_at = np.flatnonzero(kinds == _OPEN)
            rank = np.zeros(kinds.shape[0], np.int64)
            # inverse-CDF draws: searchsorted of uniforms in the cumulative probabilities (+1: ranks
            # start at 1)
            rank[noun_at] = np.searchsorted(self._noun_cdf, noun_rng.random(noun_at.shape[0]), side="right") + 1
            rank[open_at] = np.searchsorted(self._open_cdf, open_rng.random(open_at.shape[0]), side="right") + 1
            ranks = rank.tolist()
            kind_list = kinds.tolist()
            at = 0
            for p in picks:
                sentence = []
                for tok in self._skeletons[p]:
                    kind = kind_list[at]
                    if kind == _KEEP:
                        sentence.append(tok)
                    else:
                        word = f"n{ranks[at]}" if kind == _NOUN else f"w{ranks[at]}"
                        sentence.append(Token(word, word, tok.upos, tok.xpos))
                    at += 1
                yield tuple(sentence)


def training_deltas(sentences: Iterator[TaggedSentence], count: int, batch: int = 256) -> Iterator[RowBatch]:
    """The single-process core's training deltas of the next ``count`` of ``sentences``, ``batch``
    sentences at a time (``train_batch`` of each batch's encoded sentences; one ``ColumnAssigner``
    for the whole stream, so later batches add to the columns earlier ones made): what a storage
    node owning every column logs for them, one batch a record."""
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.train import train_batch

    assigner = ColumnAssigner()
    for _ in range(0, count, batch):
        encoded = [e for e in assigner.encode_many(itertools.islice(sentences, batch)) if e is not None]
        if encoded:
            yield train_batch(encoded).rows


def write_stream(path: str, count: int, seed: int = 0) -> int:
    """Write the first ``count`` sentences of ``ZipfStream(seed)`` to ``path`` as CoNLL-U (streamed)."""
    return write_conllu(itertools.islice(ZipfStream(seed), count), path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="output CoNLL-U file (.gz: gzip'd)")
    ap.add_argument("count", type=int, help="sentences to write")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = ap.parse_args(argv)
    if args.count < 0:
        ap.error("count must be >= 0")
    print(f"wrote {write_stream(args.path, args.count, args.seed)} sentences to {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
