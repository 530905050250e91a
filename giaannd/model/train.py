"""GIAANN training increments (giaann-algorithm.md §3.1), vectorised over all token pairs.

Training is a pure sum of non-negative increments (§3.3): a sentence alone determines its deltas, so
this module never reads the store. For one sentence with tokens ``0..n-1``, every ordered pair
``p < q`` (token distance ``d = q - p``, column-instance distance ``cd = inst(q) - inst(p)``) adds to
the row of the *source* neuron ``(column(p), feature(p))``:

* a **feature-segment** entry when ``d <= FEATURE_REACH`` (= Sfeat + 1 = 5 with LIF), at segment
  ``s = Scol + FEATURE_REACH - d`` (d=1 → 8, the soma; d=5 → 4);
* a **column-segment** entry when ``cd < Scol`` (= 4), at segment ``s = Scol - 1 - cd`` (cd=0 → 3);

each worth the proximity ``10 / (d + 1)`` — the column entry also uses the *token* distance ``d``.
Equal keys add up (repeated pairs, the same neuron pair reached through different slots).

How it is fast without a Python loop over pairs: the pairs that produce anything are exactly
``p < q < hi(p)`` with ``hi(p) = min(n, max(p + 6, end of instance inst(p) + 3))`` — one contiguous
range per source token (feature reach or column reach, whichever is longer). A whole *batch* of
sentences is concatenated, the ragged ranges are expanded at once (``repeat_interleave`` + arange),
both entry kinds are computed with masks, and the entries are coalesced with a single packed int64
key (local neuron ranks make the key order equal the canonical row order), so the result is a
canonical :class:`RowBatch` without a multi-key sort. Nothing here depends on the batch grouping:
``train_batch([a, b]) == train_batch([a]) + train_batch([b])`` up to float summation order.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import numpy as np
from numpy.typing import NDArray

from giaannd.model.gpu.device import Device, cuda_usable
from giaannd.model.rows import NUM_SEGMENTS, RowBatch
from giaannd.model.sentence import EncodedSentence

if TYPE_CHECKING:
    import torch

__all__ = [
    "COLUMN_SEGMENTS",
    "Backend",
    "FEATURE_REACH",
    "FEATURE_SEGMENTS",
    "PROXIMITY_SCALE",
    "SOMA_SEGMENT",
    "NeuronBatch",
    "TrainOutput",
    "backend_for",
    "default_backend",
    "proximity",
    "train_batch",
    "train_sentence",
]

#: Scol: column segments 0..3 (column distance 3, 2, 1, 0) — §1.2, "matchedSegments" with 8 seeds.
COLUMN_SEGMENTS = 4
#: Sfeat: feature segments 4..7 (token distance 5, 4, 3, 2).
FEATURE_SEGMENTS = 4
#: Lf = Sfeat + 1 with LIF: the soma (segment 8) takes distance-1 synapses directly (§3.1 step 6).
FEATURE_REACH = FEATURE_SEGMENTS + 1
#: Index of the artificial soma segment.
SOMA_SEGMENT = COLUMN_SEGMENTS + FEATURE_SEGMENTS
#: ``trainConnectionStrengthProximityScale``: value of an entry = scale / (d + 1).
PROXIMITY_SCALE = 10.0

#: Torch intra-op threads while training a batch. The tensors are small (tens of thousands of
#: elements); on a loaded 2-core machine the default pool was 10x *slower* than one thread
#: (measured: 124 ms vs 12.8 ms for the pairs of 256 WEB sentences), so training runs single-threaded
#: and parallelism comes from running more sentences/batches per process or more processes.
TRAIN_TORCH_THREADS = 1

#: Which library computes the pairs. Both give identical results (same integer keys, float64 sums).
#: "torch" is the dense torch computation the design asks for (and the path to a GPU);
#: "numpy" measured ~4.5x faster for the pair expansion on CPU here (small tensors, per-op overhead):
#: batch of 256 WEB sentences, 1 thread: torch 15.4k vs numpy 70.3k sentences/s. Hence the default
#: (``default_backend``): numpy unless the host has a CUDA device.
Backend = Literal["torch", "numpy"]
#: The NVIDIA driver's control device (``giaannd.model.gpu.device``); a name here so tests can point
#: it at a path that does not exist.
_NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"


def _torch() -> ModuleType:
    """torch, imported on first use: only the torch backend needs it (STYLE.md item 22's lazy
    import of an optional heavy dependency; a storage node never loads it)."""
    return importlib.import_module("torch")


@cache
def default_backend() -> Backend:
    """``"torch"`` where a CUDA device is usable, else ``"numpy"`` (measured faster on CPU)."""
    return "torch" if cuda_usable(_NVIDIA_CONTROL_DEVICE)[0] else "numpy"


def backend_for(device: Device) -> Backend:
    """The backend a compute node uses on ``device``: torch on CUDA, numpy (the faster) on a CPU."""
    return "torch" if device == "cuda" else "numpy"


assert SOMA_SEGMENT + 1 == NUM_SEGMENTS


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (process-global; restored on exit)."""
    torch = _torch()
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)


