"""A compute node cut off from storage (a network fault of that node alone) while it runs a
training window. The lease design's answer (docs/compute.md, "The protocol"): its lease expires,
another node takes the window over, and the job goes on; once the node is back it must not end
the job. Before the fix, the cut node's window ran out of write attempts (6, a few seconds)
while it still believed it held the lease, the window "failed", and the node's job-row write
``failed`` landed as soon as it could reach storage again: one node's network fault failed the
whole cluster job."""

import asyncio
import dataclasses

import pytest

from giaannd.compute.cluster_jobs.window_runner import TRAIN_STAGE
from giaannd.model.tokens import write_conllu
from tools.cluster_harness import Cluster

from .test_cluster_jobs_inprocess import N_SENTENCES, assert_export_equals_engine, corpus, engine, node, wait_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["corpus", "engine"]  # fixtures

#: the StorageClient calls a compute node makes for a cluster job (registers, chunks, vocabulary, batches)
_CALLS = ("read_register", "read_write_once_register", "cas_register", "put_vocab", "write", "read_rows")


def cut_off(client, cut: asyncio.Event) -> None:
    """While ``cut`` is set, every storage call of ``client`` fails as an unreachable network would."""
    for name in _CALLS:
        call = getattr(client, name)

        async def failing(*args, _call=call, **kwargs):
            if cut.is_set():
                raise ConnectionRefusedError("cut off from storage (test)")
            return await _call(*args, **kwargs)

        setattr(client, name, failing)


@pytest.mark.asyncio
async def test_cluster_job_node_cut_off_from_storage_mid_window_does_not_fail_the_job(tmp_path, corpus, engine):
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    (tmp_path / "corpus").mkdir()
    write_conllu(corpus, tmp_path / "corpus" / "train.conllu")
    nodes = [await node(cluster, tmp_path, f"c{i}") for i in range(2)]
    cut, healed = asyncio.Event(), asyncio.Event()
    victim, other = nodes[1], nodes[0]
    cut_window: list[int] = []
    cut_off(victim.storage, cut)
    write = victim.storage.write

    async def cut_at_write(batch, batch_id=None):
        if not cut_window and batch_id is not None:  # the cut starts as the first batch goes out
            cut_window.append(batch_id.seq - 1)  # (seq = window + 1)
            cut.set()
        return await write(batch, batch_id)

    victim.storage.write = cut_at_write
    # train.py's 6 attempts take a few seconds, well inside the default 10 s lease; the test's lease
    # is 1 s, so the victim's attempts are spaced less (at most 0.31 s in all) to keep that order
    victim.cluster.train = dataclasses.replace(victim.cluster.train, retry_backoff_s=0.01)
    run, other_run = victim.cluster._run, other.cluster._run  # noqa: SLF001

    async def heal_after(f, action):
        try:
            return await run(f, action)
        finally:  # the cut window gave up (before the fix), or was dropped with its lease: heal
            if cut_window == [action.window] and action.stage == TRAIN_STAGE:
                cut.clear()
                healed.set()

    async def after_heal(f, action):
        # the other node trains only once the victim is back, so the job is still running then
        if action.stage == TRAIN_STAGE:
            await healed.wait()
        return await other_run(f, action)

    victim.cluster._run = heal_after  # noqa: SLF001
    other.cluster._run = after_heal  # noqa: SLF001
    try:
        job_id = other.submit_cluster(tmp_path / "corpus" / "train.conllu")
        async with asyncio.timeout(60):
            await healed.wait()
        doc = await wait_state(other, job_id)
        assert doc["state"] == "succeeded", doc
        assert doc["done"] == doc["total"] == N_SENTENCES
        assert doc["trained"] == engine.stats.sentences_trained
        out = tmp_path / "corpus" / "export.jsonl"
        other.export_dir = tmp_path / "corpus"
        await other.export(out)
        assert_export_equals_engine(out, engine)
    finally:
        cut.clear()
        healed.set()
        for n in nodes:
            await n.stop(graceful=False)
        await cluster.close()
