"""Id -> string tables for columns and features (ARCHITECTURE §4).

Ids are content-addressed hashes (:mod:`giaannd.model.ids`), so nothing needs these tables to
*compute* an id; they exist to print predictions and to export rows with words. A
:class:`Vocabulary` is grow-only and merges by union, so tables filled by different workers combine
in any order. A second, different string hashing to an id already held is a 64-bit collision:
raised, never silently overwritten.
"""

from __future__ import annotations

from collections.abc import Iterator

from giaannd.errors import Refused
from giaannd.model.ids import PRIME_FEATURE, column_id, feature_id

__all__ = ["IdCollisionError", "Vocabulary"]


class IdCollisionError(Refused, ValueError):
    """Two different strings hashed to the same 64-bit id."""

    reason = "id_collision"


class Vocabulary:
    """Grow-only maps column id -> noun lemma and feature id -> lower-cased word."""

    __slots__ = ("_columns", "_features")

    def __init__(self) -> None:
        self._columns: dict[int, str] = {}
        self._features: dict[int, str] = {}

    @property
    def num_columns(self) -> int:
        return len(self._columns)

    @property
    def num_features(self) -> int:
        return len(self._features)

    def add_column(self, lemma: str) -> int:
        """Register a (lower-cased, merged) noun lemma; returns its column id."""
        cid = column_id(lemma)
        _put(self._columns, cid, lemma, "column")
        return cid

    def add_feature(self, word: str) -> int:
        """Register a lower-cased word; returns its feature id (never 0)."""
        fid = feature_id(word)
        _put(self._features, fid, word, "feature")
        return fid

    def column_lemma(self, cid: int) -> str:
        """The lemma of a column id. Raises KeyError if never registered."""
        return self._columns[cid]

    def feature_word(self, fid: int) -> str:
        """The word of a feature id. Raises KeyError if never registered (0 has no word)."""
        return self._features[fid]

    def word_of(self, cid: int, fid: int) -> str:
        """The word a neuron (column, feature) stands for: the lemma for the prime concept (§1.4)."""
        return self._columns[cid] if fid == PRIME_FEATURE else self._features[fid]

    def columns(self) -> Iterator[tuple[int, str]]:
        return iter(self._columns.items())

    def features(self) -> Iterator[tuple[int, str]]:
        return iter(self._features.items())

    def merge(self, other: Vocabulary) -> None:
        """Union with another table (commutative; raises IdCollisionError on a real collision)."""
        for cid, lemma in other._columns.items():
            _put(self._columns, cid, lemma, "column")
        for fid, word in other._features.items():
            _put(self._features, fid, word, "feature")


def _put(table: dict[int, str], key: int, value: str, kind: str) -> None:
    old = table.setdefault(key, value)
    if old != value:
        raise IdCollisionError(f"{kind} id {key:#018x} is both {old!r} and {value!r}")
