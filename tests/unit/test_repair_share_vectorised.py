"""``assemble_share`` (repair/plan.py step 3) in whole-array numpy gives what the per-row version it
replaced gave: the same batch, bit for bit, and the same error naming the same row. The per-row
version is kept here as the reference."""

import numpy as np
import pytest

from giaannd.model.rows import Row, RowBatch
from giaannd.storage.repair.plan import assemble_share

#: Row columns, two of them above 2**63 (keys sort as unsigned, the way Python ints of them do).
COLUMNS = np.array([3, 7, 11, 2**63 + 5, 2**64 - 2], np.uint64)


def assemble_share_reference(parts, owned):
    """The per-row implementation ``assemble_share`` had before it was vectorised (verbatim)."""
    rows = {}
    for part in parts:
        mask = owned(part.row_column)
        for i in np.flatnonzero(mask).tolist():
            key = part.key(i)
            seen = rows.get(key)
            if seen is None:
                rows[key] = (part, i)
            elif not seen[0].row(seen[1]).equals(part.row(i)):
                raise ValueError(f"peers logged different contents for row {key}")
    if not rows:
        return RowBatch.empty()
    return RowBatch.from_rows({k: b.row(i) for k, (b, i) in sorted(rows.items())})


def pack(pairs):
    """A batch of ``(key, Row)`` pairs in the order given (keys may repeat: not canonical)."""
    if not pairs:
        return RowBatch.empty()
    lengths = np.array([len(r) for _, r in pairs], np.int64)
    offsets = np.zeros(len(pairs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return RowBatch(
        np.array([k[0] for k, _ in pairs], np.uint64), np.array([k[1] for k, _ in pairs], np.uint64), offsets,
        np.concatenate([r.segment for _, r in pairs]), np.concatenate([r.target_column for _, r in pairs]),
        np.concatenate([r.target_feature for _, r in pairs]), np.concatenate([r.strength for _, r in pairs]),
    )


def random_row(rng):
    n = int(rng.integers(0, 5))  # zero-length rows too
    keys = sorted({(int(rng.integers(0, 9)), int(rng.integers(1, 6)), int(rng.integers(0, 4))) for _ in range(n)})
    strength = rng.integers(0, 4, len(keys)).astype(np.float32)  # zeros: signed-zero copies below
    return Row(np.array([k[0] for k in keys], np.uint8), np.array([k[1] for k in keys], np.uint64),
               np.array([k[2] for k in keys], np.uint64), strength)


def altered(row, how):
    """``row`` changed so that ``Row.equals`` says it differs (or, ``negzero``, not)."""
    seg, tc, tf, st = row.segment.copy(), row.target_column.copy(), row.target_feature.copy(), row.strength.copy()
    if how == "negzero":
        st[st == 0] = -0.0  # bits differ, == does not: a copy, not a conflict
    elif how == "shorter" and len(row):
        seg, tc, tf, st = seg[1:], tc[1:], tf[1:], st[1:]
    elif how == "longer" or not len(row):
        seg, tc, tf, st = (np.append(seg, np.uint8(8)), np.append(tc, np.uint64(99)),
                           np.append(tf, np.uint64(99)), np.append(st, np.float32(1)))
    else:
        field = {"segment": seg, "target_column": tc, "target_feature": tf, "strength": st}[how]
        j = int(len(row) - 1)
        field[j] = np.nan if how == "strength" and j % 2 else field[j] + 1
    return Row(seg, tc, tf, st)


def random_parts(rng, conflict):
    """Parts with overlapping rows copied from one truth, canonical or (sometimes) not."""
    truth = {(int(c), int(f)): random_row(rng) for c in COLUMNS for f in range(4) if rng.random() < 0.6}
    keys = sorted(truth)
    parts = []
    for _ in range(int(rng.integers(0, 5))):
        picked = [keys[i] for i in np.flatnonzero(rng.random(len(keys)) < 0.5)]
        pairs = [(k, altered(truth[k], "negzero") if rng.random() < 0.2 else truth[k]) for k in picked]
        if conflict and pairs and rng.random() < 0.5:
            j = int(rng.integers(len(pairs)))
            how = rng.choice(["shorter", "longer", "segment", "target_column", "target_feature", "strength"])
            pairs[j] = (pairs[j][0], altered(pairs[j][1], str(how)))
        if rng.random() < 0.15:  # not canonical: unsorted, a key twice in one part
            pairs = [pairs[i] for i in rng.permutation(len(pairs))] + pairs[:1]
        parts.append(pack(pairs))
    return parts


def random_owned(rng):
    mine = COLUMNS[rng.random(len(COLUMNS)) < 0.7]
    return lambda cols: np.isin(cols, mine)


def outcome(fn, parts, owned):
    try:
        return fn(parts, owned)
    except ValueError as exc:
        return exc


def assert_same(got, want):
    """Both raised the same error, or both returned the same batch bit for bit (dtypes too)."""
    if isinstance(want, ValueError):
        assert isinstance(got, ValueError) and str(got) == str(want)
        return
    assert isinstance(got, RowBatch)
    for g, w in zip(got.buffers(), want.buffers(), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()


def test_assemble_share_random_parts_match_reference():
    raised = returned = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        parts, owned = random_parts(rng, conflict=seed % 2 == 1), random_owned(rng)
        want = outcome(assemble_share_reference, parts, owned)
        assert_same(outcome(assemble_share, iter(parts), owned), want)
        raised += isinstance(want, ValueError)
        returned += isinstance(want, RowBatch) and want.num_rows > 0
    assert raised > 50 and returned > 100  # both paths exercised, not only empty shares


def test_assemble_share_empty_inputs_match_reference():
    row = Row(np.array([1], np.uint8), np.array([2], np.uint64), np.array([3], np.uint64), np.array([1], np.float32))
    everything, nothing = (lambda c: np.ones(c.shape[0], np.bool_)), (lambda c: np.zeros(c.shape[0], np.bool_))
    cases = [
        ([], everything),
        ([RowBatch.empty(), RowBatch.empty()], everything),
        ([pack([((3, 0), row)])], nothing),
        ([pack([((3, 0), Row.empty()), ((7, 1), Row.empty())]), pack([((3, 0), Row.empty())])], everything),
    ]
    for parts, owned in cases:
        want = assemble_share_reference(parts, owned)
        assert_same(assemble_share(parts, owned), want)
    assert assemble_share([], everything).num_rows == 0
    assert assemble_share(cases[3][0], everything).num_rows == 2  # zero-length rows are rows


def test_assemble_share_conflict_names_first_differing_copy():
    def one(s):
        return Row(np.array([0], np.uint8), np.array([1], np.uint64), np.array([1], np.uint64),
                   np.array([s], np.float32))

    everything = lambda c: np.ones(c.shape[0], np.bool_)  # noqa: E731
    # (9, 1) differs in the second part, (3, 1) only in the third: the second part's is met first
    parts = [pack([((3, 1), one(1)), ((9, 1), one(1))]), pack([((3, 1), one(1)), ((9, 1), one(2))]),
             pack([((3, 1), one(5))])]
    with pytest.raises(ValueError, match=r"^peers logged different contents for row \(9, 1\)$"):
        assemble_share(parts, everything)
    assert_same(outcome(assemble_share, parts, everything), outcome(assemble_share_reference, parts, everything))
    # a later copy is compared with the first copy, not with the one before it
    parts = [pack([((3, 1), one(1))]), pack([((3, 1), one(2))]), pack([((3, 1), one(2))])]
    assert str(outcome(assemble_share, parts, everything)) == "peers logged different contents for row (3, 1)"
    nan = [pack([((3, 1), one(np.nan))]), pack([((3, 1), one(np.nan))])]  # NaN != NaN, as Row.equals
    assert_same(outcome(assemble_share, nan, everything), outcome(assemble_share_reference, nan, everything))
    assert isinstance(outcome(assemble_share, nan, everything), ValueError)


def test_assemble_share_large_parts_match_reference():
    rng = np.random.default_rng(7)
    n = 20_000
    lengths = rng.integers(0, 6, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    m = int(offsets[-1])
    whole = RowBatch(np.sort(rng.integers(0, 2**64, n, dtype=np.uint64)), rng.integers(0, 9, n).astype(np.uint64),
                     offsets, rng.integers(0, 9, m).astype(np.uint8), rng.integers(0, 99, m).astype(np.uint64),
                     rng.integers(0, 99, m).astype(np.uint64), rng.random(m).astype(np.float32))
    parts = [whole.select_rows(rng.random(n) < 0.6) for _ in range(3)]
    owned = lambda c: c % np.uint64(3) != 0  # noqa: E731
    assert_same(assemble_share(parts, owned), assemble_share_reference(parts, owned))
