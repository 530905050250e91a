"""``RowEngine.drop_rows`` against the engine's rows read before the drop (kept rows renumbered in
id order, their entries bit for bit), and the GIL-free helpers it uses (``renumbered``,
``offsets_of``) against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.rowengine import RowEngine
from giaannd.rowengine import run as run_module
from giaannd.rowengine.run import offsets_of, renumbered

from .test_engine import POOL64, _engine_state, apply, random_batch


@pytest.mark.parametrize("seed", range(8))
def test_drop_rows_keeps_the_kept_rows_bit_for_bit_renumbered_in_order(seed):
    rng = np.random.default_rng(seed)
    engine = RowEngine(base_ratio=int(rng.integers(2, 6)))
    rows = [(int(c), int(f)) for c in POOL64 for f in POOL64[:5]]
    for _ in range(int(rng.integers(2, 12))):  # a base and delta runs (the drop folds them first)
        apply(engine, random_batch(rng, rows, POOL64, POOL64[:4], int(rng.integers(1, 9)), int(rng.integers(1, 60))))
        if rng.random() < 0.3:
            engine.compact()
    a, b, lengths, offsets, seg, tc, tf, st, _ = _engine_state(engine)
    keep = rng.random(engine.num_rows) < rng.choice([0.0, 0.3, 0.9])
    engine.drop_rows(keep)
    kept = np.flatnonzero(keep)
    got = _engine_state(engine)
    assert got[0] == [a[i] for i in kept] and got[1] == [b[i] for i in kept]
    assert got[2] == [lengths[i] for i in kept]
    want = [slice(offsets[i], offsets[i + 1]) for i in kept]
    for field, at in ((seg, 4), (tc, 5), (tf, 6), (st, 7)):
        assert got[at] == [x for s in want for x in field[s]]
    assert got[8] == sum(lengths[i] for i in kept)
    for i, j in enumerate(kept):  # the key index follows the new ids
        assert engine.row_ids(np.array([a[j]], np.uint64), np.array([b[j]], np.uint64)).tolist() == [i]


@pytest.mark.parametrize("n", [0, 1, 7, 70_000])
def test_renumbered_and_offsets_of_equal_numpys_cumsum(n):
    rng = np.random.default_rng(n)
    keep = rng.random(n) < 0.6
    assert renumbered(keep).tolist() == (np.cumsum(keep, dtype=np.int64) - 1).tolist()
    lengths = rng.integers(0, 1_000, n).astype(np.int64)
    want = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert offsets_of(lengths).tolist() == want
    assert offsets_of(lengths.astype(np.int32)).tolist() == want  # other dtypes are converted
    assert offsets_of(np.repeat(lengths, 2)[::2]).tolist() == want  # and strided views


def test_release_pages_gives_back_only_what_nothing_else_holds():
    rng = np.random.default_rng(9)
    engine = RowEngine()
    rows = [(int(c), int(f)) for c in POOL64 for f in POOL64[:5]]
    apply(engine, random_batch(rng, rows, POOL64, POOL64[:4], 30, 200))
    engine.compact()
    base = engine._base  # noqa: SLF001 (the run under test)
    frozen = engine.freeze()  # a snapshot's view holds the base's fields: nothing given back
    assert not run_module.release_pages(base)
    before = base.st.copy()
    assert np.array_equal(base.st, before)
    del frozen
    view = engine.read(0)  # a view handed out holds them too
    assert not run_module.release_pages(base)
    del view
    engine._base = run_module.Run.empty()  # noqa: SLF001 (let go: the run is ours alone now)
    if run_module.madvise.AVAILABLE:
        assert run_module.release_pages(base)
