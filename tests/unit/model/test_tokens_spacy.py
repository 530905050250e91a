"""Tagging through spaCy (marked `spacy`: needs the en_core_web_sm model, installed in the venv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.model.columns import ColumnAssigner, spans
from giaannd.model.tokens import load_english, read_conllu, tag_file_cached, tag_lines, tag_texts

pytestmark = pytest.mark.spacy


@pytest.fixture(scope="module")
def nlp():
    return load_english()


def test_tag_texts_lean_pipeline_splits_and_tags(nlp) -> None:
    assert "parser" not in nlp.pipe_names and "ner" not in nlp.pipe_names
    assert "senter" not in nlp.pipe_names  # sentences are cut by the rule-based sentencizer first
    sents = list(tag_texts(["The cat sat on the mat.\n  The dogs were sleeping in the house."], nlp=nlp))
    assert [[t.form for t in s] for s in sents] == [
        ["The", "cat", "sat", "on", "the", "mat", "."],
        ["The", "dogs", "were", "sleeping", "in", "the", "house", "."],
    ]
    cat, sat = sents[0][1], sents[0][2]
    assert (cat.upos, cat.xpos, cat.lemma) == ("NOUN", "NN", "cat")
    assert (sat.upos, sat.xpos, sat.lemma) == ("VERB", "VBD", "sit")
    assert sents[1][1].lemma == "dog" and sents[1][1].xpos == "NNS"
    enc = ColumnAssigner(min_tokens=1).encode(sents[0])
    assert enc is not None and spans(enc) == [(0, 4), (4, 7)]


def test_tag_file_cached_tags_once(nlp, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("God saw the light.\n\nIt was good. There was evening.\n", encoding="utf-8")
    first = tag_file_cached(text, tmp_path / "cache", nlp=nlp)
    mtime = first.stat().st_mtime_ns
    assert tag_file_cached(text, tmp_path / "cache", nlp=nlp) == first
    assert first.stat().st_mtime_ns == mtime
    assert [len(s) for s in read_conllu(first)] == [5, 4, 4]
    text.write_text("Changed text.\n", encoding="utf-8")
    assert tag_file_cached(text, tmp_path / "cache", nlp=nlp) != first


# -- the reference's front end (giaann-algorithm.md §2.1; issue 17) ------------------------------

ELIJAH = "Elijah’s Accomplishments 1) He was able to bring fire down from heaven by his prayers."


def test_sentences_split_by_the_rule_based_sentencizer(nlp) -> None:
    sents = list(tag_texts([ELIJAH], nlp=nlp))
    assert len(sents) == 1  # the statistical senter cut it after "Accomplishments"
    assert [t.form for t in sents[0]][:4] == ["Elijah", "’s", "Accomplishments", "1"]
    # each sentence is tagged alone; a sentence's leading whitespace is dropped, newlines are spaces
    two = list(tag_texts(["The cat sat on the mat.\n\tThe dogs were sleeping in the house."], nlp=nlp))
    assert [[t.form for t in s] for s in two] == [
        ["The", "cat", "sat", "on", "the", "mat", "."],
        ["The", "dogs", "were", "sleeping", "in", "the", "house", "."],
    ]


def test_whitespace_runs_stay_tokens_and_split_noun_phrases(nlp) -> None:
    (sent,) = tag_texts(["Leave a comment\t Little Dee said that the house is big."], nlp=nlp)
    space = [t for t in sent if t.upos == "SPACE"]
    assert [t.form for t in space] == ["\t "]
    enc = ColumnAssigner(min_tokens=1).encode(sent)
    assert enc is not None
    assert "comment" in enc.column_lemma and "little_dee" in enc.column_lemma
    assert "comment_little_dee" not in enc.column_lemma


def test_prompt_lines_are_one_sequence_each(nlp) -> None:
    got = list(tag_lines(["The cat sat. The dog ran.", "   ", "", "  Hello\tworld"], nlp=nlp))
    assert [[t.form for t in s] for s in got] == [
        ["The", "cat", "sat", ".", "The", "dog", "ran", "."],
        ["Hello", "\t", "world"],
    ]


def test_tag_cache_keys_include_the_front_end_and_the_mode(nlp, tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text("The cat sat. The dog ran.\nA bird flew.\n", encoding="utf-8")
    paragraphs = tag_file_cached(text, tmp_path / "cache", nlp=nlp)
    lines = tag_file_cached(text, tmp_path / "cache", nlp=nlp, lines=True)
    assert paragraphs != lines
    assert [len(s) for s in read_conllu(paragraphs)] == [4, 4, 4]
    assert [len(s) for s in read_conllu(lines)] == [8, 4]
