"""A compute node frozen mid-job (a GC pause, SIGSTOP) while its window's batch is on its way to
storage: its renewals stop, another node takes the window over and the job ends; then the frozen
node thaws and its old write lands after all. Each sentence must still be trained once: the export
equals the core's and the job document counts the core's sentences (docs/compute.md, "Why nothing
is counted twice or lost")."""

import asyncio

import pytest

from giaannd.compute.cluster_jobs.lease_driver import LeaseDriver
from giaannd.compute.cluster_jobs.window_runner import TRAIN_STAGE
from giaannd.model.tokens import write_conllu
from tools.cluster_harness import Cluster

from .test_cluster_jobs_inprocess import N_SENTENCES, assert_export_equals_engine, corpus, engine, node, wait_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["corpus", "engine"]  # fixtures


@pytest.mark.asyncio
async def test_cluster_job_frozen_node_late_write_lands_after_the_job(tmp_path, corpus, engine, monkeypatch):
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    (tmp_path / "corpus").mkdir()
    write_conllu(corpus, tmp_path / "corpus" / "train.conllu")
    nodes = [await node(cluster, tmp_path, f"c{i}") for i in range(2)]
    frozen, thaw = asyncio.Event(), asyncio.Event()
    victim = nodes[1]

    # the victim's driver stops handling events while frozen (no renewals, no drops): a paused process
    next_event = LeaseDriver._next_event

    async def paused(self):
        if self.agent.node == "c1" and frozen.is_set():
            await thaw.wait()
        return await next_event(self)

    monkeypatch.setattr(LeaseDriver, "_next_event", paused)
    client = victim.storage
    write = client.write
    landed: list[asyncio.Future] = []

    async def late(batch, batch_id=None):
        if batch_id is not None and not landed and not frozen.is_set() and _training(victim):
            frozen.set()  # the pause starts with this write on its way
            await thaw.wait()
            # the write goes on whatever the thawed driver does with the window (as the client's
            # sends would: they do not stop with the window's task)
            landed.append(asyncio.ensure_future(write(batch, batch_id)))
            return await asyncio.shield(landed[0])
        return await write(batch, batch_id)

    monkeypatch.setattr(client, "write", late)
    try:
        job_id = nodes[0].submit_cluster(tmp_path / "corpus" / "train.conllu")
        async with asyncio.timeout(60):
            await frozen.wait()
        doc = await wait_state(nodes[0], job_id)  # c0 takes the frozen node's leases over, ends the job
        assert doc["state"] == "succeeded", doc
        thaw.set()
        async with asyncio.timeout(20):
            while not landed:
                await asyncio.sleep(0.01)
            await landed[0]  # the late write has its W acks: storage took it (as a duplicate)
        doc = await wait_state(nodes[0], job_id)
        assert doc["done"] == doc["total"] == N_SENTENCES
        assert doc["trained"] == engine.stats.sentences_trained, doc
        assert doc["by_node"]["c1"]["leases_expired"] >= 1
        out = tmp_path / "corpus" / "export.jsonl"
        nodes[0].export_dir = tmp_path / "corpus"
        await nodes[0].export(out)
        assert_export_equals_engine(out, engine)
    finally:
        thaw.set()
        for n in nodes:
            await n.stop(graceful=False)
        await cluster.close()


def _training(svc) -> bool:
    return any(f.agent.job is not None and f.agent.job.stage == TRAIN_STAGE for f in svc.cluster.followed.values())
