"""The LIF step as it was before issue 14 item 6 ("Inference steps at memory speed"): the baseline.

A frozen copy of ``giaannd.model.infer.LifSession`` at b704720, kept so that tools/bench/lif.py and
tools/bench/scale.py measure the new step against the old one in the same run, on the same machine.
Not used by the daemon. It maps every target of a fired row to its state slot with
``KeyIndex.lookup_or_add`` (a probe loop over the whole row) and computes the deposits with a
chain of float64 temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from giaannd.model.ids import PRIME_FEATURE
from giaannd.model.infer import SEED_TOKENS, DelimiterFlags, LifConstants, activation
from giaannd.model.rows import NUM_SEGMENTS, Row, RowKey
from giaannd.rowengine import KeyIndex

__all__ = ["BaselineLifSession"]

_SOMA = NUM_SEGMENTS - 1
_LAST_COLUMN_SEGMENT = 3
_FIRST_FEATURE_SEGMENT = 4
_INITIAL_SLOTS = 256


class BaselineLifSession:
    """One sequence of LIF inference, driven by the caller (sans-IO).

    Args:
        targets: the (column id, feature id) of every known token: the whole sentence for evaluation,
            the prompt for generation. At least 1.
        flags: delimiter flags (for the column-constraint mode).
        constants: :data:`TRAIN_SET` or :data:`TEST_SET`.
        length: total steps; defaults to ``len(targets)`` (generation passes prompt + max new tokens).
        seed_tokens: steps < seed_tokens take the real token (teacher forcing, no prediction).
        teacher_forced: after the seed, continue with the real token (True) or the prediction (False).

    Raises:
        ValueError: bad arguments (no targets, teacher forcing past the known targets...).
    """

    def __init__(
        self,
        targets: Sequence[RowKey],
        flags: DelimiterFlags,
        constants: LifConstants,
        *,
        length: int | None = None,
        seed_tokens: int = SEED_TOKENS,
        teacher_forced: bool = True,
    ) -> None:
        if not targets:
            raise ValueError("a LIF session needs at least one token")
        self._targets = list(targets)
        self._length = len(self._targets) if length is None else length
        if self._length < 1:
            raise ValueError("length must be >= 1")
        if teacher_forced and self._length > len(self._targets):
            raise ValueError("teacher forcing needs a target for every step")
        self._seed = max(1, min(seed_tokens, len(self._targets)))
        self._flags = flags
        self._k = constants
        self._teacher = teacher_forced
        self._slots = KeyIndex()  # (column, feature) -> slot: the neuron's column of ``_act``
        self._act: NDArray[np.float64] = np.zeros((NUM_SEGMENTS, _INITIAL_SLOTS), np.float64)
        #: ``predictions[k]`` for every step k ≥ seed_tokens run so far (None = no prediction).
        self.predictions: dict[int, RowKey | None] = {}
        self._step = 1
        self._done = self._length <= 1
        first = self._targets[0]
        s = self._slot_of(first)
        self._act[_SOMA, s] += 1.0  # step 0: burst token 0
        self._act[_SOMA, s] *= 1.0 - self._k.soma_decay
        self._act[_SOMA, s] += 1.0
        self._current = first

    # -- public ---------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    @property
    def current(self) -> RowKey:
        return self._current

    @property
    def seed_tokens(self) -> int:
        """Steps that take the real token (no prediction)."""
        return self._seed

    @property
    def length(self) -> int:
        """Total steps of the session."""
        return self._length

    @property
    def steps_run(self) -> int:
        """Steps k ≥ 1 completed."""
        return self._step - 1

    def needs_row(self) -> RowKey | None:
        """The row the next ``step`` needs (the current node's), or None when the sequence is over."""
        return None if self._done else self._current

    def step(self, row: Row) -> RowKey | None:
        """Run step k with the current node's outgoing ``row``; returns the node chosen at this step.

        ``row`` must be canonical (sorted, unique entry keys, segments < 9): the local store only
        holds such rows, and rows from the wire are checked by ``RowBatch.validate`` first.

        Raises:
            RuntimeError: the session is already finished.
        """
        if self._done:
            raise RuntimeError("LIF session is finished")
        k = self._step
        c, f = self._current
        internal = (f == PRIME_FEATURE) or not (
            self._flags.is_deterministic(f) or self._flags.is_probabilistic(f)
        )
        act = self._act
        n = len(self._slots)
        cur = self._slot_of(self._current)
        # 2. propagate feature segments one step toward the soma.
        act[_SOMA, :n] += act[_SOMA - 1, :n]
        act[_FIRST_FEATURE_SEGMENT + 1:_SOMA, :n] = act[_FIRST_FEATURE_SEGMENT:_SOMA - 1, :n]
        act[_FIRST_FEATURE_SEGMENT, :n] = 0.0
        # 3. fire.
        eligible: NDArray[np.intp] = np.empty(0, np.intp)
        if act[_SOMA, cur] + act[_LAST_COLUMN_SEGMENT, cur] >= self._k.theta and len(row):
            slots = self._slots_of(row)
            act = self._act  # may have grown
            if self._k.boolean_synapses:
                value = np.where(row.strength > 0, activation(1.0), 0.0)
            else:
                value = 2.0 / (1.0 + np.exp(-row.strength.astype(np.float64) / 100.0)) - 1.0
            # (segment, slot) pairs are unique in a canonical row, so a plain scatter-add is exact
            flat = row.segment.astype(np.intp)
            flat *= act.shape[1]
            flat += slots
            act.reshape(-1)[flat] += value
            eligible = slots[row.segment == _SOMA]
        # 4. deactivate the current node.
        act[_SOMA, cur] = 0.0
        if self._k.clear_segment3_on_fire:
            act[_LAST_COLUMN_SEGMENT, cur] = 0.0
        # 5./6. select and choose the next node.
        if k < self._seed:
            nxt: RowKey | None = self._targets[k]
        else:
            pred = self._select(eligible, row, c, internal)
            self.predictions[k] = pred
            nxt = self._targets[k] if self._teacher else pred
        self._step += 1
        if nxt is None:
            self._done = True
            return None
        n = len(self._slots)
        # 7. column transition.
        if nxt[0] != c:
            act[_LAST_COLUMN_SEGMENT, :n] *= 1.0 - self._k.column_decay
            act[_LAST_COLUMN_SEGMENT, :n] += act[_LAST_COLUMN_SEGMENT - 1, :n]
            act[1:_LAST_COLUMN_SEGMENT, :n] = act[0:_LAST_COLUMN_SEGMENT - 1, :n]
            act[0, :n] = 0.0
        # 8. soma decay; 9. burst the next node.
        act[_SOMA, :n] *= 1.0 - self._k.soma_decay
        s = self._slot_of(nxt)
        self._act[_SOMA, s] += 1.0
        self._current = nxt
        if self._step >= self._length:
            self._done = True
        return nxt

    # -- internals ------------------------------------------------------------------------------
    def _select(self, eligible: NDArray[np.intp], row: Row, column: int, internal: bool) -> RowKey | None:
        if eligible.shape[0] == 0:
            return None
        act = self._act
        value = act[_SOMA, eligible] + act[_LAST_COLUMN_SEGMENT, eligible]
        ok = value >= self._k.theta
        if not ok.any():
            return None
        # Eligible neurons are in row order: soma entries sorted by (column, feature), so argmax's
        # first-maximum rule *is* "ties go to the lowest (column id, feature id)".
        i = int(np.argmax(np.where(ok, value, -np.inf)))
        soma = np.flatnonzero(row.segment == _SOMA)
        pred = (int(row.target_column[soma[i]]), int(row.target_feature[soma[i]]))
        if internal and pred[0] != column:
            return None
        return pred

    def _slot_of(self, key: RowKey) -> int:
        """Slot of one neuron (created if new)."""
        s = self._slots.lookup_one(key[0], key[1])
        if s < 0:
            s = int(self._slots_of_arrays(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64))[0])
        return s

    def _slots_of(self, row: Row) -> NDArray[np.intp]:
        return self._slots_of_arrays(row.target_column, row.target_feature)

    def _slots_of_arrays(self, tc: NDArray[np.uint64], tf: NDArray[np.uint64]) -> NDArray[np.intp]:
        """Slots of neurons (tc[i], tf[i]), creating slots for new ones (vectorised, exact)."""
        slots, _ = self._slots.lookup_or_add(tc, tf)
        if len(self._slots) > self._act.shape[1]:
            self._grow(len(self._slots))
        return slots.astype(np.intp, copy=False)

    def _grow(self, need: int) -> None:
        cap = self._act.shape[1]
        while cap < need:
            cap *= 2
        grown = np.zeros((NUM_SEGMENTS, cap), np.float64)
        grown[:, : self._act.shape[1]] = self._act
        self._act = grown
