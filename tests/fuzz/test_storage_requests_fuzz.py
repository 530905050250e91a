"""Seeded fuzzing of the storage service's application requests, end to end over ``mem://``.

The framing and control layer has its own fuzzers (test_wire_fuzz.py, test_framing_fuzz.py); this
one sends the *application* payloads (giaannd/protocol.py's requests, the stream endpoint's stream,
source-control and repair requests) and their numpy bulk buffers, mutated: wrong msgspec types,
missing and extra fields, negative and huge numbers, buffers of the wrong dtype, rank, length or
count, arrays whose lengths disagree, non-finite and huge strengths, out-of-range and duplicate
keys, empty batches, oversized payloads, and plain garbage.

What the project promises (protocol.py, requests.py "Every failure is a typed error *reply*";
STYLE.md item 11) and what every seed checks:

(a) every request is answered, within a bound, with a reply the protocol knows (a typed error or a
    clean refusal), never a transport ``RemoteError`` (the handler raised) and never a hang; the
    connection stays open and the node keeps serving;
(b) nothing acknowledged is lost or corrupted: the node holds exactly the reference rows, bit for
    bit, before and after a restart from its files, and every row it holds reads back in a reply a
    client accepts (``check_batch``);
(c) a refused request changes no row (and a refused hint holds nothing).

One in-process storage node (tools.cluster_harness, replicas 1: it owns every column), its
client's writes kept in the harness's reference store, and a raw connection per endpoint.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.rebalance.source_control import (
    DeliverHints,
    DiscardStream,
    DropHints,
    HintsHeld,
    ListColumns,
    SourceStart,
    SourceStatus,
)
from giaannd.storage.repair.wire import DigestsFor, LoggedFor, PlacementSpec, RowsOf
from giaannd.storage.streaming.stream import StreamData, StreamHello, StreamVerify
from peers.errors import RemoteError
from tools.cluster_harness import Cluster, make_batch

#: Bound on one request (a hang fails the test instead of the run).
CALL_TIMEOUT_S = 10.0
SEEDS = range(16)
#: Mutated requests per seed (each kind drawn at random, seeded).
REQUESTS_PER_SEED = 150
NODE = "a"
#: The node's capacity: what the seeds write fits, ``too_big_for_the_store``'s 300,000 entries do not.
STORE_BYTES = 4 << 20

_ENC = msgspec.msgpack.Encoder()
_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.float16, np.uint32, np.int32, np.float32, np.uint64,
           np.int64, np.float64, np.bool_]
#: Values of the wrong msgpack type (or out of range) for any field.
_BAD_VALUES: list[Any] = [-1, -(2**63), 2**64 - 1, 1.5, float("nan"), float("inf"), "x", b"\x00", None, True,
                          [1, 2], {"a": 1}, "x" * (p.MAX_TEXT_CHARS + 1)]

Mutation = tuple[str, Any, list[np.ndarray], str]
"""(name, payload bytes, bulk, expectation): "refused" (an error reply, nothing changes),
"store_full" (that one), "read" and "garbage" (any typed reply, nothing changes), "applied"
(acknowledged: the batch counts in the reference), "applied_or_refused" (either)."""


def _fields(msg: msgspec.Struct) -> dict[str, Any]:
    """A tagged Struct as the map msgspec encodes it (tag first), to mutate before encoding."""
    return {"type": msg.__struct_config__.tag, **msgspec.structs.asdict(msg)}


def _u64(*values: int) -> np.ndarray:
    return np.array(values, np.uint64)


def _cast(arr: np.ndarray, dtype: Any) -> np.ndarray:
    """``arr`` as ``dtype``, wrapping or saturating quietly (the values do not matter, the dtype does)."""
    with np.errstate(all="ignore"):
        return arr.astype(dtype)


@dataclass
class Node:
    """The node under test, its raw connections and the rows written to it."""

    cluster: Cluster
    data: Any  # Connection to the data plane
    stream: Any  # Connection to the stream endpoint
    rng: random.Random
    writer: int = 1 << 40  # this fuzzer's own writer ids (the harness client has its own)
    seq: int = 0
    #: a refused ApplyBatch's header and the valid batch its writer retries it with
    retry: tuple[bytes, RowBatch] | None = None

    @property
    def store(self) -> Any:
        return self.cluster.services[NODE].store

    def next_id(self) -> BatchId:
        self.seq += 1
        return BatchId(self.writer, self.seq)

    def held_rows(self) -> RowBatch:
        return self.store.store.read_all()


async def _call(conn: Any, payload: bytes, bulk: list[np.ndarray], name: str = ""
                ) -> tuple[memoryview, list[np.ndarray]]:
    """One request, bounded; a ``RemoteError`` (the handler raised) fails the test."""
    try:
        res = await asyncio.wait_for(conn.request(payload, bulk, timeout_s=CALL_TIMEOUT_S), CALL_TIMEOUT_S + 1)
    except RemoteError as exc:
        pytest.fail(f"{name}: the handler raised instead of answering: {exc}")
    return res.payload, res.bulk


def _same_rows(a: RowBatch, b: RowBatch) -> bool:
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


# -- mutations of an ApplyBatch's seven buffers ------------------------------------------------------
def _bad_bulk(rng: random.Random, batch: RowBatch) -> tuple[str, list[np.ndarray]]:
    """A mutation of a valid batch's buffers that no canonical batch has (each kind breaks a rule)."""
    bufs = [b.copy() for b in batch.buffers()]
    n = bufs[6].shape[0]
    kind = rng.choice(["fewer", "more", "none", "dtype", "rank", "row_len", "entry_len", "offsets_end",
                       "offsets_start", "offsets_down", "offsets_negative", "nan", "inf", "neg_inf", "segment",
                       "duplicate_row", "unsorted_rows", "duplicate_entry", "unsorted_entries"])
    if kind == "fewer":
        del bufs[rng.randrange(7)]
    elif kind == "more":
        bufs.insert(rng.randrange(8), bufs[rng.randrange(7)].copy())
    elif kind == "none":
        bufs = []
    elif kind == "dtype":
        j = rng.randrange(7)
        bufs[j] = _cast(bufs[j], rng.choice([d for d in _DTYPES if np.dtype(d) != bufs[j].dtype]))
    elif kind == "rank":
        j = rng.choice([j for j in range(7) if bufs[j].size % 2 == 0 and bufs[j].size])
        bufs[j] = bufs[j].reshape(2, -1)
    elif kind == "row_len":
        j = rng.choice([0, 1, 2])
        bufs[j] = bufs[j][:-1].copy() if rng.random() < 0.5 else np.append(bufs[j], bufs[j][-1:])
    elif kind == "entry_len":
        j = rng.choice([3, 4, 5, 6])
        bufs[j] = bufs[j][:-1].copy() if rng.random() < 0.5 else np.append(bufs[j], bufs[j][-1:])
    elif kind == "offsets_end":
        bufs[2][-1] += rng.choice([-1, 1, 2**40])
    elif kind == "offsets_start":
        bufs[2][0] = rng.choice([1, -1])
    elif kind == "offsets_down":
        bufs[2][1], bufs[2][2] = bufs[2][2], bufs[2][1] - 1 if bufs[2][1] == bufs[2][2] else bufs[2][1]
    elif kind == "offsets_negative":
        bufs[2][1] = -5
    elif kind in ("nan", "inf", "neg_inf"):
        bufs[6][rng.randrange(n)] = {"nan": np.nan, "inf": np.inf, "neg_inf": -np.inf}[kind]
    elif kind == "segment":
        bufs[3][rng.randrange(n)] = rng.choice([9, 17, 255])
    elif kind == "duplicate_row":
        bufs[0][1], bufs[1][1] = bufs[0][0], bufs[1][0]
    elif kind == "unsorted_rows":
        bufs[0], bufs[1] = bufs[0][::-1].copy(), bufs[1][::-1].copy()
    elif kind == "duplicate_entry":
        for j in (3, 4, 5):
            bufs[j][1] = bufs[j][0]
    else:  # unsorted_entries (within row 0: four entries each, make_batch)
        for j in (3, 4, 5):
            bufs[j][:4] = bufs[j][:4][::-1].copy()
    return kind, bufs


