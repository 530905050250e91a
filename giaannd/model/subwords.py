"""The ``giaann-v2`` model profile: o200k subwords and 3-sentence sequences (giaann-algorithm.md §2.7).

The reference's v2 defaults, reproduced with their quirks so results compare with it; the ``word``
profile (tokens.py + columns.py) stays the default until this one is measured better.

Theory of operation, text to an :class:`~giaannd.model.sentence.EncodedSentence`:

1. **Sequences** (:func:`tag_groups`). An article's newlines become spaces; the rule-based
   sentencizer splits it; the non-blank sentences are cut into consecutive, *non-overlapping*
   groups of :data:`SENTENCES_PER_SEQUENCE` (the last keeps the 1–2 left over). A group's text is the
   article's own text from its first sentence to the end of its last (leading whitespace stripped),
   tagged by ``en_core_web_sm`` as one text. Prompt lines are one sequence each (:func:`tag_prompt_lines`).
   Pre-tagged sentences (CoNLL-U) have lost their spacing: :func:`group_sentences` joins three and
   :func:`detokenise` rebuilds a text (one space between tokens except before closing punctuation
   and clitics and after opening brackets), an approximation the docs state.
2. **Limits** (:class:`SubwordAssigner`, in this order): under ``min_tokens`` (9) spaCy tokens ->
   dropped; cropped to ``max_tokens`` (80) spaCy tokens; over :data:`MAX_SEQUENCE_BYTES` UTF-8 bytes
   -> refused; cropped to :data:`MAX_SUBWORDS` subwords.
3. **Subwords and POS** (:func:`subwords`). ``encode_ordinary`` (no special tokens). Each subword
   takes the UPOS/tag of the spaCy word its bytes overlap most (ties: the first such word); then a
   whitespace-only piece becomes SPACE, a piece whose non-space characters are all punctuation
   PUNCT, all digits NUM, all symbols SYM. Word and lemma are the exact piece text (leading space
   and case kept); a piece that ends inside a UTF-8 character shows U+FFFD in names only.
4. **Columns and features** (fixed dictionaries): the *first* subword of a run of NOUN/PROPN
   subwords is the prime neuron of column ``token id``; every other subword is feature
   ``token id + 1`` (0 is the prime neuron). No noun merging.
5. **Delimiters** (then exactly columns.py's flags and spans): deterministic if the raw piece text
   is one of ``; : . ? !``, its tag is ``POS`` or its *in-context* UPOS is VERB or ADP;
   probabilistic candidate if the raw text is ``is``, ``are``, ``,`` or ``(`` — so ``' is'``,
   ``' are'``, ``' ('`` never are — or its UPOS is CCONJ or SCONJ.

Ids: token ids are < 200,020 while word-profile ids are 64-bit hashes, and the names are the
fixed encoding's, so a giaann-v2 vocabulary is never stored or replicated (:class:`SubwordVocabulary`).
A cluster records which profile trained it with :func:`profile_marker` (compute/train.py).
"""

from __future__ import annotations

import unicodedata
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, Final, Literal

import numpy as np
from numpy.typing import NDArray

from giaannd.errors import HostEnvironmentError, Refused
from giaannd.model.columns import (
    CONCEPT_UPOS,
    DETERMINISTIC_WORDS,
    DETERMINISTIC_XPOS,
    MAX_TOKENS,
    MIN_TOKENS,
    PROBABILISTIC_WORDS,
    ColumnAssigner,
)
from giaannd.model.ids import PRIME_FEATURE, feature_id
from giaannd.model.lexicon import Lexicon
from giaannd.model.sentence import EncodedSentence
from giaannd.model.tokens import (
    SPACE_UPOS,
    TaggedSentence,
    TaggedText,
    Token,
    load_english,
    load_sentencizer,
)
from giaannd.model.vocab import Vocabulary

