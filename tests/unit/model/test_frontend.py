"""The reference's front end (issue 17) where it needs no spaCy: whitespace tokens in CoNLL-U, the
lexicon's verb.exc fix and other ever-POS dictionaries, unambiguous export keys, old exports."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest

from giaannd.model.columns import ColumnAssigner
from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl, read_jsonl, write_jsonl
from giaannd.model.lexicon import Lexicon, LexiconFileError, PosClass, load_lexicon
from giaannd.model.tokens import Token, load_bundled_corpus, read_conllu, write_conllu

V, A, C, S = PosClass.VERB, PosClass.ADP, PosClass.CCONJ, PosClass.SCONJ


def _tok(form: str, upos: str, lemma: str | None = None, xpos: str = "XX") -> Token:
    return Token(form, lemma if lemma is not None else form.lower(), upos, xpos)


# -- whitespace tokens -------------------------------------------------------------------------

#: "Leave a comment\t Little Dee ..." as the reference's tagger gives it: the tab run is a token.
TAB_SENTENCE = (
    _tok("Leave", "VERB", "leave", "VB"), _tok("a", "DET", xpos="DT"), _tok("comment", "NOUN", xpos="NN"),
    Token("\t ", "\t ", "SPACE", "_SP"), _tok("Little", "PROPN", "Little", "NNP"),
    _tok("Dee", "PROPN", "Dee", "NNP"), _tok("said", "VERB", "say", "VBD"), _tok("hello", "INTJ", xpos="UH"),
    _tok(".", "PUNCT", xpos="."),
)


@pytest.mark.parametrize("name", ["ws.conllu", "ws.conllu.gz"])
def test_whitespace_tokens_round_trip_through_conllu(tmp_path: Path, name: str) -> None:
    odd = (Token("\n", "\n", "SPACE", "_SP"), Token("\r\t\\", "\r\t\\", "SPACE", "_SP"),
           Token("  ", "  ", "SPACE", "_SP"), _tok("x", "X"))
    assert write_conllu([TAB_SENTENCE, odd], tmp_path / name) == 2
    text = gzip.decompress((tmp_path / name).read_bytes()) if name.endswith(".gz") else (tmp_path / name).read_bytes()
    assert all(line.count(b"\t") == 9 for line in text.splitlines() if line)  # still 10 columns
    assert list(read_conllu(tmp_path / name)) == [TAB_SENTENCE, odd]


def test_tab_token_splits_the_noun_phrase() -> None:
    enc = ColumnAssigner(min_tokens=1).encode(TAB_SENTENCE)
    assert enc is not None
    assert enc.column_lemma == ("comment", "little_dee")  # not "comment_little_dee"
    assert "\t " in enc.words


# -- the lexicon -------------------------------------------------------------------------------

@pytest.mark.parametrize("word", ["easy", "flat", "fun", "mad", "may", "might", "pretty"])
def test_verb_exc_bases_that_are_no_wordnet_verb_are_not_verbs(word: str) -> None:
    assert not Lexicon.default().can_be(word, V)


@pytest.mark.parametrize("word", ["sit", "sat", "went", "gone", "walked", "stopping"])
def test_real_verb_forms_stay_verbs(word: str) -> None:
    assert Lexicon.default().can_be(word, V)


def test_may_is_no_deterministic_delimiter() -> None:
    sent = (_tok("The", "DET", xpos="DT"), _tok("cat", "NOUN", xpos="NN"), _tok("may", "AUX", xpos="MD"),
            _tok("well", "ADV", xpos="RB"), _tok("dog", "NOUN", xpos="NN"), _tok(".", "PUNCT", xpos="."))
    assigner = ColumnAssigner(min_tokens=1)
    assert assigner.token_is_deterministic("may", "may", "MD") is False
    enc = assigner.encode(sent)
    assert enc is not None and enc.instance.tolist() == [0, 0, 0, 0, 1, 1]  # fallback boundary before "dog"


def _reference_pickle(pos_dicts: dict[str, list[str]]) -> bytes:
    payload = {"posDicts": pos_dicts, "metadata": {"source": "WordNet+NLTK", "pos": ["VERB", "ADP"]}}
    return gzip.compress(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))


def test_reference_pickle_loads_safely(tmp_path: Path) -> None:
    path = tmp_path / "everPos.wordnet.pkl.gz"
    path.write_bytes(_reference_pickle({"VERB": ["run", "may"], "ADP": ["on", "in spite"], "CCONJ": ["and"],
                                        "SCONJ": ["if"], "AUX": ["may"], "NOUN": ["cat"], "ADJ": []}))
    lex = load_lexicon(path)
    assert lex.classes("may") == V | PosClass.AUX and lex.classes("on") == A
    assert lex.can_be("in spite", A) and lex.classes("and") == C and lex.classes("if") == S
    assert lex.classes("cat") == PosClass.NONE  # classes the delimiter rules never ask about are dropped
    assert any("reference" in h for h in lex.header)
    assert ColumnAssigner(lex).token_is_deterministic("may", "may", "MD")


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_pickle_that_would_run_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"posDicts": {"VERB": [_Boom()]}}))
    with pytest.raises(LexiconFileError, match="builtins.print"):
        load_lexicon(path)
    assert "pwned" not in capsys.readouterr().out
    path.write_bytes(pickle.dumps({"posDicts": {"VERB": "not a list"}}))
    with pytest.raises(LexiconFileError, match="posDicts"):
        load_lexicon(path)


def test_word_pos_tsv_and_own_format_load(tmp_path: Path) -> None:
    tsv = tmp_path / "pos.tsv"
    tsv.write_text("# word\tpos\nrun\tVERB\non\tADP,SCONJ\nrun\tNOUN\nand\tCCONJ\n", encoding="utf-8")
    lex = load_lexicon(tsv)
    assert lex.classes("run") == V and lex.classes("on") == A | S and lex.classes("and") == C
    tsv.write_text("run\tVERB\nbad line\n", encoding="utf-8")
    with pytest.raises(LexiconFileError, match=r"pos.tsv:2"):
        load_lexicon(tsv)
    tsv.write_text("run\tVREB\n", encoding="utf-8")
    with pytest.raises(LexiconFileError, match="VREB"):
        load_lexicon(tsv)
    own = tmp_path / "own.tsv.gz"
    own.write_bytes(gzip.compress(Lexicon({"go": V}, header=["t"]).dumps().encode()))
    assert load_lexicon(own).classes("go") == V
    with pytest.raises(LexiconFileError, match="cannot read"):
        load_lexicon(tmp_path / "absent.pkl")


# -- export keys -------------------------------------------------------------------------------

def _key(d: dict[str, object]) -> tuple[object, ...]:
    return (d["source_lemma"], d["source_word"], d["source_prime"], d["segment"], d["target_lemma"],
            d["target_word"], d["target_prime"])


def test_export_keys_are_unique_on_the_bundled_corpus() -> None:
    engine = Engine()
    engine.train(load_bundled_corpus(3000))
    lines = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    keys = {_key(d) for d in lines}
    assert len(keys) == len(lines) == engine.store.num_entries
    # the pairs that used to collide: a prime neuron and a feature whose word is its column's lemma
    assert any(d["source_prime"] is False and d["source_word"] == d["source_lemma"] for d in lines)


def test_old_exports_without_the_prime_fields_still_read(tmp_path: Path) -> None:
    engine = Engine()
    engine.train(load_bundled_corpus(60))
    path = tmp_path / "new.jsonl"
    write_jsonl(engine.store, engine.assigner.vocab, path)
    new = list(read_jsonl(path))
    assert len(new) == engine.store.num_entries
    old = tmp_path / "old.jsonl"
    with old.open("w", encoding="utf-8") as fh:
        for line in path.read_text(encoding="utf-8").splitlines():
            d = json.loads(line)
            del d["source_prime"], d["target_prime"]
            fh.write(json.dumps(d) + "\n")
    got = list(read_jsonl(old))
    assert [(e.source_lemma, e.source_word, e.segment, e.strength) for e in got] == \
        [(e.source_lemma, e.source_word, e.segment, e.strength) for e in new]
    # an old line has no prime field: a word equal to its lemma is read as the prime neuron (the
    # only reading an old export allows)
    assert all(e.source_prime == (e.source_word == e.source_lemma) for e in got)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text(encoding="utf-8").splitlines()[0] + '\n{"source_lemma": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(read_jsonl(bad))
