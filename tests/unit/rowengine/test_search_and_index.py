"""search.lower_bound against np.searchsorted on packed keys; KeyIndex against a dict."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.rowengine import KeyIndex, lower_bound

KEY = np.dtype([("seg", "u1"), ("tc", ">u8"), ("tf", ">u8")])


def packed(seg, tc, tf):
    k = np.empty(seg.shape[0], KEY)
    k["seg"], k["tc"], k["tf"] = seg, tc, tf
    return k.view("S17")


def sorted_entries(rng, n, small):
    hi = 4 if small else 2**64 - 1
    seg = rng.integers(0, 9, n).astype(np.uint8)
    tc = rng.integers(0, hi, n, dtype=np.uint64, endpoint=True)
    tf = rng.integers(0, hi, n, dtype=np.uint64, endpoint=True)
    keys, first = np.unique(packed(seg, tc, tf), return_index=True)
    return seg[first], tc[first], tf[first], keys


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), q=st.integers(0, 400), small=st.booleans())
def test_lower_bound_matches_searchsorted_in_every_range(seed, n, q, small):
    rng = np.random.default_rng(seed)
    seg, tc, tf, keys = sorted_entries(rng, n, small)
    n = seg.shape[0]
    lo = rng.integers(0, n + 1, q)
    hi = np.minimum(n, lo + rng.integers(0, n + 1, q) // rng.integers(1, 50, q))
    qs = rng.integers(0, 9, q).astype(np.uint8)
    qc = rng.integers(0, 4 if small else 2**64 - 1, q, dtype=np.uint64, endpoint=True)
    qf = rng.integers(0, 4 if small else 2**64 - 1, q, dtype=np.uint64, endpoint=True)
    take = rng.random(q) < 0.5  # half the queries are stored keys
    if n:
        at = rng.integers(0, n, q)
        qs[take], qc[take], qf[take] = seg[at[take]], tc[at[take]], tf[at[take]]
    got = lower_bound(seg, tc, tf, lo, hi, qs, qc, qf)
    qk = packed(qs, qc, qf)
    want = [lo[i] + int(np.searchsorted(keys[lo[i]:hi[i]], qk[i])) for i in range(q)]
    assert got.tolist() == want


def test_keyindex_ids_are_dense_stable_and_exact_as_it_grows():
    rng = np.random.default_rng(5)
    index, ref = KeyIndex(), {}
    for _ in range(30):
        k = int(rng.integers(1, 3000))
        a = rng.integers(0, 50, k, dtype=np.uint64)  # many repeats within and across calls
        b = rng.integers(0, 2**64 - 1, k, dtype=np.uint64, endpoint=True) % np.uint64(rng.integers(1, 400))
        before = len(ref)
        ids, added = index.lookup_or_add(a, b)
        for x, y, i in zip(a.tolist(), b.tolist(), ids.tolist()):
            assert ref.setdefault((x, y), i) == i  # one id per key, kept across calls and growth
        assert len(set(ref.values())) == len(ref) == len(index)
        new = set(ref.values()) - set(range(before))
        assert sorted(new) == list(range(before, len(ref)))  # dense: the next ids
        assert sorted(ids[added].tolist()) == sorted(new)  # one occurrence of each new key marked
    ka, kb = index.keys()
    assert {(x, y): i for i, (x, y) in enumerate(zip(ka.tolist(), kb.tolist()))} == ref
    probe_a = rng.integers(0, 60, 500, dtype=np.uint64)
    probe_b = rng.integers(0, 400, 500, dtype=np.uint64)
    got = index.lookup(probe_a, probe_b).tolist()
    assert got == [ref.get((x, y), -1) for x, y in zip(probe_a.tolist(), probe_b.tolist())]
    assert [index.lookup_one(x, y) for x, y in zip(probe_a.tolist(), probe_b.tolist())] == got


@pytest.mark.parametrize("n", [0, 1, 7, 100_000])
def test_keyindex_repeated_keys_get_one_id(n):
    index = KeyIndex()
    a = np.arange(n, dtype=np.uint64) // np.uint64(2)  # every key twice
    ids, added = index.lookup_or_add(a, np.zeros(n, np.uint64))
    p = n // 2 * 2  # keys at i and i+1 (i even) are the same
    assert (ids[0:p:2] == ids[1:p:2]).all() and sorted(set(ids.tolist())) == list(range((n + 1) // 2))
    assert int(added.sum()) == (n + 1) // 2 and (added[0:p:2] ^ added[1:p:2]).all()
    ids2, added2 = index.lookup_or_add(a, np.zeros(n, np.uint64))
    assert ids2.tolist() == ids.tolist() and not added2.any()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), calls=st.integers(1, 25), narrow=st.booleans())
def test_keyindex_append_new_refuses_a_held_key_and_changes_nothing(seed, calls, narrow):
    """``append_new`` against ``lookup`` + ``append``: new keys get the next ids in input order; a
    batch with one key indexed already (anywhere in it) is refused, every key as it was. Narrow
    key ranges make long runs of held slots, where an indexed key sits past other keys' slots."""
    rng = np.random.default_rng(seed)
    index, ref = KeyIndex(), {}
    top = 64 if narrow else 2**63
    for _ in range(calls):
        k = int(rng.integers(0, 600))
        a = rng.integers(0, top, k, dtype=np.uint64)
        b = rng.integers(0, 3, k, dtype=np.uint64)
        keys = list(dict.fromkeys((x, y) for x, y in zip(a.tolist(), b.tolist()) if (x, y) not in ref))
        held = ref and rng.random() < 0.4
        if held:
            old = list(ref)[int(rng.integers(0, len(ref)))]
            keys.insert(int(rng.integers(0, len(keys) + 1)), old)
        a = np.array([x for x, _ in keys], np.uint64)
        b = np.array([y for _, y in keys], np.uint64)
        got = index.append_new(a, b)
        if held:
            assert got is None
        else:
            assert got is not None and got.tolist() == list(range(len(ref), len(ref) + len(keys)))
            ref.update({key: len(ref) + i for i, key in enumerate(keys)})
        assert len(index) == len(ref)
        assert int((index._slots >= 0).sum()) == len(ref)  # a refused call left no slot taken
        ka, kb = index.keys()
        assert list(zip(ka.tolist(), kb.tolist())) == list(ref)
        probe = list(ref) + keys
        want = [ref.get(key, -1) for key in probe]
        assert index.lookup(np.array([x for x, _ in probe], np.uint64),
                            np.array([y for _, y in probe], np.uint64)).tolist() == want
