"""Tests of giaannd.model.tokens: CoNLL-U reading/writing, bad input, the bundled corpus."""

from __future__ import annotations

import gzip
import io
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.model.tokens import (
    CorpusFormatError,
    Token,
    _parse_conllu_fast,
    _parse_conllu_strict,
    load_bundled_corpus,
    read_conllu,
    stream_conllu,
    write_conllu,
)

GOOD = (
    "# sent_id = 1\n"
    "# text = The cat's mat.\n"
    "1\tThe\tthe\tDET\tDT\t_\t_\t_\t_\t_\n"
    "2-3\tcat's\t_\t_\t_\t_\t_\t_\t_\t_\n"
    "2\tcat\tcat\tNOUN\tNN\t_\t_\t_\t_\t_\n"
    "3\t's\t's\tPART\tPOS\t_\t_\t_\t_\t_\n"
    "3.1\tgone\tgo\tVERB\tVBN\t_\t_\t_\t_\t_\n"
    "4\tmat\tmat\tNOUN\tNN\t_\t_\t_\t_\tSpaceAfter=No\n"
    "5\t.\t.\tPUNCT\t.\t_\t_\t_\t_\t_\n"
    "\n"
    "# comment-only block\n"
    "\n"
    "1\tHi\thi\tINTJ\tUH\t_\t_\t_\t_\t_\n"
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    data = text.encode("utf-8")
    p.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return p


@pytest.mark.parametrize("name", ["a.conllu", "a.conllu.gz"])
def test_read_conllu_skips_comments_ranges_and_empty_nodes(tmp_path: Path, name: str) -> None:
    sents = list(read_conllu(_write(tmp_path, name, GOOD)))
    assert [len(s) for s in sents] == [5, 1]
    assert sents[0][1] == Token("cat", "cat", "NOUN", "NN")
    assert sents[0][2] == Token("'s", "'s", "PART", "POS")
    assert sents[1][0].form == "Hi"


def test_fast_path_takes_well_formed_input() -> None:
    assert _parse_conllu_fast(GOOD) == list(_parse_conllu_strict("t", GOOD))
    assert _parse_conllu_fast(GOOD.replace("\n\n# comment", "\n\n\n \n# comment")) is not None
    assert _parse_conllu_fast(GOOD.replace("3\t's", "4\t's")) is None


def test_read_conllu_accepts_open_text_and_binary_files() -> None:
    assert len(list(read_conllu(io.StringIO(GOOD)))) == 2
    assert len(list(read_conllu(io.BytesIO(gzip.compress(GOOD.encode()))))) == 2


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("2\tcat\tcat\tNOUN\tNN\t_\t_\t_\t_\n", "columns"),
        ("2 cat cat NOUN NN _ _ _ _ _\n", "columns"),
        ("x\tcat\tcat\tNOUN\tNN\t_\t_\t_\t_\t_\n", "not a number"),
        ("3\tcat\tcat\tNOUN\tNN\t_\t_\t_\t_\t_\n", "out of order"),
        ("2\t\tcat\tNOUN\tNN\t_\t_\t_\t_\t_\n", "empty FORM"),
        ("2-x\tcat\tcat\tNOUN\tNN\t_\t_\t_\t_\t_\n", "malformed token id"),
    ],
)
def test_read_conllu_malformed_line_names_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    text = "# c\n1\tThe\tthe\tDET\tDT\t_\t_\t_\t_\t_\n" + line
    p = _write(tmp_path, "bad.conllu", text)
    with pytest.raises(CorpusFormatError) as info:
        list(read_conllu(p))
    assert info.value.line == 3
    assert str(info.value).startswith(f"{p}:3: ")
    assert reason in str(info.value)


def test_read_conllu_truncated_gzip_is_a_clear_error(tmp_path: Path) -> None:
    data = gzip.compress(GOOD.encode() * 50)
    p = tmp_path / "cut.conllu.gz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusFormatError, match=r"cut\.conllu\.gz: truncated or corrupt gzip"):
        list(read_conllu(p))


def test_read_conllu_invalid_utf8_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "latin1.conllu"
    p.write_bytes(b"1\tcaf\xe9\tcaf\xe9\tNOUN\tNN\t_\t_\t_\t_\t_\n")
    with pytest.raises(CorpusFormatError, match=r"latin1\.conllu:1: not valid UTF-8"):
        list(read_conllu(p))
    with pytest.raises(CorpusFormatError, match="cannot read"):
        list(read_conllu(tmp_path / "missing.conllu"))


