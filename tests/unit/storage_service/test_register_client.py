"""giaannd.client.registers: the CASPaxos proposer (CasRound / ReadRound, sans-IO) and RegisterClient
over in-memory acceptors (the storage rules of register_store.py), conflict paths included."""

import asyncio
import random

import pytest

from giaannd import protocol as p
from giaannd.client.errors import RegisterUnavailable, RemoteRegisterConflict, RemoteUnavailable
from giaannd.client.registers import (
    ABSENT,
    CasOutcome,
    CasRound,
    ReadRound,
    RegisterClient,
    RegisterRead,
    register_owners,
)
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.storage.engine.register_store import RegisterState, accept, prepare

OWNERS = ("a", "b", "c")
ME = 7


def val(rnd=0, prop=0, version=0, value=b"", origin=None):
    """An acceptor's answer; the value's origin ballot defaults to the accepted one."""
    origin = origin or ((rnd, prop) if version else (0, 0))
    return p.RegisterValue(rnd, prop, version, *origin, value)


def conflict(rnd, prop):
    return RemoteRegisterConflict("x", p.RegisterConflict(rnd, prop))


def run_prepare(rnd, answers):
    out = []
    for node, ans in zip(OWNERS, answers):
        out = rnd.on_prepare(node, ans) or out
    return out


def test_cas_round_on_empty_register_prepares_then_accepts():
    rnd = CasRound("k", OWNERS, (1, ME), ABSENT, b"new")
    assert [type(m) for _, m in rnd.start()] == [p.RegisterPrepare] * 3
    accepts = run_prepare(rnd, [val(), val()])  # a quorum: decided after two
    assert [m for _, m in accepts] == [p.RegisterAccept("k", 1, ME, 1, 1, ME, b"new")] * 3
    rnd.on_accept("a", p.RegisterAccepted())
    assert not rnd.done
    rnd.on_accept("b", p.RegisterAccepted())
    assert rnd.done and rnd.outcome == CasOutcome(True, (1, 1, ME), b"new")


def test_cas_round_refused_at_once_when_the_quorum_agrees():
    rnd = CasRound("k", OWNERS, (9, ME), (1, 3, 2), b"new")
    assert run_prepare(rnd, [val(4, 2, 2, b"cur"), val(4, 2, 2, b"cur")]) == []
    assert rnd.done and rnd.outcome == CasOutcome(False, (2, 4, 2), b"cur")


def test_cas_round_refusal_writes_back_an_unsettled_value_first():
    # b holds a newer value a proposer got accepted only there (then died): the highest ballot wins,
    # and it is written back before the refusal reports it, so it is chosen from then on
    rnd = CasRound("k", OWNERS, (9, ME), (1, 3, 1), b"new")
    accepts = run_prepare(rnd, [val(3, 1, 1, b"old"), val(5, 2, 2, b"partial")])
    # written back under our ballot, keeping its version (its origin ballot (5, 2))
    assert [m for _, m in accepts] == [p.RegisterAccept("k", 9, ME, 2, 5, 2, b"partial")] * 3
    rnd.on_accept("a", p.RegisterAccepted())
    rnd.on_accept("c", p.RegisterAccepted())
    assert rnd.outcome == CasOutcome(False, (2, 5, 2), b"partial")


def test_cas_round_builds_on_an_unsettled_value_of_the_expected_version():
    rnd = CasRound("k", OWNERS, (9, ME), (2, 5, 2), b"mine")
    accepts = run_prepare(rnd, [val(3, 1, 1, b"old"), val(5, 2, 2, b"partial")])
    assert [m for _, m in accepts][0] == p.RegisterAccept("k", 9, ME, 3, 9, ME, b"mine")


def test_cas_round_same_counter_other_value_is_a_refusal():
    # the lost update a bare counter would allow: we read version 2 from a change that was then
    # superseded by another version-2 value; our CAS must not be applied on top of that one
    rnd = CasRound("k", OWNERS, (9, ME), (2, 5, 2), b"mine")
    run_prepare(rnd, [val(6, 3, 2, b"other"), val(6, 3, 2, b"other")])
    assert rnd.outcome == CasOutcome(False, (2, 6, 3), b"other")


@pytest.mark.parametrize(("answers", "retry", "error"), [
    ([conflict(4, 1), conflict(6, 0)], (6, 0), False),
    ([ConnectionError("x"), conflict(4, 1)], (4, 1), False),        # a refusal beats "no quorum"
    ([ConnectionError("x"), RemoteUnavailable("stopping", "b")], None, True),
])
def test_cas_round_prepare_lost(answers, retry, error):
    rnd = CasRound("k", OWNERS, (1, ME), ABSENT, b"v")
    run_prepare(rnd, answers)
    assert rnd.done and rnd.outcome is None and rnd.retry_above == retry and (rnd.error is not None) == error


def test_cas_round_accept_lost_to_a_higher_ballot():
    rnd = CasRound("k", OWNERS, (1, ME), ABSENT, b"v")
    run_prepare(rnd, [val(), val(), val()])
    rnd.on_accept("a", p.RegisterAccepted())
    rnd.on_accept("b", conflict(2, 3))
    assert not rnd.done
    rnd.on_accept("c", conflict(2, 3))
    assert rnd.done and rnd.outcome is None and rnd.retry_above == (2, 3)


