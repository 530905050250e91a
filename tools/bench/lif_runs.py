"""A LIF first fire's slot map by sorted runs instead of the hash walk (issue 14 item 6): measured, dropped.

    python -m tools.bench.lif_runs [--sizes 10000,100000,1000000] [--repeat 3] [--rounds 2] [--json]

A canonical row is nine runs of targets sorted by (column, feature) (giaannd/rowengine/canon.py).
The design this measures (docs/model.md, "The LIF step", "What is left"): the session's neuron index
made of sorted key runs (an LSM), a row mapped by merge-joins instead of one random hash walk per
target. On a session's first fire of a long row almost every target is new, so what the design must
do there at the least is *deduplicate the row's nine runs*: merge them into one sorted run of unique
keys and give every entry the id of its key (ids in key order, so a run's ids ascend and the scatter
into the state stays sequential). That merge is a lower bound of the design's first fire: it does
not yet look into the session's older runs, and the design gives up the hash table that short rows
(461 entries a step in real sessions) and one-key lookups are served by.

Timed alternately in each round, best of ``--repeat``, ns per row entry, on the rows of
tools/bench/lif.py (Zipf targets, 0.88-0.95 neurons per entry):

- ``ids_of``: today's slot map, ``KeyIndex.ids_of`` on a fresh session index (load 1/4): the baseline;
- ``merge, tournament``: a 9-way merge with a tournament tree over the runs' heads, deduplicating;
- ``merge, pairwise``: 2-way merges in a tree (9 -> 5 -> 3 -> 2 -> 1), the loop written for
  selects instead of branches, then one deduplicating pass;
- ``merge + append``: the tournament merge, then its unique keys appended to a fresh ``KeyIndex``
  (what keeping today's hash index beside the merge would cost);
- ``walk, ordered home``: the hash walk with the home slot from the top bits of ``mix(column) +
  feature`` (feature ids are uniform hashes), so the features of one column, sorted in a run, have
  ascending home slots: locality from the runs' order while keeping the table;
- ``walk, mixed home``: the same bare kernel with ``KeyIndex``'s hash (what the ordered home is
  compared with: same code, only the home slot differs).

Target: a figure is worth building on only if it beats ``ids_of`` measured in the same round
(``ids_of / figure > 1``); the step's target is ≤ 10 ns per entry (tools/bench/lif.py).
Times are CPU time (``time.process_time``); the machine load is printed.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import NUM_SEGMENTS
from giaannd.rowengine import KeyIndex
from giaannd.rowengine.jit import kernel, readonly
from giaannd.rowengine.keyindex import slot_hash
from tools.bench.lif import synthetic_row
from tools.bench.report import emit_figure, print_table

_MIX_A = np.uint64(0x9E3779B97F4A7C15)
_ID_BITS = 40
_ID_MASK = np.int64((1 << _ID_BITS) - 1)
_TAG_MASK = np.uint64((1 << 23) - 1)
#: Entries per bucket of the partitioned walk (its sub-tables ~2 KiB: in the L1 cache while walked).
_PER_BUCKET = 64
_LEAVES = 16  # tournament leaves (a power of two ≥ the 9 runs)
_U64_MAX = np.uint64(0xFFFFFFFFFFFFFFFF)
_SEGMENT_EDGES = np.arange(NUM_SEGMENTS + 1, dtype=np.uint8)
_U = NDArray[np.uint64]
_I = NDArray[np.int64]


@kernel(f"int64({readonly('int64')}, {readonly('uint64')}, {readonly('uint64')}, int64[::1], uint64[::1], "
        "uint64[::1])")
def _tournament(edges: _I, a: _U, b: _U, out: _I, ua: _U, ub: _U) -> int:
    """Merge the sorted runs ``[edges[s], edges[s+1])`` of keys (a, b): ``ua``, ``ub`` get the unique
    keys in order, ``out[i]`` the position of entry i's key there; returns how many keys."""
    runs = edges.shape[0] - 1
    pos = np.zeros(_LEAVES, np.int64)
    end = np.zeros(_LEAVES, np.int64)
    ha = np.empty(_LEAVES, np.uint64)
    hb = np.empty(_LEAVES, np.uint64)
    for s in range(_LEAVES):
        if s < runs:
            pos[s] = edges[s]
            end[s] = edges[s + 1]
        ha[s] = a[pos[s]] if pos[s] < end[s] else _U64_MAX
        hb[s] = b[pos[s]] if pos[s] < end[s] else _U64_MAX
    tree = np.empty(2 * _LEAVES, np.int64)
    for s in range(_LEAVES):
        tree[_LEAVES + s] = s
    for i in range(_LEAVES - 1, 0, -1):
        lo, hi = tree[2 * i], tree[2 * i + 1]
        tree[i] = lo if ha[lo] < ha[hi] or (ha[lo] == ha[hi] and hb[lo] <= hb[hi]) else hi
    u = 0
    for _ in range(a.shape[0]):
        w = tree[1]
        p = pos[w]
        x, y = ha[w], hb[w]
        if u == 0 or x != ua[u - 1] or y != ub[u - 1]:
            ua[u] = x
            ub[u] = y
            u += 1
        out[p] = u - 1
        p += 1
        pos[w] = p
        ha[w] = a[p] if p < end[w] else _U64_MAX
        hb[w] = b[p] if p < end[w] else _U64_MAX
        i = (_LEAVES + w) >> 1
        while i >= 1:
            lo, hi = tree[2 * i], tree[2 * i + 1]
            tree[i] = lo if ha[lo] < ha[hi] or (ha[lo] == ha[hi] and hb[lo] <= hb[hi]) else hi
            i >>= 1
    return u


