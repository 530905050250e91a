"""The pure parts of cross-process repair (repair/wire.py): messages, placement as data, packed
batches, log pages, digest comparison."""

import random

import msgspec
import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.update_log import KIND_BATCH, KIND_FLOOR, LogRecord
from giaannd.storage.repair.wire import (
    DigestsFor,
    Divergence,
    LoggedFor,
    LoggedPage,
    RepairRefused,
    RowsOf,
    applied_arrays,
    applied_from_bulk,
    compare_digests,
    decode_repair,
    decode_repair_reply,
    is_repair_request,
    owned_mask,
    pack_batches,
    placement_from_spec,
    rows_differ,
    select_log_page,
    spec_of,
    unpack_batches,
)
from giaannd.storage.streaming.stream import StreamHello, StreamPosition
from peers.placement import Member, Placement
from tools.cluster_harness import make_batch

ENC = msgspec.msgpack.Encoder()
PLACEMENT = Placement(tuple(Member(f"s{i}") for i in range(4)), replicas=2)
SPEC = spec_of(PLACEMENT)


def batch(seed, rows=6, columns=None):
    rng = np.random.default_rng(seed)
    return make_batch(rng, rows, 3, columns)


def same(a: RowBatch, b: RowBatch) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


# -- messages ---------------------------------------------------------------------------------------
def test_is_repair_request_tells_repair_from_stream_messages():
    assert is_repair_request(ENC.encode(LoggedFor("s0", SPEC)))
    assert is_repair_request(ENC.encode(RowsOf()))
    assert not is_repair_request(ENC.encode(StreamHello(1, "s1")))
    assert not is_repair_request(ENC.encode(StreamPosition(1, 2)))
    assert not is_repair_request(b"\xc1garbage")
    assert not is_repair_request(b"")


def test_decode_repair_round_trip_and_clear_errors():
    msg = DigestsFor("s1", SPEC, (3, 4), 10)
    assert decode_repair(ENC.encode(msg)) == msg
    with pytest.raises(ValueError, match="undecodable repair request"):
        decode_repair(ENC.encode(StreamHello(1, "s1")))  # a stream tag is not ours
    with pytest.raises(ValueError, match="undecodable repair request"):
        decode_repair(ENC.encode(RepairRefused("x")))  # a reply tag is not a request
    with pytest.raises(ValueError, match=r"\$\.after_seq"):
        decode_repair(ENC.encode({"type": 200, "node": "s0", "placement": SPEC, "after_seq": -1}))
    assert isinstance(decode_repair_reply(ENC.encode(LoggedPage("s0", [(1, 2, 3)], 7, True))), LoggedPage)


def test_decode_repair_garbage_only_raises_value_error():
    rng = random.Random(5)
    good = ENC.encode(LoggedFor("s0", SPEC, 3, 100, [1, 2]))
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode_repair(bytes(data[: rng.randint(0, len(data))]))
        except ValueError:
            pass


# -- placement as data --------------------------------------------------------------------------------
def test_placement_spec_round_trips_including_weights_and_pins():
    p = Placement((Member("a", 2.0), Member("b", 1.0), Member("c", 0.5)), 2, "weighted", {7: ("c",)})
    back = placement_from_spec(decode_repair(ENC.encode(DigestsFor("a", spec_of(p)))).placement)
    assert back.epoch == p.epoch
    keys = np.arange(1, 500, dtype=np.uint64)
    assert np.array_equal(back.owner_indices(keys), p.owner_indices(keys))


def test_placement_from_spec_refuses_epoch_mismatch_and_bad_members():
    with pytest.raises(ValueError, match="epoch mismatch"):
        placement_from_spec(msgspec.structs.replace(SPEC, replicas=3))
    with pytest.raises(ValueError, match="bad placement"):
        placement_from_spec(msgspec.structs.replace(SPEC, members=[], epoch=""))
    with pytest.raises(ValueError, match="bad placement"):
        placement_from_spec(msgspec.structs.replace(SPEC, strategy="nope", epoch=""))


def test_owned_mask_is_the_intersection_of_owners():
    cols = np.random.default_rng(1).integers(1, 2**63, 300, dtype=np.uint64)
    owners = PLACEMENT.owner_indices(cols)
    both = owned_mask(PLACEMENT, "s0", "s1")(cols)
    expect = (owners == 0).any(axis=1) & (owners == 1).any(axis=1)
    assert np.array_equal(both, expect) and both.any()
    assert not owned_mask(PLACEMENT, "s0", "stranger")(cols).any()


# -- bulk -----------------------------------------------------------------------------------------------
def test_pack_unpack_batches_round_trip():
    parts = [batch(1), RowBatch.empty(), batch(2, 1), batch(3, 9)]
    buffers = pack_batches(parts)
    back = unpack_batches(buffers, [b.num_rows for b in parts])
    assert len(back) == 4 and all(same(a, b) for a, b in zip(parts, back))
    assert unpack_batches(pack_batches([]), []) == []


