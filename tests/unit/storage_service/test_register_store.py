"""giaannd.storage.engine.register_store (the CASPaxos acceptor and its log) and the Register*
requests of the storage request core."""

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.storage.engine import register_store as rs
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.register_store import (
    REGISTERS_FILE,
    RegisterLogCorrupt,
    RegisterState,
    RegisterStore,
    RegisterStoreFull,
    accept,
    merge,
    prepare,
)
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests, WaitRegistersSynced

S0 = RegisterState()
V7 = (7, 4, 4)
PROMISED = RegisterState((5, 1))
ACCEPTED = RegisterState((5, 1), (5, 1), (3, 5, 1), b"x")


@pytest.mark.parametrize(("state", "ballot", "want"), [
    (S0, (1, 1), RegisterState((1, 1))),
    (S0, (0, 0), (0, 0)),                                      # the zero ballot is never above anything
    (PROMISED, (5, 1), (5, 1)),                                # the same ballot again: refused
    (PROMISED, (5, 0), (5, 1)),                                # proposer id breaks the tie
    (PROMISED, (5, 2), RegisterState((5, 2))),
    (ACCEPTED, (4, 9), (5, 1)),
    (ACCEPTED, (6, 0), RegisterState((6, 0), (5, 1), (3, 5, 1), b"x")),  # keeps the accepted value
])
def test_register_prepare_rule(state, ballot, want):
    assert prepare(state, ballot) == want


@pytest.mark.parametrize(("state", "ballot", "want"), [
    (S0, (1, 1), RegisterState((1, 1), (1, 1), V7, b"v")),      # no promise needed first
    (PROMISED, (5, 1), RegisterState((5, 1), (5, 1), V7, b"v")),
    (PROMISED, (4, 1), (5, 1)),                                 # below the promise: refused
    (PROMISED, (6, 1), RegisterState((6, 1), (6, 1), V7, b"v")),
    (ACCEPTED, (5, 1), ACCEPTED),                               # a retransmission: nothing changes
    (RegisterState((9, 9), (5, 1), V7, b"x"), (5, 1), (9, 9)),  # promised higher since: refused
])
def test_register_accept_rule(state, ballot, want):
    assert accept(state, ballot, V7, b"v") == want


NEWER = RegisterState((8, 2), (8, 2), (4, 8, 2), b"y")


@pytest.mark.parametrize(("state", "copied", "want"), [
    (S0, S0, S0),
    (S0, ACCEPTED, ACCEPTED),                                    # an empty joiner takes the copy
    (ACCEPTED, S0, ACCEPTED),                                    # an empty copy changes nothing
    (ACCEPTED, NEWER, NEWER),                                    # the higher accepted ballot wins...
    (NEWER, ACCEPTED, NEWER),                                    # ...from either side
    (RegisterState((9, 1)), ACCEPTED,                            # keeps its own higher promise
     RegisterState((9, 1), (5, 1), (3, 5, 1), b"x")),
    (ACCEPTED, RegisterState((9, 1)),                            # takes the copy's higher promise
     RegisterState((9, 1), (5, 1), (3, 5, 1), b"x")),
    (RegisterState((9, 1), (5, 1), (3, 5, 1), b"x"), NEWER,      # accepted 8 < own promise 9: both kept
     RegisterState((9, 1), (8, 2), (4, 8, 2), b"y")),
    (ACCEPTED, RegisterState((5, 1), (5, 1), (3, 5, 1), b"x"), ACCEPTED),  # same ballot: one value
])
def test_register_merge_rule(state, copied, want):
    got = merge(state, copied)
    assert got == want
    # never backwards: the promise and the accepted ballot are each at least the state's own
    assert got.promised >= state.promised and got.accepted >= state.accepted
    assert got.top >= max(state.top, copied.top)
    assert merge(got, copied) == got  # idempotent (a retried import changes nothing)


def test_register_store_merge_is_durable_and_seals_scope_to_an_epoch(tmp_path):
    s = RegisterStore.open(tmp_path)
    got, seq = s.merge("job/a", NEWER)
    assert got == NEWER and seq == 1
    assert s.merge("job/a", ACCEPTED) == (NEWER, 1)  # nothing to change: nothing appended
    s.sync()
    s.close()
    s = RegisterStore.open(tmp_path)
    assert s.get("job/a") == NEWER and s.items() == [("job/a", NEWER)]
    s.seal(["job/a"], "e1")
    assert s.sealed("job/a", "e1") and not s.sealed("job/a", "e2") and not s.sealed("job/b", "e1")
    assert s.unseal() == 1 and not s.sealed("job/a", "e1")
    s.close()


