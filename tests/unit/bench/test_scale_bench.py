"""The scale benchmark's stream and figures (tools/bench/zipf_stream.py, tools/bench/scale.py)."""

import argparse
import itertools
import json

import pytest

from giaannd.model.tokens import Token, read_conllu
from tools.bench import scale
from tools.bench.zipf_stream import ZipfStream, write_stream

SKELETON = (Token("The", "the", "DET", "DT"), Token("cat", "cat", "NOUN", "NN"), Token("sat", "sit", "VERB", "VBD"),
            Token("on", "on", "ADP", "IN"), Token("the", "the", "DET", "DT"), Token("Mat", "Mat", "PROPN", "NNP"),
            Token(".", ".", "PUNCT", "."))


def test_zipf_stream_is_seeded_and_keeps_the_skeleton():
    a = list(itertools.islice(ZipfStream(3, [SKELETON], chunk=4), 10))
    b = list(itertools.islice(ZipfStream(3, [SKELETON], chunk=7), 10))
    c = list(itertools.islice(ZipfStream(4, [SKELETON], chunk=4), 10))
    assert a == b != c  # the chunk size is not part of the stream
    for sentence in a:
        assert [t.upos for t in sentence] == [t.upos for t in SKELETON]
        kept = [t for t, s in zip(sentence, SKELETON) if s.upos in ("DET", "ADP", "PUNCT")]
        assert kept == [s for s in SKELETON if s.upos in ("DET", "ADP", "PUNCT")]
        assert sentence[1].form.startswith("n") and sentence[5].form.startswith("n")
        assert sentence[2].form.startswith("w") and sentence[2].form == sentence[2].lemma


def test_zipf_stream_draws_a_zipf_head():
    nouns = [t.form for s in itertools.islice(ZipfStream(0, [SKELETON], nouns=1000), 5000) for t in s
             if t.upos in ("NOUN", "PROPN")]
    top = nouns.count("n1") / len(nouns)
    assert 0.10 < top < 0.18  # 1 / H(1000) = 0.134
    assert nouns.count("n1") > 1.5 * nouns.count("n2") > 0


def test_write_stream_round_trips_through_conllu(tmp_path):
    path = tmp_path / "s.conllu.gz"
    assert write_stream(str(path), 25, seed=1) == 25
    assert list(read_conllu(path)) == list(itertools.islice(ZipfStream(1), 25))


def test_scale_child_reports_every_checkpoint():
    args = argparse.Namespace(child="new", seed=0, batch=64, lif_rows=2, checkpoints=[150, 300])
    records = list(scale._child(args))
    assert [r["sentences"] for r in records] == [150, 300]
    assert records[1]["entries"] > records[0]["entries"] > 0
    assert records[1]["largest_row"] >= records[0]["largest_row"] > 0
    assert all(r["lif_entries"] > 0 and r["lif_ns"] > 0 for r in records)
    targets = scale._targets(records)
    assert [t[3] for t in targets][2] == "not reached"


def test_engines_list_and_the_fold_thread_comparison(capsys):
    from giaannd.cpus import usable_cpus

    assert scale._engines("both") == ("old", "new") and scale._engines("new,serial") == ("new", "serial")
    for bad in ("", "x", "new,new", "both,old"):
        with pytest.raises(argparse.ArgumentTypeError):
            scale._engines(bad)
    results = {}
    for name in ("new", "serial"):
        args = argparse.Namespace(child=name, seed=0, batch=64, lif_rows=1, checkpoints=[150])
        results[name] = list(scale._child(args))
    assert results["serial"][0]["fold_thread"] is False
    assert results["new"][0]["fold_thread"] is (usable_cpus() > 1)
    assert results["new"][0]["entries"] == results["serial"][0]["entries"]
    scale._print(results)
    assert "Fold thread vs folds in the training thread" in capsys.readouterr().out
    scale._json(results)
    figures = [json.loads(line)["figure"] for line in capsys.readouterr().out.splitlines()]
    assert "sent/s new/serial@150" in figures and "sent/CPU-s new/serial@150" in figures