def test_unpack_batches_refuses_bad_counts_and_non_canonical_rows():
    parts = [batch(1, 3, np.array([100, 101, 102], np.uint64)), batch(2, 3, np.array([1, 2, 3], np.uint64))]
    buffers = pack_batches(parts)
    with pytest.raises(ValueError, match="row counts"):
        unpack_batches(buffers, [parts[0].num_rows, parts[1].num_rows + 1])
    # two records glued into one: rows of the second are not sorted after the first's
    merged = [parts[0].num_rows + parts[1].num_rows]
    with pytest.raises(ValueError, match="not sorted"):
        unpack_batches(buffers, merged)
    bad = list(buffers)
    bad[2] = bad[2].copy()
    bad[2][1] = bad[2][-1] + 5
    with pytest.raises(ValueError):
        unpack_batches(bad, [b.num_rows for b in parts])


def test_applied_from_bulk_round_trip_and_validation():
    applied = AppliedSet()
    for bid in (BatchId(5, 1), BatchId(5, 2), BatchId(5, 9), BatchId(8, 3)):
        applied.add(bid)
    assert applied_from_bulk(applied_arrays(applied)) == applied
    assert len(applied_from_bulk(applied_arrays(None))) == 0
    with pytest.raises(ValueError, match="4 arrays"):
        applied_from_bulk(applied_arrays(applied)[:3])
    with pytest.raises(ValueError, match="uint64"):
        applied_from_bulk([a.astype(np.int64) for a in applied_arrays(applied)])
    w, f, c, e = applied_arrays(applied)
    with pytest.raises(ValueError, match="exception count"):
        applied_from_bulk([w, f, c + np.uint64(1), e])


# -- log pages ------------------------------------------------------------------------------------------
def log_records():
    """Seq 1..: batches of writer 7 (seq 1..6), a floor record, a batch of (stream) writer 99."""
    recs = [LogRecord(i + 1, KIND_BATCH, BatchId(7, i + 1), batch(10 + i)) for i in range(6)]
    recs.append(LogRecord(7, KIND_FLOOR, writer=7, floor=3))
    recs.append(LogRecord(8, KIND_BATCH, BatchId(99, 1), batch(50)))
    return recs


def test_select_log_page_restricts_skips_applied_and_excluded():
    owned = owned_mask(PLACEMENT, "s2")
    applied = AppliedSet()
    applied.add(BatchId(7, 2))
    page = select_log_page(log_records(), 0, 100, owned, applied, {99}, 1 << 30)
    assert page.reached_end and page.next_after_seq == 8
    assert [b.seq for b in page.ids] == [1, 3, 4, 5, 6]
    for bid, rows in page.records:
        full = log_records()[bid.seq - 1].batch
        assert same(rows, full.select_rows(owned(full.row_column)))
        assert rows.num_rows > 0 and owned(rows.row_column).all()


def test_select_log_page_pages_with_a_tiny_budget_and_always_progresses():
    owned = owned_mask(PLACEMENT, "s2")
    after, ids, pages = 0, [], 0
    while True:
        page = select_log_page(log_records(), after, 100, owned, AppliedSet(), {99}, 1)
        pages += 1
        assert len(page.ids) <= 1
        ids += page.ids
        if page.reached_end:
            break
        assert page.next_after_seq > after
        after = page.next_after_seq
    assert [b.seq for b in ids] == [1, 2, 3, 4, 5, 6] and pages >= 6


def test_select_log_page_stops_at_upto_seq():
    page = select_log_page(log_records(), 2, 4, owned_mask(PLACEMENT, "s0"), AppliedSet(), set(), 1 << 30)
    assert page.reached_end and [b.seq for b in page.ids] == [3, 4] and page.next_after_seq == 4


# -- digests ---------------------------------------------------------------------------------------------
def test_compare_digests_classifies_rows():
    here, there = ColumnStore(1 << 26), ColumnStore(1 << 26)
    b = batch(3, 4)
    here.apply(BatchId(1, 1), b)
    there.apply(BatchId(1, 1), b)
    k = [b.key(i) for i in range(4)]
    # k[1]: the same targets, other strengths; k[2]: another target; k[3]: missing here
    bump = b.select_rows(np.array([False, True, False, False]))
    there.apply(BatchId(1, 2), bump)
    there.apply(BatchId(1, 3), RowBatch.from_entries(np.array([k[2][0]], np.uint64), np.array([k[2][1]], np.uint64),
                                                     np.array([0], np.uint8), np.array([123456789], np.uint64),
                                                     np.array([1], np.uint64), np.array([1.0], np.float32)))
    missing = (k[3][0], k[3][1] + 1_000_000)
    there.apply(BatchId(1, 4), RowBatch.from_entries(np.array([missing[0]], np.uint64),
                                                     np.array([missing[1]], np.uint64), np.array([0], np.uint8),
                                                     np.array([1], np.uint64), np.array([1], np.uint64),
                                                     np.array([1.0], np.float32)))
    keys = [k[0], k[1], k[2], missing]
    cols, feats = np.array([c for c, _ in keys], np.uint64), np.array([f for _, f in keys], np.uint64)
    for version in (1, 2):  # (1: the per-row digests of peers from before versions)
        _, keys_there, strength_there = there.row_digests(cols, feats, version)
        present, keys_here, strength_here = here.row_digests(cols, feats, version)
        verdict = compare_digests(present, keys_here, strength_here, keys_there, strength_there)
        assert verdict.missing.tolist() == [False, False, False, True]
        assert verdict.differ.tolist() == [False, False, True, False]
        assert verdict.recheck.tolist() == [False, True, False, False]


