"""End to end on real daemons: 3 storage + 2 compute ``python -m giaannd`` processes (tcp).

compute-1 trains; compute-2 never trained (empty data dir, no shared files) and must still export
every row with words and generate real words — the rows come from the storage scan and the words
from the vocabulary replicated in storage. Then a storage node is killed (-9) and restarted: the
export still equals the engine's, and the restarted node's vocabulary table is intact.
"""

import json
import time

import pytest

from giaannd.model.engine import Engine
from giaannd.model.export import iter_jsonl
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.storage.engine.vocab_store import VocabStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def same_export(ref, path):
    got = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(got) == len(ref) > 5000
    for a, b in zip(ref, got):
        assert (a["source_word"], a["segment"], a["target_word"]) == (b["source_word"], b["segment"], b["target_word"])
        assert b["strength"] == pytest.approx(a["strength"], rel=1e-5)


def test_second_compute_daemon_exports_and_generates_words(tmp_path):
    from giaannd.sdk.local_cluster import running_cluster

    corpus = load_bundled_corpus(300)
    corpora, exports = tmp_path / "corpus", tmp_path / "exports"  # the nodes' allowed directories
    corpora.mkdir()
    path = corpora / "train.conllu"
    write_conllu(corpus, path)
    engine = Engine()
    engine.train(corpus)
    ref = [json.loads(x) for x in iter_jsonl(engine.store, engine.assigner.vocab)]
    prompt = [[t.form, t.lemma, t.upos, t.xpos] for t in corpus[3][:10]]
    expected_words = engine.generate(corpus[3][:10], 8)
    with running_cluster(tmp_path / "cluster", storage=3, compute=2, transport="tcp",
                         corpus_dir=corpora, export_dir=exports) as cluster:
        cluster.wait_converged()
        trainer, other = (n.admin for n in cluster.compute_nodes)
        job = trainer.json("POST", "/v1/train", {"corpus": str(path), "workers": 1, "cluster": False})
        deadline = time.monotonic() + 90
        while (doc := trainer.json("GET", f"/v1/jobs/{job['job_id']}"))["state"] == "running":
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert doc["state"] == "succeeded", doc
        assert other.json("GET", "/v1/status")  # (reachable)
        out = exports / "other.jsonl"
        info = other.json("POST", "/v1/export", {"path": str(out)})
        assert info["lines"] == len(ref)
        same_export(ref, out)
        gen = other.json("POST", "/v1/generate", {"prompt": prompt, "max_tokens": 8})
        assert gen["tokens"] == expected_words and not any(t.startswith("<") for t in gen["tokens"])

        victim = cluster.node("storage-2")
        cluster.kill(victim)  # the export right after: the dead node fails over (or is already skipped)
        held = VocabStore.open(victim.data_dir / "storage" / "vocab")  # (the node is dead: safe to open)
        n_held = len(held)
        held.close()
        assert n_held > 500
        out2 = exports / "after-kill.jsonl"
        other.json("POST", "/v1/export", {"path": str(out2)})
        same_export(ref, out2)
        cluster.restart(victim)
        cluster.wait_converged()
        out3 = exports / "after-restart.jsonl"
        other.json("POST", "/v1/export", {"path": str(out3)})
        same_export(ref, out3)
    reopened = VocabStore.open(victim.data_dir / "storage" / "vocab")
    assert len(reopened) == n_held and reopened.torn_bytes == 0
    reopened.close()
