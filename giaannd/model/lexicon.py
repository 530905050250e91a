"""The "can this word ever be a VERB / ADP / CCONJ / SCONJ" lexicon (giaann-algorithm.md §2.4).

GIAANN's delimiter rules ask whether a word *could* be a verb or an adposition (or a conjunction)
in some context, not what the tagger said in this one: "on" closes a column span even where spaCy
tagged it a particle. The reference answers from a precomputed ever-POS dictionary (WordNet lemmas
plus the NLTK treebank samples). giaannd ships its own, built reproducibly by
``tools/build_lexicon.py`` from Debian's ``wordnet-base`` (WordNet 3.0) and closed-class lists,
as one small gzip'd text file (``giaannd/data/ever_pos.tsv.gz``): a header of ``#`` lines naming
sources and versions, then one ``word<TAB>flags`` line per word, flags being letters of
:data:`FLAG_LETTERS`. At run time only that file is read; WordNet need not be installed.
See docs/corpus.md for how it can differ from the reference's lexicon.
"""

from __future__ import annotations

import enum
import gzip
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache
from importlib import resources
from typing import IO

from giaannd.errors import CorruptDataError

__all__ = [
    "DEFAULT_LEXICON_FILE",
    "FLAG_LETTERS",
    "Lexicon",
    "LexiconFormatError",
    "PosClass",
    "normalise",
]

#: Package-data file name of the shipped lexicon.
DEFAULT_LEXICON_FILE = "ever_pos.tsv.gz"

#: First line of a lexicon file; bump the version if the line format changes.
MAGIC = "# giaannd ever-pos lexicon v1"


class PosClass(enum.IntFlag):
    """The word classes the delimiter rules ask about (UD UPOS names)."""

    NONE = 0
    VERB = 1
    ADP = 2
    CCONJ = 4
    SCONJ = 8
    #: Auxiliary. Recorded for completeness; the reference's delimiter rules do not consult it
    #: (its deterministic classes are VERB and ADP only; "is" counts through its lemma "be").
    AUX = 16


#: One letter per class in the data file.
FLAG_LETTERS: Mapping[str, PosClass] = {
    "V": PosClass.VERB,
    "A": PosClass.ADP,
    "C": PosClass.CCONJ,
    "S": PosClass.SCONJ,
    "X": PosClass.AUX,
}


class LexiconFormatError(CorruptDataError, ValueError):
    """A lexicon file is malformed; the message names the file and line."""

    reason = "corrupt_lexicon"


def normalise(word: str) -> str:
    """Lexicon key of a word or lemma: lower-cased, spaces as underscores (as the reference does)."""
    return word.lower().replace(" ", "_")


def encode_flags(classes: PosClass) -> str:
    """The letters of ``classes`` in the canonical order V, A, C, S, X."""
    return "".join(letter for letter, cls in FLAG_LETTERS.items() if classes & cls)


class Lexicon:
    """An immutable word -> :class:`PosClass` table.

    Args:
        entries: word (any case) -> classes; words are normalised with :func:`normalise`.
        header: the provenance lines of the file it came from (without the leading ``#``).
    """

    __slots__ = ("_classes", "header")

    def __init__(self, entries: Mapping[str, PosClass], *, header: Iterable[str] = ()) -> None:
        table: dict[str, PosClass] = {}
        for word, cls in entries.items():
            key = normalise(word)
            table[key] = table.get(key, PosClass.NONE) | PosClass(cls)
        self._classes = table
        self.header = tuple(header)

    def __len__(self) -> int:
        return len(self._classes)

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and normalise(word) in self._classes

    def items(self) -> Iterator[tuple[str, PosClass]]:
        """(word, classes) pairs, sorted by word."""
        return iter(sorted(self._classes.items()))

    def classes(self, word: str) -> PosClass:
        """Every class the word can ever have (``PosClass.NONE`` if unknown)."""
        return self._classes.get(normalise(word), PosClass.NONE)

    def can_be(self, word: str, classes: PosClass) -> bool:
        """True if the word can ever have at least one of ``classes``."""
        return bool(self._classes.get(normalise(word), PosClass.NONE) & classes)

    def count(self, cls: PosClass) -> int:
        """How many words can have class ``cls``."""
        return sum(1 for v in self._classes.values() if v & cls)

    # ----------------------------------------------------------------------------------------

    def dumps(self) -> str:
        """The file text: magic line, header lines, then sorted ``word<TAB>flags`` lines."""
        lines = [MAGIC]
        lines += [f"# {h}" for h in self.header]
        for word, cls in sorted(self._classes.items()):
            if cls:
                lines.append(f"{word}\t{encode_flags(cls)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def loads(cls, text: str, *, source: str = "<lexicon>") -> Lexicon:
        """Parse the file text written by :meth:`dumps`.

        Raises:
            LexiconFormatError: bad magic line, a line without exactly one tab, an empty word, an
                unknown flag letter, or a repeated word.
        """
        lines = text.split("\n")
        if not lines or lines[0].rstrip("\r") != MAGIC:
            raise LexiconFormatError(f"{source}:1: not a giaannd lexicon (expected {MAGIC!r})")
        header: list[str] = []
        entries: dict[str, PosClass] = {}
        for lineno, line in enumerate(lines[1:], 2):
            line = line.rstrip("\r")
            if not line:
                continue
            if line.startswith("#"):
                header.append(line[1:].strip())
                continue
            word, sep, flags = line.partition("\t")
            if not sep or not word or not flags or "\t" in flags:
                raise LexiconFormatError(f"{source}:{lineno}: expected 'word<TAB>flags'")
            value = PosClass.NONE
            for letter in flags:
                if letter not in FLAG_LETTERS:
                    raise LexiconFormatError(f"{source}:{lineno}: unknown flag {letter!r}")
                value |= FLAG_LETTERS[letter]
            if word in entries:
                raise LexiconFormatError(f"{source}:{lineno}: word {word!r} listed twice")
            entries[word] = value
        return cls(entries, header=header)

    @classmethod
    def load(cls, path_or_file: str | os.PathLike[str] | IO[bytes]) -> Lexicon:
        """Load a (gzip'd or plain) lexicon file."""
        if isinstance(path_or_file, (str, os.PathLike)):
            source = os.fspath(path_or_file)
            with open(source, "rb") as fh:
                raw = fh.read()
        else:
            source = str(getattr(path_or_file, "name", "<stream>"))
            raw = path_or_file.read()
        if raw[:2] == b"\x1f\x8b":
            try:
                raw = gzip.decompress(raw)
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                raise LexiconFormatError(f"{source}: truncated or corrupt gzip data ({exc})") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LexiconFormatError(f"{source}: not valid UTF-8") from exc
        return cls.loads(text, source=source)

    @staticmethod
    @lru_cache(maxsize=1)
    def default() -> Lexicon:
        """The lexicon shipped with giaannd (loaded once per process)."""
        ref = resources.files("giaannd.data").joinpath(DEFAULT_LEXICON_FILE)
        with ref.open("rb") as fh:
            return Lexicon.load(fh)