def test_row_digests_version_1_is_the_per_row_digest_and_version_2_sees_every_field():
    store = ColumnStore(1 << 26)
    store.apply(BatchId(1, 1), batch(3, 5))
    cols, feats = store.key_arrays()
    present, keys, strength = store.row_digests(cols, feats, 1)
    assert present.all()
    for i, key in enumerate(zip(cols.tolist(), feats.tolist())):
        d = store.digest(key)
        assert (d.keys, d.strength) == (keys[i], strength[i])
    _, k2, s2 = store.row_digests(cols, feats, 2)
    row = store.row((int(cols[0]), int(feats[0])))
    for field, change in (("segment", 1), ("target_column", 1), ("target_feature", 1), ("strength", 1)):
        other = ColumnStore(1 << 26)
        values = {f: getattr(row, f).copy() for f in ("segment", "target_column", "target_feature", "strength")}
        values[field][-1] += change
        other.apply(BatchId(1, 1), RowBatch.from_entries(
            np.full(len(row), cols[0], np.uint64), np.full(len(row), feats[0], np.uint64), values["segment"],
            values["target_column"], values["target_feature"], values["strength"]))
        _, ko, so = other.row_digests(cols[:1], feats[:1], 2)
        assert (ko[0], so[0]) != (k2[0], s2[0]), field
        assert (ko[0] != k2[0]) == (field != "strength") and (so[0] != s2[0]) == (field == "strength")
    with pytest.raises(ValueError, match="unknown row digest version"):
        store.row_digests(cols, feats, 3)


def test_rows_differ_aligns_rows_by_key_and_compares_within_the_tolerance():
    here, there = ColumnStore(1 << 26), ColumnStore(1 << 26)
    b = batch(4, 6)
    here.apply(BatchId(1, 1), b)
    there.apply(BatchId(1, 1), b)
    k = [b.key(i) for i in range(4)]
    nudge = b.select_rows(np.array([False, True, False, False]))
    there.apply(BatchId(1, 2), RowBatch.from_entries(  # k[1]: one strength a little larger
        nudge.row_column[:1], nudge.row_feature[:1], nudge.segment[:1], nudge.target_column[:1],
        nudge.target_feature[:1], np.array([1e-4], np.float32)))
    there.apply(BatchId(1, 3), RowBatch.from_entries(  # k[2]: one more target
        np.array([k[2][0]], np.uint64), np.array([k[2][1]], np.uint64), np.array([0], np.uint8),
        np.array([987654321], np.uint64), np.array([1], np.uint64), np.array([1.0], np.float32)))
    absent = (k[3][0], k[3][1] + 1_000_000)
    keys = [k[3], k[1], absent, k[0], k[2]]  # any order
    cols, feats = np.array([c for c, _ in keys], np.uint64), np.array([f for _, f in keys], np.uint64)
    tight = rows_differ(cols, feats, here.read_rows(cols, feats), there.read_rows(cols, feats), 0.0)
    assert tight.tolist() == [False, True, True, False, True]
    loose = rows_differ(cols, feats, here.read_rows(cols, feats), there.read_rows(cols, feats), 0.5)
    assert loose.tolist() == [False, False, True, False, True]


def test_divergence_counts_every_row_and_describes_the_first():
    out = Divergence(limit=3)
    out.add(np.arange(2, dtype=np.uint64), np.arange(2, dtype=np.uint64), "x")
    out.add(np.arange(5, dtype=np.uint64), np.ones(5, np.uint64), "y")
    assert out.count == 7 and out.listed == ["row (0, 0): x", "row (1, 1): x", "row (0, 1): y"]


def test_repair_requests_nested_past_the_decoders_recursion_are_refused_as_undecodable():
    """A peer's payload whose unknown field nests ~5,000 arrays deep (msgspec skips it
    recursively: RecursionError): not a repair request, and undecodable as one or as a reply, like
    any bad body. Before, the RecursionError escaped all three (and the stream endpoint's
    dispatch, which asks ``is_repair_request`` first)."""
    from giaannd.storage.repair.wire import decode_repair, decode_repair_reply, is_repair_request

    nested = b"\x82\xa4type\xcc\xc8\xa1x" + b"\x91" * 5000 + b"\x01"  # {"type": 200, "x": [[[...]]]}
    assert is_repair_request(nested) is False
    with pytest.raises(ValueError, match="undecodable repair request"):
        decode_repair(nested)
    with pytest.raises(ValueError, match="undecodable repair reply"):
        decode_repair_reply(nested)
