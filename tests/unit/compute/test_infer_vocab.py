"""Inference reads the node's vocabulary, never grows it: a prompt's words never trained are not
added to what the node persists (compute-state.msgpack) or reports; predictions are the core's."""

from __future__ import annotations

import asyncio

import pytest

from giaannd.compute.service import ComputeService
from giaannd.compute.state import ComputeState
from giaannd.config import ComputeConfig
from giaannd.model.engine import Engine
from giaannd.model.ids import column_id, feature_id
from giaannd.model.rows import RowBatch
from giaannd.model.tokens import Token, load_bundled_corpus

UNKNOWN_WORD = "zyzzogeton"
UNKNOWN_NOUN = "quuxberry"


@pytest.fixture(scope="module")
def trained():
    corpus = load_bundled_corpus(300)
    engine = Engine()
    engine.train(corpus)
    return engine, corpus


class EngineStorage:
    """A storage client serving the engine's rows and vocabulary (absent rows left out)."""

    def __init__(self, engine):
        self.engine = engine

    async def read_rows(self, row_column, row_feature, timeout_s=None, *, fewest=None):
        await asyncio.sleep(0)
        store = self.engine.store
        keys = zip(row_column.tolist(), row_feature.tolist())
        return RowBatch.from_rows({k: store.get(k) for k in keys if k in store})

    async def get_vocab(self, keys):
        vocab, out = self.engine.assigner.vocab, {}
        for kind, ident in keys:
            try:
                out[(kind, ident)] = vocab.column_lemma(ident) if kind == 0 else vocab.feature_word(ident)
            except KeyError:
                pass
        return out


def trained_service(tmp_path, engine):
    """A compute node that trained what ``engine`` trained: its vocabulary and flags."""
    svc = ComputeService(ComputeConfig(eval_spread=False), tmp_path, storage=EngineStorage(engine))  # type: ignore[arg-type]
    svc.state.vocab.merge(engine.assigner.vocab)
    svc.state.deterministic.update(engine.assigner.deterministic_flags)
    svc.state.probabilistic |= set(engine.assigner.probabilistic_flags)
    return svc


def with_unknown_words(sentence):
    """``sentence`` with its first non-noun word and its last noun replaced by words never trained."""
    toks = list(sentence)
    i = next(i for i, t in enumerate(toks) if t.upos not in ("NOUN", "PROPN", "PUNCT"))
    toks[i] = Token(UNKNOWN_WORD.capitalize(), UNKNOWN_WORD, toks[i].upos, toks[i].xpos)
    j = max(i for i, t in enumerate(toks) if t.upos in ("NOUN", "PROPN"))
    toks[j] = Token(UNKNOWN_NOUN, UNKNOWN_NOUN, "NOUN", "NN")
    return tuple(toks)


def vocab_of(state):
    return dict(state.vocab.columns()), dict(state.vocab.features())


def added(state, before):
    """The lemmas and words ``state`` holds that ``before`` did not."""
    columns, features = vocab_of(state)
    return (sorted(lem for c, lem in columns.items() if c not in before[0]),
            sorted(w for f, w in features.items() if f not in before[1]))


@pytest.mark.asyncio
async def test_infer_prompt_words_are_not_added_to_the_node_vocabulary(trained, tmp_path):
    engine, corpus = trained
    svc = trained_service(tmp_path, engine)
    before = vocab_of(svc.state)
    assert feature_id(UNKNOWN_WORD) not in before[1] and column_id(UNKNOWN_NOUN) not in before[0]
    prompts = [with_unknown_words(s) for s in corpus[:12]]
    await asyncio.wait_for(svc.evaluate(prompts), 60)
    await asyncio.wait_for(svc.generate(prompts[0][:6], 4), 60)
    assert added(svc.state, before) == ([], [])  # a read-only operation left the node's state as it was
    assert vocab_of(svc.state) == before
    assert svc.health()["vocab_features"] == len(before[1])
    svc.state.save(tmp_path)  # what the node persists (on stop, after a job) holds no prompt word
    saved = ComputeState.load(tmp_path)
    assert added(saved, before) == ([], []) and vocab_of(saved) == before


@pytest.mark.asyncio
async def test_infer_predictions_equal_the_core_with_and_without_unknown_words(trained, tmp_path):
    engine, corpus = trained
    svc = trained_service(tmp_path, engine)
    for prompts in (corpus[:30], [with_unknown_words(s) for s in corpus[:30]]):
        figures = await asyncio.wait_for(svc.evaluate(prompts), 60)
        ref = engine.evaluate(prompts)
        assert (figures["matches"], figures["prediction_tokens"]) == (ref.matches, ref.prediction_tokens)
        prompt = prompts[3][:7]
        gen = await asyncio.wait_for(svc.generate(prompt, 6), 60)
        assert gen["tokens"] == engine.generate(prompt, 6)
