"""The training backend default: numpy without a CUDA device, torch with one (issue 18)."""

from __future__ import annotations

from pathlib import Path

import pytest

from giaannd.model import train


@pytest.fixture(autouse=True)
def _fresh_cache():
    train.default_backend.cache_clear()
    yield
    train.default_backend.cache_clear()


def test_default_backend_numpy_without_nvidia_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(train, "_NVIDIA_CONTROL_DEVICE", str(tmp_path / "no-such-device"))
    assert train.default_backend() == "numpy"


def test_default_backend_asks_torch_when_a_driver_is_present(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    device = tmp_path / "nvidiactl"
    device.touch()
    monkeypatch.setattr(train, "_NVIDIA_CONTROL_DEVICE", str(device))
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.default_backend() == "torch"
    train.default_backend.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.default_backend() == "numpy"
