"""The giaann-v2 profile (giaann-algorithm.md §2.7): subwords, inherited POS, fixed ids, quirks, limits."""

import numpy as np
import pytest

from giaannd.model.engine import Engine
from giaannd.model.infer import TRAIN_SET
from giaannd.model.subwords import (
    MAX_SEQUENCE_BYTES,
    SubwordAssigner,
    SubwordVocabulary,
    detokenise,
    encoding,
    group_sentences,
    make_assigner,
    subwords,
)
from giaannd.model.tokens import TaggedText, Token, load_bundled_corpus

pytestmark = pytest.mark.timeout(120)


def tagged(*words):
    """A TaggedText from (text-with-leading-spaces, upos, xpos) triples, the text being their join."""
    text, toks, starts = "", [], []
    for form, upos, xpos in words:
        lead = len(form) - len(form.lstrip(" ")) if upos != "SPACE" else 0
        starts.append(len(text) + lead)
        toks.append(Token(form[lead:], form[lead:], upos, xpos))
        text += form
    return TaggedText(text, tuple(toks), tuple(starts))


def by_piece(sub):
    return list(zip(sub.text, sub.upos))


def test_ids_match_the_published_o200k_encoding():
    enc = encoding()
    assert enc.n_vocab == 200_019
    assert enc.encode_ordinary(" the") == [290]
    assert enc.encode_ordinary("In") == [637]
    assert enc.encode_ordinary("Hello, world!") == [13225, 11, 2375, 0]


SENT = tagged(("Elina", "PROPN", "NNP"), (" plays", "VERB", "VBZ"), (" at", "ADP", "IN"),
              (" the", "DET", "DT"), (" recruitment", "NOUN", "NN"), (" platform", "NOUN", "NN"),
              (" and", "CCONJ", "CC"), (" ", "SPACE", "_SP"), (" 12345", "NUM", "CD"), (" cats", "NOUN", "NNS"),
              (" sleep", "VERB", "VBP"), (" +", "NOUN", "NN"), (".", "PUNCT", "."))


def test_subwords_inherit_the_pos_of_the_word_they_overlap_then_classes_by_characters():
    sub = subwords(SENT)
    assert by_piece(sub) == [
        ("El", "PROPN"), ("ina", "PROPN"),  # both pieces of "Elina" inherit its PROPN
        (" plays", "VERB"), (" at", "ADP"), (" the", "DET"), (" recruitment", "NOUN"), (" platform", "NOUN"),
        (" and", "CCONJ"), (" ", "SPACE"), (" ", "SPACE"),  # whitespace-only pieces are SPACE
        ("123", "NUM"), ("45", "NUM"),  # digit groups (spaCy's " 12345" word: NUM too)
        (" cats", "NOUN"), (" sleep", "VERB"),
        (" +", "SYM"),  # a symbol piece is SYM whatever the tagger said
        (".", "PUNCT")]
    assert sub.xpos[8] == sub.xpos[9] == "_SP" and sub.xpos[0] == "NNP"
    assert sub.token_id.tolist()[4:6] == encoding().encode_ordinary(" the recruitment")


def test_columns_are_token_ids_features_token_ids_plus_one_first_noun_piece_only():
    a = SubwordAssigner()
    enc = a.encode(SENT)
    ids = subwords(SENT).token_id.tolist()
    # columns: 'El' (Elina: "ina" is a feature of it), ' recruitment' (' platform' is a feature),
    # ' cats'; no merging, no lower-casing
    assert enc.column_lemma == ("El", " recruitment", " cats")
    assert enc.noun_position.tolist() == [0, 5, 12]
    assert enc.is_concept.tolist() == [i in (0, 5, 12) for i in range(len(ids))]
    assert enc.feature.tolist() == [0 if i in (0, 5, 12) else t + 1 for i, t in enumerate(ids)]
    assert enc.column[enc.noun_position].tolist() == [ids[0], ids[5], ids[12]]
    assert enc.words[6] == " platform" and enc.lemmas[6] == " platform"
    assert int(enc.feature[6]) == 6361 + 1  # ' platform' = 6361 in o200k_base
    # spans: ' at' (ADP in context) is the rightmost deterministic delimiter before ' recruitment';
    # between ' platform' and ' cats' only ' and' (CCONJ: probabilistic, the first) closes the span
    assert enc.instance.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert a.is_deterministic(ids[3] + 1) and a.is_probabilistic(ids[7] + 1)
    assert enc.token_id.tolist() == ids
    vocab = a.vocab
    assert vocab.word_of(ids[5], 0) == " recruitment" and vocab.word_of(ids[5], ids[6] + 1) == " platform"


def test_delimiter_words_are_compared_with_the_leading_space():
    # "The dog is an animal": ' is' is not 'is' and AUX is not VERB, so there is no delimiter
    # between the nouns (the nᵢ₊₁−1 fallback cuts before ' animal') ...
    a = SubwordAssigner()
    s = tagged(("The", "DET", "DT"), (" dog", "NOUN", "NN"), (" is", "AUX", "VBZ"), (" an", "DET", "DT"),
               (" animal", "NOUN", "NN"), (" that", "PRON", "WDT"), (" runs", "VERB", "VBZ"), (" fast", "ADV", "RB"),
               (" today", "NOUN", "NN"), (".", "PUNCT", "."))
    enc = a.encode(s)
    assert enc.instance.tolist()[:5] == [0, 0, 0, 0, 1]
    assert a.stats.fallback_boundaries == 1 and not a.probabilistic_flags
    # ... while a bare ',' (no leading space) is a probabilistic candidate
    b = SubwordAssigner()
    s2 = tagged(("The", "DET", "DT"), (" dog", "NOUN", "NN"), (",", "PUNCT", ","), (" the", "DET", "DT"),
                (" animal", "NOUN", "NN"), (" that", "PRON", "WDT"), (" runs", "VERB", "VBZ"), (" fast", "ADV", "RB"),
                (" today", "NOUN", "NN"), (".", "PUNCT", "."))
    enc2 = b.encode(s2)
    assert enc2.instance.tolist()[:5] == [0, 0, 0, 1, 1]
    assert b.probabilistic_flags == {11 + 1}  # ',' = 11


