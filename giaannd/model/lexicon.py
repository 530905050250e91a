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

:func:`load_lexicon` also reads a lexicon the user gives (``--lexicon FILE``, config
``compute.lexicon``), to reproduce the reference exactly: the reference's own ever-POS dictionary
(``everPos.wordnet.pkl.gz``, a gzip'd pickle of ``{"posDicts": {UPOS: [word, ...]}, ...}``), a
``word<TAB>UPOS[,UPOS...]`` text file, or a file in this module's format. The pickle is parsed
with an unpickler that can build only builtin containers and strings (``dict``, ``list``,
``tuple``, ``set``, ``frozenset``, ``str``): a pickle that names any other callable is refused
before anything runs, so an untrusted file cannot execute code.
"""

from __future__ import annotations

import enum
import gzip
import hashlib
import io
import os
import pickle
import zlib
from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache
from importlib import resources
from typing import IO, Any

from giaannd.errors import CorruptDataError, InputError

__all__ = [
    "DEFAULT_LEXICON_FILE",
    "FLAG_LETTERS",
    "Lexicon",
    "LexiconFileError",
    "LexiconFormatError",
    "PosClass",
    "UPOS_TAGS",
    "load_lexicon",
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


#: The 17 Universal POS tags (a word->POS file may name any; only the PosClass ones are kept).
UPOS_TAGS = frozenset({"ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON",
                       "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X"})

#: What the safe unpickler may build: builtin containers and strings, nothing that runs code.
_PICKLE_ALLOWED = frozenset({("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "str")})


class LexiconFormatError(CorruptDataError, ValueError):
    """A lexicon file is malformed; the message names the file and line."""

    reason = "corrupt_lexicon"


class LexiconFileError(InputError):
    """A lexicon file the user named cannot be read or parsed; the message names the file."""

    reason = "bad_lexicon"


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


# --------------------------------------------------------------------------------------------
# lexicons the user gives (the reference's own dictionary, a word->POS file)


class _SafeUnpickler(pickle.Unpickler):
    """Builds only builtin containers and strings; any other global is refused unbuilt."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PICKLE_ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (only builtin containers and strings)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id")


def _classes_of(upos: Iterable[str], source: str, where: str) -> PosClass:
    value = PosClass.NONE
    for tag in upos:
        if tag not in UPOS_TAGS:
            raise LexiconFileError(f"{source}{where}: {tag!r} is not a Universal POS tag")
        value |= PosClass.__members__.get(tag, PosClass.NONE)
    return value


def _from_pos_dicts(pos_dicts: Any, source: str) -> dict[str, PosClass]:
    if not isinstance(pos_dicts, dict):
        raise LexiconFileError(f"{source}: posDicts is not a mapping of POS -> words")
    table: dict[str, PosClass] = {}
    for tag, words in pos_dicts.items():
        if not isinstance(tag, str) or not isinstance(words, (list, tuple, set, frozenset)):
            raise LexiconFileError(f"{source}: posDicts[{tag!r}] is not a collection of words")
        cls = _classes_of([tag], source, "")
        for word in words:
            if not isinstance(word, str):
                raise LexiconFileError(f"{source}: posDicts[{tag!r}] holds a {type(word).__name__}, not a word")
            if cls:
                table[word] = table.get(word, PosClass.NONE) | cls
    return table


def _load_pickle(raw: bytes, source: str) -> dict[str, PosClass]:
    try:
        payload = _SafeUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, MemoryError, RecursionError) as exc:
        raise LexiconFileError(f"{source}: not a loadable ever-POS pickle: {exc}") from None
    pos_dicts = payload.get("posDicts", payload) if isinstance(payload, dict) else payload
    return _from_pos_dicts(pos_dicts, source)


def _load_word_pos(text: str, source: str) -> dict[str, PosClass]:
    table: dict[str, PosClass] = {}
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip() or line.startswith("#"):
            continue
        word, sep, tags = line.partition("\t")
        if not sep or not word or not tags.strip():
            raise LexiconFileError(f"{source}:{lineno}: expected 'word<TAB>UPOS[,UPOS...]'")
        cls = _classes_of([t.strip() for t in tags.split(",") if t.strip()], source, f":{lineno}")
        if cls:
            table[word] = table.get(word, PosClass.NONE) | cls
    return table


def load_lexicon(path: str | os.PathLike[str]) -> Lexicon:
    """A lexicon from a file the user names (gzip'd or not, detected by content): giaannd's own
    format (:meth:`Lexicon.dumps`), the reference's ever-POS pickle (parsed safely, module
    docstring), or ``word<TAB>UPOS[,UPOS...]`` lines (``#`` comments; a word may repeat; POS
    tags other than VERB, ADP, CCONJ, SCONJ and AUX are accepted and ignored).

    Raises:
        LexiconFileError: the file cannot be read, or is none of the three formats.
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise LexiconFileError(f"{source}: cannot read: {exc.strerror or exc}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise LexiconFileError(f"{source}: truncated or corrupt gzip data ({exc})") from None
    name = os.path.basename(source)
    if raw[:1] == b"\x80":  # pickle protocol >= 2
        entries = _load_pickle(raw, source)
        return Lexicon(entries, header=[f"source: the reference's ever-POS pickle {name} sha256 {digest}"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LexiconFileError(f"{source}: neither a pickle nor UTF-8 text") from None
    if text.split("\n", 1)[0].rstrip("\r") == MAGIC:
        try:
            return Lexicon.loads(text, source=source)
        except LexiconFormatError as exc:
            raise LexiconFileError(str(exc)) from None
    entries = _load_word_pos(text, source)
    return Lexicon(entries, header=[f"source: word->POS file {name} sha256 {digest}"])
