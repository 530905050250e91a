"""search.lower_bound against np.searchsorted on packed keys; KeyIndex against a dict."""

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.rowengine import KeyIndex, keyindex, lower_bound
from giaannd.rowengine.run import merge_field
from giaannd.rowengine.search import find
from tests.unit.rowengine.collide import grouped_table

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


def reference(keys, lo, hi, qs, qc, qf):
    """Each query's lower bound in its range, by np.searchsorted on packed keys (one at a time)."""
    qk = packed(qs, qc, qf)
    return np.array([lo[i] + int(np.searchsorted(keys[lo[i]:hi[i]], qk[i])) for i in range(lo.shape[0])], np.int64)


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
    assert got.tolist() == reference(keys, lo, hi, qs, qc, qf).tolist()


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
        assert int((index._slots > 0).sum()) == len(ref)  # a refused call left no slot taken
        ka, kb = index.keys()
        assert list(zip(ka.tolist(), kb.tolist())) == list(ref)
        probe = list(ref) + keys
        want = [ref.get(key, -1) for key in probe]
        assert index.lookup(np.array([x for x, _ in probe], np.uint64),
                            np.array([y for _, y in probe], np.uint64)).tolist() == want


def _assert_runs(seg, tc, tf, lo, hi, qs, qc, qf, want):
    """find: the lower bounds ``want``, and found exactly where the key is there; the same answers
    for the queries in reverse and shuffled order (no gallop then: each is searched on its own)."""
    at = np.minimum(want, max(seg.shape[0] - 1, 0))
    there = (want < hi) & (seg[at] == qs) & (tc[at] == qc) & (tf[at] == qf) if seg.shape[0] else want < 0
    rng = np.random.default_rng(int(want.sum()) % 1000)
    for order in (np.arange(want.shape[0]), np.arange(want.shape[0])[::-1], rng.permutation(want.shape[0])):
        got, found = find(seg, tc, tf, lo[order], hi[order], qs[order], qc[order], qf[order])
        assert got.tolist() == want[order].tolist()
        assert found.tolist() == there[order].tolist()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), rows=st.integers(1, 40), small=st.booleans(),
       dense=st.floats(0.0, 1.0))
def test_find_of_sorted_queries_equals_searchsorted(seed, n, rows, small, dense):
    """Queries grouped by range, ascending in each (rows of a canonical batch, some dense, some
    sparse, stored keys and new ones, empty ranges next to non-empty ones at the same start)."""
    rng = np.random.default_rng(seed)
    seg, tc, tf, keys = sorted_entries(rng, n, small)
    n = seg.shape[0]
    cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n + 1, rows)]))
    lo_all, hi_all = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    qs_all, qc_all, qf_all = [np.empty(0, np.uint8)], [np.empty(0, np.uint64)], [np.empty(0, np.uint64)]
    for a, z in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        if rng.random() < 0.2:  # an empty range starting where this one does
            lo_all.append(np.array([a])), hi_all.append(np.array([a]))
            qs_all.append(np.array([1], np.uint8)), qc_all.append(np.array([2], np.uint64))
            qf_all.append(np.array([3], np.uint64))
        stored = np.flatnonzero(rng.random(z - a) < dense) + a
        k = int(rng.integers(0, 8))
        fresh_s = rng.integers(0, 9, k).astype(np.uint8)
        fresh_c = rng.integers(0, 4 if small else 2**64 - 1, k, dtype=np.uint64, endpoint=True)
        fresh_f = rng.integers(0, 4 if small else 2**64 - 1, k, dtype=np.uint64, endpoint=True)
        qs = np.concatenate([seg[stored], fresh_s])
        qc = np.concatenate([tc[stored], fresh_c])
        qf = np.concatenate([tf[stored], fresh_f])
        _, first = np.unique(packed(qs, qc, qf), return_index=True)  # ascending, unique
        m = first.shape[0]
        lo_all.append(np.full(m, a)), hi_all.append(np.full(m, z))
        qs_all.append(qs[first]), qc_all.append(qc[first]), qf_all.append(qf[first])
    lo, hi = np.concatenate(lo_all).astype(np.int64), np.concatenate(hi_all).astype(np.int64)
    qs, qc, qf = np.concatenate(qs_all), np.concatenate(qc_all), np.concatenate(qf_all)
    _assert_runs(seg, tc, tf, lo, hi, qs, qc, qf, reference(keys, lo, hi, qs, qc, qf))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 2000), runs=st.integers(1, 30), small=st.booleans())