def _good_batch(node: Node, rows: int = 4) -> RowBatch:
    """A canonical batch of at least 2 rows and 8 entries (the mutations above need them), over
    columns the reference already holds half the time (so a refused batch would show)."""
    nprng = np.random.default_rng(node.rng.randrange(2**32))
    held = node.cluster.reference.keys()
    if held and node.rng.random() < 0.5:
        cols = np.array([held[node.rng.randrange(len(held))][0] for _ in range(rows)], np.uint64)
    else:
        cols = nprng.integers(1, 2**63, rows, dtype=np.uint64)
    while True:
        batch = make_batch(nprng, rows, 4, cols)
        if batch.num_rows >= 2 and all(np.diff(batch.offsets) == 4):
            return batch
        cols = nprng.integers(1, 2**63, rows, dtype=np.uint64)


def apply_mutation(node: Node) -> Mutation:
    rng = node.rng
    batch = _good_batch(node)
    bid = node.next_id()
    header = p.encode(p.ApplyBatch(bid.writer, bid.seq))
    roll = rng.random()
    if roll < 0.5:
        kind, bulk = _bad_bulk(rng, batch)
        hint = rng.random() < 0.2  # a hint is checked as strictly (nothing held)
        if hint:
            header = p.encode(p.ApplyBatch(bid.writer, bid.seq, 0, "", "elsewhere"))
        else:  # the writer's retry of that id with its real batch applies it (the id was not taken)
            node.retry = (header, batch)
        return f"apply bulk {kind}{' (hint)' if hint else ''}", header, bulk, "refused"
    if roll < 0.8:
        fields = _fields(p.ApplyBatch(bid.writer, bid.seq))
        kind = rng.choice(["missing", "wrong_type", "seq_zero", "negative", "epoch_long", "hint_type",
                           "no_tag", "tag"])
        if kind == "missing":
            del fields[rng.choice(["writer", "seq"])]
        elif kind == "wrong_type":
            name = rng.choice(["writer", "seq", "writer_floor", "placement_epoch"])
            fields[name] = rng.choice([1.5, [1], {"a": 1}, b"\x01", 7 if name == "placement_epoch" else "x"])
        elif kind == "seq_zero":
            fields["seq"] = 0
        elif kind == "negative":
            fields[rng.choice(["writer", "seq", "writer_floor"])] = rng.choice([-1, -(2**63)])
        elif kind == "epoch_long":
            fields[rng.choice(["placement_epoch", "hint_for"])] = "e" * (p.MAX_TEXT_CHARS + 1 + rng.randrange(1 << 16))
        elif kind == "hint_type":
            fields["hint_for"] = rng.choice([5, ["a"], b"a", 1.5])
        elif kind == "no_tag":
            del fields["type"]
        else:
            fields["type"] = rng.choice([0, 18, 63, 64, 130, 255, -1, "2"])
        return f"apply header {kind}", _ENC.encode(fields), batch.buffers(), "refused"
    if roll < 0.9:  # valid, though unusual: acknowledged and applied
        kind = rng.choice(["extra_field", "empty", "floor"])
        if kind == "extra_field":
            fields = _fields(p.ApplyBatch(bid.writer, bid.seq))
            fields["from_the_future"] = [1, "x", None]
            return "apply extra field", _ENC.encode(fields), batch.buffers(), "applied"
        if kind == "empty":
            return "apply empty batch", header, RowBatch.empty().buffers(), "applied"
        return "apply with a floor", p.encode(p.ApplyBatch(bid.writer, bid.seq, bid.seq - 1)), batch.buffers(), \
            "applied"
    # huge but finite increments onto rows already held: accepted or refused, the rows must stay
    # readable (a row whose strength overflowed to inf is refused by every reader and its snapshot
    # by the restart)
    held = node.held_rows()
    if held.num_rows:
        i = rng.randrange(held.num_rows)
        start, end = int(held.offsets[i]), int(held.offsets[i + 1])
        if end > start:
            big = RowBatch(held.row_column[i:i + 1].copy(), held.row_feature[i:i + 1].copy(),
                           np.array([0, end - start], np.int64), held.segment[start:end].copy(),
                           held.target_column[start:end].copy(), held.target_feature[start:end].copy(),
                           np.full(end - start, rng.choice([3.0e38, -3.0e38, 2.0e38]), np.float32))
            return "apply huge strengths", header, big.buffers(), "applied_or_refused"
    return "apply empty batch", header, RowBatch.empty().buffers(), "applied"


