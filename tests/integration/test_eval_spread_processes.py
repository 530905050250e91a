"""A spread evaluation on real daemons (issue 15 item 5): 3 storage + 2 compute ``giaannd`` processes
on loopback (tcp). compute-1 trains; ``POST /v1/eval`` with ``"spread": true`` sends compute-2 its
share over the data plane (``ComputeCall``), and the figures equal ``"spread": false``'s; after
``kill -9`` of compute-2 (still listed alive: suspicion is slowed so the eval meets it first) the
result is still complete, its share redone on compute-1. Every wait is bounded."""

import time

import pytest

from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.sdk.local_cluster import running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FIGURES = ("prompts", "skipped", "prediction_tokens", "matches", "top1", "no_prediction", "steps")
#: Death takes suspicion_mult x log(n) probe intervals: ~10 s on the loopback profile at this
#: value, so compute-2 is still alive in the table when the eval after its kill starts.
MEMBERSHIP = {"suspicion_mult": 20}


def test_eval_spread_over_two_compute_daemons_and_redone_after_kill_9(tmp_path):
    with running_cluster(tmp_path / "cluster", storage=3, compute=2, transport="tcp",
                         membership_options=MEMBERSHIP) as cluster:
        path = cluster.corpus_dir / "train.conllu"
        write_conllu(load_bundled_corpus(300), path)
        cluster.wait_converged()
        admin = cluster.node("compute-1").admin
        job = admin.json("POST", "/v1/train", {"corpus": str(path), "workers": 1, "cluster": False})
        deadline = time.monotonic() + 60
        while (doc := admin.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert doc["state"] == "succeeded", doc
        ask = {"corpus": str(path), "limit": 120}
        local = admin.json("POST", "/v1/eval", {**ask, "spread": False})
        spread = admin.json("POST", "/v1/eval", {**ask, "spread": True})
        assert list(local["by_node"]) == ["compute-1"] and local["matches"] > 0
        assert sorted(spread["by_node"]) == ["compute-1", "compute-2"], spread
        assert all(v["prompts"] > 0 for v in spread["by_node"].values())
        assert "redone" not in spread, spread["redone"]
        assert {k: spread[k] for k in FIGURES} == {k: local[k] for k in FIGURES}

        cluster.kill(cluster.node("compute-2"))
        t0 = time.monotonic()
        after = admin.json("POST", "/v1/eval", {**ask, "spread": True})
        assert time.monotonic() - t0 < 30
        assert [r["node"] for r in after["redone"]] == ["compute-2"], after
        assert after["redone"][0]["by"] == "compute-1"
        assert list(after["by_node"]) == ["compute-1"]
        assert {k: after[k] for k in FIGURES} == {k: local[k] for k in FIGURES}
