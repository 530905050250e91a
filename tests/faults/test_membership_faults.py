"""Membership under 5 % loss (tc netem) with one node's process frozen 2 s in every 10 s.

Five agents (``python -m peers.membership``) run in their own network namespaces on a
private bridge (tools/netns.py); netem drops 5 % of every node's egress; SIGSTOP /
SIGCONT freezes node 1's whole process (its event loop) for 2 s every 10 s.

With Lifeguard no live member may ever be declared dead. The same run with
Lifeguard disabled must show false deaths, so the test can fail. Both halves use
the same timings: LAN with suspicion-mult 2 (min timeout 2 s, as long as the
freeze), where the simulator (tests/sim, same scenario, 30 seeds) measured 0 of
30 runs with a false death with Lifeguard and 6 of 30 runs without; since one
3-minute run without Lifeguard shows them only about one time in five, that half
runs up to OFF_ROUNDS rounds and stops at the first false death.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peers.keyring import Keyring
from tools.netns import NetnsCluster

pytestmark = [pytest.mark.faults, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
N = 5
PORT = 7946
CONFIG = {"suspicion-mult": 2}
OFF_ROUNDS = 4


def run_round(tmp: Path, lifeguard: bool, duration_s: float) -> list[dict]:
    """One cluster run; returns every MemberFailed event any agent printed."""
    key_file = tmp / "keys.json"
    Keyring.generate().save(key_file)
    procs = []
    with NetnsCluster(N) as net:
        try:
            for i in range(N):
                net.netem(i, loss_pct=5)
                cmd = [sys.executable, "-m", "peers.membership", "--name", f"n{i}",
                       "--bind", f"{net.ip(i)}:{PORT}", "--key-file", str(key_file),
                       "--profile", "lan", "--config-json", json.dumps(CONFIG)]
                if i:
                    cmd += ["--seed", f"{net.ip(0)}:{PORT}"]
                if not lifeguard:
                    cmd.append("--no-lifeguard")
                out = (tmp / f"n{i}-{lifeguard}.out").open("w")
                procs.append((net.popen(i, cmd, cwd=ROOT, stdout=out,
                                        stderr=subprocess.DEVNULL), out))
                time.sleep(0.3)
            time.sleep(5.0)  # join and converge
            frozen = procs[1][0]
            end = time.monotonic() + duration_s
            while time.monotonic() < end:
                frozen.send_signal(signal.SIGSTOP)
                time.sleep(2.0)
                frozen.send_signal(signal.SIGCONT)
                time.sleep(8.0)
        finally:
            for proc, out in procs:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)
                out.close()
    failed = []
    for i in range(N):
        for line in (tmp / f"n{i}-{lifeguard}.out").read_text().splitlines():
            if line.startswith("{"):
                event = json.loads(line)
                if event["event"] == "MemberFailed":
                    failed.append({"observer": f"n{i}", **event})
    return failed


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
