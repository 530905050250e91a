"""Column assignment: tagged sentence -> concept-column instances and features (giaann-algorithm.md §2–3.1).

Theory of operation (everything that decides a token's column lives in this file):

1. **Length rules** (§2.1 item 3) on the tagger's tokens, *before* the noun merges, as the reference
   does (it filters spaCy sequences by length before its pre-training rewrites): fewer than
   ``min_tokens`` (9 = seed tokens + 1) -> skipped; more than ``max_tokens`` (80) -> cropped to 80
   (``overlong="crop"``, the documented default) or skipped (``overlong="skip"``).
2. **Noun merges** (§2.3 items 1–2, one left-to-right pass): a run of concept tokens (UPOS NOUN or
   PROPN) becomes one token joined by ``_``; a hyphen token (``-`` or ``–``) between two concept
   tokens joins them with ``-`` instead. The merged token keeps the UPOS/XPOS of its first part.
   Item 3 (demotion to ``X``) is off, as in the reference's benchmark mode.
3. A sentence without a concept token is skipped (nothing is learnt, no flag changes).
4. **Flags** (§2.4, §3.1 step 2), per feature id (= hash of the lower-cased word):
   * *deterministic*: fixed at the feature's first sighting: word in ``; : . ? !``, or fine tag
     ``POS``, or the word or its lemma can ever be VERB or ADP (:class:`~giaannd.model.lexicon.Lexicon`);
   * *probabilistic* (grow-only set, OR-accumulated): in this sentence, a token is a candidate if
     its word is ``is``, ``are``, ``,`` or ``(``, or the word or lemma can ever be CCONJ or SCONJ,
     and it is not itself deterministic. Between two adjacent nouns with no deterministic token
     between them, the *first* candidate becomes probabilistic. The deterministic checks inside this
     rule look at the token in context (its own tag), as the reference does.
   With ``update_flags=False`` (inference prompts) new flags are used for this sentence but not stored.
5. **Spans** (§2.5) from the *stored* flags: between adjacent nouns nᵢ < nᵢ₊₁ the rightmost token
   whose feature is deterministic, else the rightmost probabilistic one, else nᵢ₊₁−1 (v2 default,
   ``no_delimiter="fallback"``; ``"skip"`` drops the sentence, the v1 rule), ends column instance i.
   The first instance starts at token 0, the last runs to the end.
6. **Ids**: instance noun -> ``column_id(lemma)`` and feature 0 (prime concept); any other token ->
   ``feature_id(word)``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from giaannd.model.ids import PRIME_FEATURE
from giaannd.model.lexicon import Lexicon, PosClass
from giaannd.model.sentence import EncodedSentence
from giaannd.model.tokens import TaggedSentence, TaggedText, Token
from giaannd.model.vocab import Vocabulary

__all__ = [
    "CONCEPT_UPOS",
    "ColumnAssigner",
    "EncodeStats",
    "MAX_TOKENS",
    "MIN_TOKENS",
    "is_concept",
    "merge_nouns",
    "spans",
]

#: UPOS tags whose tokens are concepts (own a column) (§2.3).
CONCEPT_UPOS = frozenset({"NOUN", "PROPN"})
#: Tokens that join two nouns into one hyphenated concept (§2.3 item 1).
HYPHENS = frozenset({"-", "–"})
#: Words that are always deterministic delimiters: hard punctuation (§2.4).
DETERMINISTIC_WORDS = frozenset({";", ":", ".", "?", "!"})
#: Fine tags that make a token deterministic: the possessive ('s, ') (§2.4).
DETERMINISTIC_XPOS = frozenset({"POS"})
#: Word classes that make a word deterministic if it or its lemma can ever have one (§2.4).
DETERMINISTIC_CLASSES = PosClass.VERB | PosClass.ADP
#: Words that are probabilistic-delimiter candidates (§2.4).
PROBABILISTIC_WORDS = frozenset({"is", "are", ",", "("})
#: Word classes that make a word a probabilistic candidate (§2.4).
PROBABILISTIC_CLASSES = PosClass.CCONJ | PosClass.SCONJ
#: Shortest sentence kept: numSeedTokensInference (8) + 1 (§2.1 item 3).
MIN_TOKENS = 9
#: Longest sentence kept whole: maxSequenceLength (§2.1 item 3).
MAX_TOKENS = 80


@dataclass(slots=True)
class EncodeStats:
    """What :meth:`ColumnAssigner.encode` did with the sentences it was given."""

    seen: int = 0
    encoded: int = 0
    skipped_empty: int = 0
    skipped_too_short: int = 0
    skipped_too_long: int = 0
    skipped_no_concept: int = 0
    skipped_no_delimiter: int = 0
    cropped: int = 0
    #: adjacent noun pairs with no delimiter between them that used the nᵢ₊₁−1 fallback
    fallback_boundaries: int = 0
    #: giaann-v2 profile only (subwords.py): sequences refused for their UTF-8 size, and sequences
    #: cropped to the subword limit
    skipped_too_many_bytes: int = 0
    cropped_subwords: int = 0

    @property
    def skipped(self) -> int:
        return (self.skipped_empty + self.skipped_too_short + self.skipped_too_long
                + self.skipped_no_concept + self.skipped_no_delimiter + self.skipped_too_many_bytes)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def is_concept(token: Token) -> bool:
    """A token is a concept (a noun, owner of a column) iff its UPOS is NOUN or PROPN (§2.3)."""
    return token.upos in CONCEPT_UPOS


def merge_nouns(sentence: TaggedSentence) -> TaggedSentence:
    """Apply the two noun-merge rewrites of §2.3 in one pass.

    A maximal run of concept tokens, where consecutive parts are either adjacent or separated by a
    single hyphen token, becomes one token: form and lemma joined with ``_`` (adjacent) or ``-``
    (hyphen), UPOS/XPOS of the first part. Case is kept; column assignment lower-cases.
    """
    out: list[Token] = []
    run: list[Token] = []
    joiners: list[str] = []
    pending = ""
    n = len(sentence)

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            form, lemma = run[0].form, run[0].lemma
            for join, tok in zip(joiners, run[1:]):
                form += join + tok.form
                lemma += join + tok.lemma
            out.append(Token(form, lemma, run[0].upos, run[0].xpos))
        run.clear()
        joiners.clear()

    for i, tok in enumerate(sentence):
        if tok.upos in CONCEPT_UPOS:
            if run:
                joiners.append(pending or "_")
            pending = ""
            run.append(tok)
        elif (run and (tok.form in HYPHENS or tok.lemma in HYPHENS) and i + 1 < n
              and sentence[i + 1].upos in CONCEPT_UPOS):
            pending = "-"
        else:
            flush()
            pending = ""
            out.append(tok)
    flush()
    return tuple(out)


class FlagSource(Protocol):
    """Delimiter flags an assigner reads beneath its own (``ColumnAssigner.over``): a cluster job's
    fold of every window's findings, as of one window (compute/cluster_jobs/flag_pass.py). A
    feature's answer never changes once given (first sighting wins), so an assigner may keep it."""

    def deterministic(self, feature_id: int) -> bool | None:
        """The feature's deterministic flag, or None where the source has not seen it."""
        ...

    def probabilistic(self, feature_id: int) -> bool:
        """Whether the feature is a probabilistic delimiter in the source."""
        ...