@kernel("int64(uint64[::1], uint64[::1], int64[::1], int64, int64, int64, uint64[::1], uint64[::1], int64[::1], "
        "int64)")
def _merge2(xa: _U, xb: _U, xi: _I, lo: int, mid: int, hi: int, ya: _U, yb: _U, yi: _I, k: int) -> int:
    """Merge ``[lo, mid)`` and ``[mid, hi)`` of (xa, xb, xi) into (ya, yb, yi) from ``k``; the
    choice is a select (an index computed from a comparison), not a branch."""
    i, j = lo, mid
    while i < mid and j < hi:
        take = (xa[j] < xa[i]) | ((xa[j] == xa[i]) & (xb[j] < xb[i]))
        t = np.int64(take)
        p = i + t * (j - i)
        ya[k] = xa[p]
        yb[k] = xb[p]
        yi[k] = xi[p]
        j += t
        i += 1 - t
        k += 1
    for p in range(i, mid):
        ya[k], yb[k], yi[k] = xa[p], xb[p], xi[p]
        k += 1
    for p in range(j, hi):
        ya[k], yb[k], yi[k] = xa[p], xb[p], xi[p]
        k += 1
    return k


@kernel(f"int64({readonly('int64')}, {readonly('uint64')}, {readonly('uint64')}, int64[::1], uint64[::1], "
        "uint64[::1], uint64[::1], uint64[::1], int64[::1], uint64[::1], uint64[::1], int64[::1])")
