"""Source control (source_control.py), pure parts: the messages share the stream endpoint's tag
space without collisions and round-trip; a remote source computing its own columns from the
SourceStart inputs (TransferRule over the columns it holds) gets exactly the coordinator's plan."""

import msgspec
import numpy as np
import pytest

from giaannd.storage.rebalance import source_control as sc
from giaannd.storage.rebalance.plan import TransferRule, plan_transfers
from giaannd.storage.streaming import stream as streaming
from peers.placement import Member, Placement

START = sc.SourceStart(7, "tcp://127.0.0.1:1", "a", "d", [("a", 1.0), ("b", 2.0)], [("a", 1.0), ("d", 1.0)], 2,
                       "weighted", ["a", "b"], ["b"], 4096, 1e6, "a->d", resume=True)


def test_source_control_tags_do_not_collide_with_stream_messages():
    def tags(union):
        return [t.__struct_config__.tag for t in union.__args__]

    mine = tags(sc.SourceRequest) + tags(sc.SourceReply)
    theirs = tags(streaming.StreamRequest) + tags(streaming.StreamReply)
    assert len(set(mine)) == len(mine)
    shared = {streaming.StreamRefused.__struct_config__.tag}  # in both reply unions on purpose
    assert (set(mine) - shared).isdisjoint(theirs)


@pytest.mark.parametrize("msg", [START, sc.SourceStatus(1), sc.SourcePause(2), sc.SourceClose(3),
                                 sc.SourceAbort(4, "why"), sc.SourceRate(5, None), sc.SourceRate(5, 10.0),
                                 sc.ListColumns(), sc.HintsHeld(["a", "b"]), sc.DeliverHints(), sc.DropHints("x")])
def test_source_control_requests_round_trip_through_the_endpoint_union(msg):
    decoder = msgspec.msgpack.Decoder(streaming.StreamRequest | sc.SourceRequest)
    assert decoder.decode(msgspec.msgpack.encode(msg)) == msg


def test_source_control_replies_round_trip():
    decoder = msgspec.msgpack.Decoder(sc.SourceReply)
    state = sc.SourceState(9, "caught-up", True, False, None, {"bytes_done": 5, "eta_s": None, "stream": "a->d"})
    for msg in (state, sc.SourceRefused(9, "no"), sc.ColumnList(), sc.HintCount(3)):
        assert decoder.decode(msgspec.msgpack.encode(msg)) == msg


def test_source_control_rejects_a_negative_stream_id():
    decoder = msgspec.msgpack.Decoder(sc.SourceRequest)
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"type": 17, "stream_id": -1}))


@pytest.mark.parametrize("seed", range(5))
def test_remote_source_computes_the_coordinators_columns(seed):
    """What SourceRegistry does with a SourceStart (rebuild both placements and the TransferRule,
    claim among the columns the source holds) equals the coordinator's plan for that pair."""
    rng = np.random.default_rng(seed)
    old_m = [("s0", 1.0), ("s1", 1.0), ("s2", 1.0), ("s3", 1.0)]
    new_m = [m for m in old_m if m[0] != "s1"] + [("s4", 1.0)]  # replace s1 (dead) with s4
    live = ["s0", "s2", "s3"]
    old = Placement(tuple(Member(n, w) for n, w in old_m), 2)
    new = Placement(tuple(Member(n, w) for n, w in new_m), 2)
    columns = np.unique(rng.integers(1, 2**63, 400, dtype=np.uint64))
    plan = plan_transfers(old, new, columns, live)
    assert plan.transfers
    for t in plan.transfers:
        rule = TransferRule(Placement(tuple(Member(n, w) for n, w in old_m), 2),
                            Placement(tuple(Member(n, w) for n, w in new_m), 2), frozenset(live))
        held = columns[(old.owner_indices(columns) == old.names.index(t.source)).any(axis=1)]
        mine = held[rule.claims(t.source, t.target, held)]
        assert np.array_equal(mine, t.columns), (t.source, t.target)