def proximity(d: int) -> float:
    """The increment of one entry at token distance ``d`` (§3.1 step 6)."""
    return PROXIMITY_SCALE / (d + 1)


@dataclass(frozen=True, slots=True, eq=False)
class NeuronBatch:
    """Optional neuron-strength increments (§3.1 step 5), sorted by (column, feature, segment), unique.

    Not read by default inference (§4.4); kept for completeness behind ``neuron_strengths=True``.
    """

    column: NDArray[np.uint64]
    feature: NDArray[np.uint64]
    segment: NDArray[np.uint8]
    strength: NDArray[np.float32]

    def __len__(self) -> int:
        return int(self.strength.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class TrainOutput:
    """What training a batch of sentences produces: connection deltas and, optionally, neuron deltas."""

    rows: RowBatch
    neurons: NeuronBatch | None
    sentences: int
    tokens: int


def _rank_pairs(col: NDArray[np.uint64], feat: NDArray[np.uint64]
                ) -> tuple[NDArray[np.int64], NDArray[np.uint64], NDArray[np.uint64]]:
    """Dense ranks of (col, feat) pairs in ascending (col, feat) order, and the unique pairs."""
    order = np.lexsort((feat, col))
    sc, sf = col[order], feat[order]
    new = np.ones(sc.shape[0], dtype=bool)
    new[1:] = (sc[1:] != sc[:-1]) | (sf[1:] != sf[:-1])
    rank_sorted = np.cumsum(new, dtype=np.int64) - 1
    rank = np.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank, sc[new], sf[new]


def _concat(sentences: Sequence[EncodedSentence]
            ) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.int64], NDArray[np.int64]]:
    """Concatenate token arrays; instances get batch-global ids; also the per-token range end."""
    cols, feats, insts, his = [], [], [], []
    tok_base = 0
    inst_base = 0
    for s in sentences:
        n = len(s)
        if n == 0:
            continue
        inst = np.asarray(s.instance, np.int64)
        m = int(inst[-1]) + 1
        # End (exclusive) of each instance's span, then the reach of every source token.
        ends = np.searchsorted(inst, np.arange(m, dtype=np.int64), side="right")
        col_reach = ends[np.minimum(inst + (COLUMN_SEGMENTS - 1), m - 1)]
        pos = np.arange(n, dtype=np.int64)
        hi = np.minimum(n, np.maximum(pos + FEATURE_REACH + 1, col_reach))
        cols.append(np.asarray(s.column, np.uint64))
        feats.append(np.asarray(s.feature, np.uint64))
        insts.append(inst + inst_base)
        his.append(hi + tok_base)
        tok_base += n
        inst_base += m
    if not cols:
        e64 = np.empty(0, np.int64)
        return np.empty(0, np.uint64), np.empty(0, np.uint64), e64, e64
    return np.concatenate(cols), np.concatenate(feats), np.concatenate(insts), np.concatenate(his)