def test_register_store_survives_restart_and_answers_after_sync(tmp_path):
    s = RegisterStore.open(tmp_path)
    got, seq = s.prepare("job/a", (1, 7))
    assert got == RegisterState((1, 7)) and seq == 1 and s.durable_seq == 0
    got, seq = s.accept("job/a", (1, 7), (1, 1, 7), b"row")
    assert seq == 2
    refused, seq = s.prepare("job/a", (1, 6))
    assert refused == (1, 7) and seq == 0  # a refusal writes nothing
    again, seq = s.accept("job/a", (1, 7), (1, 1, 7), b"row")
    assert again == s.get("job/a") and seq == 2  # retransmission: answered once seq 2 is durable
    assert s.sync() == 2 == s.durable_seq
    s.close()
    t = RegisterStore.open(tmp_path)
    assert t.get("job/a") == RegisterState((1, 7), (1, 7), (1, 1, 7), b"row") and t.get("other") == rs.EMPTY
    t.close()


def test_register_store_torn_tail_cut_corruption_named(tmp_path):
    s = RegisterStore.open(tmp_path)
    s.prepare("k", (1, 1))
    first = s.nbytes
    s.accept("k", (1, 1), (1, 1, 1), b"v1")
    s.prepare("k", (2, 1))
    s.sync()
    s.close()
    path = tmp_path / REGISTERS_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    t = RegisterStore.open(tmp_path)
    assert t.torn_bytes > 0 and t.get("k") == RegisterState((1, 1), (1, 1), (1, 1, 1), b"v1")
    t.close()
    bad = bytearray(path.read_bytes())
    bad[first - 2] ^= 0xFF  # damage the first record; an intact one follows
    path.write_bytes(bytes(bad))
    with pytest.raises(RegisterLogCorrupt, match="offset 0"):
        RegisterStore.open(tmp_path)


def test_register_store_compaction_keeps_states_and_later_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(rs, "COMPACT_MIN_BYTES", 2000)
    s = RegisterStore.open(tmp_path)
    for i in range(1, 200):
        s.prepare("k", (i, 1))
        s.accept("k", (i, 1), (i, i, 1), b"v" * 20)
    s.prepare("other", (1, 2))
    big = s.nbytes
    assert s.sync() == s.durable_seq and s.compactions == 1 and s.nbytes < big / 10
    s.accept("other", (1, 2), (1, 1, 2), b"after")  # appended to the new file
    s.sync()
    s.close()
    t = RegisterStore.open(tmp_path)
    assert t.get("k") == RegisterState((199, 1), (199, 1), (199, 199, 1), b"v" * 20)
    assert t.get("other") == RegisterState((1, 2), (1, 2), (1, 1, 2), b"after")
    assert not list(tmp_path.glob("*.compact"))
    t.close()


def test_register_store_refuses_past_its_limit_without_change(tmp_path):
    s = RegisterStore.open(tmp_path, max_bytes=300)
    s.accept("a", (1, 1), (1, 1, 1), b"x" * 100)
    size = s.nbytes
    with pytest.raises(RegisterStoreFull):
        s.accept("b", (1, 1), (1, 1, 1), b"y" * 200)
    assert s.get("b") == rs.EMPTY and s.nbytes == size
    s.accept("a", (2, 1), (2, 2, 1), b"z" * 150)  # replacing a value is charged the difference only
    s.close()


@pytest.fixture
def core(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 20)
    hints = HintStore.open(tmp_path / "hints")
    c = StorageRequests(store, hints, "", lambda: None)
    c.registers = registers = RegisterStore.open(tmp_path / "registers")
    yield c
    registers.close()
    store.close()
    hints.close()


def test_requests_register_prepare_accept_get_and_conflict(core):
    step = core.handle(p.encode(p.RegisterPrepare("job/x", 3, 9)), [])
    assert isinstance(step, WaitRegistersSynced) and step.reply == p.RegisterValue()
    step = core.handle(p.encode(p.RegisterAccept("job/x", 3, 9, 1, 3, 9, b"row")), [])
    assert isinstance(step, WaitRegistersSynced) and step.reply == p.RegisterAccepted() and step.seq == 2
    step = core.handle(p.encode(p.RegisterGet("job/x")), [])
    assert isinstance(step, Answer) and step.reply == p.RegisterValue(3, 9, 1, 3, 9, b"row")
    step = core.handle(p.encode(p.RegisterPrepare("job/x", 3, 8)), [])
    assert isinstance(step, Answer) and step.reply == p.RegisterConflict(3, 9)
    step = core.handle(p.encode(p.RegisterPrepare("job/x", 4, 1)), [])
    assert step.reply == p.RegisterValue(3, 9, 1, 3, 9, b"row")  # the promise answers the accepted value
    assert core.counters.register_changes == 3 and core.counters.errors == {"RegisterConflict": 1}


