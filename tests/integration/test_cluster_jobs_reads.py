"""Register reads of a cluster job (issue 15 item 2). A job's corpus is uploaded four windows to
a chunk (corpus_chunks.py ``GROUP_WINDOWS``), and the windows of a group share one read on a node:
it was one chunk per window, read once per window and stage. Chunks and flag findings are
write-once registers (every CAS on them proposes the same bytes, or empties a chunk once the job
ended), so a compute node reads them from one owner, not from all R: at R = 3 that was 3
RegisterGet requests per chunk read and per findings read ((B - 1) / B of the windows per node in
the training stage: the cost that grew with B). In-process storage (mem://), two compute nodes;
the export still equals the single-process core's."""

import asyncio
import collections
import re

import pytest

from giaannd import protocol as p
from giaannd.client.registers import RegisterClient
from giaannd.compute.cluster_jobs import cluster_train
from giaannd.compute.cluster_jobs.corpus_chunks import GROUP_WINDOWS, GROUPED, chunk_key
from giaannd.model.tokens import write_conllu
from tests.integration.test_cluster_jobs_inprocess import (
    N_SENTENCES,
    K,
    assert_export_equals_engine,
    corpus,  # noqa: F401 (fixture)
    engine,  # noqa: F401 (fixture)
    node,
    wait_state,
)
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.asyncio
async def test_cluster_job_reads_chunks_and_findings_from_one_owner(tmp_path, corpus, engine, monkeypatch):  # noqa: F811
    gets: collections.Counter[str] = collections.Counter()
    exchange = RegisterClient._exchange

    async def counted(self, sends, feed, finished, timeout_s):
        for _, msg in sends:
            if isinstance(msg, p.RegisterGet):
                kind = re.match(r"job/[0-9a-f]+/(w|g|f)/(\d+)", msg.key)
                gets[kind.group(1) if kind else "other"] += 1
        await exchange(self, sends, feed, finished, timeout_s)

    monkeypatch.setattr(RegisterClient, "_exchange", counted)
    one = RegisterClient.read_one

    async def counted_one(self, key, timeout_s=None):
        kind = re.match(r"job/[0-9a-f]+/(w|g|f)/(\d+)", key)
        gets[kind.group(1) if kind else "other"] += 1
        return await one(self, key, timeout_s)

    monkeypatch.setattr(RegisterClient, "read_one", counted_one)

    async def no_clear(*args, **kwargs):  # the chunks' emptying once the job ended reads them too
        return 0

    monkeypatch.setattr(cluster_train, "clear_windows", no_clear)

    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    (tmp_path / "corpus").mkdir()
    write_conllu(corpus, tmp_path / "corpus" / "train.conllu")
    nodes = [await node(cluster, tmp_path, f"c{i}") for i in range(2)]
    try:
        job_id = nodes[0].submit_cluster(tmp_path / "corpus" / "train.conllu")
        doc = await wait_state(nodes[1], job_id)
        assert doc["state"] == "succeeded", doc
        windows = N_SENTENCES // K
        groups = -(-windows // GROUP_WINDOWS)
        # each group is read at least once (a node's last reads may serve both stages) and at most
        # once per stage by each node (its windows' leases hold 2 windows here: a group may be
        # split), plus a redo now and then (a lease taken over on a slow machine): one request per
        # read. Per window and from all R owners, it was 2 * windows * 3 requests
        assert gets["w"] == 0 and groups <= gets["g"] <= 2 * groups * len(nodes) + 6, gets
        # each node's fold reads the findings of the windows the other node found (and the last
        # ones again when the job ends); never more than one request per window and node
        assert gets["f"] <= windows * len(nodes), gets
        out = tmp_path / "corpus" / "export.jsonl"
        nodes[1].export_dir = tmp_path / "corpus"
        await nodes[1].export(out)
        assert_export_equals_engine(out, engine)
    finally:
        for n in nodes:
            await n.stop(graceful=False)
        await cluster.close()
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_cluster_job_from_conllu_empties_its_chunks_without_reading_tagged_ones(tmp_path, corpus,  # noqa: F811
                                                                                      monkeypatch):
    # a CoNLL-U job has no tagged chunks (only a text job's flag pass stores them): emptying the
    # chunks at the job's end read one absent tagged chunk per window, a quorum read each
    gets: collections.Counter[str] = collections.Counter()
    exchange = RegisterClient._exchange

    async def counted(self, sends, feed, finished, timeout_s):
        for _, msg in sends:
            if isinstance(msg, p.RegisterGet) and re.match(r"job/[0-9a-f]+/t/", msg.key):
                gets["t"] += 1
        await exchange(self, sends, feed, finished, timeout_s)

    monkeypatch.setattr(RegisterClient, "_exchange", counted)
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=2.0).start()
    (tmp_path / "corpus").mkdir()
    write_conllu(corpus[:100], tmp_path / "corpus" / "train.conllu")
    svc = await node(cluster, tmp_path, "c0")
    try:
        job_id = svc.submit_cluster(tmp_path / "corpus" / "train.conllu")
        assert (await wait_state(svc, job_id))["state"] == "succeeded"
        async with asyncio.timeout(20):  # the node that ended the job empties its chunks
            while any([(await cluster.client.read_register(chunk_key(job_id, g, 0, GROUPED))).value
                       for g in range(-(-(100 // K) // GROUP_WINDOWS))]):
                await asyncio.sleep(0.05)
        assert gets["t"] == 0, gets
    finally:
        await svc.stop(graceful=False)
        await cluster.close()