def too_big_for_the_store(node: Node) -> Mutation:
    """A valid batch over the node's free capacity: ``StoreFull``, nothing applied, id not taken."""
    nprng = np.random.default_rng(node.rng.randrange(2**32))
    batch = make_batch(nprng, 1000, 300)
    bid = node.next_id()
    header = p.encode(p.ApplyBatch(bid.writer, bid.seq))
    node.retry = (header, RowBatch.empty())
    return "apply over the store's capacity", header, batch.buffers(), "store_full"


def oversized_apply(node: Node) -> Mutation:
    """Over the row or the entry limit: refused on the sizes alone (only the counted buffer is big)."""
    batch = _good_batch(node)
    bid = node.next_id()
    bufs = batch.buffers()
    if node.rng.random() < 0.5:
        bufs[0] = np.zeros(p.MAX_BATCH_ROWS + 1, np.uint64)
        name = "rows"
    else:
        bufs[6] = np.ones(p.MAX_BATCH_ENTRIES + 1, np.float32)
        name = "entries"
    return f"apply over the {name} limit", p.encode(p.ApplyBatch(bid.writer, bid.seq)), bufs, "refused"


# -- mutations of the other requests ----------------------------------------------------------------
def _bad_keys(rng: random.Random, cols: np.ndarray, feats: np.ndarray, limit: int) -> tuple[str, list[np.ndarray]]:
    kind = rng.choice(["fewer", "more", "dtype", "rank", "lengths", "over_limit"])
    if kind == "fewer":
        return kind, [cols]
    if kind == "more":
        return kind, [cols, feats, feats]
    if kind == "dtype":
        dt = rng.choice([d for d in _DTYPES if d is not np.uint64])
        return kind, [_cast(cols, dt), feats] if rng.random() < 0.5 else [cols, _cast(feats, dt)]
    if kind == "rank":
        return kind, [np.repeat(cols, 2).reshape(2, -1), np.repeat(feats, 2).reshape(2, -1)]
    if kind == "lengths":
        return kind, [cols, feats[:-1]]
    return kind, [np.zeros(limit + 1, np.uint64), np.zeros(limit + 1, np.uint64)]


