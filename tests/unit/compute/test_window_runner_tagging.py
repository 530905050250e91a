"""Stage 0 of a text job (window_runner.py): a tagged window left half-stored by a crashed node,
or stored by another node with a different tagging, does not fail the job, and the window's
findings are those of the tagging stage 1 will read (docs/compute.md, "Cluster jobs in the
service", Tagging; "Exact results with learned flags")."""

import pytest

from giaannd.compute.cluster_jobs import corpus_chunks
from giaannd.compute.cluster_jobs.corpus_chunks import TAGGED, chunk_key, encode_texts, encode_window, read_window
from giaannd.compute.cluster_jobs.flag_pass import decode_findings, encode_findings, findings_key, window_findings
from giaannd.compute.cluster_jobs.lease_events import RunWindow
from giaannd.compute.cluster_jobs.window_runner import FLAG_STAGE, RETRYABLE, ClusterSpec, WindowRunner
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.train import TrainSettings
from giaannd.model.lexicon import Lexicon
from giaannd.model.tokens import Token, load_bundled_corpus

from ._write_once import WriteOnceRegisters as Registers

K = 10


class Tagger:
    """Deterministic: text i -> sentence i of the bundled corpus (``upos`` suffixed by ``mark``)."""

    def __init__(self, sentences, mark: str = "") -> None:
        self.sentences, self.mark, self.calls = sentences, mark, 0

    def tagging(self, texts):
        return [tuple(Token(t.form, t.lemma, t.upos + self.mark, t.xpos) for t in self.sentences[int(x)])
                for x in texts]

    async def tag(self, texts):
        self.calls += 1
        return self.tagging(texts)


def _runner(regs, tagger):
    return WindowRunner(regs, "j", ClusterSpec(k=K, sentences=K, text=True), Lexicon.default(),  # type: ignore[arg-type]
                        TrainSettings(), TrainProgress(), tagger=tagger)


def _job(regs, monkeypatch):
    sentences = load_bundled_corpus(K)
    texts = [str(i) for i in range(K)]
    for part, data in enumerate(encode_texts(texts)):
        regs.stored[chunk_key("j", 0, part)] = data
    monkeypatch.setattr(corpus_chunks, "MAX_CHUNK_BYTES", 600)  # a tagged window of several parts
    return sentences, texts


@pytest.mark.asyncio
async def test_stage0_redo_after_a_crash_mid_store_of_the_tagged_window(monkeypatch):
    """A node crashed after storing part 0 of a window's tagging (of several parts): the redo
    completes the tagged window and stores its findings instead of failing the job."""
    regs = Registers()
    sentences, texts = _job(regs, monkeypatch)
    tagger = Tagger(sentences)
    parts = encode_window(tagger.tagging(texts))
    assert len(parts) > 1
    regs.stored[chunk_key("j", 0, 0, TAGGED)] = parts[0]  # the crashed node's first part only
    await _runner(regs, tagger)(RunWindow(FLAG_STAGE, 0, 7))
    stored = await read_window(regs.read_register, "j", 0, RETRYABLE, TAGGED)
    assert stored == tagger.tagging(texts)
    assert decode_findings(regs.stored[findings_key("j", 0)]) == window_findings(Lexicon.default(), stored)


@pytest.mark.asyncio
async def test_stage0_uses_the_tagging_another_node_stored_first(monkeypatch):
    """Two nodes tag the same window at once with taggers that differ: the one whose store lost
    takes the stored tagging (the one stage 1 trains on) for its findings, and the job goes on."""
    regs = Registers()
    sentences, texts = _job(regs, monkeypatch)
    other = Tagger(sentences, mark="X")

    class Racing(Tagger):
        async def tag(self, texts):
            for part, data in enumerate(encode_window(other.tagging(texts))):  # the other node stores first
                regs.stored[chunk_key("j", 0, part, TAGGED)] = data
            return await super().tag(texts)

    await _runner(regs, Racing(sentences))(RunWindow(FLAG_STAGE, 0, 7))
    stored = await read_window(regs.read_register, "j", 0, RETRYABLE, TAGGED)
    assert stored == other.tagging(texts)
    assert regs.stored[findings_key("j", 0)] == encode_findings(window_findings(Lexicon.default(), stored))