def _pair_entries(inst: torch.Tensor, hi: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All (source token, target token, segment, value) entries of the batch, as flat tensors.

    ``inst`` and ``hi`` are int64[T] over the concatenated tokens (global positions), on the device
    the entries are computed on.
    """
    torch = _torch()
    t = inst.shape[0]
    pos = torch.arange(t, dtype=torch.int64, device=inst.device)
    count = hi - pos - 1  # number of targets q in (p, hi(p))
    src = torch.repeat_interleave(pos, count)
    starts = torch.cumsum(count, 0) - count
    step = (torch.arange(src.shape[0], dtype=torch.int64, device=inst.device)
            - torch.repeat_interleave(starts, count))
    d = step + 1
    dst = src + d
    value = PROXIMITY_SCALE / (d + 1).to(torch.float64)
    cd = inst[dst] - inst[src]
    fmask = d <= FEATURE_REACH
    cmask = cd < COLUMN_SEGMENTS
    seg_f = (COLUMN_SEGMENTS + FEATURE_REACH) - d
    seg_c = (COLUMN_SEGMENTS - 1) - cd
    return (
        torch.cat([src[fmask], src[cmask]]),
        torch.cat([dst[fmask], dst[cmask]]),
        torch.cat([seg_f[fmask], seg_c[cmask]]),
        torch.cat([value[fmask], value[cmask]]),
    )


def _pair_entries_numpy(inst: NDArray[np.int64], hi: NDArray[np.int64]
                        ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """The same computation as :func:`_pair_entries`, in numpy (see ``Backend``)."""
    t = inst.shape[0]
    pos = np.arange(t, dtype=np.int64)
    count = hi - pos - 1
    src = np.repeat(pos, count)
    starts = np.cumsum(count) - count
    d = np.arange(src.shape[0], dtype=np.int64) - np.repeat(starts, count) + 1
    dst = src + d
    value = PROXIMITY_SCALE / (d + 1).astype(np.float64)
    cd = inst[dst] - inst[src]
    fmask = d <= FEATURE_REACH
    cmask = cd < COLUMN_SEGMENTS
    return (
        np.concatenate([src[fmask], src[cmask]]),
        np.concatenate([dst[fmask], dst[cmask]]),
        np.concatenate([((COLUMN_SEGMENTS + FEATURE_REACH) - d)[fmask], ((COLUMN_SEGMENTS - 1) - cd)[cmask]]),
        np.concatenate([value[fmask], value[cmask]]),
    )


def _coalesce(inst_np: NDArray[np.int64], hi_np: NDArray[np.int64], rank_np: NDArray[np.int64], m: int,
              backend: Backend, device: Device = "cpu") -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Sorted unique packed keys ``(source rank, segment, target rank)`` and their summed values.

    The packed key's integer order is the canonical order, because ranks follow ascending
    (column, feature); m <= T <= ~2**20 keeps it far below 2**63. On ``device="cuda"`` (torch
    backend only) the pair expansion, the unique and the scatter-add run on the device and only the
    coalesced keys and sums come back (a few bytes per distinct entry): the keys are the same
    integers; a sum may differ from the CPU's in the last bits of float64 (``index_add_`` on CUDA
    adds in an unspecified order), far below the float32 the row stores.
    """
    if backend not in ("numpy", "torch"):
        raise ValueError(f"backend must be 'torch' or 'numpy', got {backend!r}")
    if backend == "numpy":
        src, dst, seg, value = _pair_entries_numpy(inst_np, hi_np)
        key = (rank_np[src] * NUM_SEGMENTS + seg) * m + rank_np[dst]
        uniq, inverse = np.unique(key, return_inverse=True)
        summed: NDArray[np.float64] = np.bincount(inverse.reshape(-1), weights=value,
                                                  minlength=uniq.shape[0]).astype(np.float64, copy=False)
        return uniq.astype(np.int64, copy=False), summed
    torch = _torch()
    with _torch_threads(TRAIN_TORCH_THREADS):
        tsrc, tdst, tseg, tvalue = _pair_entries(torch.from_numpy(inst_np).to(device),
                                                 torch.from_numpy(hi_np).to(device))
        rank = torch.from_numpy(rank_np).to(device)
        tkey = (rank[tsrc] * NUM_SEGMENTS + tseg) * m + rank[tdst]
        tuniq, tinverse = torch.unique(tkey, sorted=True, return_inverse=True)
        tsummed = torch.zeros(tuniq.shape[0], dtype=torch.float64, device=device).index_add_(0, tinverse, tvalue)
        return tuniq.cpu().numpy(), tsummed.cpu().numpy()


def _neuron_entries(sentences: Sequence[EncodedSentence]
                    ) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.int64]]:
    """(column, feature, segment) of every +1 neuron-strength hit (§3.1 step 5), not coalesced."""
    cols, feats, segs = [], [], []
    for s in sentences:
        n = len(s)
        if n == 0:
            continue
        inst = np.asarray(s.instance, np.int64)
        noun_pos = np.asarray(s.noun_position, np.int64)[inst]
        ncol = np.minimum(COLUMN_SEGMENTS, inst + 1)
        nfeat = np.minimum(FEATURE_SEGMENTS, noun_pos + 1)
        grid = np.arange(NUM_SEGMENTS - 1)[None, :]
        hit = (grid < ncol[:, None]) | ((grid >= COLUMN_SEGMENTS) & (grid < COLUMN_SEGMENTS + nfeat[:, None]))
        tok, seg = np.nonzero(hit)
        cols.append(np.asarray(s.column, np.uint64)[tok])
        feats.append(np.asarray(s.feature, np.uint64)[tok])
        segs.append(seg.astype(np.int64))
    if not cols:
        return np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.int64)
    return np.concatenate(cols), np.concatenate(feats), np.concatenate(segs)