class _ProbabilisticEither:
    """``in``: a probabilistic flag of the assigner's own set or of its source (``_span_starts``)."""

    __slots__ = ("local", "source")

    def __init__(self, local: set[int], source: FlagSource) -> None:
        self.local, self.source = local, source

    def __contains__(self, feature_id: object) -> bool:
        return feature_id in self.local or (isinstance(feature_id, int) and self.source.probabilistic(feature_id))


class ColumnAssigner:
    """Holds the delimiter flags and turns tagged sentences into :class:`EncodedSentence` objects.

    Args:
        lexicon: the ever-POS lexicon (default: the shipped one).
        probabilistic_flags: feature ids already known to be probabilistic delimiters (the
            replicated grow-only set, ARCHITECTURE §4).
        min_tokens: sentences with fewer tagger tokens are skipped (§2.1: 9).
        max_tokens: longer sentences are cropped or skipped (§2.1: 80).
        overlong: ``"crop"`` (design default) or ``"skip"``.
        no_delimiter: ``"fallback"`` (v2: boundary at nᵢ₊₁−1) or ``"skip"`` (v1: drop the sentence).

    Attributes:
        probabilistic_flags: the grow-only set of probabilistic-delimiter feature ids.
        vocab: id -> string tables, filled as sentences are encoded.
        stats: counters of encoded and skipped sentences.
    """

    def __init__(
        self,
        lexicon: Lexicon | None = None,
        probabilistic_flags: Iterable[int] = (),
        *,
        min_tokens: int = MIN_TOKENS,
        max_tokens: int = MAX_TOKENS,
        overlong: Literal["crop", "skip"] = "crop",
        no_delimiter: Literal["fallback", "skip"] = "fallback",
    ) -> None:
        if min_tokens < 1 or max_tokens < min_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        if overlong not in ("crop", "skip") or no_delimiter not in ("fallback", "skip"):
            raise ValueError(f"bad policy overlong={overlong!r} no_delimiter={no_delimiter!r}")
        self.lexicon = lexicon if lexicon is not None else Lexicon.default()
        self.probabilistic_flags: set[int] = set(probabilistic_flags)
        self.vocab = Vocabulary()
        self.stats = EncodeStats()
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.overlong = overlong
        self.no_delimiter = no_delimiter
        self._deterministic: dict[int, bool] = {}
        #: flags read beneath this assigner's own (``over``); None: it holds all of them
        self._source: FlagSource | None = None
        #: the probabilistic flags this assigner added itself (``encode(update_flags=True)``), in
        #: the order found: what a caller sends on, without comparing whole sets per batch
        self.learned_probabilistic: list[int] = []
        # Memo of the contextual tests, keyed by (word, lemma, xpos): a pure function of the key.
        self._det_memo: dict[tuple[str, str, str], bool] = {}
        self._prob_memo: dict[tuple[str, str], bool] = {}

    def copy(self) -> ColumnAssigner:
        """An assigner with this one's settings and flags (copied: each goes on alone), a fresh
        vocabulary, counters and ``learned_probabilistic``. The contextual tests' memos are shared:
        a pure function of the token and the lexicon, so sharing only saves recomputing them.
        Costs a C-level copy of the flags, against a Python loop per flag to rebuild them.

        Raises:
            TypeError: a subclass (``SubwordAssigner``): its settings are not this class's.
        """
        out = self._sibling()
        out.probabilistic_flags = set(self.probabilistic_flags)
        out._deterministic = dict(self._deterministic)
        out._source = self._source
        return out

    def _sibling(self) -> ColumnAssigner:
        """A new assigner with this one's settings and contextual memos, no flags (``copy``, ``over``)."""
        if type(self) is not ColumnAssigner:
            raise TypeError(f"{type(self).__name__} cannot be copied as a ColumnAssigner")
        out = ColumnAssigner(self.lexicon, min_tokens=self.min_tokens, max_tokens=self.max_tokens,
                             overlong=self.overlong, no_delimiter=self.no_delimiter)
        out._det_memo, out._prob_memo = self._det_memo, self._prob_memo
        return out

    def over(self, source: FlagSource) -> ColumnAssigner:
        """An assigner with this one's settings and contextual memos (as ``copy``), no flags of its
        own, that reads ``source``'s flags beneath the ones it learns: encoding with it equals
        encoding with a copy of an assigner holding ``source``'s flags, without copying them (a
        cluster job's window: compute/cluster_jobs/flag_pass.py ``FlagFold.assigner``; a copy per
        window cost a time that grew with the features seen). A flag found in ``source`` is kept in
        its own dict the first time it is looked up (``source`` never changes it);
        ``deterministic_flags`` and ``probabilistic_flags`` then hold what it looked up and learned,
        not all of ``source``'s (``is_deterministic`` and ``is_probabilistic`` read both).

        Raises:
            TypeError: a subclass (``SubwordAssigner``), as ``copy``.
        """
        out = self._sibling()
        out._source = source
        return out

    # ---------------------------------------------------------------------------- flag queries

    def is_deterministic(self, feature_id: int) -> bool:
        """The stored deterministic flag of a feature (False if never seen)."""
        stored = self._deterministic.get(feature_id)
        if stored is None and self._source is not None:
            stored = self._source.deterministic(feature_id)
        return bool(stored)

    def is_probabilistic(self, feature_id: int) -> bool:
        """Whether the feature is in the grow-only probabilistic set."""
        return feature_id in self.probabilistic_flags or (self._source is not None
                                                          and self._source.probabilistic(feature_id))

    def add_probabilistic_flags(self, feature_ids: Iterable[int]) -> None:
        """Merge flags learnt elsewhere (OR; commutative and idempotent)."""
        self.probabilistic_flags.update(feature_ids)

    def add_deterministic_flags(self, flags: dict[int, bool]) -> None:
        """Merge deterministic flags fixed elsewhere (e.g. loaded from a snapshot).

        First sighting wins: a flag already stored here is kept, as GIAANN never changes a feature's
        deterministic flag once set.
        """
        for fid, flag in flags.items():
            self._deterministic.setdefault(fid, flag)

    @property
    def deterministic_flags(self) -> dict[int, bool]:
        """A copy of the stored deterministic flags (feature id -> flag, fixed at first sight); of an
        assigner ``over`` a source, those it looked up there or learned."""
        return dict(self._deterministic)

    # ---------------------------------------------------------------------- contextual tests

    def token_is_deterministic(self, word: str, lemma: str, xpos: str) -> bool:
        """§2.4 deterministic test of one token in context (lower-cased word and lemma)."""
        key = (word, lemma, xpos)
        hit = self._det_memo.get(key)
        if hit is None:
            lex = self.lexicon
            hit = (word in DETERMINISTIC_WORDS or xpos in DETERMINISTIC_XPOS
                   or lex.can_be(word, DETERMINISTIC_CLASSES) or lex.can_be(lemma, DETERMINISTIC_CLASSES))
            self._det_memo[key] = hit
        return hit

    def token_is_candidate(self, word: str, lemma: str) -> bool:
        """§2.4 probabilistic-candidate test of one token (before the between-nouns rule)."""
        key = (word, lemma)
        hit = self._prob_memo.get(key)
        if hit is None:
            lex = self.lexicon
            hit = (word in PROBABILISTIC_WORDS or lex.can_be(word, PROBABILISTIC_CLASSES)
                   or lex.can_be(lemma, PROBABILISTIC_CLASSES))
            self._prob_memo[key] = hit
        return hit

    # ---------------------------------------------------------------------------- encoding

    def encode_many(
        self, sentences: Iterable[TaggedSentence], *, update_flags: bool = True
    ) -> Iterator[EncodedSentence]:
        """Encode sentences in order, yielding only those not skipped."""
        for sentence in sentences:
            enc = self.encode(sentence, update_flags=update_flags)
            if enc is not None:
                yield enc

    def encode(
        self, sentence: TaggedSentence | TaggedText, *, update_flags: bool = True, min_tokens: int | None = None
    ) -> EncodedSentence | None:
        """Turn one tagged sentence into column instances (steps 1–6 of the module docstring).

        Args:
            sentence: the tagger's tokens (of a :class:`TaggedText`: its words; this profile does
                not read the text).
            update_flags: store new deterministic flags and OR new probabilistic ones (training).
                False for inference prompts: flags found in the sentence are used for it but the
                stored flags are not changed.
            min_tokens: overrides ``self.min_tokens`` for this call (generation prompts may be
                shorter than the 9 tokens a training or evaluation sentence needs).

        Returns:
            the encoded sentence, or None if it was skipped (the reason is counted in ``stats``).
        """
        if isinstance(sentence, TaggedText):
            sentence = sentence.words
        stats = self.stats
        stats.seen += 1
        if not sentence:
            stats.skipped_empty += 1
            return None
        if len(sentence) < (self.min_tokens if min_tokens is None else min_tokens):
            stats.skipped_too_short += 1
            return None
        if len(sentence) > self.max_tokens:
            if self.overlong == "skip":
                stats.skipped_too_long += 1
                return None
            stats.cropped += 1
            sentence = sentence[: self.max_tokens]
        merged = merge_nouns(sentence)
        nouns = [i for i, tok in enumerate(merged) if tok.upos in CONCEPT_UPOS]
        if not nouns:
            stats.skipped_no_concept += 1
            return None
        words = tuple(tok.form.lower() for tok in merged)
        lemmas = tuple(tok.lemma.lower() for tok in merged)
        n = len(merged)
        vocab = self.vocab
        # Noun tokens keep PRIME_FEATURE (0): each is the prime concept neuron of its own instance.
        feature = np.full(n, PRIME_FEATURE, dtype=np.uint64)
        det_ctx = [False] * n  # contextual deterministic test, per token
        is_noun = set(nouns)
        for t in range(n):
            if t in is_noun:
                continue
            feature[t] = vocab.add_feature(words[t])
            det_ctx[t] = self.token_is_deterministic(words[t], lemmas[t], merged[t].xpos)
        column_lemma = tuple(lemmas[p] for p in nouns)
        return self._assign(
            words, lemmas, nouns, feature, det_ctx, lambda t: self.token_is_candidate(words[t], lemmas[t]),
            lambda: np.array([vocab.add_column(lem) for lem in column_lemma], dtype=np.uint64),
            column_lemma, update_flags=update_flags)

    def _assign(
        self,
        words: tuple[str, ...],
        lemmas: tuple[str, ...],
        nouns: list[int],
        feature: NDArray[np.uint64],
        det_ctx: list[bool],
        is_candidate: Callable[[int], bool],
        instance_columns: Callable[[], NDArray[np.uint64]],
        column_lemma: tuple[str, ...],
        *,
        update_flags: bool,
        token_id: NDArray[np.int64] | None = None,
    ) -> EncodedSentence | None:
        """Steps 4–6 for any tokenisation profile: store/OR the flags, cut the spans, build the
        sentence. ``feature`` holds every token's feature id (0 at the nouns in ``nouns``),
        ``det_ctx`` the contextual deterministic test and ``is_candidate`` the probabilistic one;
        ``instance_columns`` gives the column id of each noun (called only if the sentence is kept).
        """
        n = len(words)
        det_stored = [False] * n  # the feature's deterministic flag as column assignment sees it
        det, source = self._deterministic, self._source
        for t in range(n):
            fid = int(feature[t])
            if fid == PRIME_FEATURE:
                continue
            stored = det.get(fid)
            if stored is None and source is not None:
                stored = source.deterministic(fid)
                if stored is not None:
                    det[fid] = stored  # (never changes in the source: first sighting wins)
            if stored is None:
                stored = det_ctx[t]
                if update_flags:
                    det[fid] = stored
            det_stored[t] = stored
        new_prob = self._detect_probabilistic(nouns, det_ctx, is_candidate, feature)
        if update_flags:
            fresh = new_prob - self.probabilistic_flags
            if source is not None and fresh:
                fresh = {f for f in fresh if not source.probabilistic(f)}
            self.learned_probabilistic.extend(sorted(fresh))
            self.probabilistic_flags.update(fresh)
            local = self.probabilistic_flags
        else:
            local = self.probabilistic_flags | new_prob if new_prob else self.probabilistic_flags
        prob: Container[int] = local if source is None else _ProbabilisticEither(local, source)
        starts = self._span_starts(nouns, det_stored, feature, prob)
        if starts is None:
            self.stats.skipped_no_delimiter += 1
            return None
        instance = (np.searchsorted(np.asarray(starts, dtype=np.int64), np.arange(n), side="right")
                    - 1).astype(np.int32)
        is_noun = np.zeros(n, dtype=np.bool_)
        is_noun[nouns] = True
        inst_column = instance_columns()
        self.stats.encoded += 1
        return EncodedSentence(
            words=words,
            lemmas=lemmas,
            is_concept=is_noun,
            instance=instance,
            column=inst_column[instance],
            feature=feature,
            noun_position=np.asarray(nouns, dtype=np.int32),
            column_lemma=column_lemma,
            token_id=token_id,
        )

    @staticmethod
    def _detect_probabilistic(
        nouns: list[int],
        det_ctx: list[bool],
        is_candidate: Callable[[int], bool],
        feature: NDArray[np.uint64],
    ) -> set[int]:
        """Feature ids that this sentence makes probabilistic delimiters (§2.4)."""
        found: set[int] = set()
        for left, right in zip(nouns, nouns[1:]):
            between = range(left + 1, right)
            if any(det_ctx[t] for t in between):
                continue
            for t in between:
                if is_candidate(t):
                    found.add(int(feature[t]))
                    break
        return found

    def _span_starts(
        self, nouns: list[int], det_stored: list[bool], feature: np.ndarray, prob: Container[int]
    ) -> list[int] | None:
        """Start position of every column instance (§2.5), or None to skip the sentence."""
        starts = [0]
        for left, right in zip(nouns, nouns[1:]):
            cut = -1
            for t in range(right - 1, left, -1):
                if det_stored[t]:
                    cut = t
                    break
            if cut < 0:
                for t in range(right - 1, left, -1):
                    if int(feature[t]) in prob:
                        cut = t
                        break
            if cut < 0:
                if self.no_delimiter == "skip":
                    return None
                self.stats.fallback_boundaries += 1
                cut = right - 1
            starts.append(cut + 1)
        return starts


def spans(encoded: EncodedSentence) -> list[tuple[int, int]]:
    """The ``[start, end)`` token span of every column instance of an encoded sentence."""
    inst = encoded.instance
    bounds = np.flatnonzero(np.diff(inst)) + 1
    edges = [0, *bounds.tolist(), len(inst)]
    return list(zip(edges[:-1], edges[1:]))

