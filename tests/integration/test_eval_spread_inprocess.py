"""An evaluation spread over in-process compute services (issue 15 item 5) over three
StorageServices (mem://, R = 3): node c0 trained (its vocabulary and flags), c1 and c2 did not, so
a share run elsewhere is exact only because its prompts travel encoded with their flags. Shares
travel as bytes (encode_share / decode_share) as they do on the data plane. Every wait bounded."""

import asyncio

import pytest
import pytest_asyncio

from giaannd.client.errors import ReadFailed
from giaannd.client.storage_client import StorageClient
from giaannd.compute.eval_spread import decode_figures, decode_share, encode_share
from giaannd.compute.service import ComputeService
from giaannd.config import ComputeConfig
from giaannd.model.tokens import load_bundled_corpus
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FIGURES = ("prompts", "skipped", "prediction_tokens", "matches", "top1", "no_prediction", "steps")


async def node(cluster: Cluster, tmp_path, name: str) -> ComputeService:
    client = StorageClient(cluster.client_topology, cluster.client.transports, request_timeout_s=2.0,
                           connect_timeout_s=1.0)
    svc = ComputeService(ComputeConfig(coalesce_k=20, eval_share_timeout_s=10.0), tmp_path / name, storage=client,
                         node_name=name)
    await svc.start()
    return svc


def wire(svc: ComputeService, calls: list[str], fail_after_start: bool = False):
    """A peer call as the data plane makes it: the share and the figures cross as bytes."""
    async def call(share):
        calls.append(svc.node_name)
        data = encode_share(share)
        if fail_after_start:  # the node dies mid-share: its task ends without an answer
            task = asyncio.ensure_future(svc.eval_share(decode_share(data)))
            await asyncio.sleep(0)
            task.cancel()
            raise ConnectionResetError("peer c2 closed the connection")
        return decode_figures(encode_share(await svc.eval_share(decode_share(data))))
    return call


@pytest_asyncio.fixture
async def trained(tmp_path):
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    nodes = [await node(cluster, tmp_path, f"c{i}") for i in range(3)]
    try:
        await nodes[0].train(load_bundled_corpus(400), nodes[0].train_settings())
        yield nodes
    finally:
        for n in nodes:
            await n.stop(graceful=False)
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["teacher", "free"])
async def test_eval_spread_over_nodes_equals_local(trained, mode):
    c0, c1, c2 = trained
    prompts = load_bundled_corpus(120)
    local = await c0.evaluate(prompts, "train", mode, spread=False)
    assert list(local["by_node"]) == ["c0"] and local["by_node"]["c0"]["prompts"] == local["prompts"] > 50
    calls: list[str] = []
    c0.eval_peers = lambda: {"c1": wire(c1, calls), "c2": wire(c2, calls)}
    spread = await c0.evaluate(prompts, "train", mode)
    assert sorted(calls) == ["c1", "c2"]
    assert {k: spread[k] for k in FIGURES} == {k: local[k] for k in FIGURES}
    assert local["matches"] > 0
    by_node = spread["by_node"]
    assert sorted(by_node) == ["c0", "c1", "c2"] and all(v["prompts"] > 0 for v in by_node.values())
    assert sum(v["prompts"] for v in by_node.values()) == spread["prompts"]
    assert sum(v["predictions"] for v in by_node.values()) == spread["prediction_tokens"]
    assert sum(v["hits"] for v in by_node.values()) == spread["matches"]
    assert "redone" not in spread
    # top-1 is total hits / total predictions, not a mean of the nodes' ratios
    assert spread["top1"] == round(spread["matches"] / spread["prediction_tokens"], 6)


@pytest.mark.asyncio
async def test_eval_spread_share_of_a_failing_node_is_redone_here(trained):
    c0, c1, c2 = trained
    prompts = load_bundled_corpus(120)
    local = await c0.evaluate(prompts, spread=False)
    calls: list[str] = []
    c0.eval_peers = lambda: {"c1": wire(c1, calls), "c2": wire(c2, calls, fail_after_start=True)}
    spread = await c0.evaluate(prompts)
    assert {k: spread[k] for k in FIGURES} == {k: local[k] for k in FIGURES}
    assert [r["node"] for r in spread["redone"]] == ["c2"] and spread["redone"][0]["by"] == "c0"
    assert "ConnectionResetError" in spread["redone"][0]["error"]
    assert sorted(spread["by_node"]) == ["c0", "c1"]
    assert spread["by_node"]["c0"]["prompts"] + spread["by_node"]["c1"]["prompts"] == spread["prompts"]


@pytest.mark.asyncio
async def test_eval_spread_false_or_no_peers_runs_here(trained):
    c0, c1, _ = trained
    prompts = load_bundled_corpus(40)
    calls: list[str] = []
    c0.eval_peers = lambda: {"c1": wire(c1, calls)}
    out = await c0.evaluate(prompts, spread=False)
    assert calls == [] and list(out["by_node"]) == ["c0"]
    c0.eval_peers = lambda: {}
    assert list((await c0.evaluate(prompts))["by_node"]) == ["c0"]


@pytest.mark.asyncio
async def test_eval_spread_storage_failing_here_raises_the_storage_error_itself(trained, monkeypatch):
    """The receiving node's own storage failure fails the request as that error (routes answer
    STORAGE_ERRORS 503), not wrapped in the task group's ExceptionGroup (a 500), spread or not."""
    c0, c1, _ = trained
    real = c0.storage.read_rows

    async def read_rows(*args, **kwargs):  # the inference reader's reads fail (it passes fewest)
        if "fewest" in kwargs:
            raise ReadFailed("every replica of some rows failed")
        return await real(*args, **kwargs)

    monkeypatch.setattr(c0.storage, "read_rows", read_rows)
    c0.eval_peers = lambda: {"c1": wire(c1, [])}
    for spread in (False, True):
        with pytest.raises(ReadFailed):
            await c0.evaluate(load_bundled_corpus(40), spread=spread)
