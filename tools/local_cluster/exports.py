"""Comparing a cluster's JSONL export with the single-process core's (one helper for the
integration tests and tools/bench/soak.py).

Entries are keyed by ``(source_word, segment, target_word)``; a key the reference has and the
export lacks is *lost*, one only the export has is *extra*, and a shared key whose strength is off
by more than ``STRENGTH_REL_TOL`` is *differing* (replicas sum updates in different orders, so the
last bits may differ; a lost or doubled update moves a strength by far more).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl
from giaannd.model.tokens import TaggedSentence

__all__ = ["STRENGTH_REL_TOL", "ExportDiff", "diff_exports", "read_export", "reference_export"]

#: Relative strength tolerance: float32 sums in a different order differ in the last bits.
STRENGTH_REL_TOL: Final = 1e-5


@dataclass(frozen=True, slots=True)
class ExportDiff:
    """What an export lacks, adds or gets wrong against the reference (module docstring)."""

    reference: int
    got: int
    lost: int
    extra: int
    differing: int
    in_order: bool

    @property
    def clean(self) -> bool:
        return self.lost == self.extra == self.differing == 0 and self.in_order


def _key(entry: dict[str, Any]) -> tuple[Any, Any, Any]:
    return entry["source_word"], entry["segment"], entry["target_word"]


def diff_exports(reference: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]],
                 rel: float = STRENGTH_REL_TOL) -> ExportDiff:
    """Compare two exports' entries (dicts as the JSONL lines decode)."""
    ref = {_key(e): float(e["strength"]) for e in reference}
    have = {_key(e): float(e["strength"]) for e in got}
    differing = sum(1 for k, s in ref.items()
                    if k in have and not math.isclose(have[k], s, rel_tol=rel, abs_tol=0.0))
    return ExportDiff(reference=len(reference), got=len(got), lost=len(ref.keys() - have.keys()),
                      extra=len(have.keys() - ref.keys()), differing=differing,
                      in_order=[_key(e) for e in reference] == [_key(e) for e in got])


def reference_export(sentences: Iterable[TaggedSentence]) -> list[dict[str, Any]]:
    """The single-process core trained on ``sentences`` in order, exported."""
    engine = Engine()
    engine.train(sentences)
    return [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]


def read_export(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