def test_limits_9_tokens_80_tokens_2560_bytes_160_subwords():
    a = SubwordAssigner()
    word = ("cat", "NOUN", "NN")
    assert a.encode(tagged(*[word] + [(" cat", "NOUN", "NN")] * 7)) is None  # 8 spaCy tokens
    assert a.stats.skipped_too_short == 1
    nine = a.encode(tagged(*[word] + [(" cat", "NOUN", "NN")] * 8))
    assert nine is not None and len(nine) == 9
    long_ = a.encode(tagged(*[word] + [(" runs", "VERB", "VBZ"), (" cat", "NOUN", "NN")] * 50))  # 101 words
    assert a.stats.cropped == 1 and len(long_) == 80  # one subword per word here: cropped to 80 words
    big = "x" * (MAX_SEQUENCE_BYTES - 24)  # "ab" + 7 x " ab" + " " = 24 bytes
    ok = tagged(*[("ab", "NOUN", "NN")] + [(" ab", "NOUN", "NN")] * 7 + [(" " + big, "NOUN", "NN")])
    assert len(ok.text.encode()) == MAX_SEQUENCE_BYTES and a.encode(ok) is not None
    over = tagged(*[("ab", "NOUN", "NN")] + [(" ab", "NOUN", "NN")] * 7 + [(" " + big + "é", "NOUN", "NN")])
    assert a.encode(over) is None and a.stats.skipped_too_many_bytes == 1  # 2,561 bytes (é is 2)
    pieces = tagged(*[word] + [(" 123456789", "NUM", "CD"), (" cat", "NOUN", "NN")] * 39)  # 79 words, 196 subwords
    before = a.stats.cropped_subwords  # the 2,536 x's above were cropped too
    enc = a.encode(pieces)
    assert len(enc) == 160 and a.stats.cropped_subwords == before + 1


def test_detokenise_and_three_sentence_groups():
    s = [Token(f, f, u, "X") for f, u in (("He", "PRON"), ("said", "VERB"), ("(", "PUNCT"), ("yes", "INTJ"),
                                            (")", "PUNCT"), ("it", "PRON"), ("'s", "AUX"), ("done", "VERB"),
                                            (",", "PUNCT"), ("ok", "INTJ"), (".", "PUNCT"))]
    t = detokenise(tuple(s))
    assert t.text == "He said (yes) it's done, ok."
    assert all(t.text[a:a + len(w.form)] == w.form for a, w in zip(t.starts, t.words))
    sents = [(Token(f"w{i}", "w", "X", "X"),) for i in range(7)]
    groups = list(group_sentences(sents + [()]))  # empty sentences are not counted
    assert [len(g) for g in groups] == [3, 3, 1]
    assert [tok.form for tok in groups[1]] == ["w3", "w4", "w5"]  # consecutive, not overlapping


def test_tag_groups_with_spacy_three_sentences_a_sequence():
    pytest.importorskip("spacy")
    from giaannd.model.subwords import tag_groups

    try:
        groups = list(tag_groups(["One cat sat.  Two dogs ran. Three birds flew.\nFour fish swam."]))
    except Exception as exc:  # no English model
        pytest.skip(f"spaCy model unavailable: {exc}")
    assert [g.text for g in groups] == ["One cat sat.  Two dogs ran. Three birds flew.", "Four fish swam."]
    first = groups[0]
    assert all(first.text[a:a + len(w.form)] == w.form for a, w in zip(first.starts, first.words))


def test_train_and_evaluate_round_trip_under_v2():
    engine = Engine(make_assigner("giaann-v2"))
    corpus = list(group_sentences(load_bundled_corpus(240)))
    stats = engine.train(corpus)
    assert stats.sentences_trained == 80
    prompts = engine.encode_prompts(corpus[:20])
    assert all(p.token_id is not None for p in prompts)
    r = engine.evaluate(prompts, constants=TRAIN_SET)
    assert r.prompts == 20 and r.prediction_tokens == sum(len(p) - 8 for p in prompts)
    assert r.top1 > 0.5  # teacher-forced on training sequences: most subwords come back
    out = engine.generate(corpus[0][:6], 5)
    assert out and all(isinstance(w, str) for w in out)
    # every stored row is keyed by token ids: column < 200,019, feature 0 or token id + 1
    keys = np.array([k for k, _ in engine.store], dtype=np.uint64)
    assert keys[:, 0].max() < 200_019 and keys[:, 1].max() <= 200_019
    assert isinstance(engine.assigner.vocab, SubwordVocabulary)


def test_make_assigner_rejects_unknown_profiles():
    with pytest.raises(ValueError, match="model profile"):
        make_assigner("bpe")  # type: ignore[arg-type]