def test_find_of_runs_over_one_range(seed, n, runs, small):
    """Runs over the same range next to each other (a row in consecutive batches of a group
    replay): each run is sorted, their concatenation is not; labels, not ranges, separate them."""
    rng = np.random.default_rng(seed)
    seg, tc, tf, keys = sorted_entries(rng, n, small)
    n = seg.shape[0]
    parts = []
    for _ in range(runs):
        a = int(rng.integers(0, n))
        z = int(rng.integers(a, n + 1))
        take = np.flatnonzero(rng.random(z - a) < rng.random()) + a
        for _ in range(int(rng.integers(1, 3))):  # the same range again, at once
            mode = rng.integers(0, 3)
            if mode == 0:  # every key of the range (the guesses hold)
                parts.append((a, z, np.arange(a, z)))
            elif mode == 1:  # a dense stretch inside it, maybe with a gap
                b = int(rng.integers(a, z + 1))
                stretch = np.arange(b, int(rng.integers(b, z + 1)))
                if stretch.shape[0] > 2 and rng.random() < 0.5:
                    stretch = np.delete(stretch, int(rng.integers(0, stretch.shape[0])))
                parts.append((a, z, stretch))
            else:
                parts.append((a, z, np.sort(rng.choice(take, min(take.shape[0], int(rng.integers(0, 40))),
                                                        replace=False)) if take.shape[0] else take))
    lo = np.concatenate([np.full(p[2].shape[0], p[0]) for p in parts]).astype(np.int64)
    hi = np.concatenate([np.full(p[2].shape[0], p[1]) for p in parts]).astype(np.int64)
    at = np.concatenate([p[2] for p in parts]).astype(np.int64)
    qs, qc, qf = seg[at], tc[at], tf[at]
    qf = qf + (rng.random(at.shape[0]) < 0.2).astype(np.uint64)  # some keys not stored (tf + 1)
    _assert_runs(seg, tc, tf, lo, hi, qs, qc, qf, reference(keys, lo, hi, qs, qc, qf))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), calls=st.integers(1, 30), collide=st.sampled_from([None, "home", "tag"]),
       max_load=st.sampled_from([0.5, 0.25, 0.1]), prefetch=st.booleans())
def test_keyindex_any_call_sequence_gives_a_dicts_ids_in_first_appearance_order(seed, calls, collide, max_load,
                                                                               prefetch):
    """Every call against a plain dict: new keys get the next ids in the order they first occur in a
    call's input (``lookup_or_add``, ``ids_of``, ``append``, ``append_new``), ``added`` marks each new
    key's first occurrence, lookups see every key, whatever the growth and (``collide``) with keys
    of a column group sharing one home slot (long probe walks, a full table's wrap-around; "tag": and
    one slot tag, so every held slot passed is a whole-key compare), with the
    kernels' prefetching on (``prefetch``: in every table, not only large ones) or off."""
    with mock.patch.object(keyindex, "_PREFETCH_BYTES", 0 if prefetch else 1 << 62):
        _any_call_sequence(seed, calls, collide, max_load)


def _any_call_sequence(seed, calls, collide, max_load):
    rng = np.random.default_rng(seed)
    table = grouped_table(45, 200, same_tag=collide == "tag") if collide else None

    def keys(k, cols=40, feats=200):
        a = rng.integers(0, cols, k, dtype=np.uint64)
        b = rng.integers(0, feats, k, dtype=np.uint64)
        if collide:
            b = table[a.astype(np.int64), b.astype(np.int64)]
        if rng.random() < 0.5:  # read-only inputs (rows decoded from a log) are taken as they are
            a.flags.writeable = b.flags.writeable = False
        return a, b

    index, ref = KeyIndex(max_load=max_load), {}
    for _ in range(calls):
        op = rng.choice(["lookup_or_add", "ids_of", "append", "append_new"])
        a, b = keys(int(rng.integers(0, 700)))
        pairs = list(zip(a.tolist(), b.tolist()))
        if op in ("append", "append_new"):
            new = list(dict.fromkeys(p for p in pairs if p not in ref))
            if op == "append_new" and ref and rng.random() < 0.3:
                new.insert(int(rng.integers(0, len(new) + 1)), list(ref)[int(rng.integers(0, len(ref)))])
                assert index.append_new(np.array([x for x, _ in new], np.uint64),
                                        np.array([y for _, y in new], np.uint64)) is None
                assert int((index._slots > 0).sum()) == len(ref)
                continue
            fn = index.append if op == "append" else index.append_new
            got = fn(np.array([x for x, _ in new], np.uint64), np.array([y for _, y in new], np.uint64))
            want = list(range(len(ref), len(ref) + len(new)))
            ref.update({p: len(ref) + i for i, p in enumerate(new)})
            assert got is not None and got.tolist() == want
        else:
            before = dict(ref)
            first_new = [i for i, p in enumerate(pairs) if p not in before and pairs.index(p) == i]
            for p in pairs:
                ref.setdefault(p, len(ref))
            if op == "ids_of":
                ids = index.ids_of(a, b)
            else:
                ids, added = index.lookup_or_add(a, b)
                assert added.nonzero()[0].tolist() == first_new
            assert ids.tolist() == [ref[p] for p in pairs]
        assert len(index) == len(ref) and int((index._slots > 0).sum()) == len(ref)
        assert int((index._slots > 0).sum()) <= max_load * index._slots.shape[0]
    ka, kb = index.keys()
    assert list(zip(ka.tolist(), kb.tolist())) == list(ref)
    pa, pb = keys(400, 45, 200)
    want = [ref.get(p, -1) for p in zip(pa.tolist(), pb.tolist())]
    assert index.lookup(pa, pb).tolist() == want
    assert [index.lookup_one(x, y) for x, y in zip(pa.tolist(), pb.tolist())] == want


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 200_000), m=st.integers(0, 300), small=st.booleans(),
       spread=st.integers(0, 4))