def _neuron_batch(sentences: Sequence[EncodedSentence]) -> NeuronBatch:
    col, feat, seg = _neuron_entries(sentences)
    if col.shape[0] == 0:
        return NeuronBatch(col, feat, np.empty(0, np.uint8), np.empty(0, np.float32))
    rank, ucol, ufeat = _rank_pairs(col, feat)
    key = rank * NUM_SEGMENTS + seg
    uniq, counts = np.unique(key, return_counts=True)
    r = uniq // NUM_SEGMENTS
    return NeuronBatch(ucol[r], ufeat[r], (uniq % NUM_SEGMENTS).astype(np.uint8), counts.astype(np.float32))


def train_batch(sentences: Sequence[EncodedSentence], neuron_strengths: bool = False,
                backend: Backend | None = None, device: Device = "cpu") -> TrainOutput:
    """The summed increments of many sentences as one canonical (coalesced) RowBatch.

    Args:
        sentences: encoded sentences (any length; empty ones contribute nothing).
        neuron_strengths: also compute the optional neuron-strength increments (§3.1 step 5).
        backend: ``"torch"`` or ``"numpy"`` for the pair computation (identical results); None:
            ``default_backend()``.
        device: where the torch backend computes (``compute.device`` resolved); ``"cuda"`` implies
            the torch backend (numpy cannot run there).

    Returns:
        A :class:`TrainOutput` whose ``rows`` is canonical (sorted rows, sorted unique entries).
    """
    col, feat, inst_np, hi_np = _concat(sentences)
    tokens = int(col.shape[0])
    neurons = _neuron_batch(sentences) if neuron_strengths else None
    if tokens == 0:
        return TrainOutput(RowBatch.empty(), neurons, len(sentences), 0)
    rank_np, ucol, ufeat = _rank_pairs(col, feat)
    m = int(ucol.shape[0])
    chosen: Backend = "torch" if device == "cuda" else (backend or default_backend())
    u, summed = _coalesce(inst_np, hi_np, rank_np, m, chosen, device)
    tgt = u % m
    rest = u // m
    seg_np = (rest % NUM_SEGMENTS).astype(np.uint8)
    srank = rest // NUM_SEGMENTS
    row_start = np.ones(u.shape[0], dtype=bool)
    row_start[1:] = srank[1:] != srank[:-1]
    starts = np.flatnonzero(row_start)
    rows = RowBatch(
        ucol[srank[starts]], ufeat[srank[starts]],
        np.append(starts, u.shape[0]).astype(np.int64),
        seg_np, ucol[tgt], ufeat[tgt], summed.astype(np.float32),
    )
    return TrainOutput(rows, neurons, len(sentences), tokens)


def train_sentence(sentence: EncodedSentence, neuron_strengths: bool = False,
                   backend: Backend | None = None, device: Device = "cpu") -> TrainOutput:
    """The increments of one sentence (same as ``train_batch([sentence])``)."""
    return train_batch([sentence], neuron_strengths, backend, device)
