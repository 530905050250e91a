"""A cluster job's upload survives its node (cluster_jobs/uploads.py): the uploader "dies" mid-upload
(its tasks cancelled, as kill -9 would for the cluster); another compute node adopts the upload
once its row stops being renewed and finishes it from the shared corpus directory, or, when it
cannot read the corpus, marks the job failed with the reason. No job stays ``uploading``."""

import asyncio

import pytest

from giaannd.compute.cluster_jobs.uploads import UPLOADS_KEY, decode_upload, decode_uploads, upload_key
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from tests.integration.test_cluster_jobs_inprocess import kill, node, wait_state
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio]

N_SENTENCES, K = 300, 20


def slow_chunks(svc, delay_s=1.0):
    """The node's chunk writes take ``delay_s`` each, so the test can kill it mid-upload."""
    client = svc._client()
    real = client.cas_register

    async def cas(key, expect, value=b"", timeout_s=None):
        if "/w/" in key or "/g/" in key:  # a chunk: one window, or a group of windows
            await asyncio.sleep(delay_s)
        return await real(key, expect, value, timeout_s)
    client.cas_register = cas


async def die_mid_upload(cluster, svc, job_id):
    async with asyncio.timeout(30):
        while True:
            got = await cluster.client.read_register(upload_key(job_id))
            if got.version[0] and decode_upload(got.value).windows >= 1:
                break
            await asyncio.sleep(0.02)
    kill(svc)
    for up in svc.cluster.uploading.values():
        up.task.cancel()
    await asyncio.sleep(0)


async def setup(tmp_path, shared: bool):
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    (tmp_path / "corpus").mkdir()
    write_conllu(load_bundled_corpus(N_SENTENCES), tmp_path / "corpus" / "train.conllu")
    c0 = await node(cluster, tmp_path, "c0")
    c1 = await node(cluster, tmp_path if shared else tmp_path / "elsewhere", "c1")
    return cluster, c0, c1


@pytest.mark.parametrize("shared", [True, False])
async def test_upload_adopted_when_its_node_dies(tmp_path, shared):
    cluster, c0, c1 = await setup(tmp_path, shared)
    try:
        slow_chunks(c0)
        job_id = c0.submit_cluster(tmp_path / "corpus" / "train.conllu")
        await die_mid_upload(cluster, c0, job_id)
        doc = await c1.cluster.document(job_id)  # any node answers for an upload in progress
        assert doc["phase"] == "uploading" and doc["state"] == "running" and doc["uploader"] == "c0"
        doc = await wait_state(c1, job_id, 60)
        row = decode_upload((await cluster.client.read_register(upload_key(job_id))).value)
        assert row.node == "c1" and row.adoptions == 1
        if shared:  # c1 finished the upload from the same file, and the job ran to the end
            assert doc["state"] == "succeeded", doc
            assert doc["done"] == doc["total"] == N_SENTENCES and row.state == "done"
        else:
            assert doc["state"] == "failed" and doc["phase"] == "uploading", doc
            assert "cannot read the corpus" in doc["error"] and row.state == "failed"
        async with asyncio.timeout(10):  # the row is ended first, then the index forgets it
            while job_id in decode_uploads((await cluster.client.read_register(UPLOADS_KEY)).value).jobs:
                await asyncio.sleep(0.05)
    finally:
        for svc in (c0, c1):
            await svc.stop(graceful=False)
        await cluster.close()


@pytest.mark.parametrize("spill_bytes", [2**21, None])
async def test_upload_larger_than_the_register_ram_cap(tmp_path, spill_bytes):
    """Corpus size (issue 15 item 1): 4,000 sentences (~1.4 MB of chunks, all on each of the 3
    storage nodes at R = 3) against a 1 MiB register RAM cap. With no value spilled to disk (2 MiB:
    the store as it was before) the upload is refused and the job fails with the reason; with the
    default, the chunks stay on disk and the job trains to the end."""
    extra = {} if spill_bytes is None else {"register_spill_bytes": spill_bytes}
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start(register_ram_bytes=2**20, **extra)
    (tmp_path / "corpus").mkdir()
    write_conllu(load_bundled_corpus(4000), tmp_path / "corpus" / "train.conllu")
    c0 = await node(cluster, tmp_path, "c0")
    try:
        job_id = c0.submit_cluster(tmp_path / "corpus" / "train.conllu")
        async with asyncio.timeout(60):
            while (doc := await c0.cluster.document(job_id)) is None or doc["phase"] == "uploading" and \
                    doc["state"] == "running":
                await asyncio.sleep(0.05)
        if spill_bytes is not None:
            assert doc["state"] == "failed" and doc["phase"] == "uploading", doc
            assert "register_store_full" in doc["error"] or "limit" in doc["error"], doc
            return
        assert doc["state"] == "running" and doc["phase"] != "uploading", doc
        stores = [svc.registers for svc in cluster.services.values()]
        assert all(s is not None and s.ram_bytes <= 2**20 < s.disk_bytes for s in stores)
        doc = await wait_state(c0, job_id, 90)  # every window read back from the spilled chunks
        assert doc["state"] == "succeeded" and doc["done"] == doc["total"] == 4000, doc
    finally:
        await c0.stop(graceful=False)
        await cluster.close()
