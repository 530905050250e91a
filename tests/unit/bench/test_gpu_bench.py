"""tools/bench/gpu.py runs on a host without CUDA: the CPU figures are measured, every device
figure is reported as not measured (JSON null), never as a number."""

import json

import pytest

from giaannd.model.gpu.device import cuda_usable
from tools.bench import gpu


@pytest.mark.skipif(cuda_usable()[0], reason="this host has a CUDA device")
def test_gpu_bench_without_a_device_prints_no_fake_figures(capsys):
    pytest.importorskip("torch")
    assert gpu.main(["--sentences", "60", "--sizes", "2000", "--steps", "3", "--repeat", "1", "--torch-cpu",
                     "--json"]) == 0
    figures = {d["figure"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert figures["device"]["value"].startswith("none: ")
    assert figures["training sentences/s cpu (numpy)"]["value"] > 0
    assert figures["LIF steps/s torch on CPU @2000"]["value"] > 0  # labelled, not a device figure
    device = [d for name, d in figures.items() if "cuda" in name or "H2D" in name]
    assert device and all(d["value"] is None for d in device)
    assert figures["H2D staged/plain"]["target"] == ">= 0.7 x plain .to()"


@pytest.mark.skipif(cuda_usable()[0], reason="this host has a CUDA device")
def test_gpu_bench_table_says_no_device(capsys):
    assert gpu.main(["--sentences", "60", "--sizes", "2000", "--steps", "3", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device found" in out and "skipped (no CUDA device)" in out
