"""GIAANN maths in one process: ids, rows, column assignment, training, LIF inference, export.

Names are imported lazily (PEP 562), so ``import giaannd.model.rows`` stays cheap (no torch, no
lexicon) for processes that only move rows.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # contracts
    "Row": "rows", "RowBatch": "rows", "RowKey": "rows", "NUM_SEGMENTS": "rows", "merge_rows": "rows",
    "EncodedSentence": "sentence", "PRIME_FEATURE": "ids", "column_id": "ids", "feature_id": "ids",
    # training and rows
    "train_batch": "train", "train_sentence": "train", "TrainOutput": "train", "NeuronBatch": "train",
    "RowStore": "rowstore",
    # inference and evaluation
    "LifSession": "infer", "LifConstants": "infer", "TRAIN_SET": "infer", "TEST_SET": "infer",
    "SEED_TOKENS": "infer", "RowSource": "infer", "DelimiterFlags": "infer", "run_session": "infer",
    "evaluate": "evaluate", "generate": "evaluate", "EvalResult": "evaluate",
    # export and the facade
    "write_jsonl": "export", "iter_jsonl": "export", "save_snapshot": "export",
    "load_snapshot": "export", "SnapshotError": "export",
    "Engine": "engine", "constants_named": "engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'giaannd.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"giaannd.model.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
