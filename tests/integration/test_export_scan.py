"""The cluster-wide export (storage scan) and the replicated vocabulary, on in-process clusters.

What "done" means here: an export is every row of the cluster exactly once, whichever compute node
or job wrote it, equal to the single-process Engine's; a compute node that never trained (empty
data dir) prints real words, because the id → string table lives in storage.
"""

import json

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.storage_client import ReadFailed, RemoteVocabConflict, ScanInterrupted, VocabWriteFailed
from giaannd.compute.service import ComputeService
from giaannd.compute.train import TrainSettings
from giaannd.config import ComputeConfig
from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl
from giaannd.model.ids import column_id, feature_id
from giaannd.model.rows import RowBatch
from giaannd.model.tokens import load_bundled_corpus
from giaannd.storage.engine.vocab_store import KIND_COLUMN
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(120)]

N_SENTENCES = 400


@pytest.fixture(scope="module")
def corpus():
    return load_bundled_corpus(N_SENTENCES)


@pytest.fixture(scope="module")
def engine(corpus):
    e = Engine()
    e.train(corpus)
    return e


async def service(cluster: Cluster, data_dir) -> ComputeService:
    svc = ComputeService(ComputeConfig(), data_dir, storage=cluster.client)
    await svc.start()
    return svc


def read_export(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def assert_same_export(ref_lines, lines):
    assert len(lines) == len(ref_lines) > 1000
    for a, b in zip(ref_lines, lines):
        assert {k: v for k, v in a.items() if k != "strength"} == {k: v for k, v in b.items() if k != "strength"}
        assert b["strength"] == pytest.approx(a["strength"], rel=1e-5)


def keys_of(batches):
    return [k for b in batches for k, _ in b]


async def all_stored_keys(cluster: Cluster) -> set:
    return {k for svc in cluster.services.values() for k in svc.store.store.keys()}


@pytest.mark.asyncio
async def test_export_of_two_jobs_on_two_nodes_from_a_fresh_node_equals_engine(tmp_path, corpus, engine):
    """Two compute nodes train the two halves (two jobs, two writers); a third that never trained,
    with an empty data dir, exports everything with words, and generates words, not hex."""
    cluster = await Cluster(tmp_path / "storage", 3).start()
    try:
        half = len(corpus) // 2
        a = await service(cluster, tmp_path / "a")
        b = await service(cluster, tmp_path / "b")
        await a.train(corpus[:half], TrainSettings(workers=1, coalesce_sentences=64))
        await b.train(corpus[half:], TrainSettings(workers=1, coalesce_sentences=64))
        fresh = await service(cluster, tmp_path / "fresh")
        assert fresh.state.vocab.num_columns == 0 and fresh.state.rows_written == 0
        out = tmp_path / "export.jsonl"
        info = await fresh.export(out)
        ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
        assert_same_export(ref, read_export(out))
        assert info["rows"] == len(engine.store.keys())
        # node a alone wrote only half of the rows, yet its export is the whole cluster's too
        info_a = await a.export(tmp_path / "a.jsonl")
        assert info_a["lines"] == len(ref) and a.state.rows_written < info_a["rows"]
        # generation on the fresh node: words fetched from storage, equal to the engine's
        prompt = corpus[3][:10]
        gen = await fresh.generate(prompt, 8)
        assert gen["tokens"] == engine.generate(prompt, 8) and gen["tokens"]
        assert not any(t.startswith("<") for t in gen["tokens"])
        ev = await fresh.evaluate(corpus[:40], "train")
        assert ev["prediction_tokens"] > 0
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_scan_all_is_every_row_exactly_once_with_a_node_down_and_a_failover(tmp_path, caplog):
    rng = np.random.default_rng(7)
    cluster = await Cluster(tmp_path / "storage", 4, replicas=3).start()
    try:
        for _ in range(4):
            await cluster.client.write(make_batch(rng, 300))
        stored = await all_stored_keys(cluster)
        pages = [b async for b in cluster.client.scan_all(page_rows=37)]
        got = keys_of(pages)
        assert len(got) == len(set(got)) and set(got) == stored and len(pages) > 4
        full = RowBatch.concat(pages)
        ref = await cluster.client.read_rows(full.row_column, full.row_feature)
        assert all(np.array_equal(x, y) for x, y in zip(full.buffers(), ref.buffers()))

        # a node down (known to the topology): its columns come from their next live owner
        await cluster.stop_node("s1")
        got = keys_of([b async for b in cluster.client.scan_all(page_rows=50)])
        assert len(got) == len(set(got)) and set(got) == stored

        # a node failing mid-scan (not yet known down): the rest of its share fails over
        victim = "s2"
        caplog.set_level("INFO", logger="giaannd.client.storage_client")
        seen_from_victim = 0
        scan = cluster.client.scan_all(page_rows=20)
        got = []
        async for page in scan:
            got += keys_of([page])
            first_live = {[n for n in cluster.owners(k[0]) if n != "s1"][0] for k, _ in page}
            # pages are merged across nodes: a page with rows *from* the victim (their first live
            # owner), early in the scan, when its share has more pages to come
            if victim in first_live and victim in cluster.services:
                seen_from_victim = 1  # stop it mid-way through its share
                await cluster.kill(victim, noticed=False)  # the client's topology still says live
        assert len(got) == len(set(got)) and set(got) == stored
        assert seen_from_victim and any("scan failover node=s2" in r.getMessage() for r in caplog.records)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_scan_fails_clearly_when_no_owner_is_left_and_on_placement_change(tmp_path):
    rng = np.random.default_rng(3)
    cluster = await Cluster(tmp_path / "storage", 3, replicas=1, request_timeout_s=0.5).start()
    try:
        await cluster.client.write(make_batch(rng, 200))
        await cluster.kill("s0", noticed=False)  # R = 1: its rows have no other owner
        with pytest.raises(ReadFailed, match="no other live owner"):
            _ = [b async for b in cluster.client.scan_all()]
        # a placement change mid-scan is detected, not silently mixed
        cluster.client_topology.mark_down("s0")
        scan = cluster.client.scan_all(page_rows=5)
        await anext(scan)
        await cluster.client_runtime.commit_ring(cluster.ring.with_removed("s1"))  # (this view only)
        with pytest.raises(ScanInterrupted):
            _ = [b async for b in scan]
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_vocab_replicated_survives_restart_and_a_missed_replica(tmp_path):
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=1.0).start()
    try:
        words = [f"word{i}" for i in range(200)]
        entries = [(1, feature_id(w), w) for w in words] + [(0, column_id(w), w) for w in words[:50]]
        assert await cluster.client.put_vocab(entries) == len(entries)
        # every owner holds its entries (R = 3 of 3: every node holds all)
        for svc in cluster.services.values():
            assert len(svc.vocab) == len(entries)
        # restart of a node keeps its table (the log is replayed)
        await cluster.stop_node("s0", graceful=False)
        late = [(1, feature_id(f"late{i}"), f"late{i}") for i in range(30)]
        await cluster.client.put_vocab(late)  # W = 2 of 3 while s0 is down: s0 misses these
        restarted = await cluster.restart_node("s0")
        assert len(restarted.vocab) == len(entries)
        # lookups still find the entries s0 missed (asked of the next owner)
        keys = [(k, i) for k, i, _ in entries + late]
        found = await cluster.client.get_vocab(keys)
        assert found == {(k, i): t for k, i, t in entries + late}
        assert await cluster.client.get_vocab([(KIND_COLUMN, 12345)]) == {}  # absent, not an error
        # a second put of the same entries adds nothing anywhere
        size = restarted.vocab.nbytes
        await cluster.client.put_vocab(entries)
        assert restarted.vocab.nbytes == size
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_vocab_conflict_and_quorum_failures_are_clear(tmp_path):
    cluster = await Cluster(tmp_path / "storage", 3, request_timeout_s=0.5).start()
    try:
        # a planted "collision" on one node: the put is refused there, with the strings named
        cluster.services["s1"].vocab._tables[0][column_id("cow")] = "not-cow"
        with pytest.raises(RemoteVocabConflict, match="not-cow"):
            await cluster.client.put_vocab([(0, column_id("cow"), "cow")])
        # a text that does not hash to its id is a bad request, nothing stored
        with pytest.raises(VocabWriteFailed):
            await cluster.client.put_vocab([(1, feature_id("a"), "b")])
        assert all(svc.vocab.get(1, feature_id("a")) is None for svc in cluster.services.values())
        # fewer than W live owners: the put fails (and can be retried later)
        await cluster.stop_node("s0")
        await cluster.stop_node("s2")
        with pytest.raises(VocabWriteFailed, match="fewer than 2 acks"):
            await cluster.client.put_vocab([(1, feature_id("x"), "x")])
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_scan_request_limits_are_enforced_by_the_node(tmp_path):
    cluster = await Cluster(tmp_path / "storage", 1, replicas=1).start()
    try:
        rng = np.random.default_rng(1)
        await cluster.client.write(make_batch(rng, 100))
        reply, bulk = await cluster.client._call("s0", p.ScanRows(limit=10 ** 9))
        assert isinstance(reply, p.ScanPage) and p.check_batch(bulk).num_rows == 100 and reply.done
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_scan_drops_rows_a_node_returns_outside_its_share(tmp_path, caplog):
    """A node that ignores the ownership filter (here: its service's topology is unset, so its
    core filters nothing) cannot make the scan repeat rows: the client re-checks every page."""
    rng = np.random.default_rng(5)
    cluster = await Cluster(tmp_path / "storage", 3, replicas=2).start()
    try:
        await cluster.client.write(make_batch(rng, 400))
        stored = await all_stored_keys(cluster)
        cluster.services["s0"].topology = None
        caplog.set_level("WARNING", logger="giaannd.client.storage_client")
        got = keys_of([b async for b in cluster.client.scan_all(page_rows=64)])
        assert len(got) == len(set(got)) and set(got) == stored
        assert any("outside its share" in r.getMessage() for r in caplog.records)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_export_of_rows_without_strings_fails_clearly_and_writes_nothing(tmp_path):
    from giaannd.compute.service import VocabularyMissing

    cluster = await Cluster(tmp_path / "storage", 3).start()
    try:
        await cluster.client.write(make_batch(np.random.default_rng(2), 20))  # ids nobody named
        fresh = await service(cluster, tmp_path / "fresh")
        out = tmp_path / "x.jsonl"
        with pytest.raises(VocabularyMissing, match="not in the vocabulary"):
            await fresh.export(out)
        assert not out.exists()
    finally:
        await cluster.close()
