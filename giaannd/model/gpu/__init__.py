"""The device-resident compute path (issue 20): choosing the device, the torch LIF step, rows on a device.

Every module here imports torch lazily (STYLE.md item 22): a storage node, or a compute node with
``compute.device`` resolving to ``cpu``, never loads it. Nothing here has run on a CUDA device yet
(README, "Known gaps"); the torch code is device-independent and is tested on CPU torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Device": "device", "DeviceSetting": "device", "cuda_usable": "device", "resolve_device": "device",
    "TorchLifSession": "lif", "make_session": "lif",
    "DeviceRows": "rows", "PinnedStager": "rows", "rows_to_device": "rows",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'giaannd.model.gpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"giaannd.model.gpu.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