def _keys_held(node: Node) -> tuple[np.ndarray, np.ndarray]:
    """Keys of some held rows, repeated and shuffled, with some absent ones."""
    held = node.held_rows()
    k = max(2, min(8, held.num_rows))
    idx = [node.rng.randrange(max(1, held.num_rows)) for _ in range(k)]
    cols = np.array([held.row_column[i] if held.num_rows else 5 for i in idx] + [2**64 - 1, 0], np.uint64)
    feats = np.array([held.row_feature[i] if held.num_rows else 0 for i in idx] + [2**64 - 1, 0], np.uint64)
    return cols, feats


def read_mutation(node: Node) -> Mutation:
    rng = node.rng
    cols, feats = _keys_held(node)
    kind = rng.choice(["ReadRows", "ReadRows", "RowDigests", "ReadRowPart", "ScanRows", "ColumnInfo",
                       "BatchesApplied", "HeldHints", "GetUsage"])
    if kind in ("ReadRows", "RowDigests"):
        msg: msgspec.Struct = p.ReadRows(chunked=rng.random() < 0.5) if kind == "ReadRows" else p.RowDigests()
        limit = p.MAX_READ_ROWS if kind == "ReadRows" else p.MAX_DIGEST_ROWS
        if rng.random() < 0.3:  # duplicate, unsorted and absent keys: valid, answered
            return f"{kind} odd keys", p.encode(msg), [cols, feats], "read"
        bad, bulk = _bad_keys(rng, cols, feats, limit)
        return f"{kind} keys {bad}", p.encode(msg), bulk, "refused"
    big = [0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
    if kind == "ReadRowPart":
        fields = _fields(p.ReadRowPart(int(cols[0]), int(feats[0]), rng.choice(big), rng.choice(big[1:])))
        bad_fields = {"limit": [0, -1, "x"], "offset": [-1, 1.5], "column": [-1, None]}
    elif kind == "ScanRows":
        fields = _fields(p.ScanRows(rng.choice(big), rng.choice(big), rng.random() < 0.5, rng.choice(big[1:]),
                                    False, [], [], "", rng.choice(big), rng.choice(big)))
        bad_fields = {"limit": [0, -1], "max_bytes": [-1], "after_entry": [-1, "x"],
                      "skip": [["x" * (p.MAX_TEXT_CHARS + 1)], 5], "owned": ["yes"]}
    elif kind == "ColumnInfo":
        fields = _fields(p.ColumnInfo(rng.choice(big), rng.choice(big), rng.random() < 0.5, rng.choice(big[1:]),
                                      rng.choice([1, 2, 3, 255])))
        bad_fields = {"digest_version": [0, 256, -1], "limit": [0], "column": [-1, "x"]}
    elif kind == "BatchesApplied":
        fields = _fields(p.BatchesApplied(rng.choice(big), [rng.choice(big[1:]) for _ in range(rng.randrange(4))]))
        bad_fields = {"seqs": [[0], [-1], "x", list(range(1, p.MAX_QUERY_SEQS + 2))], "writer": [-1]}
    elif kind == "HeldHints":
        fields = _fields(p.HeldHints(rng.choice(["s1", "", "x" * 40]), rng.choice(big),
                                     [rng.choice(big[1:]) for _ in range(rng.randrange(4))]))
        bad_fields = {"seqs": [[0], [-1], "x", list(range(1, p.MAX_QUERY_SEQS + 2))], "writer": [-1],
                      "target": [5, "x" * (p.MAX_TEXT_CHARS + 1)]}
    else:
        fields = _fields(p.GetUsage())
        bad_fields = {"type": [-5, 300, "4"]}
    if rng.random() < 0.5:  # valid (extreme values): answered, nothing changes
        if rng.random() < 0.3:
            fields["unknown_field"] = {"x": [1.5]}
        return f"{kind} extreme", _ENC.encode(fields), [], "read"
    name = rng.choice(sorted(bad_fields))
    fields[name] = rng.choice(bad_fields[name])
    return f"{kind} bad {name}", _ENC.encode(fields), [], "refused"


def vocab_register_mutation(node: Node) -> Mutation:
    """Vocabulary and register requests (they change their own stores, never rows)."""
    rng = node.rng
    kind = rng.choice(["PutVocab", "GetVocab", "RegisterGet", "RegisterPrepare", "RegisterAccept"])
    if kind == "PutVocab":
        entry: list[Any] = [rng.choice([0, 1, 2, -1]), rng.choice([0, 2**64 - 1, 12345]),
                            rng.choice(["word", "", "w" * (p.MAX_VOCAB_TEXT_CHARS + 1)])]
        fields = {"type": 7, "entries": rng.choice([[entry], [entry[:2]], "x", [entry] * 3])}
        return "PutVocab mutated", _ENC.encode(fields), [], "read"  # (a hash mismatch: BadRequest)
    if kind == "GetVocab":
        fields = {"type": 8, "kinds": [rng.choice([0, 1, 2])] * rng.randrange(3), "ids": [1] * rng.randrange(3)}
        return "GetVocab mutated", _ENC.encode(fields), [], "read"
    fields = _fields(p.RegisterAccept("fuzz/key", 1, 2, 3, 4, 5, b"v"))
    fields["type"] = {"RegisterGet": 13, "RegisterPrepare": 14, "RegisterAccept": 15}[kind]
    name = rng.choice(["key", "round", "value", "version", "placement_epoch"])
    fields[name] = rng.choice(["", "k" * (p.MAX_REGISTER_KEY_CHARS + 1), -1, 1.5, None,
                               b"v" * (p.MAX_REGISTER_VALUE_BYTES + 1), 2**64 - 1, "fuzz/key"])
    return f"{kind} bad {name}", _ENC.encode(fields), [], "read"


def runtime_mutation(node: Node) -> Mutation:
    """Ring and override requests with bad fields (valid ones would change the node's placement)."""
    rng = node.rng
    if rng.random() < 0.5:
        entry: list[Any] = [NODE, 1, "active", 1.0]
        j = rng.randrange(4)
        entry[j] = rng.choice([["", "x" * 300, 5], [-1, "x", 1.5], ["gone", 1], [-1.0, "x"]][j])
        fields: dict[str, Any] = {"type": 11, "entries": [entry]}
        return f"RingPush bad entry {j}", _ENC.encode(fields), [], "refused"
    member: list[Any] = [NODE, f"mem://{NODE}", 1.0]
    j = rng.randrange(3)
    member[j] = rng.choice([["", 5], [5, "x" * (p.MAX_TEXT_CHARS + 1)], [0.0, -1.0, float("inf"), float("nan")]][j])
    fields = {"type": 12, "members": [member], "flush_timeout_s": rng.choice([30.0, 0.0, -1.0, 1e9])}
    return f"SetOverride bad member {j}", _ENC.encode(fields), [], "refused"


def stream_mutation(node: Node) -> Mutation:
    """Stream, source-control and repair requests on the stream endpoint, all bad or read-only."""
    rng = node.rng
    sid = (1 << 60) + rng.randrange(1 << 20)
    cols, feats = _keys_held(node)
    kind = rng.choice(["hello", "data", "verify", "verify", "start", "control", "repair", "repair"])
    if kind == "hello":
        bulk = rng.choice([[], [cols, feats], [_cast(cols, np.float64)], [cols.reshape(1, -1)]])
        return "StreamHello bad columns", _ENC.encode(StreamHello(sid, "fuzzer")), bulk, "refused"
    if kind == "data":
        bad, bulk = _bad_bulk(rng, _good_batch(node))
        return f"StreamData bulk {bad}", _ENC.encode(StreamData(sid, 0, 1, 0)), bulk, "refused"
    if kind == "verify":
        msg = StreamVerify(sid, rng.random() < 0.5, rng.choice([0, 1, 2, 2**63]))
        if rng.random() < 0.4:
            return "StreamVerify", _ENC.encode(msg), [cols, feats], "read"
        bad, bulk = _bad_keys(rng, cols, feats, 1 << 20)
        return f"StreamVerify keys {bad}", _ENC.encode(msg), bulk, "refused"
    if kind == "start":  # never starts: a wrong source, placement or column list
        fields = _fields(SourceStart(sid, "mem://nowhere", NODE, "b", [(NODE, 1.0)], [(NODE, 1.0), ("b", 1.0)], 1))
        bulk: list[np.ndarray] = []
        what = rng.choice(["source", "weight", "replicas", "strategy", "columns"])
        if what == "source":
            fields["source"] = "not-me"
        elif what == "weight":
            fields["new_members"] = [[NODE, rng.choice([0.0, -1.0, float("inf"), float("nan")])]]
        elif what == "replicas":
            fields["replicas"] = rng.choice([0, -1, -(2**63)])
        elif what == "strategy":
            fields["strategy"] = rng.choice(["", "nope", 5])
        else:
            bulk = rng.choice([[_cast(cols, np.float64)], [_cast(cols, np.int8)], [cols.reshape(1, -1)], [cols, cols]])
        return f"SourceStart bad {what}", _ENC.encode(fields), bulk, "refused"
    if kind == "control":
        msg2 = rng.choice([SourceStatus(sid), ListColumns(), HintsHeld(["x", NODE]), DeliverHints(),
                           DropHints("nobody"), DiscardStream(sid)])
        return f"{type(msg2).__name__}", _ENC.encode(msg2), [], "read"
    spec = PlacementSpec([(NODE, rng.choice([1.0, 0.0, -1.0, float("inf")]))], rng.choice([1, 0, -1]),
                         rng.choice(["hash", "nope"]), [], rng.choice(["", "bogus"]))
    req = rng.choice([LoggedFor(NODE, spec, rng.choice([0, 2**64 - 1]), rng.choice([1, 2**40])),
                      DigestsFor(rng.choice([NODE, "x"]), spec, rng.choice([None, (2**64 - 1, 0)]),
                                 rng.choice([1, 2**40]), rng.choice([1, 2, 255])),
                      RowsOf(rng.choice([0, 1, 2**40]))])
    bulk = rng.choice([[], [cols, feats], [_cast(cols, np.float32), feats], [cols.reshape(1, -1)] * 2,
                       [np.zeros(3, np.float32)] * 4])
    return f"{type(req).__name__}", _ENC.encode(req), bulk, "read"


def garbage(node: Node) -> Mutation:
    """Bytes that are no request, or a map with any tag and random fields."""
    rng = node.rng
    roll = rng.random()
    # (one msgpack object each: a payload that is not one breaks the frame itself, which
    # test_framing_fuzz.py covers)
    if roll < 0.3:
        payload = _ENC.encode(rng.randbytes(rng.randrange(64)))
    elif roll < 0.5:
        payload = _ENC.encode(rng.choice([None, 1, "x", [1, 2], b"\x00" * 9, 1.5, {"type": None}]))
    else:
        fields: dict[str, Any] = {"type": rng.randrange(-2, 260)}
        for name in rng.sample(["writer", "seq", "stream_id", "key", "entries", "members", "column", "limit",
                                "seqs", "node", "placement", "index"], rng.randrange(5)):
            fields[name] = rng.choice(_BAD_VALUES)
        payload = _ENC.encode(fields)
    bulk = [np.arange(rng.randrange(6)).astype(rng.choice(_DTYPES)) for _ in range(rng.randrange(4))]
    return "garbage", payload, bulk, "garbage"


GENERATORS: list[tuple[float, Callable[[Node], Mutation], str]] = [
    (0.34, apply_mutation, "data"),
    (0.22, read_mutation, "data"),
    (0.10, vocab_register_mutation, "data"),
    (0.06, runtime_mutation, "data"),
    (0.18, stream_mutation, "stream"),
    (0.10, garbage, "either"),
]

_STREAM_REPLIES: Any = None


def _decode_stream_reply(payload: memoryview) -> Any:
    """Decode a stream endpoint's reply with the union of its replies (stream, source, repair)."""
    global _STREAM_REPLIES
    if _STREAM_REPLIES is None:
        from giaannd.storage.rebalance import register_handoff as rh
        from giaannd.storage.rebalance import source_control as sc
        from giaannd.storage.repair import wire as rw
        from giaannd.storage.streaming import stream as st

        types = (st.StreamPosition | st.StreamRefused | st.VerifyReply | sc.SourceState | sc.SourceRefused
                 | sc.ColumnList | sc.HintCount | sc.StreamDiscarded | rh.RegisterStates | rh.RegisterCount
                 | rw.LoggedPage | rw.RepairRefused | rw.DigestsPage | rw.RowsPage)
        _STREAM_REPLIES = msgspec.msgpack.Decoder(types)
    return _STREAM_REPLIES.decode(payload)


_STREAM_REFUSALS = ("StreamRefused", "SourceRefused", "RepairRefused")


async def _send(node: Node, mutation: Mutation, where: str) -> None:
    """Send one mutated request and check (a) and (c)."""
    name, payload, bulk, expect = mutation
    rows_before, hints_before = node.held_rows(), node.cluster.services[NODE].hints.held
    if where == "either":
        where = node.rng.choice(["data", "stream"])
    conn = node.data if where == "data" else node.stream
    reply_payload, reply_bulk = await _call(conn, payload, bulk, name)
    if where == "data":
        try:
            reply: Any = p.decode_reply(reply_payload)
        except p.ProtocolViolation as exc:
            pytest.fail(f"{name}: an undecodable reply: {exc}")
        refused = isinstance(reply, p.ErrorReply.__args__)  # type: ignore[attr-defined]
    else:
        try:
            reply = _decode_stream_reply(reply_payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            pytest.fail(f"{name}: an undecodable stream endpoint reply: {exc}")
        refused = type(reply).__name__ in _STREAM_REFUSALS
    if expect == "refused":
        assert refused, f"{name}: accepted ({reply!r}), expected a refusal"
    if expect == "store_full":
        assert isinstance(reply, p.StoreFull), f"{name}: {reply!r}, expected StoreFull"
    if expect == "applied":
        assert isinstance(reply, p.ApplyAck), f"{name}: {reply!r}, expected an ack"
    if isinstance(reply, p.ApplyAck) and reply.applied:
        batch = RowBatch.from_buffers(list(bulk))
        msg = p.decode_request(payload)
        assert isinstance(msg, p.ApplyBatch)
        node.cluster.reference.apply(BatchId(msg.writer, msg.seq), batch)
        return
    if isinstance(reply, p.RowsReply | p.ScanPage):  # a reply a client accepts
        p.check_batch(reply_bulk)
    assert _same_rows(node.held_rows(), rows_before), f"{name}: rows changed ({reply!r})"
    assert node.cluster.services[NODE].hints.held == hints_before, f"{name}: a hint was held ({reply!r})"
    if node.retry is not None:
        header, batch = node.retry
        node.retry = None
        reply_payload, _ = await _call(node.data, header, batch.buffers(), f"{name}, retried")
        ack = p.decode_reply(reply_payload)
        assert isinstance(ack, p.ApplyAck) and ack.applied, f"{name}: its retry was answered {ack!r}"
        msg = p.decode_request(header)
        node.cluster.reference.apply(BatchId(msg.writer, msg.seq), batch)


async def _check_rows(node: Node, why: str) -> None:
    """(b): exactly the reference rows, and all of them read back over the wire in a reply a client
    accepts, bit for bit."""
    ref = node.cluster.reference
    assert node.cluster.mismatches() == [], why
    assert len(node.store.store) == len(ref), why
    keys = ref.keys()
    cols, feats = _u64(*(k[0] for k in keys)), _u64(*(k[1] for k in keys))
    payload, bulk = await _call(node.data, p.encode(p.ReadRows()), [cols, feats])
    assert isinstance(p.decode_reply(payload), p.RowsReply), why
    try:
        got = p.check_batch(bulk)
    except p.ProtocolViolation as exc:
        pytest.fail(f"{why}: the rows held do not read back: {exc}")
    assert _same_rows(got, ref.read_rows(cols, feats)), why


async def _connect(cluster: Cluster) -> tuple[Any, Any]:
    """A new connection to the node's data plane and one to its stream endpoint."""
    transport = cluster.transport("fuzzer")
    data = await transport.connect_once(cluster.addresses[NODE], timeout_s=CALL_TIMEOUT_S)
    stream = await transport.connect_once(cluster.stream_addresses[NODE], timeout_s=CALL_TIMEOUT_S)
    return data, stream


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_storage_requests_fuzz(tmp_path, seed):
    cluster = await Cluster(tmp_path, names=[NODE], replicas=1, request_timeout_s=CALL_TIMEOUT_S,
                            capacity_bytes=STORE_BYTES).start()
    try:
        rng = random.Random(seed)
        await cluster.write_many(np.random.default_rng(seed), 4, np.arange(1, 40, dtype=np.uint64))
        data, stream = await _connect(cluster)
        node = Node(cluster, data, stream, rng)
        weights = [w for w, _, _ in GENERATORS]
        for i in range(REQUESTS_PER_SEED):
            _, gen, where = rng.choices(GENERATORS, weights)[0]
            mutation = gen(node)
            await _send(node, mutation, where)
            assert not data.is_closed and not stream.is_closed, f"request {i} ({mutation[0]}) closed the connection"
        if seed % 4 == 0:  # the size limits, before anything is copied (32 MiB at most: a few seeds)
            await _send(node, oversized_apply(node), "data")
        if seed % 4 == 1:
            await _send(node, too_big_for_the_store(node), "data")
        await _check_rows(node, "after the bad requests")
        # (b) a good write and read still work, and everything survives a restart from the files
        await cluster.write(make_batch(np.random.default_rng(seed + 1000), 3))
        await _check_rows(node, "after a good write")
        await cluster.services[NODE].snapshot()
        await cluster.write(make_batch(np.random.default_rng(seed + 2000), 3))  # (in the log only)
        await data.close()
        await stream.close()
        await cluster.kill(NODE)
        await cluster.restart_node(NODE)
        node.data, node.stream = await _connect(cluster)
        await _check_rows(node, "after a restart")
        await node.data.close()
        await node.stream.close()
    finally:
        await cluster.close()


def test_storage_requests_fuzz_mutations_are_deterministic():
    """Same seed, same requests: a failure reproduces from its seed alone."""
    def run(seed: int) -> list[tuple[str, bytes]]:
        from giaannd.storage.engine.column_store import ColumnStore

        class _Fake:
            reference = ColumnStore(1 << 20)

        node = Node(_Fake(), None, None, random.Random(seed))  # type: ignore[arg-type]
        node.held_rows = RowBatch.empty  # type: ignore[method-assign]
        gens = [apply_mutation, read_mutation, vocab_register_mutation, runtime_mutation, stream_mutation, garbage]
        return [(m[0], m[1]) for m in (gens[i % len(gens)](node) for i in range(60))]

    assert run(3) == run(3)


@pytest.mark.asyncio
async def test_stream_endpoint_refuses_keys_and_columns_of_another_dtype_or_rank(tmp_path):
    """Found by the fuzz above: a ``StreamVerify`` cast keys of any dtype to u64 (floats became
    other keys, silently) and raised on 2-d ones (a ``RemoteError``, not a refusal); a
    ``SourceStart`` cast its column list the same way."""
    cluster = await Cluster(tmp_path, names=[NODE], replicas=1).start()
    try:
        await cluster.write_many(np.random.default_rng(0), 1, np.arange(1, 9, dtype=np.uint64))
        data, stream = await _connect(cluster)
        keys = _u64(1, 2, 3, 4)
        for combined in (False, True):
            msg = _ENC.encode(StreamVerify(7, combined))
            for bulk in ([keys.astype(np.float64), keys], [keys.astype(np.int64), keys],
                         [keys.reshape(2, 2), keys.reshape(2, 2)]):
                payload, _ = await _call(stream, msg, bulk, f"StreamVerify {bulk[0].dtype} {bulk[0].shape}")
                assert type(_decode_stream_reply(payload)).__name__ == "StreamRefused", bulk
        start = _ENC.encode(SourceStart(9, "mem://nowhere", NODE, "b", [(NODE, 1.0)], [(NODE, 1.0), ("b", 1.0)], 1))
        for columns in (np.array([1.5, 2.0]), np.array([-1, 3], np.int64)):
            payload, _ = await _call(stream, start, [columns], f"SourceStart {columns.dtype}")
            assert type(_decode_stream_reply(payload)).__name__ == "SourceRefused", columns
        await data.close()
        await stream.close()
    finally:
        await cluster.close()
