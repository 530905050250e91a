import pytest

from giaannd.model.engine import Engine, constants_named
from giaannd.model.infer import TEST_SET, TRAIN_SET
from giaannd.model.tokens import Token

_XPOS = {"NOUN": "NN", "VERB": "VBD", "ADP": "IN", "PUNCT": ".", "DET": "DT", "CCONJ": "CC", "ADJ": "JJ"}


def tagged(spec: str):
    out = []
    for w in spec.split():
        form, _, pos = w.partition("/")
        pos = pos or "DET"
        out.append(Token(form, form, pos, _XPOS.get(pos, "XX")))
    return tuple(out)


STORY = tagged("the cat/NOUN sat/VERB on/ADP the mat/NOUN and/CCONJ the dog/NOUN slept/VERB on/ADP "
               "the rug/NOUN ./PUNCT")


def test_engine_train_evaluate_generate_round_trip():
    e = Engine(batch_sentences=2)
    stats = e.train([STORY] * 3 + [tagged("too short ./PUNCT")])
    assert stats.sentences_seen == 4 and stats.sentences_trained == 3 and stats.batches == 2
    for constants in (TRAIN_SET, TEST_SET):
        r = e.evaluate([STORY], constants=constants)
        assert r.prompts == 1 and r.prediction_tokens == len(STORY) - 8
        assert r.top1 == 1.0
    free = e.evaluate([STORY], mode="free")
    assert free.top1 == 1.0
    assert e.generate(tagged("the cat/NOUN sat/VERB"), 12) == \
        ["on", "the", "mat", "and", "the", "dog", "slept", "on", "the", "rug", "."]


def test_engine_untrained_store_predicts_nothing():
    e = Engine()
    r = e.evaluate([STORY])
    assert r.prompts == 1 and r.matches == 0 and r.no_prediction == r.prediction_tokens
    assert e.generate(tagged("the cat/NOUN sat/VERB")) == []


def test_engine_bad_arguments():
    with pytest.raises(ValueError):
        Engine(batch_sentences=0)
    with pytest.raises(ValueError):
        constants_named("dev")
    assert constants_named("test") is TEST_SET
    with pytest.raises(ValueError, match="mode"):
        Engine().evaluate([STORY], mode="beam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skipped"):
        Engine().generate(tagged("quickly ./PUNCT"))


def test_evaluate_refuses_a_seed_of_no_tokens():
    # A session always takes token 0 as given (LifSession seeds at least 1), so with seed_tokens 0
    # evaluate scored token 0 as a "no prediction" miss: top-1 13/14 on a perfectly learnt sentence.
    from giaannd.model.evaluate import evaluate

    e = Engine()
    e.train([STORY] * 3)
    prompts = e.encode_prompts([STORY])
    assert evaluate(prompts, e.store, e.assigner, TRAIN_SET, seed_tokens=1).top1 == 1.0
    for seed in (0, -1):
        with pytest.raises(ValueError, match="seed_tokens"):
            evaluate(prompts, e.store, e.assigner, TRAIN_SET, seed_tokens=seed)
