"""The torch LIF step (giaannd/model/gpu/lif.py) on CPU torch, in lockstep with the numpy step over
real sessions: bundled-corpus prompts against a store trained on them.

Predictions must be identical at every step; the state equal within float32 tolerance (rtol 1e-6,
atol 1e-9): lif.py's docstring says why bits may differ (``exp`` in the test-set deposit) and why
only there. The same torch code runs on CUDA (tests/gpu/test_compute_cuda.py).
"""

import numpy as np
import pytest

from giaannd.model.engine import Engine
from giaannd.model.infer import TEST_SET, TRAIN_SET, LifSession
from giaannd.model.tokens import load_bundled_corpus

torch = pytest.importorskip("torch")

from giaannd.model.gpu.lif import TorchLifSession, make_session  # noqa: E402  (after the skip)

#: float32's resolution: rows hold float32 strengths, so smaller differences carry no information.
RTOL, ATOL = 1e-6, 1e-9


@pytest.fixture(scope="module")
def trained():
    sentences = load_bundled_corpus(limit=400)
    engine = Engine(batch_sentences=64)
    engine.train(sentences)
    prompts = engine.encode_prompts(sentences[:60])
    return engine, prompts


def _assert_close_state(numpy_session, torch_session):
    na, nb, nact = numpy_session.activation_state()
    ta, tb, tact = torch_session.activation_state()
    assert np.array_equal(na, ta) and np.array_equal(nb, tb)
    np.testing.assert_allclose(tact, nact, rtol=RTOL, atol=ATOL)


def _lockstep(engine, prompt, constants, teacher):
    targets = list(zip(prompt.column.tolist(), prompt.feature.tolist()))
    length = None if teacher else len(targets) + 6
    a = LifSession(targets, engine.assigner, constants, teacher_forced=teacher, length=length)
    b = TorchLifSession(targets, engine.assigner, constants, teacher_forced=teacher, length=length, device="cpu")
    steps = 0
    while (key := a.needs_row()) is not None:
        assert b.needs_row() == key
        row = engine.store.get_row(*key)
        assert a.step(row) == b.step(row)
        _assert_close_state(a, b)
        steps += 1
    assert b.needs_row() is None and a.predictions == b.predictions
    return steps, sum(p is not None for p in a.predictions.values())


@pytest.mark.parametrize("constants", [TRAIN_SET, TEST_SET], ids=["train-set", "test-set"])
@pytest.mark.parametrize("teacher", [True, False], ids=["teacher", "free"])
def test_torch_lif_step_matches_numpy_on_bundled_prompts(trained, constants, teacher):
    engine, prompts = trained
    steps = predicted = 0
    for prompt in prompts:
        s, p = _lockstep(engine, prompt, constants, teacher)
        steps += s
        predicted += p
    assert steps > 500 and predicted > 50  # the sessions fire and predict, not only seed


def test_torch_lif_state_grows_past_its_initial_capacity(trained):
    engine, prompts = trained
    targets = [k for p in prompts for k in zip(p.column.tolist(), p.feature.tolist())][:300]
    a = LifSession(targets, engine.assigner, TEST_SET)
    b = TorchLifSession(targets, engine.assigner, TEST_SET, device="cpu")
    while (key := a.needs_row()) is not None:
        row = engine.store.get_row(*key)
        assert a.step(row) == b.step(row)
    assert b._capacity() > 256  # grew (the initial capacity is 256 slots)
    _assert_close_state(a, b)
    assert a.predictions == b.predictions


def test_make_session_is_numpy_on_cpu_and_torch_elsewhere(trained):
    engine, prompts = trained
    targets = list(zip(prompts[0].column.tolist(), prompts[0].feature.tolist()))
    assert type(make_session("cpu", targets, engine.assigner, TRAIN_SET)) is LifSession
    # "cpu:0" is a torch device other than the compute role's "cpu": the torch session on the CPU
    assert isinstance(make_session("cpu:0", targets, engine.assigner, TRAIN_SET), TorchLifSession)
