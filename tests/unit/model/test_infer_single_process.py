"""The single-process tool end to end on a tiny corpus (in-process, seconds)."""

from giaannd.model.export import load_snapshot
from giaannd.model.tokens import write_conllu
from tests.unit.model.test_infer_engine import STORY, tagged
from tools import single_process

OTHER = tagged("a bird/NOUN flew/VERB over/ADP the hill/NOUN and/CCONJ the fox/NOUN ran/VERB to/ADP "
               "the den/NOUN ./PUNCT")


def test_single_process_trains_evaluates_and_writes_exports(tmp_path, capsys):
    corpus = tmp_path / "c.conllu"
    write_conllu([STORY, OTHER] * 12, corpus)
    snap, jsonl = tmp_path / "s.bin", tmp_path / "x.jsonl"
    rc = single_process.main(["--corpus", str(corpus), "--sentences", "20", "--heldout", "4", "--prompts", "5",
                              "--prompt", "the cat sat", "--max-new", "5",
                              "--snapshot", str(snap), "--jsonl", str(jsonl)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "trained 20" in out
    assert "top-1 train-set: 1.0000" in out
    assert "top-1 test-set (held out): 1.0000" in out  # the held-out lines repeat trained ones
    assert "generate" in out
    store = load_snapshot(snap)
    assert store.num_entries == len(jsonl.read_text().splitlines()) > 0


def test_single_process_rejects_bad_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        single_process.main(["--sentences", "-1"])
    assert exc.value.code == 2
    assert "--sentences must be >= 0" in capsys.readouterr().err
