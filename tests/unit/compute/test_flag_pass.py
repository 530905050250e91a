"""The flag pass and its fold (cluster_jobs/flag_pass.py): a window encoded by a fresh assigner
holding the fold of the windows before it equals the core's encoding of that window, whatever
order the windows' findings were computed in; corpus chunks round-trip and split at the cap."""

import random

import numpy as np
import pytest

from giaannd.client.registers import CasOutcome, RegisterRead
from giaannd.compute.cluster_jobs.corpus_chunks import MAX_CHUNK_BYTES, encode_window
from giaannd.compute.cluster_jobs.flag_pass import (
    INITIAL,
    FlagFold,
    decode_findings,
    encode_findings,
    initial_findings,
    window_findings,
)
from giaannd.compute.cluster_jobs.lease_table import Shard, complete, grant, take_over
from giaannd.compute.cluster_jobs.window_runner import ClusterSpec, WindowRunner
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.train import TrainSettings
from giaannd.model.columns import ColumnAssigner
from giaannd.model.lexicon import Lexicon
from giaannd.model.tokens import Token, load_bundled_corpus

K = 25


def test_flag_fold_window_encodings_equal_the_sequential_core():
    lexicon = Lexicon.default()
    corpus = load_bundled_corpus(400)
    windows = [corpus[i:i + K] for i in range(0, len(corpus), K)]
    core = ColumnAssigner(lexicon)
    expected = [[core.encode(s, update_flags=True) for s in w] for w in windows]
    # findings computed out of order (as nodes would), stored and read back
    order = list(range(len(windows)))
    random.Random(3).shuffle(order)
    stored = {w: encode_findings(window_findings(lexicon, windows[w])) for w in order}
    fold = FlagFold()
    fold.add(INITIAL, initial_findings(()))
    for w in range(len(windows)):
        fold.add(w, decode_findings(stored[w]))
    for w in reversed(range(len(windows))):  # any window, after the fold moved past it
        assigner = fold.assigner(lexicon, w)
        got = [assigner.encode(s, update_flags=True) for s in windows[w]]
        for a, b in zip(expected[w], got):
            assert (a is None) == (b is None)
            if a is not None:
                assert np.array_equal(a.column, b.column) and np.array_equal(a.feature, b.feature)
                assert np.array_equal(a.instance, b.instance)
    prob, det = fold.flags_before(len(windows))
    assert prob == core.probabilistic_flags and det == core.deterministic_flags


def test_flag_fold_assigner_is_the_fold_before_its_window_in_any_order():
    """A window's assigner (the fold's flags as of its window beneath its own) answers exactly
    ``flags_before(w)`` for every feature, whatever order windows are asked for and while the fold
    moves on, and encoding with one (which learns flags) changes neither the fold nor the other
    windows' assigners."""
    lexicon = Lexicon.default()
    corpus = load_bundled_corpus(300)
    windows = [corpus[i:i + K] for i in range(0, len(corpus), K)]
    fold = FlagFold()
    fold.add(INITIAL, initial_findings({7, 9}))
    half = len(windows) // 2
    for w, sentences in enumerate(windows[:half]):
        fold.add(w, window_findings(lexicon, sentences))
    early = fold.assigner(lexicon, 2)  # taken before the fold moves on
    for w, sentences in enumerate(windows[half:], half):
        fold.add(w, window_findings(lexicon, sentences))
    _, every_det = fold.flags_before(len(windows))
    features = sorted({*every_det, *fold.flags_before(len(windows))[0], 7, 9, 10**9})
    asks = [0, 1, 2, 2, 5, 3, 8, len(windows), 1, len(windows), INITIAL, 4]
    for w, assigner in [(2, early)] + [(w, fold.assigner(lexicon, w)) for w in asks]:
        prob, det = fold.flags_before(w)
        assert [f for f in features if assigner.is_probabilistic(f)] == sorted(prob), w
        assert {f: True for f in features if assigner.is_deterministic(f)} == {f: v for f, v in det.items() if v}, w
        assert assigner.learned_probabilistic == [] and list(assigner.vocab.columns()) == []
        holding = ColumnAssigner(lexicon, prob)  # the reference: an assigner holding those flags
        holding.add_deterministic_flags(det)
        for s in windows[w % len(windows)]:  # learns flags into this assigner only
            got, want = assigner.encode(s, update_flags=True), holding.encode(s, update_flags=True)
            assert (got is None) == (want is None)
            assert got is None or np.array_equal(got.instance, want.instance)
        assert assigner.learned_probabilistic == holding.learned_probabilistic
        assert fold.flags_before(w) == (prob, det)
    other = Lexicon.default()  # another lexicon: a template of its own
    assert fold.assigner(other, 3).lexicon is other


