"""Cluster scenarios on the deterministic simulator (virtual time, seeded)."""

import pytest

from peers.keyring import Keyring
from peers.membership.config import MembershipConfig
from peers.membership.events import MemberFailed, MemberLeft, MemberSuspected, NameConflict
from peers.membership.messages import MemberStatus
from tests.sim.cluster import NetModel, SimCluster

pytestmark = pytest.mark.sim

LAN = MembershipConfig.lan()


def joined_cluster(n, *, seed=1, net=None, config=LAN, sealed=False, keyring=None):
    c = SimCluster(config, seed=seed, net=net, sealed=sealed, keyring=keyring)
    names = [f"n{i}" for i in range(n)]
    for name in names:
        c.add_node(name)
    c.join_all(names, "n0")
    assert c.run_until(30.0, c.converged), "cluster did not converge after join"
    return c, names


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sim_kill_is_detected_everywhere(seed):
    c, _ = joined_cluster(8, seed=seed)
    c.kill("n5")
    t0 = c.now
    assert c.run_until(t0 + 60, lambda: c.all_see("n5", MemberStatus.DEAD))
    assert c.now - t0 < 20.0
    # nobody else was ever suspected
    assert {e.name for _, _, e in c.events_of(MemberSuspected)} <= {"n5"}


def test_sim_graceful_leave_never_suspect():
    c, _ = joined_cluster(8)
    c.leave("n3")
    t0 = c.now
    assert c.run_until(t0 + 10, lambda: c.all_see("n3", MemberStatus.LEFT))
    c.run_for(60)
    assert c.all_see("n3", MemberStatus.LEFT)
    assert c.events_of(MemberSuspected, "n3") == []
    assert c.events_of(MemberFailed, "n3") == []
    assert len(c.events_of(MemberLeft, "n3")) == 7


def test_sim_rejoin_after_restart_refutes_with_higher_incarnation():
    c, _ = joined_cluster(6)
    c.kill("n2")
    assert c.run_until(c.now + 60, lambda: c.all_see("n2", MemberStatus.DEAD))
    dead_inc = c.nodes["n0"].core.member("n2").incarnation
    c.restart("n2", ["n0"])
    t0 = c.now
    assert c.run_until(t0 + 10, lambda: c.all_see("n2", MemberStatus.ALIVE,
                                                  incarnation_above=dead_inc))
    assert c.now - t0 < 3.0
    assert c.nodes["n2"].joins[-1].contacted == 1
    assert c.converged()


def test_sim_partition_and_heal():
    c, names = joined_cluster(8)
    left, right = names[:4], names[4:]
    c.partition(left, right)
    c.run_for(120)
    for a in left:
        for b in right:
            assert c.status(a, b) == MemberStatus.DEAD
    c.heal()
    # Dead members are only reachable again through push-pull / gossip-to-the-dead
    # and refutation; memberlist needs a join to merge after a long split.
    for b in right:
        c.join(b, ["n0"])
    assert c.run_until(c.now + 30, c.converged)


@pytest.mark.parametrize("seed", [1, 2])
def test_sim_partition_heals_without_a_join(seed):
    """Both halves declared each other dead; nobody probes or gossips to the dead any more, so only
    the reconnect timer (Serf's reconnect of failed members) brings them back, within a few of its
    intervals and with no operator action."""
    c, names = joined_cluster(8, seed=seed)
    left, right = names[:4], names[4:]
    c.partition(left, right)
    c.run_for(120)
    assert all(c.status(a, b) == MemberStatus.DEAD for a in left for b in right)
    c.heal()
    t0 = c.now
    assert c.run_until(t0 + 6 * LAN.reconnect_interval_s, c.converged), "halves never merged"
    assert sum(n.core.counters.get("reconnect_attempts", 0) for n in c.nodes.values()) >= 1


def test_sim_lone_node_cut_off_rejoins_by_itself():
    c, names = joined_cluster(5)
    c.partition(names[:4], names[4:])
    c.run_for(120)
    assert c.status(names[4], names[0]) == MemberStatus.DEAD
    c.heal()
    assert c.run_until(c.now + 6 * LAN.reconnect_interval_s, c.converged)


def test_sim_left_members_are_not_reconnected():
    c, _ = joined_cluster(5)
    c.leave("n3")
    c.run_for(5 * LAN.reconnect_interval_s)
    assert c.all_see("n3", MemberStatus.LEFT)
    assert sum(n.core.counters.get("reconnect_attempts", 0) for n in c.nodes.values()) == 0