def test_requests_register_limits_and_refusals(core):
    raw = p.encode(p.RegisterAccept("k", 1, 1, 1, 1, 1, b"v"))
    huge = p.encode(p.RegisterAccept("k", 1, 1, 1, 1, 1, b"\0" * (p.MAX_REGISTER_VALUE_BYTES + 1)))
    for payload in (huge, p.encode(p.RegisterGet("k" * (p.MAX_REGISTER_KEY_CHARS + 1))), raw[:-1]):
        step = core.handle(payload, [])
        assert isinstance(step.reply, p.BadRequest)
    assert len(core.registers) == 0
    core.refuse_writes = True
    assert isinstance(core.handle(raw, []).reply, p.Unavailable)
    assert isinstance(core.handle(p.encode(p.RegisterGet("k")), []).reply, p.RegisterValue)  # reads still served
    core.refuse_writes, core.registers = False, None
    assert isinstance(core.handle(raw, []).reply, p.Unavailable)


def test_requests_register_not_owner(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 20)
    hints = HintStore.open(tmp_path / "hints")
    view = ClusterView(local="n0", replicas=1)
    view.set_members([StorageNode("n0", "mem://n0"), StorageNode("n1", "mem://n1")])
    core = StorageRequests(store, hints, "n0", lambda: view)
    core.registers = RegisterStore.open(tmp_path / "registers")
    keys = [f"job/{i}" for i in range(40)]
    mine = [k for k in keys if view.placement.owners(p.register_key_id(k)) == ("n0",)]
    other = [k for k in keys if k not in mine]
    assert mine and other
    assert isinstance(core.handle(p.encode(p.RegisterPrepare(mine[0], 1, 1)), []), WaitRegistersSynced)
    step = core.handle(p.encode(p.RegisterPrepare(other[0], 1, 1)), [])
    assert isinstance(step.reply, p.NotOwner) and len(core.registers) == 1
    # a sealed key (handed off by a placement change) is answered like one not owned, reads too
    core.registers.seal([mine[0]], view.placement.epoch)
    for msg in (p.RegisterGet(mine[0]), p.RegisterPrepare(mine[0], 2, 1)):
        assert isinstance(core.handle(p.encode(msg), []).reply, p.NotOwner)
    core.registers.unseal()
    assert isinstance(core.handle(p.encode(p.RegisterGet(mine[0])), []).reply, p.RegisterValue)
    assert p.register_key_id("job/1") != p.register_key_id("job/2")
    assert np.uint64(p.register_key_id("job/1")) >= 0
    core.registers.close()
    store.close()
    hints.close()


def test_register_store_holds_values_past_its_ram_cap_on_disk(tmp_path, monkeypatch):
    """Corpus chunks (issue 15 item 1): values of `spill_bytes` or more stay in the log, not in
    RAM, so registers far beyond the RAM cap are accepted, read back, compacted and reloaded."""
    monkeypatch.setattr(rs, "COMPACT_MIN_BYTES", 64 * 1024)
    monkeypatch.setattr(rs, "COMPACT_RATIO", 1)
    s = RegisterStore.open(tmp_path, max_bytes=64 * 1024)
    chunks = {f"job/j/w/{i}/0": bytes([i]) * 16_384 for i in range(64)}  # 1 MiB: 16x the RAM cap
    for key, value in chunks.items():
        s.prepare(key, (1, 1))
        s.accept(key, (1, 1), (1, 1, 1), value)
    s.accept("job/j", (1, 1), (1, 1, 1), b"row")  # a small value stays in RAM
    assert s.ram_bytes <= 64 * 1024
    assert all(s.get(k).value == v for k, v in chunks.items())
    for i in range(8):  # clear some chunks (what the end of a job does), then compact
        s.accept(f"job/j/w/{i}/0", (2, 1), (2, 2, 1), b"")
    s.accept("job/j/w/9/0", (3, 1), (3, 3, 1), b"\x09" * 20_000)
    s.sync()
    for i in range(2):  # grow the log with small changes until a compaction runs
        for r in range(4, 400):
            s.prepare("job/j", (r + 400 * i, 1))
        s.sync()
    assert s.compactions >= 1
    s.accept("job/j/w/10/0", (9999, 1), (9, 9, 1), b"\x0a" * 17_000)  # after the compaction
    s.sync()
    want = {**chunks, **{f"job/j/w/{i}/0": b"" for i in range(8)},
            "job/j/w/9/0": b"\x09" * 20_000, "job/j/w/10/0": b"\x0a" * 17_000}
    assert all(s.get(k).value == v for k, v in want.items())
    assert [k for k, _ in s.items()] == sorted([*want, "job/j"])
    s.close()
    t = RegisterStore.open(tmp_path, max_bytes=64 * 1024)
    assert all(t.get(k).value == v for k, v in want.items()) and t.get("job/j").value == b"row"
    assert t.ram_bytes <= 64 * 1024
    t.close()


def test_register_store_names_a_damaged_value_on_read(tmp_path):
    s = RegisterStore.open(tmp_path)
    s.accept("job/j/w/0/0", (1, 1), (1, 1, 1), b"\x01" * 50_000)
    s.sync()
    path = tmp_path / REGISTERS_FILE
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # the value's bytes change on disk after the store read the log
    path.write_bytes(bytes(data))
    with pytest.raises(RegisterLogCorrupt, match="offset 0"):
        s.get("job/j/w/0/0")
    s.close()
