"""Tagging through spaCy (marked `spacy`: needs the en_core_web_sm model, installed in the venv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.model.columns import ColumnAssigner, spans
from giaannd.model.tokens import load_english, read_conllu, tag_file_cached, tag_texts

pytestmark = pytest.mark.spacy


@pytest.fixture(scope="module")
def nlp():
    return load_english(sentences=True)


def test_tag_texts_lean_pipeline_splits_and_tags(nlp) -> None:
    assert "parser" not in nlp.pipe_names and "ner" not in nlp.pipe_names
    assert "senter" in nlp.pipe_names
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