__all__ = [
    "ENCODING",
    "MAX_SEQUENCE_BYTES",
    "MAX_SUBWORDS",
    "PROFILES",
    "SENTENCES_PER_SEQUENCE",
    "EncodingUnavailableError",
    "Profile",
    "ProfileMismatchError",
    "SubwordAssigner",
    "SubwordVocabulary",
    "Subwords",
    "detokenise",
    "encoding",
    "group_sentences",
    "make_assigner",
    "profile_marker",
    "subwords",
    "tag_groups",
    "tag_prompt_lines",
]

#: The model profiles: ``word`` (the project's first core, default) and ``giaann-v2`` (§2.7).
Profile = Literal["word", "giaann-v2"]
PROFILES: Final[tuple[Profile, ...]] = ("word", "giaann-v2")
#: The reference's BPE (tiktoken's ``o200k_base``, embedded offline by the ``bpe-openai`` package).
ENCODING: Final = "o200k_base"
#: ``multisentencePredictions``: sentences per training sequence (§2.7).
SENTENCES_PER_SEQUENCE: Final = 3
#: A sequence over this many UTF-8 bytes is refused (the reference's limit, §2.7): 80 spaCy tokens
#: of ordinary text stay far below it, so it only drops pathological runs (long URLs, base64).
MAX_SEQUENCE_BYTES: Final = 2560
#: Subwords kept of a sequence (§2.7): 2x the 80 spaCy tokens, the reference's crop.
MAX_SUBWORDS: Final = 160

#: In-context UPOS that make a subword a deterministic / probabilistic delimiter under v2 (§2.7:
#: spaCy's contextual POS, not the ever-POS lexicon).
_DETERMINISTIC_UPOS = frozenset({"VERB", "ADP"})
_PROBABILISTIC_UPOS = frozenset({"CCONJ", "SCONJ"})
#: No space is put before these when a pre-tagged sentence is turned back into text ...
_NO_SPACE_BEFORE = frozenset({".", ",", ";", ":", "!", "?", ")", "]", "}", "”", "’", "%", "n't", "...", "'"})
#: ... nor after these.
_NO_SPACE_AFTER = frozenset({"(", "[", "{", "“", "‘", "$"})
#: spaCy's fine tag of whitespace.
_SPACE_XPOS = "_SP"


class EncodingUnavailableError(HostEnvironmentError):
    """The ``bpe-openai`` package (o200k_base) is not installed."""

    reason = "encoding_unavailable"


class ProfileMismatchError(Refused):
    """A job of one model profile met a cluster trained under the other (they cannot be mixed:
    their ids and delimiter rules differ)."""

    reason = "profile_mismatch"


@cache
def encoding() -> Any:
    """The o200k_base encoding (``bpe_openai``, tiktoken's API), loaded once (~1 s).

    Raises:
        EncodingUnavailableError: ``bpe-openai`` is not installed.
    """
    # bpe-openai 0.1.4 reads its data with importlib.resources.open_binary, deprecated since 3.11:
    # its warning is silenced here, where the package is loaded, and nowhere else.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import bpe_openai
        except ImportError as exc:
            raise EncodingUnavailableError(
                "the giaann-v2 profile needs o200k_base: pip install 'bpe-openai>=0.1.4,<0.2' "
                "(or giaannd[compute])") from exc
        return bpe_openai.get_encoding(ENCODING)


@dataclass(frozen=True, slots=True)
class _Piece:
    text: str
    nbytes: int
    upos: str  # the class its characters force ("" if none: it inherits its word's)


@cache
def _piece(token_id: int) -> _Piece:
    """What a token id's text is and forces (memoised: a few thousand distinct ids in practice)."""
    raw = encoding().decode_single_token_bytes(token_id)
    text = raw.decode("utf-8", errors="replace")
    core = text.strip()
    if not core:
        upos = SPACE_UPOS
    elif all(unicodedata.category(ch).startswith("P") for ch in core):
        upos = "PUNCT"
    elif core.isdigit():
        upos = "NUM"
    elif all(unicodedata.category(ch).startswith("S") for ch in core):
        upos = "SYM"
    else:
        upos = ""
    return _Piece(text, len(raw), upos)


