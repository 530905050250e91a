"""Equivalence on a real loopback cluster: 3 storage *processes* (tcp, R=3, W=2), compute here."""

import asyncio
import json

import pytest

from giaannd.compute.service import ComputeService
from giaannd.compute.train import TrainSettings
from giaannd.config import ComputeConfig
from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl
from giaannd.model.tokens import load_bundled_corpus
from tools.bench.cluster import make_client, storage_processes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_compute_processes_one_worker_export_and_predictions_equal_engine(tmp_path):
    corpus = load_bundled_corpus(400)
    engine = Engine()
    engine.train(corpus)

    async def run(addrs):
        client = make_client(addrs)
        svc = ComputeService(ComputeConfig(), tmp_path / "compute", storage=client)
        await svc.start()
        try:
            await svc.train(corpus, TrainSettings(workers=1, coalesce_sentences=100))
            out = tmp_path / "cluster.jsonl"
            await svc.export(out)
            ev = await svc.evaluate(corpus[:80], "train")
            ev_test = await svc.evaluate(corpus[:80], "test")
            return out, ev, ev_test
        finally:
            await svc.stop(graceful=True)
            await client.close()

    with storage_processes(tmp_path / "storage") as addrs:
        out, ev, ev_test = asyncio.run(asyncio.wait_for(run(addrs), 150))
    ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == len(ref) > 5000
    for a, b in zip(ref, got):
        assert a["source_word"] == b["source_word"] and a["target_word"] == b["target_word"]
        assert a["segment"] == b["segment"] and b["strength"] == pytest.approx(a["strength"], rel=1e-5)
    for name, ev_ in (("train", ev), ("test", ev_test)):
        from giaannd.model.engine import constants_named
        expected = engine.evaluate(corpus[:80], constants=constants_named(name))
        assert (ev_["matches"], ev_["prediction_tokens"]) == (expected.matches, expected.prediction_tokens)
