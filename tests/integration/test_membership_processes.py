"""Five real ``giaannd`` processes with no role (membership only) on loopback: kill -9, restart,
graceful leave; a frozen process is suspected but never declared dead (tools/local_cluster launches
them; member tables come from the admin API, member events from each daemon's log)."""

import re
import signal
import time
from pathlib import Path

import pytest

from giaannd.sdk.local_cluster import LocalCluster, Node
from peers.membership.config import MembershipConfig

pytestmark = pytest.mark.integration

N = 5
#: What peers/membership/node.py logs for every member event.
EVENT = re.compile(r"member (Member\w+) name=(\S+) incarnation=(\d+)")


def launch(tmp: Path, profile: str = "loopback") -> LocalCluster:
    cluster = LocalCluster(tmp / "cluster", nodes=[(f"n{i}", []) for i in range(N)], transport="tcp",
                           cluster_name="itest", membership_options={"profile": profile})
    try:
        cluster.start()
    except BaseException:
        cluster.kill_all()
        raise
    return cluster


def members(node: Node) -> dict:
    """The member table as ``node`` sees it (name -> row with status and incarnation)."""
    try:
        rows = node.admin.json("GET", "/v1/members")["members"]
    except Exception:  # (restarting: no admin address yet)
        return {}
    return {m["name"]: m for m in rows}


def events(node: Node) -> list[dict]:
    """Every member event the daemon logged (all its runs: the log is appended to)."""
    text = node.log_path.read_text(errors="replace") if node.log_path.exists() else ""
    return [{"event": m[1], "name": m[2], "incarnation": int(m[3])} for m in EVENT.finditer(text)]


def wait_until(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_membership_processes_kill_restart_leave(tmp_path):
    cluster = launch(tmp_path)
    agents = {n.name: n for n in cluster.nodes}
    try:
        names = sorted(agents)

        def everyone_sees(subject, status, among, min_inc=-1):
            for a in among:
                m = members(agents[a]).get(subject)
                if m is None or m["status"] != status or m["incarnation"] <= min_inc:
                    return False
            return True

        wait_until(lambda: all(everyone_sees(s, "alive", names) for s in names), 20,
                   "all five alive everywhere")

        # kill -9: every other member marks it dead
        victim = agents["n4"]
        cluster.kill(victim)
        others = [n for n in names if n != "n4"]
        wait_until(lambda: everyone_sees("n4", "dead", others), 20, "n4 dead everywhere")
        dead_inc = max(members(agents[a])["n4"]["incarnation"] for a in others)

        # restart with the same name and node id (its data directory): alive again, higher incarnation
        node_id = (victim.data_dir / "node-id").read_text().strip()
        cluster.restart(victim)
        assert (victim.data_dir / "node-id").read_text().strip() == node_id
        wait_until(lambda: everyone_sees("n4", "alive", others, dead_inc), 20,
                   "n4 alive again with a higher incarnation")

        # graceful leave (SIGTERM): left everywhere, never suspect
        assert cluster.stop_node(agents["n3"]) == 0
        rest = [n for n in names if n != "n3"]
        wait_until(lambda: everyone_sees("n3", "left", rest), 20, "n3 left everywhere")
        time.sleep(1.0)
        assert everyone_sees("n3", "left", rest)
        for a in rest:
            bad = [e for e in events(agents[a])
                   if e["name"] == "n3" and e["event"] in ("MemberSuspected", "MemberFailed")]
            assert bad == [], f"{a} saw {bad}"
    finally:
        cluster.kill_all()


def test_membership_processes_frozen_loop_no_false_dead(tmp_path):
    """Short CI variant of the faults test (no netem here): LAN timings on loopback,
    n1's whole process stopped (SIGSTOP) 2.5 s in every 10 s for 40 s. Nobody may be
    declared dead; n1 is suspected and refutes.

    A peer suspects n1 when one of its probe ticks (1 s apart, n1 once per round of four
    targets) falls in the first 1.5 s of a freeze, so that the probe's interval ends before n1
    wakes; with four peers that is most cycles. The suspicion is then at most 1.5 s old when n1
    refutes, well under the 4 s minimum suspicion timeout (no false death)."""
    cluster = launch(tmp_path, profile="lan")
    agents = {n.name: n for n in cluster.nodes}
    try:
        # Five nodes joining at once: a node that joined after a member's alive broadcast was
        # spent, through a seed that had not heard it yet, learns that member only at its first
        # push-pull, 0.5-1x the LAN interval (30 s) after start. Seen in 2 of 12 starts (18 and
        # 28 s; docs/membership.md "Known gaps"); 20 s here failed CI now and then.
        wait_until(lambda: all(len(members(a)) == N and all(
            m["status"] == "alive" for m in members(a).values()) for a in agents.values()),
            MembershipConfig.lan().push_pull_interval_s + 10, "convergence")
        frozen = agents["n1"].proc
        assert frozen is not None

        def suspected():
            return [e for a in agents.values() for e in events(a)
                    if e["event"] == "MemberSuspected" and e["name"] == "n1"]

        # At least 4 freeze cycles; more (up to 8) only while no probe has happened to land in a
        # freeze yet, so the test never passes without having exercised suspicion and refutation.
        for cycle in range(8):
            if cycle >= 4 and suspected():
                break
            frozen.send_signal(signal.SIGSTOP)
            time.sleep(2.5)
            frozen.send_signal(signal.SIGCONT)
            time.sleep(7.5)
        failed = [(name, e) for name, a in agents.items() for e in events(a)
                  if e["event"] == "MemberFailed"]
        assert failed == []
        assert suspected(), "the freezes went unnoticed: the test would prove nothing"
        assert all(m["status"] == "alive" for a in agents.values()
                   for m in members(a).values())
    finally:
        for agent in agents.values():
            if agent.proc is not None and agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGCONT)
        cluster.kill_all()