def token_text(token_id: int) -> str:
    """The exact text of an o200k token (U+FFFD where it cuts a UTF-8 character).

    Raises:
        KeyError: not a token id.
    """
    if not 0 <= token_id < encoding().n_vocab:
        raise KeyError(token_id)
    return _piece(token_id).text


@dataclass(frozen=True, slots=True)
class Subwords:
    """A sequence cut into subwords, each with its inherited tags (module docstring, step 3)."""

    token_id: NDArray[np.int64]
    text: tuple[str, ...]
    upos: tuple[str, ...]
    xpos: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.text)


def _byte_offsets(text: str) -> NDArray[np.int64]:
    """UTF-8 byte offset of every character position 0..len(text) (vectorised over code points)."""
    cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    width = 1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000)
    return np.concatenate((np.zeros(1, np.int64), np.cumsum(width)))


def subwords(tagged: TaggedText, *, max_subwords: int = MAX_SUBWORDS) -> Subwords:
    """Encode a tagged text and give each subword the tags of the word it overlaps most (step 3)."""
    ids = encoding().encode_ordinary(tagged.text)[:max_subwords]
    pieces = [_piece(t) for t in ids]
    sub_len = np.fromiter((p.nbytes for p in pieces), dtype=np.int64, count=len(pieces))
    sub_end = np.cumsum(sub_len)
    sub_start = sub_end - sub_len
    upos = [p.upos for p in pieces]
    xpos = [_SPACE_XPOS if u == SPACE_UPOS else "" for u in upos]
    words = tagged.words
    if words and pieces:
        offsets = _byte_offsets(tagged.text)
        starts = np.asarray(tagged.starts, dtype=np.int64)
        ends = starts + np.fromiter((len(w.form) for w in words), dtype=np.int64, count=len(words))
        w_start, w_end = offsets[starts], offsets[np.minimum(ends, len(offsets) - 1)]
        overlap = (np.minimum(sub_end[:, None], w_end[None, :])
                   - np.maximum(sub_start[:, None], w_start[None, :]))
        best = np.argmax(overlap, axis=1)
        has = overlap[np.arange(len(pieces)), best] > 0
        for i, (w, ok) in enumerate(zip(best.tolist(), has.tolist())):
            if not upos[i]:
                upos[i] = words[w].upos if ok else "X"
            if not xpos[i]:
                xpos[i] = words[w].xpos if ok else "XX"
    upos = [u or "X" for u in upos]
    xpos = [x or "XX" for x in xpos]
    return Subwords(np.asarray(ids, dtype=np.int64), tuple(p.text for p in pieces), tuple(upos), tuple(xpos))


# --------------------------------------------------------------------------------------------
# Sequences


def detokenise(words: TaggedSentence) -> TaggedText:
    """A text for pre-tagged tokens whose spacing was not kept (module docstring, step 1)."""
    parts: list[str] = []
    starts: list[int] = []
    pos = 0
    glue = True  # no space before the first token
    for tok in words:
        form = tok.form
        if not (glue or tok.upos == SPACE_UPOS or form in _NO_SPACE_BEFORE or form[0] in "'’"):
            parts.append(" ")
            pos += 1
        starts.append(pos)
        parts.append(form)
        pos += len(form)
        glue = tok.upos == SPACE_UPOS or form in _NO_SPACE_AFTER
    return TaggedText("".join(parts), tuple(words), tuple(starts))


def group_sentences(sentences: Iterable[TaggedSentence], size: int = SENTENCES_PER_SEQUENCE
                    ) -> Iterator[TaggedSentence]:
    """Consecutive, non-overlapping groups of ``size`` non-empty sentences, each joined into one
    sequence (the last group keeps what is left over)."""
    if size < 1:
        raise ValueError("size must be >= 1")
    group: list[Token] = []
    count = 0
    for sentence in sentences:
        if not sentence:
            continue
        group.extend(sentence)
        count += 1
        if count == size:
            yield tuple(group)
            group, count = [], 0
    if group:
        yield tuple(group)