def test_sim_name_conflict_rejected():
    c, _ = joined_cluster(5)
    original = c.nodes["n2"]
    impostor = c.add_node("n2", node_id="11111111-2222-3333-4444-555555555555",
                          addr=("10.9.9.9", 7946))
    c.join("n2", ["n0"])  # "n2" now names the impostor's process
    c.run_for(5)
    finished = impostor.joins[-1]
    assert finished.conflict is not None and finished.conflict.local
    conflicts = [e for _, _, e in c.events_of(NameConflict)]
    assert any(not e.local and e.claimed_node_id == impostor.node_id for e in conflicts)
    for name in ("n0", "n1", "n3", "n4"):  # the original n2 is untouched everywhere
        member = c.nodes[name].core.member("n2")
        assert member.node_id == original.node_id and member.status == MemberStatus.ALIVE


def test_sim_key_rotation_without_suspicions():
    old = Keyring.generate()
    c, names = joined_cluster(6, sealed=True, keyring=old)
    new_key = Keyring.generate().primary
    for step in ("install", "use", "remove"):
        for name in names:
            ring = c.nodes[name].codec.keyring
            if step == "install":
                ring.install(new_key)
            elif step == "use":
                ring.use(new_key)
            else:
                ring.remove(old.primary)
            c.run_for(2.0)  # nodes step one by one, as an operator's CLI would
    c.run_for(30)
    assert c.events_of(MemberSuspected) == []
    assert c.converged()
    assert all(sum(c.nodes[n].rejected.values()) == 0 for n in names)


def test_sim_wrong_key_node_cannot_join_and_is_counted():
    c, names = joined_cluster(4, sealed=True, keyring=Keyring.generate())
    stranger = c.add_node("x")
    stranger.codec.keyring = Keyring.generate()
    c.join("x", ["n0"])
    c.run_for(10)
    assert stranger.joins[-1].contacted == 0
    assert c.nodes["n0"].rejected.get("wrong_key", 0) >= 1
    assert c.nodes["n0"].core.member("x") is None


@pytest.mark.parametrize("seed", [11, 12])
def test_sim_churn_converges(seed):
    c, names = joined_cluster(12, seed=seed, net=NetModel(loss=0.01))
    rng = c.rng
    for _round in range(6):
        victim = rng.choice(names[1:])
        action = rng.choice(["kill", "leave", "meta"])
        if action == "kill" and c.nodes[victim].up:
            c.kill(victim)
        elif action == "leave" and c.nodes[victim].up:
            c.leave(victim)
        elif c.nodes[victim].up:
            c.update_meta(victim, bytes([_round]))
        c.run_for(rng.uniform(1, 10))
        for name in names:
            if not c.nodes[name].up and rng.random() < 0.5:
                c.restart(name, ["n0"])
    for name in names:
        if not c.nodes[name].up:
            c.restart(name, ["n0"])
    assert c.run_until(c.now + 60, c.converged)
    for node in c.up_nodes():  # metadata agrees everywhere
        for other in c.up_nodes():
            assert c.nodes[other.name].core.member(node.name).meta == node.core.local.meta


def test_sim_update_converges_to_all_members():
    c, names = joined_cluster(32)
    c.update_meta("n7", b"v2")
    t0 = c.now
    assert c.run_until(t0 + 10, lambda: all(
        c.nodes[n].core.member("n7").meta == b"v2" for n in names), check_every_s=0.01)
    assert c.now - t0 < 1.5


def _frozen_run(lifeguard, seed, duration_s, n=8, suspicion_mult=4):
    config = MembershipConfig(lifeguard=lifeguard, suspicion_mult=suspicion_mult)
    c, names = joined_cluster(n, seed=seed, net=NetModel(loss=0.05), config=config)
    t_end = c.now + duration_s
    while c.now < t_end:
        c.freeze("n1", 2.0)  # n1's loop blocks 2 s in every 10 s
        c.run_for(10.0)
    return c, [e for _, _, e in c.events_of(MemberFailed)]


@pytest.mark.parametrize("seed", [21, 22])
def test_sim_lifeguard_no_false_dead_under_loss_and_frozen_loop(seed):
    _, failed = _frozen_run(True, seed, 180.0)
    assert failed == []


def test_sim_lifeguard_vs_plain_swim_same_timings():
    """The faults scenario over 30 seeds, identical timings, Lifeguard on and off.

    suspicion-mult 2 makes the minimum suspicion timeout (2 s) equal to the freeze,
    where plain SWIM's fixed timeout loses refutations and Lifeguard's does not.
    """
    on = sum(len(_frozen_run(True, s, 180.0, n=5, suspicion_mult=2)[1]) for s in range(30))
    off = sum(len(_frozen_run(False, s, 180.0, n=5, suspicion_mult=2)[1]) for s in range(30))
    assert on == 0
    assert off > 0
