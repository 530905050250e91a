"""Tests of the ever-POS lexicon (giaannd.model.lexicon) and its builder (tools/build_lexicon.py)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from giaannd.model.lexicon import DEFAULT_LEXICON_FILE, Lexicon, LexiconFormatError, PosClass
from tools import build_lexicon

V, A, C, S = PosClass.VERB, PosClass.ADP, PosClass.CCONJ, PosClass.SCONJ
DATA = Path(__file__).resolve().parents[3] / "giaannd" / "data" / DEFAULT_LEXICON_FILE


def test_shipped_lexicon_loads_with_provenance() -> None:
    lex = Lexicon.default()
    assert len(lex) > 30_000
    assert any("WordNet 3.0" in h for h in lex.header)
    assert any("index.verb sha256" in h for h in lex.header)
    assert lex.count(V) > 30_000
    assert 50 < lex.count(A) < 300


@pytest.mark.parametrize(
    ("word", "has", "lacks"),
    [
        ("on", A | S, V),  # preposition; PTB IN -> ADP and SCONJ
        ("to", A, PosClass.NONE),
        ("because", A | S, C),
        ("that", S, V),
        ("and", C, A | S),
        ("sit", V, A),  # WordNet lemma
        ("sat", V, A),  # verb.exc
        ("went", V, A),  # verb.exc
        ("walked", V, A),  # generated regular form
        ("stopping", V, A),  # doubling
        ("building", V, A),
        ("be", V, A),
        ("'s", V, A),  # contraction seen as VBZ
        ("The", PosClass.NONE, V | A | C | S),  # case-insensitive lookup
        ("when", PosClass.NONE, S),  # PTB WRB -> ADV in the reference
        ("zzzz", PosClass.NONE, V | A | C | S),
    ],
)
def test_shipped_lexicon_classes(word: str, has: PosClass, lacks: PosClass) -> None:
    cls = Lexicon.default().classes(word)
    assert cls & has == has
    assert not cls & lacks


def test_lexicon_round_trip_and_normalisation() -> None:
    lex = Lexicon({"Run": V, "run": PosClass.AUX, "in spite": A}, header=["test"])
    again = Lexicon.loads(lex.dumps())
    assert again.classes("RUN") == V | PosClass.AUX
    assert again.can_be("in spite", A) and "in_spite" in again
    assert again.header == ("test",)
    assert list(again.items()) == list(lex.items())


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not a lexicon\n", "not a giaannd lexicon"),
        ("# giaannd ever-pos lexicon v1\nrun\n", ":2: expected 'word<TAB>flags'"),
        ("# giaannd ever-pos lexicon v1\nrun\tVQ\n", ":2: unknown flag 'Q'"),
        ("# giaannd ever-pos lexicon v1\n# h\nrun\tV\nrun\tA\n", ":4: word 'run' listed twice"),
    ],
)
def test_lexicon_malformed_file(text: str, match: str) -> None:
    with pytest.raises(LexiconFormatError, match=match):
        Lexicon.loads(text)


def test_lexicon_truncated_gzip(tmp_path: Path) -> None:
    data = DATA.read_bytes()
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(data[: len(data) // 3])
    with pytest.raises(LexiconFormatError, match="truncated or corrupt gzip"):
        Lexicon.load(cut)


@pytest.mark.parametrize(
    ("lemma", "forms", "not_forms"),
    [
        ("walk", {"walks", "walked", "walking"}, set()),
        ("stop", {"stops", "stopped", "stopping"}, {"stoped"}),
        ("try", {"tries", "tried", "trying"}, set()),
        ("make", {"makes", "making"}, {"makking"}),
        ("die", {"dies", "died", "dying"}, set()),
        ("watch", {"watches", "watched", "watching"}, set()),
        ("prefer", {"prefers", "preferred", "preferring"}, set()),
        ("panic", {"panicked", "panicking"}, set()),
        ("play", {"plays", "played", "playing"}, set()),
    ],
)
def test_regular_inflections(lemma: str, forms: set[str], not_forms: set[str]) -> None:
    got = build_lexicon.inflections(lemma)
    assert forms <= got
    assert not (not_forms & got)


@pytest.mark.skipif(not Path("/usr/share/wordnet/index.verb").is_file(),
                    reason="needs Debian wordnet-base (apt-get install -y wordnet-base)")
def test_shipped_lexicon_is_reproducible_from_wordnet() -> None:
    built = build_lexicon.build(Path("/usr/share/wordnet"))
    shipped = Lexicon.load(DATA)
    assert list(built.items()) == list(shipped.items())
    assert gzip.decompress(DATA.read_bytes()).decode() == built.dumps()


def test_build_lexicon_without_wordnet_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing WordNet (the package not installed) exited 1, the status of a failure, not 2."""
    with pytest.raises(SystemExit) as exit_:
        build_lexicon.main(["--wordnet-dir", str(tmp_path), "--out", str(tmp_path / "out.tsv.gz")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("build_lexicon: error: ") and "wordnet-base" in err[0]
    assert list(tmp_path.iterdir()) == []
