"""Hand-made and synthetic EncodedSentences (independent of the text front end).

``make_sentence`` builds the §3.1 worked example and friends from words + concept marks + spans.
``synthetic_corpus`` makes a seeded, Zipf-distributed corpus with noun spans closed by a simple
rightmost-delimiter rule: structurally like real encoded sentences (repeated words, several instances
of one column, spans of varying length), for tests and benchmarks when the bundled corpus is absent.
"""

from __future__ import annotations

import random

import numpy as np

from giaannd.model.ids import PRIME_FEATURE, column_id, feature_id
from giaannd.model.sentence import EncodedSentence

DELIMITERS = frozenset({"on", "in", "sat", "is", "and", ".", ",", "of", "to", "said", "went", "with"})


def make_sentence(words, concepts, spans, lemmas=None) -> EncodedSentence:
    """words: tokens; concepts: positions of nouns; spans: [(start, end_exclusive)] per instance."""
    n = len(words)
    lemmas = list(words) if lemmas is None else list(lemmas)
    is_concept = np.zeros(n, bool)
    is_concept[list(concepts)] = True
    instance = np.zeros(n, np.int32)
    for i, (a, b) in enumerate(spans):
        instance[a:b] = i
    column_lemma = tuple(lemmas[p] for p in concepts)
    column = np.array([column_id(column_lemma[i]) for i in instance], np.uint64)
    feature = np.array(
        [PRIME_FEATURE if is_concept[t] else feature_id(words[t]) for t in range(n)], np.uint64
    )
    return EncodedSentence(
        tuple(words), tuple(lemmas), is_concept, instance, column, feature,
        np.array(list(concepts), np.int32), column_lemma,
    )


def worked_example() -> EncodedSentence:
    """``the cat sat on the mat .`` with spans cat = 0–3, mat = 4–6 (§3.1)."""
    return make_sentence(["the", "cat", "sat", "on", "the", "mat", "."], [1, 5], [(0, 4), (4, 7)])


def synthetic_corpus(count: int, seed: int = 0, vocab: int = 600, nouns: int = 300,
                     min_len: int = 9, max_len: int = 40) -> list[EncodedSentence]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)] + sorted(DELIMITERS)
    noun_words = [f"n{i}" for i in range(nouns)]
    wweights = [1.0 / (i + 1) for i in range(vocab)] + [8.0 / vocab * 50] * len(DELIMITERS)
    nweights = [1.0 / (i + 1) for i in range(nouns)]
    out = []
    while len(out) < count:
        n = rng.randint(min_len, max_len)
        toks = []
        concept_pos = []
        for t in range(n):
            if rng.random() < 0.25:
                toks.append(rng.choices(noun_words, nweights)[0])
                concept_pos.append(t)
            else:
                toks.append(rng.choices(words, wweights)[0])
        # merge adjacent nouns away: keep only nouns not directly after a noun
        concept_pos = [p for i, p in enumerate(concept_pos) if i == 0 or concept_pos[i - 1] != p - 1]
        for t in range(n):
            if toks[t].startswith("n") and t not in concept_pos:
                toks[t] = "w0"
        if not concept_pos:
            continue
        spans = []
        start = 0
        for a, b in zip(concept_pos, concept_pos[1:]):
            between = [t for t in range(a + 1, b) if toks[t] in DELIMITERS]
            last = between[-1] if between else b - 1
            spans.append((start, last + 1))
            start = last + 1
        spans.append((start, n))
        out.append(make_sentence(toks, concept_pos, spans))
    return out


class SetFlags:
    """Delimiter flags from word sets (the feature id of each word)."""

    def __init__(self, deterministic=("on", "in", "sat", "is", ".", "of", "to", "said", "went", "with"),
                 probabilistic=("and", ",")):
        self.det = {feature_id(w) for w in deterministic}
        self.prob = {feature_id(w) for w in probabilistic}

    def is_deterministic(self, f: int) -> bool:
        return f in self.det

    def is_probabilistic(self, f: int) -> bool:
        return f in self.prob