def test_find_gallops_over_long_ranges(seed, n, m, small, spread):
    """Sorted queries into one long range, as a Zipf head row gets them: sparse ones (long gallops,
    across the range and past its end), dense stretches (steps of 1), repeats of one key, keys
    before the first and after the last; the range is a window of the arrays (keys outside it are
    never answers) and a second copy of the same range follows, starting over from small keys."""
    rng = np.random.default_rng(seed)
    seg, tc, tf, keys = sorted_entries(rng, n, small)
    n = seg.shape[0]
    a = int(rng.integers(0, n // 3 + 1))
    z = int(rng.integers(a, n + 1))
    if spread == 0:  # a dense stretch
        b = int(rng.integers(a, z + 1))
        at = np.arange(b, min(z, b + m))
    else:  # sparse: m positions anywhere in the arrays, some outside the range
        at = np.sort(rng.integers(0, max(n, 1), m)) if n else np.empty(0, np.int64)
    qs, qc, qf = (seg[at], tc[at], tf[at]) if n else (np.empty(0, np.uint8), np.empty(0, np.uint64),
                                                        np.empty(0, np.uint64))
    bump = (rng.random(at.shape[0]) < 0.3).astype(np.uint64)  # some keys just after a stored one
    qf = qf + bump
    edge_s = np.array([0, 255, 255], np.uint8)  # the smallest key, the largest, the largest again
    edge_c = np.array([0, 2**64 - 1, 2**64 - 1], np.uint64)
    edge_f = np.array([0, 2**64 - 1, 2**64 - 1], np.uint64)
    qs, qc, qf = np.concatenate([edge_s[:1], qs, qs, edge_s[1:]]), np.concatenate([edge_c[:1], qc, qc, edge_c[1:]]), \
        np.concatenate([edge_f[:1], qf, qf, edge_f[1:]])
    qk = packed(qs, qc, qf)
    order = np.argsort(qk, kind="stable")  # ascending, with repeats next to each other
    qs, qc, qf = qs[order], qc[order], qf[order]
    k = qs.shape[0]
    qs, qc, qf = np.concatenate([qs, qs]), np.concatenate([qc, qc]), np.concatenate([qf, qf])
    lo, hi = np.full(2 * k, a, np.int64), np.full(2 * k, z, np.int64)
    _assert_runs(seg, tc, tf, lo, hi, qs, qc, qf, reference(keys, lo, hi, qs, qc, qf))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 2000), k=st.integers(0, 500),
       dtype=st.sampled_from([np.uint8, np.uint64, np.int64, np.float32]),
       where=st.sampled_from(["any", "start", "end"]))