def _pairwise(edges: _I, a: _U, b: _U, out: _I, ua: _U, ub: _U, xa: _U, xb: _U, xi: _I, ya: _U, yb: _U,
              yi: _I) -> int:
    """``_tournament``'s result by a tree of 2-way merges, then one deduplicating pass; x*, y*: scratch
    of the row's length (made by numpy, which asks for huge pages as the kernels' own arrays do not)."""
    m = a.shape[0]
    xa[:], xb[:] = a, b
    xi[:] = np.arange(m)
    bounds = edges.copy()
    while bounds.shape[0] > 2:
        runs = bounds.shape[0] - 1
        merged = np.empty((runs + 1) // 2 + 1, np.int64)
        merged[0] = 0
        k = r = 0
        for s in range(0, runs, 2):
            mid = bounds[s + 1]
            k = _merge2(xa, xb, xi, bounds[s], mid, bounds[s + 2] if s + 1 < runs else mid, ya, yb, yi, k)
            r += 1
            merged[r] = k
        bounds = merged[: r + 1]
        xa, ya, xb, yb, xi, yi = ya, xa, yb, xb, yi, xi
    u = 0
    for p in range(m):
        if u == 0 or xa[p] != ua[u - 1] or xb[p] != ub[u - 1]:
            ua[u] = xa[p]
            ub[u] = xb[p]
            u += 1
        out[xi[p]] = u - 1
    return u


@kernel(f"int64(int64[::1], uint64[::1], uint64[::1], int64, {readonly('uint64')}, {readonly('uint64')}, boolean, "
        "int64[::1])")
def _walk(slots: _I, ka: _U, kb: _U, bits: int, a: _U, b: _U, ordered: bool, out: _I) -> int:
    """The hash walk of ``KeyIndex._find_or_add`` (found or inserted, tags, linear probing, no
    prefetching) into a table sized for every key; the home slot from ``KeyIndex``'s hash, or
    (``ordered``) from ``mix(a) + b``. Returns how many keys."""
    mask = (np.int64(1) << bits) - 1
    shift = np.uint64(64 - bits)
    n = 0
    for i in range(a.shape[0]):
        x, y = a[i], b[i]
        if ordered:
            h = x * _MIX_A
            h ^= h >> np.uint64(29)
            h = h * _MIX_A + y
        else:
            h = (x * _MIX_A) ^ (y * np.uint64(0xC2B2AE3D27D4EB4F))
            h ^= h >> np.uint64(29)
            h *= _MIX_A
        s = np.int64(h >> shift)
        tag = np.int64(h & _TAG_MASK) << _ID_BITS
        while True:
            v = slots[s]
            if v == 0:
                slots[s] = tag | (n + 1)
                ka[n] = x
                kb[n] = y
                out[i] = n
                n += 1
                break
            if (v & ~_ID_MASK) == tag:
                sid = (v & _ID_MASK) - 1
                if ka[sid] == x and kb[sid] == y:
                    out[i] = sid
                    break
            s = (s + 1) & mask
    return n


@kernel(f"int64({readonly('int64')}, {readonly('uint64')}, {readonly('uint64')}, int64, int64[::1], int64[::1], "
        "uint64[::1], uint64[::1])")
def _partitioned(edges: _I, a: _U, b: _U, bucket_bits: int, slots: _I, out: _I, ka: _U, kb: _U) -> int:
    """The hash walk into a table partitioned on the column id's top ``bucket_bits`` bits: one
    sub-table per bucket, sized for its entries (load ≤ 1/4, so the Zipf head's bucket gets a large
    one), and the nine runs walked in lockstep bucket by bucket (each run is sorted by column id),
    so each walk stays in one small sub-table while it is hot. New ids in that order (each run's
    ids still ascend). ``slots``: zeros, at least ``_partition_slots(m)``. Returns how many keys."""
    m = a.shape[0]
    runs = edges.shape[0] - 1
    buckets = np.int64(1) << bucket_bits
    top = np.uint64(64 - bucket_bits)
    count = np.zeros(buckets, np.int64)
    for i in range(m):
        count[np.int64(a[i] >> top) if bucket_bits else 0] += 1
    offset = np.empty(buckets, np.int64)
    sub_bits = np.empty(buckets, np.int64)
    total = 0
    for j in range(buckets):
        bits = 3
        while (np.int64(1) << bits) < 4 * count[j]:
            bits += 1
        offset[j] = total
        sub_bits[j] = bits
        total += np.int64(1) << bits
    pos = edges[:runs].copy()
    n = 0
    for j in range(buckets):
        base = offset[j]
        mask = (np.int64(1) << sub_bits[j]) - 1
        shift = np.uint64(64 - sub_bits[j])
        for r in range(runs):
            p = pos[r]
            end = edges[r + 1]
            while p < end and (not bucket_bits or np.int64(a[p] >> top) == j):
                x, y = a[p], b[p]
                h = (x * _MIX_A) ^ (y * np.uint64(0xC2B2AE3D27D4EB4F))
                h ^= h >> np.uint64(29)
                h *= _MIX_A
                s = np.int64(h >> shift)
                tag = np.int64(h & _TAG_MASK) << _ID_BITS
                while True:
                    v = slots[base + s]
                    if v == 0:
                        slots[base + s] = tag | (n + 1)
                        ka[n] = x
                        kb[n] = y
                        out[p] = n
                        n += 1
                        break
                    if (v & ~_ID_MASK) == tag:
                        sid = (v & _ID_MASK) - 1
                        if ka[sid] == x and kb[sid] == y:
                            out[p] = sid
                            break
                    s = (s + 1) & mask
                p += 1
            pos[r] = p
    return n


def _check_walk_hash() -> None:
    """The bare walk's mixed home is ``KeyIndex``'s (``slot_hash``): the comparison is of the home only."""
    a, b = np.array([3, 5], np.uint64), np.array([7, 11], np.uint64)
    slots, out = np.zeros(1 << 20, np.int64), np.empty(2, np.int64)
    ka, kb = np.empty(2, np.uint64), np.empty(2, np.uint64)
    _walk(slots, ka, kb, 20, a, b, False, out)
    for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        assert slots[slot_hash(x, y) >> 44] & _ID_MASK == out[i] + 1


def _timed(name: str, edges: _I, a: _U, b: _U) -> Callable[[], object]:
    """A fresh run of ``name`` (module docstring): its outputs and tables are made inside, as
    ``ids_of`` makes its own, so every figure pays its allocations and first touches alike."""
    m = a.shape[0]
    if name == "ids_of":
        index = KeyIndex(max_load=0.25)
        return lambda: index.ids_of(a, b)
    if name.startswith("walk"):
        bits = max(10, int(np.ceil(np.log2(4 * m))))  # load 1/4, as the session's index
        ordered = name.endswith("ordered home")
        return lambda: _walk(np.zeros(1 << bits, np.int64), np.empty(m, np.uint64), np.empty(m, np.uint64), bits, a,
                             b, ordered, np.empty(m, np.int64))
    if name.startswith("partitioned"):
        return lambda: partitioned(edges, a, b, np.empty(m, np.int64), np.empty(m, np.uint64), np.empty(m, np.uint64))
    index = KeyIndex(max_load=0.25)

    def run() -> object:
        ua, ub = np.empty(m, np.uint64), np.empty(m, np.uint64)
        u = merged(name, edges, a, b, np.empty(m, np.int64), ua, ub)
        return index.append(ua[:u], ub[:u]) if name == "merge + append" else u
    return run


def merged(name: str, edges: _I, a: _U, b: _U, out: _I, ua: _U, ub: _U) -> int:
    """The merge ``name`` names (``_pairwise``'s scratch made here by numpy)."""
    if name != "merge, pairwise":
        return int(_tournament(edges, a, b, out, ua, ub))
    m = a.shape[0]
    return int(_pairwise(edges, a, b, out, ua, ub, *(np.empty(m, t) for t in (np.uint64, np.uint64, np.int64) * 2)))


def partitioned(edges: _I, a: _U, b: _U, out: _I, ka: _U, kb: _U) -> int:
    """``_partitioned`` with ``_PER_BUCKET`` entries a bucket; its table (zeros, made by numpy) holds
    every bucket's sub-table: each at most 8 slots per entry, at least 8."""
    m = a.shape[0]
    bucket_bits = max(0, int(np.log2(max(m, 1) / _PER_BUCKET)))
    slots = np.zeros(8 * m + 8 * (1 << bucket_bits), np.int64)
    return int(_partitioned(edges, a, b, bucket_bits, slots, out, ka, kb))


NAMES = ("ids_of", "merge, tournament", "merge, pairwise", "merge + append", "walk, ordered home",
         "walk, mixed home", "partitioned walk")


def verify(edges: _I, a: _U, b: _U) -> int:
    """Both merges give every entry its key's position among the unique keys, and the partitioned
    walk its key's id, as ``ids_of`` deduplicates them (the same number of keys); returns that number."""
    m = a.shape[0]
    index = KeyIndex()
    index.ids_of(a, b)
    neurons = len(index)
    for name in ("merge, tournament", "merge, pairwise"):
        out, ua, ub = np.empty(m, np.int64), np.empty(m, np.uint64), np.empty(m, np.uint64)
        u = merged(name, edges, a, b, out, ua, ub)
        assert u == neurons and np.array_equal(ua[out], a) and np.array_equal(ub[out], b)
        assert np.all((ua[1:u] > ua[: u - 1]) | ((ua[1:u] == ua[: u - 1]) & (ub[1:u] > ub[: u - 1])))
    out, ka, kb = np.empty(m, np.int64), np.empty(m, np.uint64), np.empty(m, np.uint64)
    u = partitioned(edges, a, b, out, ka, kb)
    assert u == neurons and np.array_equal(ka[out], a) and np.array_equal(kb[out], b)
    _check_walk_hash()
    return neurons


def measure(n: int, repeat: int, rounds: int, seed: int) -> dict[str, float]:
    row = synthetic_row(n, seed)
    edges = np.searchsorted(row.segment, _SEGMENT_EDGES).astype(np.int64)
    a, b = row.target_column, row.target_feature
    verify(edges, a, b)
    best: dict[str, float] = {}
    for _ in range(rounds * repeat):
        for name in NAMES:
            run = _timed(name, edges, a, b)
            t = time.process_time()
            run()
            best[name] = min(best.get(name, float("inf")), time.process_time() - t)
    return {name: seconds * 1e9 / n for name, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="row lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="timings per figure and round, best kept")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object per figure")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    before = os.getloadavg()[0]
    results = {n: measure(n, max(args.repeat, 1), max(args.rounds, 1), args.seed) for n in sizes}
    load = f"load average {before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs"
    if args.json:
        emit_figure(f"machine load: {load}", None)
        for n, r in results.items():
            for name in NAMES:
                emit_figure(f"slot map {name} ns/entry @{n}", r[name], None if name == "ids_of" else
                            f"< {r['ids_of']:.2f} (ids_of, same run)")
        return 0
    print(f"\nmachine: {load}")
    print_table("First fire's slot map, ns per row entry (fresh index; alternated, best of each)",
                ["entries", *NAMES, "target"],
                [[f"{n:,}", *(f"{r[name]:.1f}" + ("" if name == "ids_of" else f" ({r['ids_of'] / r[name]:.2f}x)")
                              for name in NAMES), "ids_of / figure > 1"] for n, r in results.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
