"""Tests of column assignment (giaannd.model.columns): giaann-algorithm.md §2.3–2.5 and §3.1 steps 1–4."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.model.columns import ColumnAssigner, EncodeStats, merge_nouns, spans
from giaannd.model.ids import PRIME_FEATURE, column_id, feature_id
from giaannd.model.lexicon import Lexicon, PosClass
from giaannd.model.tokens import TaggedSentence, Token, load_bundled_corpus
from giaannd.model.vocab import IdCollisionError, Vocabulary


def sent(text: str) -> TaggedSentence:
    """'form/lemma/UPOS/XPOS ...' -> tokens; a bare 'form/UPOS/XPOS' uses the form as lemma."""
    out = []
    for item in text.split():
        parts = item.rsplit("/", 3) if item.count("/") >= 3 else item.rsplit("/", 2)
        if len(parts) == 3:
            parts = [parts[0], parts[0], parts[1], parts[2]]
        out.append(Token(*parts))
    return tuple(out)


# A small lexicon, so the rule tests do not depend on what WordNet happens to list.
LEX = Lexicon(
    {
        "sat": PosClass.VERB, "sit": PosClass.VERB, "be": PosClass.VERB, "is": PosClass.VERB,
        "on": PosClass.ADP | PosClass.SCONJ, "in": PosClass.ADP | PosClass.SCONJ,
        "and": PosClass.CCONJ, "or": PosClass.CCONJ,
    }
)

BLACK_CAT = sent(
    "the/DET/DT black/ADJ/JJ cat/NOUN/NN sat/sit/VERB/VBD on/ADP/IN the/DET/DT old/ADJ/JJ mat/NOUN/NN "
    "and/CCONJ/CC the/DET/DT dog/NOUN/NN is/be/AUX/VBZ asleep/ADJ/JJ ./PUNCT/."
)
CAT_MAT = sent("the/DET/DT cat/NOUN/NN sat/sit/VERB/VBD on/ADP/IN the/DET/DT mat/NOUN/NN ./PUNCT/.")
NEW_YORK = sent(
    "New/PROPN/NNP York/PROPN/NNP City/PROPN/NNP is/be/AUX/VBZ a/DET/DT large/ADJ/JJ city/NOUN/NN "
    "in/ADP/IN the/DET/DT United/PROPN/NNP States/States/PROPN/NNPS ./PUNCT/."
)


def assigner(**kw) -> ColumnAssigner:
    kw.setdefault("min_tokens", 1)
    return ColumnAssigner(kw.pop("lexicon", LEX), **kw)


@pytest.mark.parametrize("lexicon", [LEX, None], ids=["test-lexicon", "shipped-lexicon"])
@pytest.mark.parametrize(
    ("sentence", "want_spans", "want_columns"),
    [
        (BLACK_CAT, [(0, 5), (5, 9), (9, 14)], ("cat", "mat", "dog")),
        (CAT_MAT, [(0, 4), (4, 7)], ("cat", "mat")),
        (NEW_YORK, [(0, 2), (2, 6), (6, 9)], ("new_york_city", "city", "united_states")),
    ],
)
def test_reference_examples_of_section_2_5(sentence, want_spans, want_columns, lexicon) -> None:
    enc = ColumnAssigner(lexicon, min_tokens=1).encode(sentence)
    assert enc is not None
    assert spans(enc) == want_spans
    assert enc.column_lemma == want_columns


def test_worked_example_ids_and_features() -> None:
    ca = assigner()
    enc = ca.encode(CAT_MAT)
    assert enc is not None
    assert enc.words == ("the", "cat", "sat", "on", "the", "mat", ".")
    assert enc.lemmas == ("the", "cat", "sit", "on", "the", "mat", ".")
    assert enc.is_concept.tolist() == [False, True, False, False, False, True, False]
    assert enc.instance.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert enc.noun_position.tolist() == [1, 5]
    cat, mat = column_id("cat"), column_id("mat")
    assert enc.column.tolist() == [cat] * 4 + [mat] * 3
    want = [feature_id("the"), PRIME_FEATURE, feature_id("sat"), feature_id("on"), feature_id("the"),
            PRIME_FEATURE, feature_id(".")]
    assert enc.feature.tolist() == want
    assert enc.column.dtype == np.uint64 and enc.feature.dtype == np.uint64
    assert enc.instance.dtype == np.int32 and enc.noun_position.dtype == np.int32
    assert enc.target_word(1) == "cat" and enc.target_word(2) == "sat"
    assert ca.vocab.column_lemma(cat) == "cat"
    assert ca.vocab.word_of(mat, PRIME_FEATURE) == "mat"
    assert ca.vocab.word_of(mat, feature_id("sat")) == "sat"
    assert ca.is_deterministic(feature_id("on")) and ca.is_deterministic(feature_id("."))
    assert not ca.is_deterministic(feature_id("the"))


def test_merge_nouns_hyphen_and_runs() -> None:
    s = sent("a/DET/DT well/NOUN/NN -/PUNCT/HYPH known/NOUN/NN –/PUNCT/: fact/NOUN/NN New/PROPN/NNP "
             "York/PROPN/NNP -/PUNCT/HYPH ,/PUNCT/, -/PUNCT/HYPH cat/NOUN/NN")
    merged = merge_nouns(s)
    assert [t.form for t in merged] == ["a", "well-known-fact_New_York", "-", ",", "-", "cat"]  # en dash joins as "-"
    assert merged[1].upos == "NOUN" and merged[1].xpos == "NN"  # POS of the first part
    run = merge_nouns(sent("the/DET/DT Dead/PROPN/NNP Seas/Sea/PROPN/NNPS"))
    assert (run[1].form, run[1].lemma, run[1].upos) == ("Dead_Seas", "Dead_Sea", "PROPN")
    assert merge_nouns(CAT_MAT) == CAT_MAT


def test_probabilistic_first_candidate_only_and_stored_flags_persist() -> None:
    ca = assigner()
    comma, and_ = feature_id(","), feature_id("and")
    s1 = sent("the/DET/DT cat/NOUN/NN ,/PUNCT/, and/CCONJ/CC the/DET/DT dog/NOUN/NN ./PUNCT/.")
    enc = ca.encode(s1)
    # "," is the first candidate between cat and dog: only it becomes probabilistic, and it is
    # used for this very sentence (flags are updated before columns are assigned).
    assert ca.is_probabilistic(comma) and not ca.is_probabilistic(and_)
    assert spans(enc) == [(0, 3), (3, 7)]
    s2 = sent("the/DET/DT cat/NOUN/NN and/CCONJ/CC the/DET/DT dog/NOUN/NN ./PUNCT/.")
    assert spans(ca.encode(s2)) == [(0, 3), (3, 6)]
    assert ca.is_probabilistic(and_)
    # Now both are stored: the rightmost probabilistic one ("and") closes the span, although
    # "," is still the first candidate in this sentence.
    assert spans(ca.encode(s1)) == [(0, 4), (4, 7)]
    # A fresh assigner seeded with the replicated set behaves the same.
    fresh = assigner(probabilistic_flags={comma, and_})
    assert spans(fresh.encode(s1)) == [(0, 4), (4, 7)]


def test_probabilistic_needs_no_deterministic_between_nouns() -> None:
    ca = assigner()
    enc = ca.encode(sent("the/DET/DT cat/NOUN/NN sat/sit/VERB/VBD and/CCONJ/CC the/DET/DT dog/NOUN/NN"))
    assert not ca.is_probabilistic(feature_id("and"))
    assert spans(enc) == [(0, 3), (3, 6)]  # "sat" is the rightmost (and only) deterministic one
    # Before the first noun or after the last there is no noun pair: never probabilistic.
    ca.encode(sent("and/CCONJ/CC the/DET/DT cat/NOUN/NN or/CCONJ/CC"))
    assert not ca.is_probabilistic(feature_id("and")) and not ca.is_probabilistic(feature_id("or"))


def test_deterministic_flag_is_fixed_at_first_sight() -> None:
    ca = assigner()
    apos = feature_id("'")
    ca.encode(sent("the/DET/DT kings/king/NOUN/NNS '/PART/POS crown/NOUN/NN"))
    assert ca.is_deterministic(apos)
    # Later the same word as a closing quote (tag ''): the stored flag still makes it a boundary.
    enc = ca.encode(sent("a/DET/DT cat/NOUN/NN '/PUNCT/'' a/DET/DT dog/NOUN/NN"))
    assert spans(enc) == [(0, 3), (3, 5)]
    # The other order: first seen as a quote -> stored False; a later possessive use blocks the
    # probabilistic rule in its span (contextual test) but is no boundary -> fallback n_{i+1}-1.
    ca2 = assigner()
    ca2.encode(sent("a/DET/DT cat/NOUN/NN '/PUNCT/'' ,/PUNCT/, dog/NOUN/NN"))
    assert not ca2.is_deterministic(apos) and ca2.is_probabilistic(feature_id(","))
    ca3 = assigner()
    ca3.encode(sent("a/DET/DT cat/NOUN/NN '/PUNCT/'' x/X/XX dog/NOUN/NN"))
    enc = ca3.encode(sent("the/DET/DT kings/king/NOUN/NNS '/PART/POS or/CCONJ/CC crown/NOUN/NN"))
    assert not ca3.is_probabilistic(feature_id("or"))
    assert spans(enc) == [(0, 4), (4, 5)]  # fallback: "or" (n_{i+1}-1) ends the kings span
    assert ca3.stats.fallback_boundaries == 2


def test_flags_round_trip_into_a_fresh_assigner() -> None:
    ca = assigner()
    ca.encode(sent("the/DET/DT kings/king/NOUN/NNS '/PART/POS ,/PUNCT/, and/CCONJ/CC crown/NOUN/NN"))
    ca.encode(sent("the/DET/DT cat/NOUN/NN ,/PUNCT/, the/DET/DT dog/NOUN/NN"))
    assert ca.probabilistic_flags == {feature_id(",")}
    other = assigner(probabilistic_flags=ca.probabilistic_flags)
    other.add_deterministic_flags({feature_id("'"): False, feature_id("the"): True})
    other.add_deterministic_flags(ca.deterministic_flags)  # first sighting wins: "'" stays False
    assert not other.is_deterministic(feature_id("'")) and other.is_deterministic(feature_id("the"))
    assert other.is_probabilistic(feature_id(","))


def test_no_delimiter_fallback_and_v1_skip() -> None:
    s = sent("the/DET/DT big/ADJ/JJ cat/NOUN/NN the/DET/DT small/ADJ/JJ dog/NOUN/NN ./PUNCT/.")
    ca = assigner()
    assert spans(ca.encode(s)) == [(0, 5), (5, 7)]
    assert ca.stats.fallback_boundaries == 1
    v1 = assigner(no_delimiter="skip")
    assert v1.encode(s) is None
    assert v1.stats.skipped_no_delimiter == 1 and v1.stats.encoded == 0


def test_inference_does_not_store_flags() -> None:
    ca = assigner()
    s = sent("the/DET/DT cat/NOUN/NN and/CCONJ/CC the/DET/DT dog/NOUN/NN")
    enc = ca.encode(s, update_flags=False)
    assert spans(enc) == [(0, 3), (3, 5)]  # the sentence's own flags are used ...
    assert not ca.probabilistic_flags and not ca.deterministic_flags  # ... but not stored
    assert ca.encode(s) is not None
    assert ca.probabilistic_flags == {feature_id("and")}


def test_skipped_sentences_are_counted() -> None:
    ca = ColumnAssigner(LEX)  # default length rules: 9 .. 80 tagger tokens
    no_noun = sent(" ".join(["it/PRON/PRP ran/run/VERB/VBD"] * 5))
    short = sent("the/DET/DT cat/NOUN/NN sat/sit/VERB/VBD ./PUNCT/.")
    long_ = sent(" ".join(["the/DET/DT cat/NOUN/NN sat/sit/VERB/VBD ./PUNCT/."] * 25))
    # 9 tagger tokens, 7 after the merge: the length rule applies before the merges.
    nine = sent("New/PROPN/NNP York/PROPN/NNP City/PROPN/NNP is/be/AUX/VBZ a/DET/DT large/ADJ/JJ "
                "city/NOUN/NN ./PUNCT/. ./PUNCT/.")
    results = [ca.encode(s) for s in ((), no_noun, short, long_, nine)]
    assert [r is None for r in results] == [True, True, True, False, False]
    assert len(results[3]) == 80 and len(results[4]) == 7
    assert ca.stats == EncodeStats(seen=5, encoded=2, skipped_empty=1, skipped_too_short=1,
                                   skipped_no_concept=1, cropped=1)
    assert ca.stats.skipped == 3
    strict = ColumnAssigner(LEX, overlong="skip")
    assert strict.encode(long_) is None and strict.stats.skipped_too_long == 1


def test_bad_configuration() -> None:
    with pytest.raises(ValueError):
        ColumnAssigner(LEX, min_tokens=10, max_tokens=5)
    with pytest.raises(ValueError):
        ColumnAssigner(LEX, overlong="truncate")  # type: ignore[arg-type]


def test_vocabulary_merge_and_collision() -> None:
    a, b = Vocabulary(), Vocabulary()
    a.add_column("cat")
    b.add_feature("sat")
    a.merge(b)
    assert a.feature_word(feature_id("sat")) == "sat" and a.num_columns == 1
    a._features[feature_id("on")] = "upon"  # simulate a 64-bit collision
    with pytest.raises(IdCollisionError, match="both 'upon' and 'on'"):
        a.add_feature("on")


def test_bundled_corpus_encodes_with_invariants() -> None:
    ca = ColumnAssigner()
    sentences = load_bundled_corpus(limit=2000)
    encoded = list(ca.encode_many(sentences))
    assert ca.stats.seen == 2000 and ca.stats.encoded == len(encoded) > 1200
    assert ca.stats.encoded + ca.stats.skipped == ca.stats.seen
    for enc in encoded:
        n = len(enc)
        assert 1 <= n <= 80
        inst = enc.instance
        assert inst[0] == 0 and np.all(np.diff(inst) >= 0) and np.all(np.diff(inst) <= 1)
        assert inst[-1] == enc.num_instances - 1
        # every instance owns exactly one concept token: its noun, with feature 0
        assert np.array_equal(np.flatnonzero(enc.is_concept), enc.noun_position)
        assert np.array_equal(inst[enc.noun_position], np.arange(enc.num_instances))
        assert np.all(enc.feature[enc.is_concept] == 0) and np.all(enc.feature[~enc.is_concept] != 0)
        assert enc.column.tolist() == [column_id(enc.column_lemma[i]) for i in inst]
    assert len(ca.probabilistic_flags) > 0
