"""The compute role on a CUDA device, end to end (issue 20 item 4). Skipped without a device.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu`` (or ``tools/device/gpu_check.sh``, which
also runs the GPU benchmark). They passed on an NVIDIA H100 80GB HBM3 on 2026-11-28 (README, GPU
table); CI has no GPU, so there they are collected and skipped. The file follows the CPU tests it
mirrors (tests/integration/test_export_scan_daemons.py for the daemons,
tests/unit/model/test_lif_torch.py for the lockstep).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from giaannd.model.engine import Engine  # noqa: E402
from giaannd.model.export import iter_jsonl  # noqa: E402
from giaannd.model.gpu.lif import TorchLifSession  # noqa: E402
from giaannd.model.gpu.rows import PinnedStager  # noqa: E402
from giaannd.model.infer import TEST_SET, TRAIN_SET, LifSession  # noqa: E402
from giaannd.model.tokens import load_bundled_corpus, write_conllu  # noqa: E402
from giaannd.model.train import train_batch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _same_export(ref, path):
    got = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(got) == len(ref) > 5000
    for a, b in zip(ref, got):
        assert (a["source_word"], a["segment"], a["target_word"]) == (b["source_word"], b["segment"], b["target_word"])
        assert b["strength"] == pytest.approx(a["strength"], rel=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_compute_daemon_on_cuda_exports_what_the_cpu_core_trains(tmp_path, transport):
    from giaannd.sdk.local_cluster import running_cluster

    corpus = load_bundled_corpus(300)
    corpora, exports = tmp_path / "corpus", tmp_path / "exports"
    corpora.mkdir()
    path = corpora / "train.conllu"
    write_conllu(corpus, path)
    engine = Engine()  # the CPU core (numpy)
    engine.train(corpus)
    ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    prompt = [[t.form, t.lemma, t.upos, t.xpos] for t in corpus[3][:10]]
    expected_words = engine.generate(corpus[3][:10], 8)
    with running_cluster(tmp_path / "cluster", storage=3, compute=1, transport=transport, corpus_dir=corpora,
                         export_dir=exports, compute_options={"device": "cuda"}) as cluster:
        cluster.wait_converged()
        node = cluster.compute_nodes[0].admin
        assert node.json("GET", "/v1/status")["services"]["compute"]["device"] == "cuda"
        job = node.json("POST", "/v1/train", {"corpus": str(path), "workers": 1})
        deadline = time.monotonic() + 120
        while (doc := node.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert doc["state"] == "succeeded", doc
        out = exports / "cuda.jsonl"
        assert node.json("POST", "/v1/export", {"path": str(out)})["lines"] == len(ref)
        _same_export(ref, out)
        gen = node.json("POST", "/v1/generate", {"prompt": prompt, "max_tokens": 8})
        assert gen["tokens"] == expected_words


def test_train_batch_on_cuda_equals_numpy():
    from tests.oracle.sentences import synthetic_corpus

    sents = synthetic_corpus(500, seed=3)
    a = train_batch(sents, backend="numpy").rows
    b = train_batch(sents, device="cuda").rows
    for x, y in zip(a.buffers()[:-1], b.buffers()[:-1]):
        assert np.array_equal(x, y)  # the same integer keys
    np.testing.assert_allclose(b.strength, a.strength, rtol=1e-6)  # index_add_ order on CUDA


@pytest.mark.parametrize("constants", [TRAIN_SET, TEST_SET], ids=["train-set", "test-set"])
def test_lif_on_cuda_in_lockstep_with_numpy(constants):
    sentences = load_bundled_corpus(limit=300)
    engine = Engine(batch_sentences=64)
    engine.train(sentences)
    for prompt in engine.encode_prompts(sentences[:40]):
        targets = list(zip(prompt.column.tolist(), prompt.feature.tolist()))
        a = LifSession(targets, engine.assigner, constants)
        b = TorchLifSession(targets, engine.assigner, constants, device="cuda")
        assert b._t.is_cuda
        while (key := a.needs_row()) is not None:
            row = engine.store.get_row(*key)
            assert a.step(row) == b.step(row)
        _, _, sa = a.activation_state()
        _, _, sb = b.activation_state()
        np.testing.assert_allclose(sb, sa, rtol=1e-6, atol=1e-9)
        assert a.predictions == b.predictions


def _in_device_pool(ptr: int) -> bool:
    """Whether ``ptr`` lies in a segment torch's CUDA caching allocator got from cudaMalloc on the
    current device: device memory by the allocator's own account (no host copy can live there)."""
    device = torch.cuda.current_device()
    return any(seg["device"] == device and seg["address"] <= ptr < seg["address"] + seg["total_size"]
               for seg in torch.cuda.memory_snapshot())


def test_staged_rows_land_in_device_memory_from_one_pooled_pinned_buffer():
    from tests.oracle.sentences import synthetic_corpus

    batch = train_batch(synthetic_corpus(300, seed=9), backend="numpy").rows
    stager = PinnedStager("cuda")
    rows = stager.stage(batch)
    staging = stager.staging_buffer
    assert stager.pin and staging.is_pinned()
    for t in (rows.row_column, rows.offsets, rows.segment, rows.target_feature, rows.strength):
        assert t.is_cuda and _in_device_pool(t.data_ptr())
    again = stager.stage(batch)
    assert stager.staging_buffer.data_ptr() == staging.data_ptr()  # pooled: the same pinned buffer
    torch.cuda.synchronize()
    for x, y, z in zip(rows.to_host().buffers(), again.to_host().buffers(), batch.buffers()):
        assert np.array_equal(x.view(np.uint8), z.view(np.uint8)) and np.array_equal(y.view(np.uint8), z.view(np.uint8))


@pytest.mark.asyncio
async def test_ucx_row_buffers_land_in_a_pooled_cuda_buffer():
    """What the transport can do today for rows (the read path does not use it yet: rows.py says
    why): a reply's row arrays received straight into CUDA tensors from torch's caching allocator."""
    from peers.transport import Reply
    from tests.gpu.test_cuda_bulk import _pair
    from tests.oracle.sentences import synthetic_corpus

    batch = train_batch(synthetic_corpus(300, seed=10), backend="numpy").rows

    async def handle(incoming):
        return Reply("rows", [batch.target_column, batch.strength])

    listener, conn = await _pair(handle)
    dest = [torch.empty(batch.num_entries, dtype=torch.int64, device="cuda"),
            torch.empty(batch.num_entries, dtype=torch.float32, device="cuda")]
    result = await conn.request("read", recv_into=dest, timeout_s=30)
    assert result.bulk[0] is dest[0] and result.bulk[1] is dest[1]  # no host array was made
    assert all(d.is_cuda and _in_device_pool(d.data_ptr()) for d in dest)
    torch.cuda.synchronize()
    assert np.array_equal(dest[0].cpu().numpy().view(np.uint64), batch.target_column)
    assert np.array_equal(dest[1].cpu().numpy(), batch.strength)
    await conn.close()
    await listener.close()