def _tagged_text(doc: Any) -> TaggedText:
    words = tuple(Token(t.text, t.lemma_ or t.text, t.pos_ or "X", t.tag_ or "XX") for t in doc)
    return TaggedText(doc.text, words, tuple(t.idx for t in doc))


def _group_texts(texts: Iterable[str], splitter: Any, size: int, batch_size: int) -> Iterator[str]:
    for doc in splitter.pipe((t.replace("\n", " ") for t in texts), batch_size=batch_size):
        sents = [s for s in doc.sents if s.text.strip()]
        for i in range(0, len(sents), size):
            last = sents[min(i + size, len(sents)) - 1]
            yield doc[sents[i].start:last.end].text.lstrip()


def tag_groups(texts: Iterable[str], *, nlp: Any | None = None, splitter: Any | None = None,
               size: int = SENTENCES_PER_SEQUENCE, batch_size: int = 256) -> Iterator[TaggedText]:
    """Articles -> tagged 3-sentence sequences with their text (module docstring, step 1).

    Raises:
        TaggerUnavailableError: no spaCy model.
    """
    model = nlp if nlp is not None else load_english()
    split = splitter if splitter is not None else load_sentencizer()
    for doc in model.pipe(_group_texts(texts, split, size, batch_size), batch_size=batch_size):
        if len(doc):
            yield _tagged_text(doc)


def tag_prompt_lines(lines: Iterable[str], *, nlp: Any | None = None, batch_size: int = 256
                     ) -> Iterator[TaggedText]:
    """Every non-blank line one sequence, tagged whole (the evaluation protocol, §2.7)."""
    model = nlp if nlp is not None else load_english()
    texts = (line.rstrip("\r\n").lstrip() for line in lines if line.strip())
    for doc in model.pipe(texts, batch_size=batch_size):
        yield _tagged_text(doc)


# --------------------------------------------------------------------------------------------
# Column assignment and names


class SubwordVocabulary(Vocabulary):
    """The fixed giaann-v2 dictionaries: column c is token c, feature f is token f - 1. Names come
    from the encoding, so nothing is registered, stored or replicated (iterating gives nothing)."""

    __slots__ = ()

    @property
    def num_columns(self) -> int:
        return int(encoding().n_vocab)

    @property
    def num_features(self) -> int:
        return int(encoding().n_vocab) + 1

    def column_lemma(self, cid: int) -> str:
        return token_text(cid)

    def feature_word(self, fid: int) -> str:
        if fid == PRIME_FEATURE:
            raise KeyError(fid)
        return token_text(fid - 1)

    def word_of(self, cid: int, fid: int) -> str:
        return token_text(cid) if fid == PRIME_FEATURE else token_text(fid - 1)


