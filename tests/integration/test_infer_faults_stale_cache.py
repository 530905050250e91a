"""The row cache of a compute node after *another* compute node trained (in-process services over
three StorageServices, mem://, R = 3): a generation must predict what the single-process core
predicts on the model storage now holds, not what this node's cache held before the training.
Every wait bounded."""

import asyncio

import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.compute.service import ComputeService
from giaannd.compute.train import TrainSettings
from giaannd.config import ComputeConfig
from giaannd.model.engine import Engine
from giaannd.model.tokens import load_bundled_corpus
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

N_SENTENCES = 200


async def node(cluster: Cluster, tmp_path, name: str) -> ComputeService:
    client = StorageClient(cluster.client_topology, cluster.client.transports, request_timeout_s=2.0,
                           connect_timeout_s=1.0)
    svc = ComputeService(ComputeConfig(), tmp_path / name, storage=client, node_name=name)
    await svc.start()
    return svc


@pytest.mark.asyncio
async def test_infer_generate_after_another_node_trained_equals_the_core(tmp_path):
    """c1 generates before any training (its rows are absent: cached as empty rows), c0 then
    trains the corpus (a node-local job: it invalidates c0's cache only). c1's next generation
    must be the core's on the trained model; it returned the stale, empty continuation."""
    corpus = load_bundled_corpus(N_SENTENCES)
    engine = Engine()
    engine.train(corpus)
    prompt = corpus[3][:10]
    expected = engine.generate(prompt, 8)
    assert expected  # the trained model continues this prompt
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    c0 = c1 = None
    try:
        c0 = await node(cluster, tmp_path, "c0")
        c1 = await node(cluster, tmp_path, "c1")
        before = await asyncio.wait_for(c1.generate(prompt, 8), 20)
        assert before["tokens"] == []  # nothing trained yet
        await asyncio.wait_for(c0.train(corpus, TrainSettings(workers=1, coalesce_sentences=64)), 30)
        after = await asyncio.wait_for(c1.generate(prompt, 8), 20)
        assert after["tokens"] == expected
    finally:
        for svc in (c0, c1):
            if svc is not None:
                await svc.stop(graceful=False)
        await cluster.close()
