"""register_handoff.plan_handoff (pure): which joiner gets which merged state, and which keys are lost."""

import msgspec

from giaannd import protocol as p
from giaannd.storage.engine.register_store import RegisterState
from giaannd.storage.rebalance.register_handoff import RegisterImport, from_wire, moving, pages, plan_handoff, to_wire
from peers.placement import Member, Placement

KEYS = [f"job/{i}" for i in range(200)]
OLD_V = RegisterState((3, 1), (3, 1), (1, 3, 1), b"old")
NEW_V = RegisterState((7, 2), (7, 2), (2, 7, 2), b"new")


def _placement(names, r=3):
    return Placement(tuple(Member(n) for n in names), r)


def test_plan_join_merges_a_majority_into_the_joiner():
    old, new = _placement("abc"), _placement("abcd")
    # the latest value reached only two owners, the third has the one before
    answers = {"a": dict.fromkeys(KEYS, NEW_V), "b": dict.fromkeys(KEYS, OLD_V), "c": dict.fromkeys(KEYS, NEW_V)}
    plan = plan_handoff(old, new, answers, live="abcd")
    gained = [k for k, (was, now) in zip(KEYS, moving(old, new, KEYS)) if "d" in now]
    assert gained and set(plan.imports) == {"d"} and sorted(plan.imports["d"]) == sorted(gained)
    assert all(s == NEW_V for s in plan.imports["d"].values()) and not plan.lost


def test_plan_counts_silent_owners_as_empty_and_loses_keys_without_a_majority():
    old, new = _placement("abcd"), _placement("abc")  # d leaves; its keys gain one of a, b, c
    only_d = {"d": dict.fromkeys(KEYS, NEW_V)}
    plan = plan_handoff(old, new, {**only_d, "a": {}, "b": {}, "c": {}}, live="abcd")
    # d's keys: three answers (d + two others holding nothing): a majority, merged to d's value
    assert not plan.lost and all(s == NEW_V for st in plan.imports.values() for s in st.values())
    plan = plan_handoff(old, new, {**only_d, "a": {}}, live="abcd")  # b and c did not answer
    owners = dict(zip(KEYS, moving(old, new, KEYS)))
    assert plan.lost == sorted(k for k in KEYS if "d" in owners[k][0] and sum(o in "ad" for o in owners[k][0]) < 2)


def test_plan_key_with_a_down_joiner_is_lost_but_live_joiners_still_get_it():
    old, new = _placement("abcd"), _placement("abc")
    answers = {n: dict.fromkeys(KEYS, NEW_V) for n in "abcd"}
    plan = plan_handoff(old, new, answers, live="abd")  # c is down
    joined_c = [k for k, (was, now) in zip(KEYS, moving(old, new, KEYS)) if "c" in now and "c" not in was]
    assert joined_c and sorted(plan.lost) == sorted(joined_c) and "c" not in plan.imports


def test_states_and_pages_round_trip():
    states = {k: RegisterState((i, 1), (i, 1), (i, i, 1), b"v" * 1000) for i, k in enumerate(KEYS, 1)}
    cut = list(pages(states, max_bytes=10_000))
    assert len(cut) > 1 and sum(map(len, cut)) == len(KEYS)
    back = dict(from_wire(w) for page in cut for w in page)
    assert back == states and from_wire(to_wire("k", NEW_V)) == ("k", NEW_V)
    msg = RegisterImport(cut[0])

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=RegisterImport) == msg
    assert p.register_key_id(KEYS[0])
