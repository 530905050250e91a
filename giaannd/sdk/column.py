"""One concept column as numpy arrays: what ``Client.column(word)`` returns.

The daemon answers ``GET /v1/columns/{column}/rows`` with the column's rows in columnar JSON
(docs/operations.md): one element per feature neuron that has outgoing connections, and one per
connection (entry), rows in key order and entries in row order. ``Column`` turns the lists into
typed arrays once, so a notebook can filter and sort them with numpy (or hand them to pandas:
``pandas.DataFrame(column.connections)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from giaannd.sdk.errors import UsageError

__all__ = ["Column"]


@dataclass(frozen=True)
class Column:
    """A column's feature neurons and outgoing connections.

    Attributes:
        column: the column's id.
        word: its concept (noun lemma).
        features: the feature neurons with outgoing connections: ``feature`` (word), ``prime``
            (True for the column's prime concept neuron, whose word is the lemma) and ``entries``
            (its connection count).
        connections: one element per connection, aligned arrays: ``source_feature``,
            ``source_prime``, ``segment`` (uint8), ``target_column`` and ``target_feature``
            (words), ``target_prime`` and ``strength`` (float32).
        total_entries: connections the column holds; ``truncated`` when the answer stopped short
            of them (the ``limit`` given).
    """

    column: int
    word: str
    features: Mapping[str, NDArray[Any]]
    connections: Mapping[str, NDArray[Any]]
    total_entries: int
    truncated: bool

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Column:
        """From the route's JSON answer (KeyError / ValueError on a malformed one)."""
        f, e = doc["features"], doc["entries"]
        features = {"feature": np.asarray(f["feature"], dtype=str), "prime": np.asarray(f["prime"], dtype=bool),
                    "entries": np.asarray(f["entries"], dtype=np.int64)}
        connections = {
            "source_feature": np.asarray(e["source_feature"], dtype=str),
            "source_prime": np.asarray(e["source_prime"], dtype=bool),
            "segment": np.asarray(e["segment"], dtype=np.uint8),
            "target_column": np.asarray(e["target_column"], dtype=str),
            "target_feature": np.asarray(e["target_feature"], dtype=str),
            "target_prime": np.asarray(e["target_prime"], dtype=bool),
            "strength": np.asarray(e["strength"], dtype=np.float32),
        }
        lengths = {len(a) for a in connections.values()}
        if len(lengths) > 1 or len({len(a) for a in features.values()}) > 1:
            raise ValueError("column answer with arrays of different lengths")
        return cls(int(doc["column"]), str(doc["word"]), features, connections,
                   int(doc["total_entries"]), bool(doc["truncated"]))

    def __len__(self) -> int:
        """Connections held here."""
        return len(self.connections["strength"])

    def strongest(self, n: int = 10) -> list[tuple[str, str, str, float]]:
        """The ``n`` strongest connections as (source feature, target column, target feature,
        strength), strongest first.

        Raises:
            UsageError: ``n`` is negative (a slice ``[:n]`` would drop the weakest instead).
        """
        if n < 0:
            raise UsageError(f"n must be >= 0, not {n}")
        order = np.argsort(-self.connections["strength"], kind="stable")[:n]
        c = self.connections
        return [(str(c["source_feature"][i]), str(c["target_column"][i]), str(c["target_feature"][i]),
                 float(c["strength"][i])) for i in order]