def test_merge_field_inserts_before_the_position(seed, n, k, dtype, where):
    """run.merge_field against the definition: inserted entry j at ``pos[j] + j``, the old entries in
    the other slots in order (positions repeat, sit at 0 and at the end)."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 200, n).astype(dtype)
    new = rng.integers(0, 200, k).astype(dtype)
    pos = {"any": np.sort(rng.integers(0, n + 1, k)), "start": np.zeros(k, np.int64),
           "end": np.full(k, n, np.int64)}[where].astype(np.int64)
    want = np.empty(n + k, dtype)
    dst = pos + np.arange(k)
    slot = np.ones(n + k, bool)
    slot[dst] = False
    want[slot], want[dst] = old, new
    got = merge_field(old, new, pos)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    if k >= 2 and pos[0] < pos[-1]:  # out of order: refused, not merged wrong
        with pytest.raises(ValueError):
            merge_field(old, new, pos[::-1].copy())
    if k:
        with pytest.raises(ValueError):
            merge_field(old, new, np.full(k, n + 1, np.int64))
    with pytest.raises(ValueError):  # an output of the wrong size is refused (the kernel has no bounds checks)
        merge_field(old, new, pos, out=np.empty(n + k + 1, dtype))
    with pytest.raises(ValueError):
        merge_field(old, new.astype(np.float64), pos)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), repeats=st.integers(0, 2),
       narrow=st.booleans(), same_tag=st.booleans())
def test_keyindex_from_keys_refuses_a_repeated_key(seed, n, repeats, narrow, same_tag):
    """``from_keys`` against a set and a dict: unique keys get ids 0..n-1 in order (every lookup finds
    its id), and keys added later the next ids; a key given twice, anywhere, is refused. Narrow
    keys share home slots (long probe walks), and with ``same_tag`` share the slot tag too (every
    passed slot compared)."""
    rng = np.random.default_rng(seed)
    cols, feats = (40, 40) if narrow else (1 << 19, 1 << 19)
    flat = rng.choice(cols * feats, size=min(n, cols * feats), replace=False)
    a, f = (flat // feats).astype(np.int64), (flat % feats).astype(np.int64)
    if narrow:
        b = grouped_table(cols, feats, same_tag=same_tag)[a, f]
    else:
        b = f.astype(np.uint64)
    a = a.astype(np.uint64)
    for _ in range(repeats if a.shape[0] else 0):  # a key put again at a random place
        i, at = int(rng.integers(0, a.shape[0])), int(rng.integers(0, a.shape[0] + 1))
        a, b = np.insert(a, at, a[i]), np.insert(b, at, b[i])
    unique = len(set(zip(a.tolist(), b.tolist()))) == a.shape[0]
    if not unique:
        with pytest.raises(ValueError, match="row keys repeat"):
            KeyIndex.from_keys(a, b)
        return
    a0, b0 = a.copy(), b.copy()
    index = KeyIndex.from_keys(a, b)
    assert len(index) == a.shape[0]
    assert index.lookup(a, b).tolist() == list(range(a.shape[0]))
    # keys added later (held ones among them) get the next ids; the arrays given are never written
    more_a = np.concatenate([a[: n // 3], rng.integers(1 << 20, 1 << 21, n + 700, dtype=np.uint64)])
    more_b = np.concatenate([b[: n // 3], rng.integers(0, 8, n + 700, dtype=np.uint64)])
    ids = {k: i for i, k in enumerate(zip(a.tolist(), b.tolist()))}
    for k in zip(more_a.tolist(), more_b.tolist()):
        ids.setdefault(k, len(ids))
    got, _ = index.lookup_or_add(more_a, more_b)
    assert got.tolist() == [ids[k] for k in zip(more_a.tolist(), more_b.tolist())]
    assert np.array_equal(a, a0) and np.array_equal(b, b0)
    assert index.lookup(a0, b0).tolist() == list(range(a0.shape[0]))


def _run_of(keys):
    """A delta run of sorted, unique (row, seg, tc, tf) tuples (strengths 0, no base positions)."""
    from giaannd.rowengine.run import Run

    arr = np.array(keys, dtype=np.int64).reshape(-1, 4)
    n = arr.shape[0]
    return Run.from_sorted(arr[:, 0].copy(), arr[:, 1].astype(np.uint8), arr[:, 2].astype(np.uint64),
                           arr[:, 3].astype(np.uint64), np.zeros(n, np.float32), np.zeros(n, np.int64))


@pytest.mark.parametrize("seed", range(40))
def test_insertion_points_count_the_older_entries_before_each_newer_one(seed):
    """``run.insertion_points`` (merge_deltas' positions) against a count over sorted tuples: rows
    in one run only, long rows with a few keys of the other, keys before, between and after."""
    from giaannd.rowengine.run import insertion_points

    rng = np.random.default_rng(seed)
    keys = set()
    for row in rng.choice(60, size=int(rng.integers(1, 40)), replace=False).tolist():
        size = int(rng.choice([1, 3, 20, 2000]))
        for _ in range(size):
            keys.add((row, int(rng.integers(0, 3)), int(rng.integers(0, 50)), int(rng.integers(0, 5))))
    keys = sorted(keys)
    share = rng.random()
    in_newer = rng.random(len(keys)) < share
    older = [k for k, x in zip(keys, in_newer) if not x]
    newer = [k for k, x in zip(keys, in_newer) if x]
    got = insertion_points(_run_of(older), _run_of(newer))
    want = np.searchsorted(np.array([k[0] * 10**9 + k[1] * 10**6 + k[2] * 10 + k[3] for k in older], np.int64),
                           np.array([k[0] * 10**9 + k[1] * 10**6 + k[2] * 10 + k[3] for k in newer], np.int64))
    assert np.array_equal(got, want)
