"""Membership under 5 % loss (tc netem) with one node's process frozen 2 s in every 10 s.

Five ``giaannd`` daemons with no role (membership only) run in their own network namespaces on a
private bridge (tools/netns.py, tests/faults/daemons.py); netem drops 5 % of every node's egress;
SIGSTOP / SIGCONT freezes node 1's whole process (its event loop) for 2 s every 10 s.

With Lifeguard no live member may ever be declared dead. The same run with
Lifeguard disabled must show false deaths, so the test can fail. Both halves use
the same timings: LAN with suspicion-mult 2 (min timeout 2 s, as long as the
freeze), where the simulator (tests/sim, same scenario, 30 seeds) measured 0 of
30 runs with a false death with Lifeguard and 6 of 30 runs without; since one
3-minute run without Lifeguard shows them only about one time in five, that half
runs up to OFF_ROUNDS rounds and stops at the first false death.
"""

import signal
import time
from pathlib import Path

import pytest

from peers.keyring import Keyring
from tests.faults.daemons import member_events, spawn, stop, wait_logged, write_config
from tools.netns import NetnsCluster

pytestmark = [pytest.mark.faults, pytest.mark.slow]

N = 5
PORT = 7946
OFF_ROUNDS = 4
READY_S = 60.0


def run_round(tmp: Path, lifeguard: bool, duration_s: float) -> list[dict]:
    """One cluster run; returns every MemberFailed event any daemon logged."""
    root = tmp / f"lifeguard-{lifeguard}-{time.monotonic_ns()}"
    root.mkdir(parents=True)
    key_file = root / "keys.json"
    Keyring.generate().save(key_file)
    procs, logs = [], []
    with NetnsCluster(N) as net:
        try:
            for i in range(N):
                net.netem(i, loss_pct=5)
                config = write_config(root, f"n{i}", ip=net.ip(i), gossip_port=PORT, roles=[],
                                      cluster="faults", key_file=key_file,
                                      seeds=[f"{net.ip(0)}:{PORT}"] if i else [],
                                      membership={"profile": "lan", "suspicion_mult": 2, "lifeguard": lifeguard})
                logs.append(root / f"n{i}" / "giaannd.log")
                procs.append(spawn(net, i, config, logs[i]))
                if i == 0:  # the seed answers before the others join
                    wait_logged(procs[0], logs[0], "ready node=", READY_S)
            for proc, log in zip(procs, logs):
                wait_logged(proc, log, "ready node=", READY_S)
            time.sleep(5.0)  # converge
            frozen = procs[1]
            end = time.monotonic() + duration_s
            while time.monotonic() < end:
                frozen.send_signal(signal.SIGSTOP)
                time.sleep(2.0)
                frozen.send_signal(signal.SIGCONT)
                time.sleep(8.0)
        finally:
            stop(procs, graceful=False)  # (no leave: nothing may happen after the measured run)
    return [{"observer": f"n{i}", **e} for i, log in enumerate(logs) for e in member_events(log)
            if e["event"] == "MemberFailed"]


# One 180 s round with Lifeguard plus up to OFF_ROUNDS rounds without it, each with set-up and teardown.
@pytest.mark.timeout(240 * (1 + OFF_ROUNDS))
def test_membership_faults_lifeguard_prevents_false_dead(tmp_path):
    failed_on = run_round(tmp_path, lifeguard=True, duration_s=180.0)
    assert failed_on == [], f"false deaths with Lifeguard: {failed_on}"
    failed_off = []
    for _ in range(OFF_ROUNDS):
        failed_off = run_round(tmp_path, lifeguard=False, duration_s=180.0)
        if failed_off:
            break
    assert failed_off, "without Lifeguard no false death appeared: the scenario is too mild"
