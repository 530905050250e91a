"""Which device the compute role runs on: ``compute.device = auto | cpu | cuda`` resolved once at start.

``auto`` is the default and resolves to ``cuda`` only where a CUDA device is usable, so every CI
machine and every host without a GPU keeps the numpy path (measured faster on CPU, see
``giaannd.model.train.Backend``). ``cuda`` on a host without one is a :class:`ConfigError` (exit 2):
an operator who asked for the GPU wants to hear that it is missing, not a node that silently runs
on the CPU at a tenth of the speed it was sized for.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Literal

from giaannd.errors import ConfigError

__all__ = ["Device", "DeviceSetting", "cuda_usable", "resolve_device", "torch_module"]

#: The config knob's values.
DeviceSetting = Literal["auto", "cpu", "cuda"]
#: What it resolves to.
Device = Literal["cpu", "cuda"]
#: The NVIDIA driver's control device: without it there is no CUDA device, and checking for it
#: spares a CPU-only host from importing torch (~1 s, ~300 MB) just to learn that.
NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"


def torch_module() -> ModuleType:
    """torch, imported on first use (STYLE.md item 22: an optional heavy dependency, lazily)."""
    return importlib.import_module("torch")


def cuda_usable(control_device: str = NVIDIA_CONTROL_DEVICE) -> tuple[bool, str]:
    """Whether torch can use a CUDA device here, and if not, why (for the error message).

    Args:
        control_device: the driver node to look for first (a test passes a path that does not exist).
    """
    if not os.path.exists(control_device):
        return False, (f"{control_device} does not exist (no NVIDIA driver, or the device is not "
                       "visible to this process)")
    try:
        torch = torch_module()
    except ImportError as exc:
        return False, f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} reports no usable CUDA device (CPU build, or driver mismatch)"
    return True, ""


def resolve_device(setting: str, control_device: str = NVIDIA_CONTROL_DEVICE) -> Device:
    """Resolve ``compute.device``.

    Args:
        setting: ``auto``, ``cpu`` or ``cuda``.
        control_device: see :func:`cuda_usable`.

    Returns:
        ``"cuda"`` or ``"cpu"``.

    Raises:
        ConfigError: ``cuda`` was asked for and no CUDA device is usable, or an unknown setting.
    """
    if setting == "cpu":
        return "cpu"
    if setting not in ("auto", "cuda"):
        raise ConfigError(f"compute.device must be auto, cpu or cuda, got {setting!r}", "$.compute.device")
    ok, why = cuda_usable(control_device)
    if ok:
        return "cuda"
    if setting == "cuda":
        raise ConfigError(f"compute.device = cuda, but no CUDA device is usable: {why}; "
                          "use auto or cpu on this host", "$.compute.device")
    return "cpu"
