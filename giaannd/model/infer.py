"""Leaky integrate-and-fire (LIF) inference, giaann-algorithm.md §4.3, as a step-wise session.

Theory of operation
-------------------
A :class:`LifSession` walks one token sequence. At step ``k`` (1 ≤ k < length) the *current node*
(column c, feature f) is the node chosen at step k−1; the session asks its caller for that node's
outgoing row (``needs_row()``), and ``step(row)`` then does, in this order (§4.3 steps 2–11):

1. column-constraint mode from f's delimiter flags: deterministic → ``delimiter``; else probabilistic
   → none; else ``internal`` (allowed column set {c}). Only ``internal`` has an effect (the veto).
2. propagate: feature segments 4..7 shift one toward the soma (7 merges into 8, by sum); column
   segments 0..3 and the soma stay.
3. fire, if the current node's soma + segment 3 ≥ θ (always, after its burst): every row entry adds
   ``g(value)`` to (segment, target), ``g(x) = 2·sigmoid(x/100) − 1``, value = 1 (train-set constants:
   boolean synapses) or the strength (test-set constants). Targets hit on the soma segment (the
   distance-1 synapses of this row, *this step only*) form the eligible set.
4. deactivate: current soma := 0 (train-set constants also clear its segment 3).
5. select: seed steps (k < seed_tokens) take the real token. Otherwise among eligible neurons with
   soma + segment 3 ≥ θ take the arg-max; **ties go to the lowest (column id, feature id)** (GIAANN
   uses ``torch.topk`` over float32 values, which differs on a few tokens, §4.3 step 7). Under
   ``internal`` an arg-max in another column is vetoed (no prediction); no candidate → no prediction.
6. next node = real token k (teacher forcing) or the prediction (free running; no prediction ends it).
7. column transition if the next node's column ≠ c: column segments advance 0→1→2→3, segment 3 is
   decayed (× (1 − x_col)) and receives segment 2.
8. soma decay: every soma × (1 − x_soma).
9. burst the next node: soma += 1.

Step 0 bursts token 0, applies the soma decay and bursts it again (it cannot be observed: the
current node's soma is cleared before anything reads it at step 1).

State is a dense ``float64[9, slots]`` array (segment-major, so whole-segment updates are
contiguous) over the neurons touched so far in this sequence; a hash index with compiled probe
loops (giaannd/rowengine/keyindex.py, ``ids_of``: each target walks the table once, found or
inserted; table at load 1/4) maps (column, feature) → slot, new neurons getting the next slots in
the order they first occur in the row. Segments move by relabelling rows, not by copying them: the
rows holding segments 4..7 form a ring (7 is added into the soma, cleared, and becomes 4) and so do
those of segments 0..2 at a column change (2 is added into the decayed segment 3, cleared, and
becomes 0), so a step's dense work is two or three compiled passes over the slots instead of a dozen.
Firing a row is two compiled passes over it: the slot map, then ``_deposit`` (g(strength) and the
add into (segment, slot), one add per element: a canonical row is nine sorted runs with distinct
targets in each, and the soma run *is* the eligible set); numpy computes only ``exp`` of the
test-set deposits, as before. A row fired again skips the slot map: the session remembers, per
source node, the slots of each row of ≥ 2,048 entries it fired (and, test-set, the strengths and
their ``exp``), in at most ``remember_bytes`` (48 MiB by default, least recently fired forgotten
first), and checks them before each reuse (``KeyIndex.holds``: the key stored at each remembered slot
is the entry's target, one near-sequential pass instead of a probe walk; the strengths' bits are
equal), so a changed row, or another Row object with the same content (the local store makes a new
one per ``get_row``; the cluster's row cache hands out the same one), is always handled right.
Selection is one compiled pass over the eligible set (``_pick``). No Python per entry. Every float
operation is the one the spec states, in the same order, so the state is the same bit for bit as a
straightforward implementation's (tests/unit/model/test_infer_step.py checks it against the previous
one, step by step; test_infer_refire.py with rows fired again). What bounds a first fire on long
rows is the slot map's random access into the hash table and the first touch of fresh memory
(tools/bench/lif.py breaks the step down). The session never does I/O: the caller fetches rows
(from a local :class:`~giaannd.model.rowstore.RowStore` or a remote storage client) and may do so
asynchronously.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from giaannd.model.ids import PRIME_FEATURE
from giaannd.model.rows import NUM_SEGMENTS, Row, RowKey
from giaannd.rowengine import KeyIndex
from giaannd.rowengine.jit import kernel

__all__ = [
    "SEED_TOKENS",
    "TEST_SET",
    "TRAIN_SET",
    "DelimiterFlags",
    "LifConstants",
    "LifSession",
    "NoDelimiters",
    "REMEMBER_BYTES",
    "RowSource",
    "activation",
    "run_session",
]

#: ``numSeedTokensInference``: tokens 0..7 seed the state; predictions start at token 8 (§4.2).
SEED_TOKENS = 8
_SOMA = NUM_SEGMENTS - 1
_LAST_COLUMN_SEGMENT = 3
_FIRST_FEATURE_SEGMENT = 4
_INITIAL_SLOTS = 256
#: A state grown for ``need`` neurons by more than doubling gets ``need / _GROW_SPARE`` more room.
_GROW_SPARE = 8
#: Load of the session's slot table: at 1/4 (not the default 1/2) a fired row's targets walk fewer
#: slots (~1.2 instead of ~1.5-2.5 per key), for 16-32 more bytes per neuron of a table that lives as
#: long as the session. With the compiled probe loops the two measured within noise at 10^4 (1/4
#: 5-20 % faster at 10^5-10^6, tools/bench/lif.py, a loaded machine).
_SLOT_TABLE_LOAD = 0.25
#: Where each segment's run starts in a canonical row (searched for in its uint8 segments, no cast).
_SEGMENT_EDGES = np.arange(NUM_SEGMENTS + 1, dtype=np.uint8)
#: Default ``remember_bytes``: what a session spends remembering the rows it fired (``_Fired``: 8 bytes
#: per entry for the slots, 12 more with test-set constants for the strengths and their ``exp``), all
#: rows together; the least recently fired go first, and a row that needs more alone is not
#: remembered. 48 MiB: a row of 2.4·10^6 entries (test-set), or several shorter ones.
REMEMBER_BYTES = 48 << 20
#: Rows shorter than this are not remembered: mapping them costs a few µs, about what keeping and
#: checking a record costs, and few rows of a sentence fire twice (the bundled corpus's sessions: 461
#: entries a step on average).
_MEMO_MIN_ENTRIES = 2048


@dataclass(slots=True)
class _Fired:
    """What a session remembers of a row it fired, to fire it again without a lookup: the state slot of
    every entry (what ``KeyIndex.ids_of`` returned) and, for test-set constants, the
    strengths (a copy) and ``exp(strength / -100)`` of every entry. Checked before each use
    (``KeyIndex.holds``: the keys at those slots are the row's targets; the strengths' bits equal),
    so a row that changed, or another Row object with the same content, is handled right."""

    slots: NDArray[np.int64]
    strength: NDArray[np.float32] | None = None
    value: NDArray[np.float64] | None = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.strength is None or self.value is None else self.strength.nbytes + self.value.nbytes
        return int(self.slots.nbytes) + extra


@dataclass(frozen=True, slots=True)
class LifConstants:
    """One constant set of §4.1."""

    #: Soma firing / candidate threshold θ.
    theta: float
    #: Deposit g(1) for every synapse with strength > 0 (train-set) instead of g(strength).
    boolean_synapses: bool
    #: x in "soma × (1 − x)" after each step.
    soma_decay: float
    #: x in "segment 3 × (1 − x)" at each column change.
    column_decay: float
    #: Also zero the current node's segment 3 when it fires.
    clear_segment3_on_fire: bool


#: ``inferenceEvaluateTestSet=False``: boolean synapses, θ 0.004, soma cleared, decays 1.0.
TRAIN_SET = LifConstants(theta=0.004, boolean_synapses=True, soma_decay=1.0, column_decay=1.0,
                         clear_segment3_on_fire=True)
#: ``inferenceEvaluateTestSet=True``: raw strengths, θ 0.008, decays 0.75.
TEST_SET = LifConstants(theta=0.008, boolean_synapses=False, soma_decay=0.75, column_decay=0.75,
                        clear_segment3_on_fire=False)


def activation(x: float) -> float:
    """g(x) = 2·sigmoid(x/100) − 1 (≈ x/200 for small x)."""
    return 2.0 / (1.0 + math.exp(-x / 100.0)) - 1.0


#: g(1), the deposit of every boolean synapse (train-set constants).
_G_ONE = activation(1.0)
#: ``_deposit``'s modes: every entry adds value[0] (g(1)); g(1) where strength > 0, else 0.0;
#: g from value[i] = exp(strength[i] / -100).
_G_CONSTANT, _G_BOOLEAN, _G_EXP = 0, 1, 2


@kernel('int64(float64[:, ::1], int64[::1], Array(uint8, 1, "C", readonly=True), '
        'Array(int64, 1, "C", readonly=True), Array(float32, 1, "C", readonly=True), '
        'Array(float64, 1, "C", readonly=True), int64)')
def _deposit(act: NDArray[np.float64], lane: NDArray[np.int64], segment: NDArray[np.uint8],
             slots: NDArray[np.int64], strength: NDArray[np.float32], value: NDArray[np.float64],
             mode: int) -> int:
    """``act[lane[segment[i]], slots[i]] += g_i`` for every entry i (``LifSession._deposits`` says
    what ``value`` and ``mode`` hold). One add per element: a canonical row has distinct
    (segment, slot) pairs, so this is the scatter-add numpy's fancy ``+=`` did, in any order.
    Returns how many entries it skipped for a segment ≥ 9 (none in a canonical row; the check keeps
    a bad row from writing outside the state, bounds checks being off)."""
    g1 = value[0]
    bad = 0
    for i in range(slots.shape[0]):
        seg = segment[i]
        if seg >= lane.shape[0]:
            bad += 1
            continue
        if mode == _G_CONSTANT:
            g = g1
        elif mode == _G_BOOLEAN:
            g = g1 if strength[i] > 0 else 0.0
        else:
            e = value[i] + 1.0
            g = 2.0 / e
            g = g - 1.0
        # unsigned indices: numba wraps a negative signed one around (extra instructions per access;
        # train-set 10^4 entries ~1.0 -> ~0.7 ns each). Slots are ids (≥ 0) and lane holds 0..8.
        act[np.uint64(lane[seg]), np.uint64(slots[i])] += g
    return bad


@kernel("void(float64[:, ::1], int64, int64, int64, float64)")
def _fold_lane(act: NDArray[np.float64], into: int, lane: int, n: int, factor: float) -> None:
    """``act[into, :n] = act[into, :n] * factor + act[lane, :n]``, then ``act[lane, :n] = 0``: what
    numpy's ``*=``, ``+=`` and ``= 0`` did in three passes, in one (the same two roundings per element,
    no fused multiply-add without fastmath; ``factor`` 1.0 multiplies exactly)."""
    for i in range(n):
        v = act[into, i] * factor
        act[into, i] = v + act[lane, i]
        act[lane, i] = 0.0


@kernel('int64(float64[:, ::1], Array(int64, 1, "C", readonly=True), float64)')
def _pick(act: NDArray[np.float64], eligible: NDArray[np.int64], theta: float) -> int:
    """The position in ``eligible`` of the first neuron with the largest soma + segment 3 among those
    with soma + segment 3 ≥ θ, or -1 if none: what ``argmax(where(value >= θ, value, -inf))`` and an
    ``any`` gave (a NaN is never ≥ θ; each sum is the same float64 add)."""
    best = -1
    top = 0.0
    for i in range(eligible.shape[0]):
        e = eligible[i]
        v = act[_SOMA, e] + act[_LAST_COLUMN_SEGMENT, e]
        if v >= theta and (best < 0 or v > top):
            best = i
            top = v
    return best


class DelimiterFlags(Protocol):
    """The per-feature delimiter flags (the column assigner provides them)."""

    def is_deterministic(self, feature_id: int) -> bool: ...

    def is_probabilistic(self, feature_id: int) -> bool: ...


class NoDelimiters:
    """Flags with no delimiters at all: every step is ``internal`` (for tests and tools)."""

    def is_deterministic(self, feature_id: int) -> bool:
        return False

    def is_probabilistic(self, feature_id: int) -> bool:
        return False


class RowSource(Protocol):
    """Where rows come from: the local row store, or (later) a storage client."""

    def get_row(self, column_id: int, feature_id: int) -> Row: ...


class LifSession:
    """One sequence of LIF inference, driven by the caller (sans-IO).

    Args:
        targets: the (column id, feature id) of every known token: the whole sentence for evaluation,
            the prompt for generation. At least 1.
        flags: delimiter flags (for the column-constraint mode).
        constants: :data:`TRAIN_SET` or :data:`TEST_SET`.
        length: total steps; defaults to ``len(targets)`` (generation passes prompt + max new tokens).
        seed_tokens: steps < seed_tokens take the real token (teacher forcing, no prediction).
        teacher_forced: after the seed, continue with the real token (True) or the prediction (False).
        remember_bytes: memory for remembering the rows fired (``_Fired``, :data:`REMEMBER_BYTES`), so
            that one fired again skips the slot map; 0 remembers nothing (every fire maps its row).

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
        remember_bytes: int = REMEMBER_BYTES,
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
        # (column, feature) -> slot: the neuron's column of ``_act``
        self._slots = KeyIndex(max_load=_SLOT_TABLE_LOAD)
        #: The rows fired so far, by source node (the row fired is always the current node's), least
        #: recently fired first: a row fired again skips the slot map (``_slots_of``).
        self._fired: dict[RowKey, _Fired] = {}
        self._fired_bytes = 0
        self._remember_bytes = remember_bytes
        self._act: NDArray[np.float64] = np.zeros((NUM_SEGMENTS, _INITIAL_SLOTS), np.float64)
        #: The row of ``_act`` holding each segment. Segments 0..2 and 4..7 move by relabelling these
        #: rows (a ring each), not by copying them; segment 3 and the soma stay in rows 3 and 8.
        self._lane = list(range(NUM_SEGMENTS))
        #: ``predictions[k]`` for every step k ≥ seed_tokens run so far (None = no prediction).
        self.predictions: dict[int, RowKey | None] = {}
        self._step = 1
        self._done = self._length <= 1
        first = self._targets[0]
        s = self._current_slot = self._slot_of(first)
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
            ValueError: ``row`` has a segment ≥ 9 or arrays of different lengths (found before it
                writes into the state if the row is sorted, else during the deposits: either way
                no write lands outside the state, and the session is not to be used further).
        """
        if self._done:
            raise RuntimeError("LIF session is finished")
        k = self._step
        c, f = self._current
        internal = (f == PRIME_FEATURE) or not (
            self._flags.is_deterministic(f) or self._flags.is_probabilistic(f)
        )
        n = len(self._slots)
        cur = self._current_slot
        # 2. propagate feature segments one step toward the soma.
        self._shift_feature_segments(n)
        # 3. fire.
        eligible: NDArray[np.int64] = np.empty(0, np.int64)
        soma_start = 0
        if self._potential(cur) >= self._k.theta and len(row):
            eligible, soma_start = self._fire(row)
        # 4. deactivate the current node.
        self._deactivate(cur)
        # 5./6. select and choose the next node.
        if k < self._seed:
            nxt: RowKey | None = self._targets[k]
        else:
            pred = self._select(eligible, row, soma_start, c, internal)
            self.predictions[k] = pred
            nxt = self._targets[k] if self._teacher else pred
        self._step += 1
        if nxt is None:
            self._done = True
            return None
        n = len(self._slots)
        # 7. column transition.
        if nxt[0] != c:
            self._shift_column_segments(n)
        # 8. soma decay; 9. burst the next node.
        self._decay_soma(n)
        self._current_slot = self._slot_of(nxt)  # a neuron's slot never changes
        self._burst(self._current_slot)
        self._current = nxt
        if self._step >= self._length:
            self._done = True
        return nxt

    def activation_state(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.float64]]:
        """Every neuron seen so far and its nine segment values, for tests and tools: (column ids,
        feature ids, float64[9, neurons]) in slot order, segments in segment order (lanes undone),
        always on the host."""
        ka, kb = self._slots.keys()
        return ka, kb, self._host_state()[self._lane][:, : ka.shape[0]]

    # -- the state's primitive operations (the torch session, giaannd/model/gpu/lif.py, overrides
    #    exactly these; everything about *when* they run stays in ``step``) -----------------------
    def _host_state(self) -> NDArray[np.float64]:
        return self._act

    def _capacity(self) -> int:
        return int(self._act.shape[1])

    def _shift_feature_segments(self, n: int) -> None:
        """Step 2: 7 merges into the soma, and its row, cleared, becomes segment 4 (6, 5, 4 become
        7, 6, 5 by relabelling, no copy)."""
        lane = self._lane
        last = lane[_SOMA - 1]
        _fold_lane(self._act, _SOMA, last, n, 1.0)
        lane[_FIRST_FEATURE_SEGMENT:_SOMA] = [last, *lane[_FIRST_FEATURE_SEGMENT:_SOMA - 1]]

    def _potential(self, slot: int) -> float:
        """Soma + segment 3 of one neuron (the firing and selection quantity)."""
        return float(self._act[_SOMA, slot] + self._act[_LAST_COLUMN_SEGMENT, slot])

    def _deactivate(self, slot: int) -> None:
        """Step 4."""
        self._act[_SOMA, slot] = 0.0
        if self._k.clear_segment3_on_fire:
            self._act[_LAST_COLUMN_SEGMENT, slot] = 0.0

    def _shift_column_segments(self, n: int) -> None:
        """Step 7: segment 3 decays and receives 2; 2's row, cleared, becomes 0 (1, 0 become 2, 1)."""
        lane = self._lane
        prev = lane[_LAST_COLUMN_SEGMENT - 1]
        _fold_lane(self._act, _LAST_COLUMN_SEGMENT, prev, n, 1.0 - self._k.column_decay)
        lane[0:_LAST_COLUMN_SEGMENT] = [prev, *lane[0:_LAST_COLUMN_SEGMENT - 1]]

    def _decay_soma(self, n: int) -> None:
        """Step 8."""
        self._act[_SOMA, :n] *= 1.0 - self._k.soma_decay

    def _burst(self, slot: int) -> None:
        """Step 9."""
        self._act[_SOMA, slot] += 1.0

    # -- internals ------------------------------------------------------------------------------
    def _fire(self, row: Row) -> tuple[NDArray[np.int64], int]:
        """Deposit g(value) of every entry of ``row`` into (segment, target); returns the slots of the
        soma entries (the eligible set) and where they start in the row.

        The row is canonical, so its segments are nine contiguous runs (found by one binary search)
        and within a run every target is distinct: each (segment, slot) gets one add, and the soma
        run *is* the eligible set. Two compiled passes over the row: the slot map
        (``KeyIndex.ids_of``), then the deposits (``_scatter``).
        """
        edges: list[int] = np.searchsorted(row.segment, _SEGMENT_EDGES).tolist()
        if edges[NUM_SEGMENTS] != len(row):
            raise ValueError(f"a row's segments must be < {NUM_SEGMENTS}")
        slots = self._slots_of(row)
        self._scatter(slots, row.segment, row.strength)
        return slots[edges[_SOMA]:edges[_SOMA + 1]], edges[_SOMA]

    def _scatter(self, slots: NDArray[np.int64], segment: NDArray[np.uint8], strength: NDArray[np.float32]) -> None:
        """``act[segment, slot] += g(value)`` for every entry, in one compiled pass (``_deposit``):
        the part of g numpy computes (``_deposits``) is finished there by the same float64
        operations in the same order, so every state value gets the same bits as before."""
        if not slots.shape[0] == segment.shape[0] == strength.shape[0]:
            raise ValueError("a row's arrays must be of one length")
        mode, value = self._deposits(strength, self._fired.get(self._current))
        if _deposit(self._act, np.array(self._lane, np.int64), np.ascontiguousarray(segment, np.uint8),
                    slots, np.ascontiguousarray(strength, np.float32), value, mode):
            raise ValueError(f"a row's segments must be < {NUM_SEGMENTS}")

    def _deposits(self, strength: NDArray[np.float32], fired: _Fired | None = None) -> tuple[int, NDArray[np.float64]]:
        """What ``_deposit`` needs to add g(value) of every entry: (``_G_CONSTANT``, [g(1)]) for boolean
        synapses whose strengths are all > 0 (the usual case); (``_G_BOOLEAN``, [g(1)]) when some are
        not (g(1) where strength > 0, else 0.0, chosen per entry); (``_G_EXP``, exp(s / −100)) for raw
        strengths, numpy's ``exp`` as before (the kernel adds 1, divides 2 by it and subtracts 1:
        ``2 / (1 + exp(-s / 100)) - 1`` in the order the spec writes it; negating before or after
        dividing by 100 is exact). ``fired``: what the session remembers of this row (``_slots_of``
        just checked its slots): its ``exp`` values are reused when the strengths have the same bits,
        else computed and remembered with a copy of the strengths."""
        if self._k.boolean_synapses:
            mode = _G_CONSTANT if strength.shape[0] and float(strength.min()) > 0.0 else _G_BOOLEAN
            return mode, np.array([_G_ONE])
        if fired is not None and fired.value is not None and fired.strength is not None and np.array_equal(
                fired.strength.view(np.uint32), np.ascontiguousarray(strength, np.float32).view(np.uint32)):
            return _G_EXP, fired.value
        # widen first, then divide in place: the same float64 operations as ``np.divide(strength,
        # -100.0, dtype=np.float64)``, without setting up its casting loop (~0.7 µs less a call: 461
        # entries 16.7 -> 15.2 ns each; the same from 10^4 on, where numpy's exp, ~5.5 ns, is the cost)
        value = strength.astype(np.float64)
        value /= -100.0
        np.exp(value, out=value)
        if fired is not None:
            self._fired_bytes -= fired.nbytes
            fired.strength = np.array(strength, np.float32)
            fired.value = value
            value.flags.writeable = False
            self._fired_bytes += fired.nbytes
            self._trim_fired()
        return _G_EXP, value

    def _select(self, eligible: NDArray[np.int64], row: Row, soma_start: int, column: int,
                internal: bool) -> RowKey | None:
        # Eligible neurons are in row order: soma entries sorted by (column, feature), so the first
        # maximum (``_pick``) *is* "ties go to the lowest (column id, feature id)".
        i = _pick(self._act, eligible, self._k.theta)
        if i < 0:
            return None
        i += soma_start
        pred = (int(row.target_column[i]), int(row.target_feature[i]))
        if internal and pred[0] != column:
            return None
        return pred

    def _slot_of(self, key: RowKey) -> int:
        """Slot of one neuron (created if new)."""
        s = self._slots.lookup_one(key[0], key[1])
        if s < 0:
            s = int(self._slots_of_arrays(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64))[0])
        return s

    def _slots_of(self, row: Row) -> NDArray[np.int64]:
        """The slots of the targets of ``row``, the current node's row (new neurons get new slots).
        A row this session fired before and still remembers (``_Fired``) is checked instead of mapped
        (``KeyIndex.holds``: no probe walk); otherwise it is mapped and remembered. Either way,
        ``_fired[current]`` is then this row's record, or absent (a row too short or too long to
        remember: ``_MEMO_MIN_ENTRIES``, ``remember_bytes``)."""
        key = self._current
        tc, tf = row.target_column, row.target_feature
        fired = self._fired.pop(key, None) if self._fired else None
        if fired is not None:
            if fired.slots.shape[0] == tc.shape[0] and self._slots.holds(tc, tf, fired.slots):
                self._fired[key] = fired  # now the most recently fired
                return fired.slots
            self._fired_bytes -= fired.nbytes
        slots = self._slots_of_arrays(tc, tf)
        if tc.shape[0] >= _MEMO_MIN_ENTRIES:
            fired = _Fired(slots)
            self._fired[key] = fired
            self._fired_bytes += fired.nbytes
            self._trim_fired()
        return slots

    def _trim_fired(self) -> None:
        """Forget the least recently fired rows until the records fit in ``remember_bytes`` (the one just
        fired, last, goes too if it alone does not fit)."""
        fired = self._fired
        while self._fired_bytes > self._remember_bytes and fired:
            self._fired_bytes -= fired.pop(next(iter(fired))).nbytes

    def _slots_of_arrays(self, tc: NDArray[np.uint64], tf: NDArray[np.uint64]) -> NDArray[np.int64]:
        """Slots of neurons (tc[i], tf[i]), creating slots for new ones (vectorised, exact)."""
        slots = self._slots.ids_of(tc, tf)
        if len(self._slots) > self._capacity():
            self._grow(len(self._slots))
        return slots

    def _grow(self, need: int) -> None:
        # at least double (amortised growth), but a first fire of a long row gets what it needs and an
        # eighth more (the next nodes' new neurons), not the next power of two: numpy zeroes the whole
        # array (10^4-10^5 entries: ~1 ns per entry less, tools/bench/lif.py "state grow")
        cap = max(2 * int(self._act.shape[1]), need + need // _GROW_SPARE)
        grown = np.zeros((NUM_SEGMENTS, cap), np.float64)
        grown[:, : self._act.shape[1]] = self._act
        self._act = grown


def run_session(session: LifSession, source: RowSource) -> LifSession:
    """Drive a session to its end against a synchronous row source."""
    while (key := session.needs_row()) is not None:
        session.step(source.get_row(key[0], key[1]))
    return session
