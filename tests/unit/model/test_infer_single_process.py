"""The single-process tool end to end on a tiny corpus (in-process, seconds)."""

import pytest

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


def test_single_process_evaluates_a_conllu_prompt_file(tmp_path, capsys):
    corpus, prompts = tmp_path / "c.conllu", tmp_path / "p.conllu"
    write_conllu([STORY, OTHER] * 12, corpus)
    write_conllu([OTHER, STORY[:5], STORY], prompts)
    lexicon = tmp_path / "lex.tsv"
    lexicon.write_text("sat\tVERB\non\tADP\nflew\tVERB\nover\tADP\nran\tVERB\nto\tADP\nslept\tVERB\n"
                       "and\tCCONJ\n", encoding="utf-8")
    rc = single_process.main(["--corpus", str(corpus), "--sentences", "20", "--prompts-file", str(prompts),
                              "--constants", "test", "--lexicon", str(lexicon)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "prompt 1: a bird flew over the hill and the fox ran to the den ." in out
    assert "  predicted: fox ran to the den ." in out
    assert "prompt 2: skipped" in out
    assert "top-1 prompt file (test constants): 1.0000 (12/12 prediction tokens, 2 prompts, 1 skipped" in out
    assert "top-1 train-set" not in out and "generate" not in out  # the prompt file replaces them


def test_single_process_bad_input_files_exit_2(tmp_path, capsys):
    assert single_process.main(["--lexicon", str(tmp_path / "absent.pkl")]) == 2
    assert "absent.pkl: cannot read" in capsys.readouterr().err
    assert single_process.main(["--prompts-file", str(tmp_path / "none.txt"), "--sentences", "1"]) == 2
    assert "none.txt does not exist" in capsys.readouterr().err


@pytest.mark.spacy
def test_single_process_text_corpus_and_text_prompt_file(tmp_path, capsys):
    corpus, prompts = tmp_path / "train.txt", tmp_path / "prompts.txt"
    story = ("The old man walked to the river with his dog. The dog jumped into the cold water near the "
             "bridge. ")
    corpus.write_text((story * 3 + "\n\n") * 4, encoding="utf-8")
    prompts.write_text("The old man walked to the river with his dog. The dog jumped into the cold water.\n"
                       "\nToo short here.\n", encoding="utf-8")
    rc = single_process.main(["--corpus", str(corpus), "--sentences", "10", "--prompts-file", str(prompts),
                              "--tag-cache", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert rc == 0, out
    # the two sentences of the first line are one prompt; the short line is skipped
    assert "prompt 1: the old man walked to the river with his dog . the dog jumped" in out
    assert "prompt 2: skipped" in out and "prompt 3" not in out
    assert "top-1 prompt file (train constants): " in out and ", 1 prompts, 1 skipped" in out
    assert len(list((tmp_path / "cache").iterdir())) == 2  # the corpus (articles) and the prompts (lines)


def test_single_process_giaann_v2_profile_trains_and_evaluates_subwords(tmp_path, capsys):
    corpus, prompts = tmp_path / "c.conllu", tmp_path / "p.conllu"
    write_conllu([STORY, OTHER, OTHER] * 8, corpus)  # 24 sentences -> 8 sequences of 3
    write_conllu([OTHER], prompts)
    rc = single_process.main(["--profile", "giaann-v2", "--corpus", str(corpus), "--sentences", "8",
                              "--prompts-file", str(prompts), "--constants", "train"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "profile: giaann-v2" in out and "trained 8" in out
    # one prompt line is one sequence; subwords keep their leading spaces, shown between "|"
    assert "prompt 1: a| bird| flew| over| the| hill| and| the| fox| ran| to| the| den|." in out
    assert "  predicted:  fox| ran| to| the| den|." in out
    assert "top-1 prompt file (train constants): 1.0000 (6/6 prediction tokens, 1 prompts" in out


def test_single_process_prompt_without_a_noun_skips_generation(tmp_path, capsys, monkeypatch):
    # A --prompt with no noun is skipped by column assignment: the run says so and still writes
    # its exports (it crashed with the ValueError of Engine.generate after the whole run).
    from giaannd.model import tokens

    monkeypatch.setattr(tokens, "tag_lines", lambda lines, **_: iter([tagged("quickly/ADV ./PUNCT")]))
    corpus, jsonl = tmp_path / "c.conllu", tmp_path / "x.jsonl"
    write_conllu([STORY, OTHER] * 4, corpus)
    rc = single_process.main(["--corpus", str(corpus), "--sentences", "4", "--heldout", "2", "--prompts", "2",
                              "--prompt", "quickly.", "--jsonl", str(jsonl)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "generate: skipped (tagged with spaCy: 'quickly .': the prompt was skipped" in out
    assert jsonl.read_text()


def test_single_process_unwritable_export_exits_2(tmp_path, capsys):
    corpus = tmp_path / "c.conllu"
    write_conllu([STORY, OTHER] * 4, corpus)
    for flag in ("--jsonl", "--snapshot"):
        rc = single_process.main(["--corpus", str(corpus), "--sentences", "2", "--heldout", "0", "--prompts", "0",
                                  "--max-new", "0", flag, str(tmp_path / "absent" / "out")])
        assert rc == 2
        assert "single_process: " in capsys.readouterr().err
    assert not (tmp_path / "absent").exists()


def test_single_process_zero_sentences_trains_nothing(tmp_path, capsys):
    corpus, snap = tmp_path / "c.conllu", tmp_path / "s.bin"
    write_conllu([STORY, OTHER] * 4, corpus)
    rc = single_process.main(["--corpus", str(corpus), "--sentences", "0", "--heldout", "2", "--prompts", "0",
                              "--max-new", "0", "--snapshot", str(snap)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "trained 0 " in out and "rows: 0 rows" in out
    assert "top-1 test-set (held out): 0.0000 (0/12 prediction tokens, 2 prompts" in out  # the first two, held out
    assert load_snapshot(snap).num_entries == 0