def test_cas_round_recognises_its_own_earlier_round():
    rnd = CasRound("k", OWNERS, (8, ME), (4, 1, 1), b"v")
    assert run_prepare(rnd, [val(7, ME, 5, b"v"), val(7, ME, 5, b"v")]) == []
    assert rnd.outcome == CasOutcome(True, (5, 7, ME), b"v")
    other = CasRound("k", OWNERS, (8, ME), (4, 1, 1), b"v")  # same bytes by another proposer: a refusal
    run_prepare(other, [val(7, ME + 1, 5, b"v"), val(7, ME + 1, 5, b"v")])
    assert other.outcome == CasOutcome(False, (5, 7, ME + 1), b"v")


def test_read_round_settled_or_not():
    rnd = ReadRound("k", OWNERS)
    rnd.on_reply("a", val(2, 1, 3, b"x"))
    rnd.on_reply("b", val(2, 1, 3, b"x"))
    assert rnd.outcome == RegisterRead((3, 2, 1), b"x", True)
    rnd = ReadRound("k", OWNERS)
    rnd.on_reply("a", val(1, 1, 2, b"old"))
    rnd.on_reply("b", val(2, 1, 3, b"new"))
    assert rnd.outcome == RegisterRead((3, 2, 1), b"new", False)
    rnd = ReadRound("k", OWNERS)
    rnd.on_reply("a", ConnectionError("x"))
    rnd.on_reply("b", TimeoutError())
    assert rnd.outcome is None and "need 2" in rnd.error


# -- RegisterClient over in-memory acceptors ------------------------------------------------------
class Acceptors:
    """Three nodes' acceptor states behind a NodeCall, with faults: ``down`` nodes raise, and
    ``drop_accepts`` loses the answer (not the effect) of accepts to some nodes."""

    def __init__(self):
        self.states = {}
        self.down = set()
        self.drop_accepts = set()
        self.calls = 0
        self.before = None  # called with (node, msg) before each request is served

    def serve(self, node, msg):
        """The acceptor rules on ``node``'s state, synchronously (also to inject another proposer)."""
        state = self.states.get((node, msg.key), RegisterState())
        if isinstance(msg, p.RegisterPrepare):
            got = prepare(state, (msg.round, msg.proposer))
        else:
            got = accept(state, (msg.round, msg.proposer), (msg.version, msg.origin_round, msg.origin_proposer),
                         msg.value)
        if isinstance(got, RegisterState):
            self.states[(node, msg.key)] = got
        return got

    async def call(self, node, msg, bulk=(), timeout_s=None):
        self.calls += 1
        if self.before is not None:
            self.before(node, msg)
        await asyncio.sleep(0)
        if node in self.down:
            raise ConnectionError(f"{node} down")
        state = self.states.get((node, msg.key), RegisterState())
        if isinstance(msg, p.RegisterGet):
            return p.RegisterValue(*state.accepted, *state.version, state.value), []
        if isinstance(msg, p.RegisterPrepare):
            got = prepare(state, (msg.round, msg.proposer))
        else:
            got = accept(state, (msg.round, msg.proposer), (msg.version, msg.origin_round, msg.origin_proposer),
                         msg.value)
        # read, rule and store in one step, as a storage node does (one event loop, no await in
        # between): a pause here let two requests read the same state and the later store undo
        # the earlier one (two proposers then both won a version, about 1 run in 40)
        if isinstance(got, RegisterState):
            self.states[(node, msg.key)] = got
        await asyncio.sleep(0)  # the reply's way back: other requests run meanwhile
        if not isinstance(got, RegisterState):
            raise RemoteRegisterConflict(node, p.RegisterConflict(*got))
        if isinstance(msg, p.RegisterAccept) and node in self.drop_accepts:
            raise TimeoutError("answer lost")
        if isinstance(msg, p.RegisterPrepare):
            return p.RegisterValue(*got.accepted, *got.version, got.value), []
        return p.RegisterAccepted(), []


def view3():
    view = ClusterView(local=None, replicas=3)
    view.set_members([StorageNode(n, f"mem://{n}") for n in OWNERS])
    return view


def client(acc, view, proposer, seed=0, max_rounds=12):
    return RegisterClient(view, acc.call, proposer=proposer, rng=random.Random(seed), max_rounds=max_rounds)


@pytest.mark.asyncio
async def test_register_client_cas_and_read():
    acc, view = Acceptors(), view3()
    c = client(acc, view, 1)
    assert register_owners(view, "k") == tuple(sorted(OWNERS)) or set(register_owners(view, "k")) == set(OWNERS)
    assert await c.read("k") == RegisterRead(ABSENT, b"", True)
    one = await c.cas("k", ABSENT, b"one")
    assert one.ok and one.version[0] == 1 and one.value == b"one"
    assert await c.cas("k", ABSENT, b"again") == CasOutcome(False, one.version, b"one")  # stale: refused
    two = await c.cas("k", one.version, b"two")
    assert two.ok and two.version[0] == 2
    assert await c.read("k") == RegisterRead(two.version, b"two", True)
    assert await c.cas("k", None) == CasOutcome(True, two.version, b"two")  # read by CAS
    with pytest.raises(ValueError):
        await c.cas("k", two.version, b"\0" * (p.MAX_REGISTER_VALUE_BYTES + 1))


