"""``train cancel`` of a cluster job while it is being created (cluster_train.py): the upload is over
and the uploader's driver is writing the job row, or the upload is still running on another node.
Three StorageServices (mem://), two compute nodes whose windows never run (a job can only end by
the cancel), one register write held at a gate (an asyncio.Event) while the cancel is made: no
timing decides the order. The job must end cancelled, nothing may start it after the cancel.

Before the fix: a cancel on the uploading node after the upload cancelled the upload's task while
its driver went on creating the job, which then ran; a cancel on another node set the upload row
``failed`` but an uploader that finished before its next renewal wrote the job row anyway, and one
whose upload ended between the canceller's document and its write was not cancelled at all."""

import asyncio
import re

import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.compute.cluster_jobs.lease_table import INDEX_KEY, decode_index, decode_job, job_key
from giaannd.compute.cluster_jobs.uploads import UPLOADS_KEY, decode_upload, decode_uploads, upload_key
from giaannd.compute.service import ComputeService
from giaannd.config import ComputeConfig
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from tests.integration.test_cluster_jobs_inprocess import wait_state
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.asyncio]

JOB_ROW = re.compile(r"job/[0-9a-f]+")


async def node(cluster: Cluster, tmp_path, name: str, windows_open: asyncio.Event) -> ComputeService:
    # lease_s long: no upload is adopted and no lease expires while the test holds a write
    cfg = ComputeConfig(cluster_jobs=True, coalesce_k=20, train_workers=2, lease_s=30.0, lease_probe_interval_s=0.1,
                        lease_windows=2, corpus_dir=str(tmp_path / "corpus"))
    client = StorageClient(cluster.client_topology, cluster.client.transports, request_timeout_s=2.0,
                           connect_timeout_s=1.0)
    svc = ComputeService(cfg, tmp_path / name, storage=client, node_name=name, corpus_dir=tmp_path / "corpus")
    await svc.start()
    run = svc.cluster._run

    async def held(f, action):  # windows wait for the end of the test
        await windows_open.wait()
        return await run(f, action)

    svc.cluster._run = held

    async def no_renewal(job_id, up):  # the next renewal has not come yet (it would see a cancel)
        await asyncio.Event().wait()

    svc.cluster._renew_upload = no_renewal
    return svc


def gate(svc: ComputeService, match) -> tuple[asyncio.Event, asyncio.Event, asyncio.Event]:
    """Hold the node's first register CAS on a key ``match`` accepts until ``release`` is set;
    ``passed`` is set once that CAS has returned."""
    client = svc._client()
    real = client.cas_register
    reached, release, passed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def cas(key, expect, value=b"", timeout_s=None):
        if not match(key) or reached.is_set():
            return await real(key, expect, value, timeout_s)
        reached.set()
        await release.wait()
        try:
            return await real(key, expect, value, timeout_s)
        finally:
            passed.set()

    client.cas_register = cas
    return reached, release, passed


async def wait_for(event: asyncio.Event) -> None:
    async with asyncio.timeout(30):
        await event.wait()


@pytest.mark.parametrize("where", ["same_node_job_row", "other_node_upload", "other_node_job_row",
                                   "other_node_upload_ended"])
async def test_cancel_during_creation_cancels_the_job(tmp_path, where):
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    (tmp_path / "corpus").mkdir()
    write_conllu(load_bundled_corpus(200), tmp_path / "corpus" / "train.conllu")
    windows_open = asyncio.Event()
    c0, c1 = [await node(cluster, tmp_path, f"c{i}", windows_open) for i in range(2)]
    canceller = c0 if where.startswith("same") else c1
    try:
        if where == "other_node_upload":  # a chunk write: the upload is running
            reached, release, passed = gate(c0, lambda key: "/g/" in key)
        else:  # the job row's first write: the upload is over, the driver creates the job
            reached, release, passed = gate(c0, JOB_ROW.fullmatch)
        if where == "other_node_upload_ended":  # the canceller's upload-row write waits for the row's end
            c1_reached, c1_release, _ = gate(c1, lambda key: key.endswith("/upload"))
        job_id = c0.submit_cluster(tmp_path / "corpus" / "train.conllu")
        creating = c0.cluster.uploading[job_id].task
        await wait_for(reached)
        if where == "other_node_upload_ended":
            cancel = asyncio.create_task(canceller.cluster.cancel(job_id))
            await wait_for(c1_reached)  # c1 read the document (uploading) and is about to end the upload
            release.set()
            async with asyncio.timeout(30):  # c0 writes the job row, then ends its upload row
                while decode_upload((await cluster.client.read_register(upload_key(job_id))).value).state \
                        == "uploading":
                    await asyncio.sleep(0.02)
            c1_release.set()
            doc = await cancel
        else:
            doc = await canceller.cluster.cancel(job_id)
            release.set()
        assert doc["phase"] == "uploading", doc  # what the canceller saw: no job row yet
        async with asyncio.timeout(30):  # the create task ends (the job row written, or the upload given up)
            await asyncio.gather(creating, return_exceptions=True)
            await passed.wait()  # and the held write is in: the job row, or the chunk
        try:  # windows never run here: only the cancel can end the job
            doc = await wait_state(c1, job_id, 30)
        except TimeoutError:
            pytest.fail(f"the job was not cancelled: {await c1.cluster.document(job_id)}")
        got = await cluster.client.read_register(job_key(job_id))
        if got.version[0]:
            assert decode_job(got.value).state == "cancelled" and doc["state"] == "cancelled", doc
        else:
            assert doc["state"] == "failed" and doc["error"].startswith("cancelled"), doc
        assert doc["done"] == 0
        async with asyncio.timeout(30):  # nothing left listed: the job index and the upload index
            while job_id in decode_uploads((await cluster.client.read_register(UPLOADS_KEY)).value).jobs or \
                    job_id in decode_index((await cluster.client.read_register(INDEX_KEY)).value).jobs:
                await asyncio.sleep(0.05)
    finally:
        windows_open.set()
        for svc in (c0, c1):
            await svc.stop(graceful=False)
        await cluster.close()