class SubwordAssigner(ColumnAssigner):
    """Column assignment under ``giaann-v2`` (module docstring, steps 2–5). Flags, spans and
    statistics are :class:`ColumnAssigner`'s; the lexicon is not read.

    Args:
        probabilistic_flags: feature ids already known to be probabilistic delimiters.
        min_tokens / max_tokens: spaCy-token limits (9 / 80).
        max_bytes: UTF-8 size over which a sequence is refused (:data:`MAX_SEQUENCE_BYTES`).
        max_subwords: subwords kept (:data:`MAX_SUBWORDS`).
        no_delimiter: as :class:`ColumnAssigner`.
    """

    def __init__(self, probabilistic_flags: Iterable[int] = (), *, min_tokens: int = MIN_TOKENS,
                 max_tokens: int = MAX_TOKENS, max_bytes: int = MAX_SEQUENCE_BYTES,
                 max_subwords: int = MAX_SUBWORDS, no_delimiter: Literal["fallback", "skip"] = "fallback") -> None:
        super().__init__(Lexicon({}), probabilistic_flags, min_tokens=min_tokens, max_tokens=max_tokens,
                         no_delimiter=no_delimiter)
        if max_bytes < 1 or max_subwords < 1:
            raise ValueError("max_bytes and max_subwords must be >= 1")
        self.vocab = SubwordVocabulary()
        self.max_bytes = max_bytes
        self.max_subwords = max_subwords
        encoding()  # fail now, not at the first sentence

    def encode(self, sentence: TaggedSentence | TaggedText, *, update_flags: bool = True,
               min_tokens: int | None = None) -> EncodedSentence | None:
        """One sequence (a :class:`TaggedText`, or pre-tagged tokens: :func:`detokenise`) ->
        column instances; None if skipped (the reason is counted in ``stats``)."""
        tagged = sentence if isinstance(sentence, TaggedText) else detokenise(sentence)
        stats = self.stats
        stats.seen += 1
        words = tagged.words
        if not words:
            stats.skipped_empty += 1
            return None
        if len(words) < (self.min_tokens if min_tokens is None else min_tokens):
            stats.skipped_too_short += 1
            return None
        if len(words) > self.max_tokens:
            stats.cropped += 1
            k = self.max_tokens
            tagged = TaggedText(tagged.text[:tagged.starts[k - 1] + len(words[k - 1].form)], words[:k],
                                tagged.starts[:k])
        if len(tagged.text.encode("utf-8")) > self.max_bytes:
            stats.skipped_too_many_bytes += 1
            return None
        sub = subwords(tagged, max_subwords=self.max_subwords + 1)
        if len(sub) > self.max_subwords:
            stats.cropped_subwords += 1
            m = self.max_subwords
            sub = Subwords(sub.token_id[:m], sub.text[:m], sub.upos[:m], sub.xpos[:m])
        return self._encode_subwords(sub, update_flags)

    def _encode_subwords(self, sub: Subwords, update_flags: bool) -> EncodedSentence | None:
        noun = np.fromiter((u in CONCEPT_UPOS for u in sub.upos), dtype=np.bool_, count=len(sub))
        first = noun.copy()
        first[1:] &= ~noun[:-1]  # only the first subword of a NOUN/PROPN run starts a column
        nouns = np.flatnonzero(first).tolist()
        if not nouns:
            self.stats.skipped_no_concept += 1
            return None
        tid = sub.token_id
        feature = np.where(first, PRIME_FEATURE, tid + 1).astype(np.uint64)
        det_ctx = [t in DETERMINISTIC_WORDS or x in DETERMINISTIC_XPOS or u in _DETERMINISTIC_UPOS
                   for t, x, u in zip(sub.text, sub.xpos, sub.upos)]
        cand = [t in PROBABILISTIC_WORDS or u in _PROBABILISTIC_UPOS for t, u in zip(sub.text, sub.upos)]
        return self._assign(
            sub.text, sub.text, nouns, feature, det_ctx, cand.__getitem__,
            lambda: tid[nouns].astype(np.uint64), tuple(sub.text[p] for p in nouns),
            update_flags=update_flags, token_id=tid)


def make_assigner(profile: Profile, lexicon: Lexicon | None = None,
                  probabilistic_flags: Iterable[int] = ()) -> ColumnAssigner:
    """The column assigner of a model profile (``lexicon`` is read by ``word`` only)."""
    if profile == "word":
        return ColumnAssigner(lexicon, probabilistic_flags)
    if profile == "giaann-v2":
        return SubwordAssigner(probabilistic_flags)
    raise ValueError(f"model profile must be one of {', '.join(PROFILES)}, got {profile!r}")


def profile_marker(profile: Profile) -> tuple[int, int, str]:
    """The vocabulary entry (kind 1 = feature, id, text) that says a cluster was trained under
    ``profile``. Its text holds spaces, which no tagger token does, so it names no real feature;
    it is content-addressed like every entry, so storage checks and replicates it unchanged."""
    text = f"giaannd model profile {profile}"
    return (1, feature_id(text), text)
