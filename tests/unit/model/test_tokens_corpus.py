"""Tests of tools/prepare_corpus.py: the SWORD zText decoder and the OSIS cleaner (synthetic module)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from tools.prepare_corpus import ModuleFormatError, chapters, clean_osis, read_slots


def test_clean_osis_drops_notes_titles_and_markup() -> None:
    osis = ('<title type="x">Heading</title><w lemma="s:1">In</w> <w>the</w> <w>beginning</w>, '
            '<w>God</w><note placement="foot"><reference>1:1</reference>Hebrew “Elohim”</note>'
            '<w>created</w> &amp; <q marker="">made</q>   it. <milestone type="x"/>')
    assert clean_osis(osis) == "In the beginning, God created & made it."


def _module(tmp_path: Path, testament: str, slots: list[str], block_size: int = 2) -> None:
    """Write a zText testament: slots packed `block_size` per zlib block; '' = empty slot."""
    bzs, bzv, bzz = bytearray(), bytearray(), bytearray()
    for b in range(0, len(slots), block_size):
        chunk = [s.encode() for s in slots[b:b + block_size]]
        raw = b"".join(chunk)
        comp = zlib.compress(raw)
        bzs += struct.pack("<III", len(bzz), len(comp), len(raw))
        off = 0
        for c in chunk:
            bzv += struct.pack("<IIH", b // block_size, off, len(c))
            off += len(c)
        bzz += comp
    for ext, data in (("bzs", bzs), ("bzv", bzv), ("bzz", bzz)):
        (tmp_path / f"{testament}.{ext}").write_bytes(bytes(data))


def test_chapters_from_a_synthetic_module(tmp_path: Path) -> None:
    _module(tmp_path, "ot", [
        "", "<milestone/>", "<div type='front'/>A preface.",
        '<chapter sID="Gen.1"/>', "<w>First</w> verse.", "Second <note>n</note>verse.",
        '<chapter sID="Gen.2"/>Opening words.', "More.",
    ])
    _module(tmp_path, "nt", [
        '<chapter sID="Matt.1"/>', "Last verse. The following words used in the World English Bible: x",
    ])
    assert list(chapters(tmp_path)) == [
        "First verse. Second verse.", "Opening words. More.", "Last verse.",
    ]
    assert len(list(read_slots(tmp_path, "ot"))) == 7


def test_damaged_module_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModuleFormatError, match="apt-get install -y sword-text-web"):
        list(read_slots(tmp_path, "ot"))
    _module(tmp_path, "ot", ["a", "b", "c"])
    bzv = (tmp_path / "ot.bzv").read_bytes()
    (tmp_path / "ot.bzv").write_bytes(bzv + struct.pack("<IIH", 99, 0, 1))
    with pytest.raises(ModuleFormatError, match="block 99 out of range"):
        list(read_slots(tmp_path, "ot"))
    (tmp_path / "ot.bzv").write_bytes(bzv[:-3])
    with pytest.raises(ModuleFormatError, match="not whole records"):
        list(read_slots(tmp_path, "ot"))


def test_per_verse_texts(tmp_path: Path) -> None:
    _module(tmp_path, "ot", ['<chapter sID="Gen.1"/>', "One.", "Two."])
    _module(tmp_path, "nt", ['<chapter sID="Matt.1"/>Three.'])
    assert list(chapters(tmp_path, per_verse=True)) == ["One.", "Two.", "Three."]


def test_prepare_corpus_without_the_module_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing SWORD module (the package not installed) ended in a ModuleFormatError traceback, exit 1."""
    from tools.prepare_corpus import main

    assert main(["--excerpt", str(tmp_path / "x.conllu.gz"), "--module-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prepare_corpus: error: ") and "sword-text-web" in err[0]
    assert list(tmp_path.iterdir()) == []
