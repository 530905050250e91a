"""One evaluation spread over every live compute node (issue 15 item 5).

Theory of operation
-------------------
The node that received ``POST /v1/eval`` does what needs *its* state once: it tags and encodes the
prompts with its column assigner (its vocabulary, lexicon, profile and flags). It then cuts the
encoded prompts into contiguous shares, one per live compute node (itself included), sends each
other node an :class:`EvalShare` and runs its own share here. A share carries everything a session
reads that is not a storage row: the encoded prompts (every ``EncodedSentence`` field) and the
delimiter flags the sessions will ask about. So the node that runs a share encodes nothing and
reads nothing of its own state, and each prompt's session (one prompt per session, as the design
says) steps exactly as it would on the receiving node: rows are read-only during inference
(giaann-algorithm.md §4.4), so where a session runs cannot change what it predicts. The figures
are merged exactly: counts are summed and top-1 is total hits / total predictions, never an
average of per-node ratios.

Which flags travel: teacher forcing asks for the flags of the prompt's own features only, so a
teacher-forced share carries the flags of its features; free-running sessions step through
whatever they predict, so a free-running share carries the assigner's whole flag sets (the
deterministic features and the probabilistic set; ``MAX_SHARE_FLAGS`` bounds them, past which
the share is run locally instead of sent).

**Failure.** A share that fails on its node (unreachable, dead mid-eval, a bad reply, past
``compute.eval-share-timeout-s``) is redone here, on the receiving node, so the result is always
complete; the reply lists it under ``redone``. Only the receiving node's own failure (storage
failing for it) fails the request.

Sans-IO apart from :func:`spread_evaluate`'s task group: how a share reaches a node is the
caller's ``peers`` callables (the data plane in a daemon, direct calls in tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec
import numpy as np

from giaannd.model.infer import DelimiterFlags
from giaannd.model.sentence import EncodedSentence

__all__ = [
    "MAX_SHARE_FLAGS",
    "MAX_SHARE_PROMPTS",
    "EvalShare",
    "FlagSet",
    "ShareFigures",
    "SpreadResult",
    "decode_share",
    "encode_share",
    "make_share",
    "share_prompts",
    "spread_evaluate",
    "split_shares",
]

log = logging.getLogger(__name__)

#: Prompts in one share (the admin request's own cap, routes.MAX_EVAL_PROMPTS: a share never
#: holds more than the whole evaluation).
MAX_SHARE_PROMPTS: Final = 100_000
#: Tokens of one wire prompt (the assigner crops sentences to 80; room for other profiles).
MAX_PROMPT_TOKENS: Final = 4096
#: Flag ids one share may carry (8 MB of ids); a free-running share over a larger flag set is run
#: on the receiving node rather than sent.
MAX_SHARE_FLAGS: Final = 1 << 20

_Ids = Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
_Words = Annotated[list[str], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]


class WirePrompt(msgspec.Struct, frozen=True, array_like=True):
    """Every field of one ``EncodedSentence`` (sentence.py), as lists."""

    words: _Words
    lemmas: _Words
    is_concept: Annotated[list[bool], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
    instance: _Ids
    column: _Ids
    feature: _Ids
    noun_position: _Ids
    column_lemma: _Words
    token_id: _Ids | None = None


class EvalShare(msgspec.Struct, frozen=True):
    """One node's share of an evaluation: prompts already encoded, the flags their sessions read,
    and the constants and mode by name."""

    prompts: Annotated[list[WirePrompt], msgspec.Meta(max_length=MAX_SHARE_PROMPTS)]
    deterministic: Annotated[list[int], msgspec.Meta(max_length=MAX_SHARE_FLAGS)]
    probabilistic: Annotated[list[int], msgspec.Meta(max_length=MAX_SHARE_FLAGS)]
    constants: str
    mode: str


class ShareFigures(msgspec.Struct):
    """What one node did with one share (EvalResult's counts, plus its wall time)."""

    prompts: int = 0
    skipped_short: int = 0
    prediction_tokens: int = 0
    matches: int = 0
    no_prediction: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, other: ShareFigures) -> None:
        self.prompts += other.prompts
        self.skipped_short += other.skipped_short
        self.prediction_tokens += other.prediction_tokens
        self.matches += other.matches
        self.no_prediction += other.no_prediction
        self.steps += other.steps
        self.seconds += other.seconds


