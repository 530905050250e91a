"""The compute role: distributed training and inference over the storage cluster (ARCHITECTURE §9).

Names are imported lazily (PEP 562): importing one submodule (the job journal, say) does not pull
in torch or the lexicon.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FLAG_ROW": "flags", "FlagTracker": "flags", "flags_batch": "flags", "flag_ids": "flags",
    "Job": "jobs", "JobRegistry": "jobs", "TrainProgress": "jobs",
    "TrainSettings": "train", "TrainingJob": "train", "TrainResult": "train", "load_corpus": "train",
    "job_client": "train", "read_flags": "train",
    "RowCache": "infer", "RowFetcher": "infer", "Inference": "infer", "drive_session": "infer",
    "ComputeState": "state",
    "JobJournal": "job_journal", "JobSpec": "job_journal", "JournalCorrupt": "job_journal",
    "JournalWriter": "job_journal", "load_journals": "job_journal",
    "ComputeService": "service", "create_service": "service",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'giaannd.compute' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"giaannd.compute.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
