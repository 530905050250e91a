"""An encoded sentence: what training and inference need once text has become columns and features.

Produced by the tokens/columns stage (tagging, noun merges, delimiter flags, rightmost-delimiter
column assignment: giaann-algorithm.md §2) and consumed by training (§3) and inference (§4). It is
the contract between those two halves of the model; nothing in it depends on how it was computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["EncodedSentence"]


@dataclass(frozen=True, slots=True, eq=False)
class EncodedSentence:
    """One sentence after column assignment.

    Attributes:
        words: lower-cased surface form of every token (after noun merges), length n.
        lemmas: lower-cased lemma of every token, length n.
        is_concept: bool[n], true for the noun of each column instance.
        instance: int32[n], the column instance that owns each token; non-decreasing, 0-based,
            every instance owns a contiguous, non-empty span.
        column: uint64[n], column id of the instance that owns each token.
        feature: uint64[n], feature id of each token: 0 (prime concept) for the instance's own noun,
            else the feature id of its lower-cased word.
        noun_position: int32[num_instances], token position of each instance's noun.
        column_lemma: the lemma of each instance's noun (its column name), length num_instances.
        token_id: int64[n], the o200k token id of every token under the ``giaann-v2`` profile
            (giaann-algorithm.md §2.7: a prediction hits iff it *is* that token); None under the
            word profile, where a hit compares words through their hashed ids.
    """

    words: tuple[str, ...]
    lemmas: tuple[str, ...]
    is_concept: NDArray[np.bool_]
    instance: NDArray[np.int32]
    column: NDArray[np.uint64]
    feature: NDArray[np.uint64]
    noun_position: NDArray[np.int32]
    column_lemma: tuple[str, ...]
    token_id: NDArray[np.int64] | None = None

    def __len__(self) -> int:
        return len(self.words)

    @property
    def num_instances(self) -> int:
        return int(self.noun_position.shape[0])

    def target_word(self, t: int) -> str:
        """The word token t is scored against (§7): the lemma for a noun, else the lower-cased word
        (giaann-v2: both are the subword's exact text)."""
        return self.lemmas[t] if bool(self.is_concept[t]) else self.words[t]