@pytest.mark.asyncio
async def test_register_client_one_owner_down_then_two():
    acc, view = Acceptors(), view3()
    c = client(acc, view, 1)
    acc.down = {"c"}
    first = await c.cas("k", ABSENT, b"v")
    assert first.ok
    view.mark_down("b")  # believed down: not even asked
    calls = acc.calls
    with pytest.raises(RegisterUnavailable, match="need 2"):
        await c.cas("k", first.version, b"w")
    assert acc.calls - calls == 2  # a and c (down, but not known to be) were asked; b was not
    view.mark_up("b")
    acc.down = set()
    for _ in range(5):  # any two owners answer the value a and b accepted (c never saw it)
        got = await c.read("k")
        assert (got.version, got.value) == (first.version, b"v")
    assert await c.cas("k", None) == CasOutcome(True, first.version, b"v")


@pytest.mark.asyncio
async def test_register_client_lost_accept_answers_still_report_success():
    acc, view = Acceptors(), view3()
    c = client(acc, view, 1)
    acc.drop_accepts = {"a", "b"}  # the accepts land but two answers are lost: no quorum seen
    with pytest.raises(RegisterUnavailable):
        await c.cas("k", ABSENT, b"v")
    acc.drop_accepts = set()
    # the caller retries the same CAS: the next round finds its own value and reports success
    again = await c.cas("k", ABSENT, b"v")
    assert again.ok and again.version[0] == 1 and again.version[2] == c.proposer


@pytest.mark.asyncio
async def test_register_client_concurrent_proposers_never_both_win_a_version():
    acc, view = Acceptors(), view3()
    # rounds are not what this test is about: enough that contention never exhausts them (a CAS
    # given up after a lost round may have landed unseen, and the count of wins would be short)
    clients = [client(acc, view, proposer=i + 1, seed=i, max_rounds=10_000) for i in range(4)]
    wins: list[tuple[int, int]] = []

    async def bump(c, times):
        for _ in range(times):
            current = await c.cas("counter", None)
            while True:
                n = int(current.value or b"0")
                out = await c.cas("counter", current.version, str(n + 1).encode())
                if out.ok:
                    wins.append((out.version, c.proposer))
                    break
                current = out

    await asyncio.gather(*(bump(c, 15) for c in clients))
    versions = sorted(v[0] for v, _ in wins)
    assert versions == list(range(1, 61))  # one chain: every version won exactly once
    final = await clients[0].cas("counter", None)
    assert final.version[0] == 60 and final.value == b"60"
    assert sum(c.conflicts for c in clients) > 0  # the proposers did duel


@pytest.mark.asyncio
async def test_register_client_refusal_after_a_lost_accept_is_doubtful():
    acc, view = Acceptors(), view3()
    c = client(acc, view, 1)
    other = (100, 999)  # another proposer's ballot, far above ours

    def interfere(node, msg):
        # right after our prepares, the other proposer promises b and c and writes its own value
        if isinstance(msg, p.RegisterAccept) and msg.proposer == 1 and acc.before is not None:
            acc.before = None
            for n in ("b", "c"):
                acc.serve(n, p.RegisterPrepare("k", *other))
            for n in ("b", "c"):
                acc.serve(n, p.RegisterAccept("k", *other, 1, *other, b"theirs"))

    acc.before = interfere
    out = await c.cas("k", ABSENT, b"mine")
    assert out == CasOutcome(False, (1, *other), b"theirs", doubtful=True) and c.conflicts == 1
    plain = await c.cas("k", ABSENT, b"mine")  # no lost round in this call: a plain refusal
    assert plain == CasOutcome(False, (1, *other), b"theirs", doubtful=False)


@pytest.mark.asyncio
async def test_register_client_read_one_asks_one_owner_and_answers_none_where_it_holds_nothing():
    # write-once reads (registers.py): one request to the first live owner; None when that owner
    # holds no value or fails, so the caller reads a quorum
    acc, view = Acceptors(), view3()
    c = client(acc, view, 1)
    first = register_owners(view, "k")[0]
    acc.down = {first}
    written = await c.cas("k", ABSENT, b"v")  # accepted by the two others only
    assert written.ok
    calls = acc.calls
    assert await c.read_one("k") is None  # the first owner is down (not known to be): one request
    assert acc.calls - calls == 1
    acc.down = set()
    assert await c.read_one("k") is None  # it missed the write: nothing, not the absent value
    view.mark_down(first)  # believed down: the next live owner is asked
    calls = acc.calls
    assert await c.read_one("k") == RegisterRead(written.version, b"v", False)
    assert acc.calls - calls == 1
    view.mark_up(first)
    assert (await c.cas("k", written.version, b"")).ok  # emptied (a cleared chunk): nothing either
    assert await c.read_one("k") is None