_SHARE_ENCODER: Final = msgspec.msgpack.Encoder()
_SHARE_DECODER: Final = msgspec.msgpack.Decoder(EvalShare)
_FIGURES_DECODER: Final = msgspec.msgpack.Decoder(ShareFigures)


def encode_share(share: EvalShare | ShareFigures) -> bytes:
    return _SHARE_ENCODER.encode(share)


def decode_share(data: bytes | memoryview) -> EvalShare:
    """Raises: ValueError (msgspec's errors are ValueErrors) on bytes that are not a share."""
    return _SHARE_DECODER.decode(data)


def decode_figures(data: bytes | memoryview) -> ShareFigures:
    return _FIGURES_DECODER.decode(data)


class FlagSet:
    """The delimiter flags a share carries (``DelimiterFlags``)."""

    def __init__(self, deterministic: Sequence[int], probabilistic: Sequence[int]) -> None:
        self._deterministic = frozenset(deterministic)
        self._probabilistic = frozenset(probabilistic)

    def is_deterministic(self, feature_id: int) -> bool:
        return feature_id in self._deterministic

    def is_probabilistic(self, feature_id: int) -> bool:
        return feature_id in self._probabilistic


def split_shares(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` ranges of ``range(n)`` whose sizes differ by at most 1
    (the first ``n % parts`` one longer); empty ranges when ``parts > n``."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


def _wire(s: EncodedSentence) -> WirePrompt:
    return WirePrompt(list(s.words), list(s.lemmas), s.is_concept.tolist(), s.instance.tolist(), s.column.tolist(),
                      s.feature.tolist(), s.noun_position.tolist(), list(s.column_lemma),
                      None if s.token_id is None else s.token_id.tolist())


def make_share(prompts: Sequence[EncodedSentence], flags: Any, constants: str, mode: str) -> EvalShare | None:
    """The share of ``prompts`` (module docstring: which flags travel); None when its flags are
    over ``MAX_SHARE_FLAGS`` (run it locally).

    Args:
        flags: the receiving node's column assigner (``deterministic_flags``,
            ``probabilistic_flags``, and ``DelimiterFlags``).
    """
    if mode == "teacher":
        features = {f for s in prompts for f in s.feature.tolist()}
        det = sorted(f for f in features if flags.is_deterministic(f))
        prob = sorted(f for f in features if flags.is_probabilistic(f))
    else:
        det = sorted(f for f, on in flags.deterministic_flags.items() if on)
        prob = sorted(flags.probabilistic_flags)
    if len(det) > MAX_SHARE_FLAGS or len(prob) > MAX_SHARE_FLAGS:
        return None
    return EvalShare([_wire(s) for s in prompts], det, prob, constants, mode)


def share_prompts(share: EvalShare) -> tuple[list[EncodedSentence], DelimiterFlags]:
    """The encoded prompts and flags of a share received.

    Raises:
        ValueError: a prompt whose fields disagree in length, or a bad mode or constants name.
    """
    if share.mode not in ("teacher", "free") or share.constants not in ("train", "test"):
        raise ValueError("share mode must be 'teacher' or 'free', constants 'train' or 'test'")
    out = []
    for i, w in enumerate(share.prompts):
        n = len(w.words)
        sizes = (len(w.lemmas), len(w.is_concept), len(w.instance), len(w.column), len(w.feature))
        if (any(x != n for x in sizes) or len(w.noun_position) != len(w.column_lemma)
                or (w.token_id is not None and len(w.token_id) != n)):
            raise ValueError(f"share prompt {i}: fields of different lengths")
        try:
            out.append(EncodedSentence(
                tuple(w.words), tuple(w.lemmas), np.array(w.is_concept, np.bool_), np.array(w.instance, np.int32),
                np.array(w.column, np.uint64), np.array(w.feature, np.uint64), np.array(w.noun_position, np.int32),
                tuple(w.column_lemma), None if w.token_id is None else np.array(w.token_id, np.int64)))
        except OverflowError:
            raise ValueError(f"share prompt {i}: an id out of range") from None
    return out, FlagSet(share.deterministic, share.probabilistic)


RunShare = Callable[[Sequence[EncodedSentence]], Awaitable[ShareFigures]]
RemoteShare = Callable[[EvalShare], Awaitable[ShareFigures]]


@dataclass
class SpreadResult:
    """The merged figures, what each node did, and the shares redone here."""

    total: ShareFigures
    by_node: dict[str, ShareFigures]
    redone: list[dict[str, Any]] = field(default_factory=list)

    def by_node_doc(self) -> dict[str, dict[str, Any]]:
        return {name: {"prompts": f.prompts, "predictions": f.prediction_tokens, "hits": f.matches,
                       "seconds": round(f.seconds, 3)} for name, f in sorted(self.by_node.items())}


async def spread_evaluate(prompts: Sequence[EncodedSentence], local: str, run_local: RunShare,
                          peers: Mapping[str, RemoteShare], share_of: Callable[[Sequence[EncodedSentence]],
                                                                                EvalShare | None],
                          timeout_s: float) -> SpreadResult:
    """Evaluate ``prompts`` over ``local`` and ``peers`` (module docstring).

    Args:
        run_local: runs a share on this node.
        peers: other live compute nodes -> a call that runs a share there.
        share_of: the wire share of some prompts (None: run them locally).
        timeout_s: bound on one remote share; past it the share is redone here.

    Raises:
        whatever ``run_local`` raises (this node's own share, or a share redone here).
    """
    names = [local, *sorted(n for n in peers if n != local)]
    ranges = split_shares(len(prompts), len(names))
    by_node: dict[str, ShareFigures] = {}
    redone: list[dict[str, Any]] = []

    async def remote(name: str, part: Sequence[EncodedSentence]) -> None:
        share = share_of(part)
        error: str | None = None
        if share is None:
            error = "flags over the share limit: not sent"
        else:
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(timeout_s):
                    figures = await peers[name](share)
                if figures.prompts + figures.skipped_short != len(part):
                    raise ValueError(f"answered for {figures.prompts + figures.skipped_short} prompts of {len(part)}")
            except Exception as exc:  # any failure of that node: its share is redone here (docstring)
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                figures.seconds = time.perf_counter() - t0  # as this node saw it (clocks differ)
                by_node[name] = figures
                return
        log.warning("eval share of node=%s (%d prompts) redone here: %s", name, len(part), error)
        figures = await run_local(part)
        by_node.setdefault(local, ShareFigures()).add(figures)
        redone.append({"node": name, "prompts": len(part), "by": local, "error": error})

    async def own(part: Sequence[EncodedSentence]) -> None:
        figures = await run_local(part)
        by_node.setdefault(local, ShareFigures()).add(figures)

    # a TaskGroup raises an ExceptionGroup: its first failure is raised as itself, so callers
    # handle this node's own failure (routes: STORAGE_ERRORS -> 503) as if run_local raised it
    failure: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as group:
            for name, (start, end) in zip(names, ranges):
                part = prompts[start:end]
                if not part:
                    continue
                group.create_task(own(part) if name == local else remote(name, part))
    except ExceptionGroup as eg:
        failure = eg.exceptions[0]
    if failure is not None:
        raise failure  # outside the handler, so its context is not the group that holds it
    total = ShareFigures()
    for figures in by_node.values():
        total.add(figures)
    return SpreadResult(total, by_node, redone)
