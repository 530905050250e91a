"""Top-1 evaluation (giaann-algorithm.md §7) and free-running generation over LIF sessions.

Metric: for every prompt of ≥ ``SEED_TOKENS + 1`` tokens, tokens 0–7 seed the state and the prediction
of every step k ≥ 8 is compared with token k. A match means predicted word == target word, where the
predicted word is the feature's word (or the column lemma for a prime-concept prediction) and the
target word is the lower-cased word (or the lemma for a noun). Column identity need not match.
"No prediction" is a miss; in free-running mode it also ends the prompt (the rest are misses).

Under the ``giaann-v2`` profile (§2.7) a hit is the exact target subword: :func:`token_matches`
compares token ids (the encoded sentence carries them).

Words are compared through their content-addressed ids (ids.py): a prime prediction (c, 0) matches
iff ``column_id(target word) == c``, a feature prediction (c, f) iff ``feature_id(target word) == f``
— the same test as comparing strings, short of a 64-bit hash collision, and it needs no vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from giaannd.model.ids import PRIME_FEATURE, column_id, feature_id
from giaannd.model.infer import SEED_TOKENS, DelimiterFlags, LifConstants, LifSession, RowSource, run_session
from giaannd.model.rows import RowKey
from giaannd.model.sentence import EncodedSentence

__all__ = ["EvalResult", "Mode", "evaluate", "generate", "prediction_matches", "token_matches"]

Mode = Literal["teacher", "free"]


@dataclass(slots=True)
class EvalResult:
    """Counts of one evaluation run."""

    prompts: int = 0
    skipped_short: int = 0
    prediction_tokens: int = 0
    matches: int = 0
    no_prediction: int = 0
    steps: int = 0
    #: Per prompt: list of (target word index k, matched) — only when ``keep_details``.
    details: list[list[tuple[int, bool]]] = field(default_factory=list)
    #: Per prompt: the prediction of every step k ≥ seed (None: no prediction) — only when ``keep_details``.
    predictions: list[list[RowKey | None]] = field(default_factory=list)

    @property
    def top1(self) -> float:
        """``averageTop1Accuracy: predictionTokens`` (0.0 when there was nothing to predict)."""
        return self.matches / self.prediction_tokens if self.prediction_tokens else 0.0


def prediction_matches(pred: RowKey | None, target_word: str) -> bool:
    """§7's match test for one prediction."""
    if pred is None:
        return False
    col, feat = pred
    if feat == PRIME_FEATURE:
        return col == column_id(target_word)
    return feat == feature_id(target_word)


def token_matches(pred: RowKey | None, token_id: int) -> bool:
    """§7's match test under the ``giaann-v2`` profile (§2.7): the prediction is the exact target
    subword, as the prime neuron of its column (c = token id) or as a feature (f = token id + 1)."""
    if pred is None:
        return False
    col, feat = pred
    return col == token_id if feat == PRIME_FEATURE else feat == token_id + 1


def evaluate(
    sentences: Iterable[EncodedSentence],
    source: RowSource,
    flags: DelimiterFlags,
    constants: LifConstants,
    mode: Mode = "teacher",
    *,
    seed_tokens: int = SEED_TOKENS,
    keep_details: bool = False,
) -> EvalResult:
    """Top-1 accuracy of predicting every token after the seed (see the module docstring).

    Args:
        sentences: encoded prompts (encode them with flags left unchanged: ``update_flags=False``).
        source: where rows come from.
        flags: delimiter flags (column-constraint mode).
        constants: :data:`~giaannd.model.infer.TRAIN_SET` or ``TEST_SET``.
        mode: ``"teacher"`` (the benchmark metric) or ``"free"`` (predictions drive the sequence).
        seed_tokens: seed length (8; at least 1: token 0 is never predicted).
        keep_details: record per-token hits and predictions in ``EvalResult.details`` and
            ``EvalResult.predictions``.

    Raises:
        ValueError: an unknown ``mode``, or ``seed_tokens`` < 1.
    """
    if mode not in ("teacher", "free"):
        raise ValueError(f"mode must be 'teacher' or 'free', got {mode!r}")
    if seed_tokens < 1:  # a session always seeds token 0: it would be scored as a miss
        raise ValueError(f"seed_tokens must be >= 1, got {seed_tokens}")
    result = EvalResult()
    for sent in sentences:
        n = len(sent)
        if n < seed_tokens + 1:
            result.skipped_short += 1
            continue
        targets = list(zip(sent.column.tolist(), sent.feature.tolist()))
        session = run_session(
            LifSession(targets, flags, constants, seed_tokens=seed_tokens, teacher_forced=(mode == "teacher")),
            source,
        )
        result.prompts += 1
        result.steps += session.steps_run
        hits: list[tuple[int, bool]] = []
        preds: list[RowKey | None] = []
        token_id = sent.token_id
        for k in range(seed_tokens, n):
            pred = session.predictions.get(k)
            ok = (prediction_matches(pred, sent.target_word(k)) if token_id is None
                  else token_matches(pred, int(token_id[k])))
            result.prediction_tokens += 1
            result.matches += ok
            result.no_prediction += pred is None
            hits.append((k, ok))
            preds.append(pred)
        if keep_details:
            result.details.append(hits)
            result.predictions.append(preds)
    return result


def generate(
    prompt: Sequence[RowKey],
    source: RowSource,
    flags: DelimiterFlags,
    constants: LifConstants,
    max_new_tokens: int,
) -> list[RowKey]:
    """Free-running continuation of a prompt: every prompt token seeds, then predictions drive.

    Returns the generated (column id, feature id) nodes, stopping early at the first step with no
    prediction.
    """
    session = generation_session(prompt, flags, constants, max_new_tokens)
    if session is None:
        return []
    run_session(session, source)
    return continuation(session)


def generation_session(
    prompt: Sequence[RowKey], flags: DelimiterFlags, constants: LifConstants, max_new_tokens: int,
    new_session: Callable[..., LifSession] = LifSession,
) -> LifSession | None:
    """The free-running session for ``generate`` (None when there is nothing to generate).

    Shared by the local ``generate`` and the compute node's remote one, which drives the same
    session with rows fetched from storage (``new_session``: its device's session class,
    ``giaannd.model.gpu.lif.make_session``).
    """
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if not prompt or max_new_tokens == 0:
        return None
    return new_session(list(prompt), flags, constants, length=len(prompt) + max_new_tokens,
                       seed_tokens=len(prompt), teacher_forced=False)


def continuation(session: LifSession) -> list[RowKey]:
    """The generated nodes of a finished free-running session, up to its first non-prediction."""
    out: list[RowKey] = []
    for k in range(session.seed_tokens, session.length):
        pred = session.predictions.get(k)
        if pred is None:
            break
        out.append(pred)
    return out