def test_read_conllu_ids_restart_per_sentence_and_crlf(tmp_path: Path) -> None:
    text = GOOD.replace("\n", "\r\n")
    sents = list(read_conllu(_write(tmp_path, "crlf.conllu", text)))
    assert [len(s) for s in sents] == [5, 1]
    assert sents[0][-1].xpos == "."


@pytest.mark.parametrize("name", ["out.conllu", "out.conllu.gz"])
def test_write_conllu_round_trips(tmp_path: Path, name: str) -> None:
    sents = [
        (Token("The", "the", "DET", "DT"), Token("cats", "cat", "NOUN", "NNS")),
        (),
        (Token("Go", "go", "VERB", "VB"), Token("!", "!", "PUNCT", ".")),
    ]
    n = write_conllu(iter(sents), tmp_path / name)
    assert n == 2
    assert list(read_conllu(tmp_path / name)) == [sents[0], sents[2]]
    assert sorted(os.listdir(tmp_path)) == [name]


def test_write_conllu_failure_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    dest = tmp_path / "keep.conllu.gz"
    good = [(Token("a", "a", "DET", "DT"),)]
    write_conllu(good, dest)
    before = dest.read_bytes()

    def exploding():
        yield (Token("b", "b", "DET", "DT"),)
        raise RuntimeError("tagger crashed")

    with pytest.raises(RuntimeError, match="tagger crashed"):
        write_conllu(exploding(), dest)
    bad = [(Token("b", "b", "DET", "DT"),), (Token("x\ty", "x", "X", "XX"),)]
    with pytest.raises(ValueError, match="sentence 2, token 1: form"):
        write_conllu(bad, dest)
    assert dest.read_bytes() == before
    assert os.listdir(tmp_path) == ["keep.conllu.gz"]
    with pytest.raises(ValueError):
        write_conllu(bad, tmp_path / "new.conllu")
    assert not (tmp_path / "new.conllu").exists()
    assert os.listdir(tmp_path) == ["keep.conllu.gz"]


def test_bundled_corpus_is_real_tagged_text() -> None:
    sents = load_bundled_corpus(limit=200)
    assert len(sents) == 200
    assert sents[0][0].form == "In"
    assert all(tok.form and tok.upos and tok.xpos for s in sents for tok in s)
    upos = {tok.upos for s in sents for tok in s}
    assert {"NOUN", "VERB", "ADP", "DET", "PUNCT"} <= upos


_LINES = [
    "", " ", "# c", "1\tA\ta\tDET\tDT\t_\t_\t_\t_\t_", "2\tB\tb\tNOUN\tNN\t_\t_\t_\t_\t_",
    "3\tC\tc\tVERB\tVB\t_\t_\t_\t_\t_", "1-2\tAB\t_\t_\t_\t_\t_\t_\t_\t_", "1.1\tX\tx\tX\tXX\t_\t_\t_\t_\t_",
    "0\tZ\tz\tX\tXX\t_\t_\t_\t_\t_", "2\tB\tb\tNOUN\tNN", "x\tB\tb\tNOUN\tNN\t_\t_\t_\t_\t_",
    "2\t\tb\tNOUN\tNN\t_\t_\t_\t_\t_", "1\tA\ta\tDET\tDT\t_\t_\t_\t_\t_\r",
]


@given(st.lists(st.sampled_from(_LINES), max_size=30), st.booleans())
@settings(max_examples=300, deadline=None)
def test_fast_reader_agrees_with_strict_reader(lines: list[str], trailing_newline: bool) -> None:
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    fast = _parse_conllu_fast(text)
    try:
        strict = list(_parse_conllu_strict("t", text))
    except CorpusFormatError:
        assert fast is None  # the fast path never accepts what the strict reader rejects
        return
    assert fast is None or fast == strict


@pytest.mark.parametrize("tid", ["²", "1²", "③"])
def test_conllu_id_of_non_decimal_digits_names_file_and_line(tmp_path: Path, tid: str) -> None:
    # str.isdigit() holds for '²' and '③' but int() refuses them: a bare ValueError without the
    # file or line came out of both readers
    text = f"1\tThe\tthe\tDET\tDT\t_\t_\t_\t_\t_\n{tid}\tcat\tcat\tNOUN\tNN\t_\t_\t_\t_\t_\n"
    p = _write(tmp_path, "sup.conllu", text)
    for read in (read_conllu, stream_conllu):
        with pytest.raises(CorpusFormatError) as info:
            list(read(p))
        assert str(info.value).startswith(f"{p}:2: ") and "not a number" in str(info.value)
