"""``compute.device`` (issue 20 item 1): resolution, the config error on a host without CUDA, and
the compute role's inference on a torch session equal to the numpy one (torch on CPU here)."""

from __future__ import annotations

import asyncio

import pytest

from giaannd.compute.infer import Inference, RowCache, RowFetcher
from giaannd.compute.service import ComputeService
from giaannd.config import ComputeConfig, load_config
from giaannd.errors import EXIT_USAGE, ConfigError
from giaannd.model.engine import Engine
from giaannd.model.gpu.device import cuda_usable, resolve_device
from giaannd.model.infer import REMEMBER_BYTES, TEST_SET, LifSession, NoDelimiters
from giaannd.model.rows import RowBatch
from giaannd.model.tokens import load_bundled_corpus


def test_resolve_device_without_a_driver(tmp_path):
    missing = str(tmp_path / "nvidiactl")
    assert resolve_device("cpu", missing) == "cpu"
    assert resolve_device("auto", missing) == "cpu"  # every CI machine: the numpy path
    with pytest.raises(ConfigError, match=r"compute.device = cuda, but no CUDA device is usable") as info:
        resolve_device("cuda", missing)
    assert info.value.exit_code == EXIT_USAGE == 2 and info.value.path == "$.compute.device"
    with pytest.raises(ConfigError, match="auto, cpu or cuda"):
        resolve_device("gpu", missing)


def test_resolve_device_asks_torch_when_a_driver_is_present(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    ctl = tmp_path / "nvidiactl"
    ctl.touch()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", str(ctl)) == "cpu"
    with pytest.raises(ConfigError, match="reports no usable CUDA device"):
        resolve_device("cuda", str(ctl))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", str(ctl)) == "cuda" and resolve_device("cuda", str(ctl)) == "cuda"


def test_config_device_knob():
    assert load_config(environ={}).compute.device == "cpu"  # off by default: the CUDA path never ran
    assert load_config(environ={}, overrides=["compute.device=auto"]).compute.device == "auto"
    with pytest.raises(ConfigError, match="compute.device"):
        load_config(environ={}, overrides=["compute.device=gpu"])


@pytest.mark.asyncio
@pytest.mark.skipif(cuda_usable()[0], reason="this host has a CUDA device: cuda is valid here")
async def test_compute_service_with_cuda_and_no_device_fails_start_with_config_error(tmp_path):
    service = ComputeService(ComputeConfig(device="cuda"), tmp_path / "compute")
    with pytest.raises(ConfigError, match="no CUDA device is usable"):
        await service.start()
    assert not (tmp_path / "compute" / "corpora").exists()  # refused before creating anything


@pytest.mark.asyncio
async def test_compute_service_auto_resolves_to_cpu_without_a_device(tmp_path, monkeypatch):
    import giaannd.compute.service as service_module

    monkeypatch.setattr(service_module, "resolve_device", lambda setting: resolve_device(setting, str(tmp_path / "x")))
    service = ComputeService(ComputeConfig(device="auto"), tmp_path / "compute")
    await service.start()
    try:
        assert service.device == "cpu" and service.train_settings().device == "cpu"
        assert service.health()["device"] == "cpu"
    finally:
        await service.stop(graceful=True)


@pytest.mark.asyncio
async def test_inference_on_a_torch_device_equals_the_numpy_path():
    pytest.importorskip("torch")
    sentences = load_bundled_corpus(limit=200)
    engine = Engine(batch_sentences=64)
    engine.train(sentences)
    prompts = engine.encode_prompts(sentences[:30])

    async def read(cols, feats):
        await asyncio.sleep(0)
        keys = sorted(set(zip(cols.tolist(), feats.tolist())))
        return RowBatch.from_rows({k: engine.store.get_row(*k) for k in keys if len(engine.store.get_row(*k))})

    reports = {}
    for device in ("cpu", "cpu:0"):  # "cpu:0": the torch session (the cuda path's code) on the CPU
        inference = Inference(RowFetcher(read, RowCache(0)), device=device)
        reports[device] = await asyncio.wait_for(inference.evaluate(prompts, engine.assigner, TEST_SET), 60)
    a, b = reports["cpu"], reports["cpu:0"]
    assert a.result.matches > 0 and a.predictions == b.predictions and a.result == b.result


def test_infer_remember_bytes_reaches_every_session(tmp_path):
    # compute.infer-remember-bytes: the sessions' default unless set, and what each session gets.
    assert load_config(environ={}).compute.infer_remember_bytes == REMEMBER_BYTES
    config = load_config(environ={}, overrides=["compute.infer-remember-bytes=12345"]).compute
    with pytest.raises(ConfigError, match="compute.infer-remember-bytes"):
        load_config(environ={}, overrides=["compute.infer-remember-bytes=-1"])
    service = ComputeService(config, tmp_path / "compute")
    service._client = lambda: object()  # the runner is built without reading anything
    session = service._infer()._new_session([(1, 1)], NoDelimiters(), TEST_SET)
    assert isinstance(session, LifSession) and session._remember_bytes == 12345