def test_flag_fold_refuses_out_of_order_windows():
    fold = FlagFold()
    with pytest.raises(ValueError):
        fold.add(0, initial_findings(()))
    fold.add(INITIAL, initial_findings({5}))
    assert fold.flags_before(0) == ({5}, {})
    with pytest.raises(ValueError):
        fold.flags_before(2)


def test_corpus_chunk_splits_at_the_cap():
    tok = Token("w" * 1000, "w", "NOUN", "NN")
    sentence = tuple([tok] * 50)  # ~50 KB
    parts = encode_window([sentence] * 12)
    assert len(parts) > 1 and all(len(p) <= MAX_CHUNK_BYTES + 16 for p in parts)


def test_shard_tallies_count_windows_and_takeovers():
    shard = Shard(job_id="j", stage=1, shard=0, start=0, stop=4, next=0)
    shard, lease = grant(shard, "a", 2)
    shard = complete(shard, "a", lease.id, 2)
    shard, lease = grant(shard, "a", 2)
    shard, new = take_over(shard, "b", lease.id, lease.beats)
    shard = complete(shard, "b", new.id, 4)
    tallies = {t.node: t for t in shard.tallies}
    assert (tallies["a"].windows, tallies["a"].lost, tallies["a"].tail) == (2, 1, False)
    assert (tallies["b"].windows, tallies["b"].won, tallies["b"].tail) == (2, 1, True)


def test_stream_conllu_equals_read_conllu_block_by_block(tmp_path):
    """The receiving node's reader (a block of lines at a time) gives read_conllu's sentences, for
    plain and gzip files, and names the file's own line in an error past the first block."""
    from giaannd.model.tokens import CorpusFormatError, read_conllu, stream_conllu, write_conllu

    corpus = load_bundled_corpus(300)
    for name in ("c.conllu", "c.conllu.gz"):
        path = tmp_path / name
        write_conllu(corpus, path)
        assert list(stream_conllu(path, block_lines=50)) == list(read_conllu(path)) == corpus
    bad = tmp_path / "bad.conllu"
    lines = (tmp_path / "c.conllu").read_text().splitlines(keepends=True)
    lines[400] = "x\tbroken\n"
    bad.write_text("".join(lines))
    with pytest.raises(CorpusFormatError) as err:
        list(stream_conllu(bad, block_lines=50))
    assert err.value.line == 401


@pytest.mark.asyncio
async def test_window_runner_folds_the_findings_it_computed_without_reading_them_back():
    """At B = 1 every window's findings were computed by the node itself in stage 0: stage 1's
    fold takes them from memory (one register read per window less on the critical path); a
    window found elsewhere is read back, and the fold equals one built from the stored bytes."""
    stored: dict[str, bytes] = {"job/j/f/init": encode_findings(initial_findings({5}))}  # written at creation
    reads: list[str] = []

    class Registers:
        async def cas_register(self, key, expect, value=b"", timeout_s=None):
            ok = key not in stored
            stored.setdefault(key, value)
            return CasOutcome(ok, (1, 1, 1), stored[key])

        async def read_register(self, key, timeout_s=None):
            reads.append(key)
            return RegisterRead((1, 1, 1), stored[key], True)

        async def read_write_once_register(self, key, timeout_s=None):
            reads.append(key)
            return RegisterRead((1, 1, 1), stored[key], False)

    sentences = load_bundled_corpus(60)
    lexicon = Lexicon.default()
    runner = WindowRunner(Registers(), "j", ClusterSpec(k=20, sentences=60), lexicon,  # type: ignore[arg-type]
                          TrainSettings(), TrainProgress())
    other = WindowRunner(Registers(), "j", ClusterSpec(k=20, sentences=60), lexicon,  # type: ignore[arg-type]
                         TrainSettings(), TrainProgress())
    await runner._find(0, sentences[:20])
    await other._find(1, sentences[20:40])  # another node's window
    await runner._find(2, sentences[40:])
    fold = await runner.extend_fold(3)
    assert reads == ["job/j/f/init", "job/j/f/1"]
    reference = FlagFold()
    for w in range(INITIAL, 3):
        reference.add(w, decode_findings(stored["job/j/f/" + ("init" if w == INITIAL else str(w))]))
    assert fold.flags_before(3) == reference.flags_before(3) and runner._found == {}
