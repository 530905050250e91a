"""The LIF step on torch tensors (issue 20 item 1): the activation state lives on the compute device.

Theory of operation
-------------------
:class:`TorchLifSession` is a :class:`~giaannd.model.infer.LifSession` whose nine segment rows are
one float64 ``torch.Tensor`` ``[9, capacity]`` on ``device``. It overrides only the state's primitive
operations (``_shift_feature_segments``, ``_fire``/``_scatter``, ``_select``, ...); *when* each runs,
the lane relabelling, the slot table and the teacher forcing stay in ``LifSession.step``, so the two
paths cannot drift apart in their rules. Each operation is one or a few whole-tensor calls; a fired
row is deposited with one ``index_add_`` into the flattened state (no Python per entry).

What stays on the host, and why:

* the (column, feature) -> slot table (``rowengine.KeyIndex``, a hash table in host arrays with
  compiled probe loops): a fired row's targets are mapped to slots there and the slot indices (8
  bytes per entry) go to the device. A
  device-side hash table is the next step for rows of 10^6+ entries (README, "Known gaps").
* control flow: whether the current node fires and which neuron is chosen are read back each step
  (two or three scalars: one device sync per step, unavoidable since the next row depends on them).

Equality with the numpy step (tests/unit/model/test_lif_torch.py runs both in lockstep): the state
is float64 on both, every add, multiply and compare is the same IEEE operation on the same
operands, and within a canonical row every (segment, slot) is distinct, so the scatter-add adds
each element once (no summation order to differ). The one operation that may differ is ``exp`` in
the test-set deposit ``g(strength)``: numpy and torch (and CUDA's libdevice) each round their own
``exp`` and are allowed a last-bit difference (1 ulp, ~1e-16 relative). The tolerance the tests use
is float32's (rtol 1e-6, atol 1e-9): a row stores float32 strengths, so differences below that are
noise; predictions are compared exactly (a threshold compare or an arg-max tie could in principle
flip on a 1-ulp difference; it did not on the bundled corpus).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from giaannd.model.gpu.device import torch_module
from giaannd.model.infer import REMEMBER_BYTES, SEED_TOKENS, DelimiterFlags, LifConstants, LifSession, activation
from giaannd.model.rows import NUM_SEGMENTS, Row, RowKey
from giaannd.model.train import COLUMN_SEGMENTS, SOMA_SEGMENT

if TYPE_CHECKING:
    import torch

__all__ = ["TorchLifSession", "make_session"]

#: g(1): the deposit of every boolean synapse (train-set constants), the same float as the numpy path's.
_G_ONE = activation(1.0)
#: The segment layout (giaannd/model/train.py): the soma, the last column segment, the first feature one.
_SOMA = SOMA_SEGMENT
_LAST_COLUMN_SEGMENT = COLUMN_SEGMENTS - 1
_FIRST_FEATURE_SEGMENT = COLUMN_SEGMENTS
#: Where each segment's run starts in a canonical row (searched for in its uint8 segments).
_SEGMENT_EDGES = np.arange(NUM_SEGMENTS + 1, dtype=np.uint8)


class TorchLifSession(LifSession):
    """A LIF session whose activation state is a torch tensor on ``device`` (module docstring).

    Args:
        targets, flags, constants, length, seed_tokens, teacher_forced, remember_bytes: as
            :class:`LifSession` (remembered rows skip the host slot map; the deposits go to the
            device as before).
        device: a torch device string (``"cuda"``, ``"cuda:1"``; ``"cpu"`` in tests and tools).
    """

    def __init__(self, targets: Sequence[RowKey], flags: DelimiterFlags, constants: LifConstants, *,
                 length: int | None = None, seed_tokens: int = SEED_TOKENS, teacher_forced: bool = True,
                 remember_bytes: int = REMEMBER_BYTES, device: str = "cuda") -> None:
        # LifSession.__init__ builds the (small) initial state on the host, bursting token 0; it
        # then moves to the device once, and the host array is dropped.
        super().__init__(targets, flags, constants, length=length, seed_tokens=seed_tokens,
                         teacher_forced=teacher_forced, remember_bytes=remember_bytes)
        self._torch = torch_module()
        self.device = self._torch.device(device)
        self._t: torch.Tensor = self._torch.from_numpy(self._act).to(self.device)
        self._act = np.zeros((NUM_SEGMENTS, 0), np.float64)

    # -- state primitives (LifSession's docstrings say what each step does) ----------------------
    def _host_state(self) -> NDArray[np.float64]:
        host: NDArray[np.float64] = self._t.cpu().numpy()
        return host

    def _capacity(self) -> int:
        # before __init__ moved the state (the first burst), the host array is the state
        t = getattr(self, "_t", None)
        return int(self._act.shape[1] if t is None else t.shape[1])

    def _shift_feature_segments(self, n: int) -> None:
        t, lane = self._t, self._lane
        last = lane[_SOMA - 1]
        t[_SOMA, :n].add_(t[last, :n])
        t[last, :n].zero_()
        lane[_FIRST_FEATURE_SEGMENT:_SOMA] = [last, *lane[_FIRST_FEATURE_SEGMENT:_SOMA - 1]]

    def _potential(self, slot: int) -> float:
        return float((self._t[_SOMA, slot] + self._t[_LAST_COLUMN_SEGMENT, slot]).item())

    def _deactivate(self, slot: int) -> None:
        self._t[_SOMA, slot] = 0.0
        if self._k.clear_segment3_on_fire:
            self._t[_LAST_COLUMN_SEGMENT, slot] = 0.0

    def _shift_column_segments(self, n: int) -> None:
        t, lane = self._t, self._lane
        prev = lane[_LAST_COLUMN_SEGMENT - 1]
        t[_LAST_COLUMN_SEGMENT, :n].mul_(1.0 - self._k.column_decay)
        t[_LAST_COLUMN_SEGMENT, :n].add_(t[prev, :n])
        t[prev, :n].zero_()
        lane[0:_LAST_COLUMN_SEGMENT] = [prev, *lane[0:_LAST_COLUMN_SEGMENT - 1]]

    def _decay_soma(self, n: int) -> None:
        self._t[_SOMA, :n].mul_(1.0 - self._k.soma_decay)

    def _burst(self, slot: int) -> None:
        self._t[_SOMA, slot] += 1.0

    def _fire(self, row: Row) -> tuple[NDArray[np.int64], int]:
        """Deposit g(value) of every entry of ``row`` into (segment, target) with one ``index_add_``
        into the flattened state; returns the soma run's slots (the eligible set) and its start."""
        torch = self._torch
        edges: list[int] = np.searchsorted(row.segment, _SEGMENT_EDGES).tolist()
        slots = self._slots_of(row)  # may grow the state
        flat = np.array(self._lane, np.int64)[row.segment]
        flat *= self._capacity()
        flat += slots
        index = torch.from_numpy(flat).to(self.device, non_blocking=True)
        self._t.view(-1).index_add_(0, index, self._deposits_on_device(row.strength))
        return slots[edges[_SOMA]:edges[_SOMA + 1]], edges[_SOMA]

    def _deposits_on_device(self, strength: NDArray[np.float32]) -> torch.Tensor:
        """g(value) of every entry, float64 on the device, by the numpy path's operations in its
        order: ``2 / (1 + exp(s / -100)) - 1`` (only ``exp`` may round differently, module docstring)."""
        th = self._torch  # not "torch": that name is the type namespace in annotations here
        n = strength.shape[0]
        if self._k.boolean_synapses:
            if n and float(strength.min()) > 0.0:
                full: torch.Tensor = th.full((n,), _G_ONE, dtype=th.float64, device=self.device)
                return full
            # 1.0 * g(1) and 0.0 * g(1) are exact: the same floats as numpy's where(s > 0, g(1), 0)
            positive = th.from_numpy(strength).to(self.device) > 0
            masked: torch.Tensor = positive.to(th.float64).mul_(_G_ONE)
            return masked
        value = th.from_numpy(strength).to(self.device).to(th.float64)
        value.div_(-100.0).exp_().add_(1.0)
        deposits: torch.Tensor = (2.0 / value).sub_(1.0)
        return deposits

    def _select(self, eligible: NDArray[np.int64], row: Row, soma_start: int, column: int,
                internal: bool) -> RowKey | None:
        if eligible.shape[0] == 0:
            return None
        torch = self._torch
        e = torch.from_numpy(eligible).to(self.device, non_blocking=True)
        value = self._t[_SOMA, e] + self._t[_LAST_COLUMN_SEGMENT, e]
        ok = value >= self._k.theta
        # torch.argmax returns the first maximal index (as numpy's), so ties still go to the
        # lowest (column id, feature id): eligible is in row order. One read-back: the index and
        # whether it passed the threshold (none did when even the maximum of the masked values fails).
        i = torch.argmax(torch.where(ok, value, -torch.inf))
        picked, passed = torch.stack([i, ok[i].to(torch.int64)]).tolist()
        if not passed:
            return None
        j = soma_start + int(picked)
        pred = (int(row.target_column[j]), int(row.target_feature[j]))
        if internal and pred[0] != column:
            return None
        return pred

    def _grow(self, need: int) -> None:
        t = getattr(self, "_t", None)
        if t is None:  # still building the first state on the host (LifSession.__init__)
            super()._grow(need)
            return
        cap = int(t.shape[1])
        while cap < need:
            cap *= 2
        grown = self._torch.zeros((NUM_SEGMENTS, cap), dtype=self._torch.float64, device=self.device)
        grown[:, : t.shape[1]] = t
        self._t = grown


def make_session(device: str, targets: Sequence[RowKey], flags: DelimiterFlags, constants: LifConstants,
                 **kwargs: Any) -> LifSession:
    """The session for a compute device: the numpy :class:`LifSession` on ``"cpu"`` (its fastest
    path; torch is not imported), a :class:`TorchLifSession` on any other device."""
    if device == "cpu":
        return LifSession(targets, flags, constants, **kwargs)
    return TorchLifSession(targets, flags, constants, device=device, **kwargs)
