"""Keys that collide in ``KeyIndex``'s slot hash on purpose (long probe walks in tests).

``KeyIndex`` hashes (a, b) with ``slot_hash`` and takes the top bits as the home slot. The mix is
invertible in b for a given a, so a test can choose the hash of each key: ``b_for_hash(a, h)`` is
the b with ``slot_hash(a, b) == h``. Giving many keys hashes that share their top bits puts them on
one home slot in every table up to ``2**24`` slots."""

from __future__ import annotations

import numpy as np

from giaannd.rowengine.keyindex import _MASK64, _MIX_A_INT, _MIX_B_INT, slot_hash

_INV_A = pow(_MIX_A_INT, -1, 1 << 64)
_INV_B = pow(_MIX_B_INT, -1, 1 << 64)


def b_for_hash(a: int, h: int) -> int:
    """The b with ``slot_hash(a, b) == h``."""
    h2 = (h * _INV_A) & _MASK64
    h1 = h2 ^ (h2 >> 29) ^ (h2 >> 58)
    b = ((h1 ^ ((a * _MIX_A_INT) & _MASK64)) * _INV_B) & _MASK64
    assert slot_hash(a, b) == h
    return b


def on_home(a: int, group: int, unique: int) -> int:
    """A b for key (a, b) whose hash has ``group`` (< 8) as its top 3 bits and zeros down to bit 40:
    keys of one group share one home slot in every table up to ``2**24`` slots. Distinct ``unique``
    values (< 2**40) give distinct b for one a."""
    assert 0 <= group < 8 and 0 <= unique < 1 << 40
    return b_for_hash(a, (group << 61) | unique)


def grouped(a: int, b: int, groups: int = 7) -> int:
    """A new b for key (a, b) of small ints (< 2**20), distinct for distinct (a, b), such that every
    key with the same ``a % groups`` (≤ 8 groups) shares one home slot."""
    assert groups <= 8 and a < 1 << 20 and b < 1 << 20
    return on_home(a, a % groups, (a << 20) | b)


def grouped_table(cols: int, feats: int, groups: int = 7, same_tag: bool = False) -> np.ndarray:
    """``table[a, b] = grouped(a, b)`` for small a, b (a test maps its drawn keys through it).
    ``same_tag``: besides, every key's hash has the same low 23 bits (KeyIndex's slot tag), so a
    walk compares the whole key at every held slot it passes."""
    if same_tag:
        assert cols * feats < 1 << 17
        return np.array([[on_home(a, a % groups, (a * feats + b) << 23) for b in range(feats)]
                         for a in range(cols)], np.uint64)
    return np.array([[grouped(a, b, groups) for b in range(feats)] for a in range(cols)], np.uint64)
