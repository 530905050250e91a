"""A deliberately plain GIAANN: training per token pair and LIF per step, with dicts and loops.

Written from giaann-algorithm.md §3.1 and §4.3 line by line, for reading against the spec, not for
speed. The fast core (giaannd.model.train / infer) must agree with it entry for entry and token for
token (tests/oracle/test_equivalence.py). It shares no code with the fast core beyond the data types.
"""

from __future__ import annotations

import math
from typing import Any

from giaannd.model.sentence import EncodedSentence

NUM_SEGMENTS = 9
SCOL = 4
SFEAT = 4
LF = SFEAT + 1  # LIF: the soma takes distance-1 synapses
SOMA = 8


def plain_train(sentence: EncodedSentence, out: dict[Any, float] | None = None) -> dict[Any, float]:
    """{(src col, src feat, segment, tgt col, tgt feat): strength} for one sentence (added into out)."""
    out = {} if out is None else out
    n = len(sentence)
    for p in range(n):
        for q in range(p + 1, n):
            d = q - p
            cd = int(sentence.instance[q]) - int(sentence.instance[p])
            value = 10.0 / (d + 1)
            src = (int(sentence.column[p]), int(sentence.feature[p]))
            tgt = (int(sentence.column[q]), int(sentence.feature[q]))
            if d <= LF:
                key = (src[0], src[1], SCOL + LF - d, tgt[0], tgt[1])
                out[key] = out.get(key, 0.0) + value
            if cd < SCOL:
                key = (src[0], src[1], SCOL - 1 - cd, tgt[0], tgt[1])
                out[key] = out.get(key, 0.0) + value
    return out


def plain_neurons(sentence: EncodedSentence, out: dict[Any, float] | None = None) -> dict[Any, float]:
    """{(col, feat, segment): strength} neuron increments of §3.1 step 5."""
    out = {} if out is None else out
    for t in range(len(sentence)):
        i = int(sentence.instance[t])
        noun_pos = int(sentence.noun_position[i])
        segs = list(range(0, min(SCOL, i + 1))) + list(range(SCOL, SCOL + min(SFEAT, noun_pos + 1)))
        for s in segs:
            key = (int(sentence.column[t]), int(sentence.feature[t]), s)
            out[key] = out.get(key, 0.0) + 1.0
    return out


def rows_of(entries: dict[Any, float]) -> dict[Any, list[Any]]:
    """{(src col, src feat): [(segment, tgt col, tgt feat, strength), ...] sorted}."""
    rows: dict[Any, list[Any]] = {}
    for (sc, sf, s, tc, tf), v in entries.items():
        rows.setdefault((sc, sf), []).append((s, tc, tf, v))
    for r in rows.values():
        r.sort()
    return rows


def g(x: float) -> float:
    return 2.0 / (1.0 + math.exp(-x / 100.0)) - 1.0


def plain_lif(targets: Any, rows: Any, is_det: Any, is_prob: Any, constants: Any, *, seed: int = 8,
              teacher: bool = True, length: int | None = None) -> dict[int, Any]:
    """Run §4.3 step by step. Returns {k: predicted (col, feat) or None} for k >= seed.

    ``constants`` = (theta, boolean, soma_decay, column_decay, clear_seg3).
    """
    theta, boolean, soma_x, col_x, clear3 = constants
    length = len(targets) if length is None else length
    seed = max(1, min(seed, len(targets)))
    A: dict[Any, list[float]] = {}  # (col, feat) -> [9 floats]

    def vec(key: Any) -> list[float]:
        if key not in A:
            A[key] = [0.0] * NUM_SEGMENTS
        return A[key]

    preds: dict[int, Any] = {}
    current = targets[0]
    vec(current)[SOMA] += 1.0
    vec(current)[SOMA] *= 1.0 - soma_x
    vec(current)[SOMA] += 1.0
    for k in range(1, length):
        c, f = current
        if f == 0:
            mode = "internal"
        elif is_det(f):
            mode = "delimiter"
        elif is_prob(f):
            mode = "none"
        else:
            mode = "internal"
        row = rows.get(current, [])
        # propagate
        for v in A.values():
            v[8] += v[7]
            v[7] = v[6]
            v[6] = v[5]
            v[5] = v[4]
            v[4] = 0.0
        # fire
        eligible = []
        me = vec(current)
        if me[SOMA] + me[3] >= theta:
            for s, tc, tf, strength in row:
                value = (1.0 if strength > 0 else 0.0) if boolean else float(strength)
                vec((tc, tf))[s] += g(value)
                if s == SOMA:
                    eligible.append((tc, tf))
        # deactivate
        me[SOMA] = 0.0
        if clear3:
            me[3] = 0.0
        # select
        if k < seed:
            nxt = targets[k]
        else:
            best = None
            best_value = -math.inf
            for key in eligible:
                value = A[key][SOMA] + A[key][3]
                if value < theta:
                    continue
                if best is None or value > best_value or (value == best_value and key < best):
                    best, best_value = key, value
            if best is not None and mode == "internal" and best[0] != c:
                best = None
            preds[k] = best
            nxt = targets[k] if teacher else best
        if nxt is None:
            break
        # column transition
        if nxt[0] != c:
            for v in A.values():
                v[3] = v[3] * (1.0 - col_x) + v[2]
                v[2] = v[1]
                v[1] = v[0]
                v[0] = 0.0
        for v in A.values():
            v[SOMA] *= 1.0 - soma_x
        vec(nxt)[SOMA] += 1.0
        current = nxt
    return preds
