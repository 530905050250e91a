"""Content-addressed 64-bit ids for concept columns and features (ARCHITECTURE §4).

Any node computes any id with no coordination: a column id is the xxh3_64 hash of the normalised
noun lemma, a feature id the xxh3_64 hash of the lower-cased surface word, in separate namespaces
(a prefix byte string), so the same string used as a lemma and as a word gets unrelated ids.

Feature id 0 is reserved for the prime concept neuron of every column (giaann-algorithm.md §1.4).
A real hash that happens to be 0 is remapped to 1 (probability 2**-64; documented, not ignored).
"""

from __future__ import annotations

import xxhash

__all__ = ["PRIME_FEATURE", "column_id", "feature_id", "parse_column"]

#: Feature id of the prime concept neuron (the column's own noun), in every column.
PRIME_FEATURE = 0

_COLUMN_NS = b"giaann/column\x00"
_FEATURE_NS = b"giaann/feature\x00"


def _h64(namespace: bytes, text: str) -> int:
    value = xxhash.xxh3_64_intdigest(namespace + text.encode("utf-8"))
    return value if value != PRIME_FEATURE else 1


def column_id(lemma: str) -> int:
    """The 64-bit id of the concept column of a (lower-cased, merged) noun lemma."""
    return _h64(_COLUMN_NS, lemma)


def feature_id(word: str) -> int:
    """The 64-bit id of the feature neuron of a lower-cased surface word (never 0)."""
    return _h64(_FEATURE_NS, word)


def parse_column(text: str) -> tuple[int, str]:
    """A column named by id (decimal or ``0x`` hex) or by concept word: ``(id, how)``, ``how``
    being ``"id"`` or ``"word"`` (a word is lower-cased, as lemmas are, then hashed).

    Raises:
        ValueError: empty, or an id outside 64 bits.
    """
    raw = text.strip()
    try:
        value = int(raw, 16) if raw.lower().startswith("0x") else int(raw)
    except ValueError:
        if not raw:
            raise ValueError("empty column") from None
        return column_id(raw.lower()), "word"
    if not 0 <= value < 1 << 64:
        raise ValueError(f"column id {raw} is not a 64-bit unsigned integer")
    return value, "id"
