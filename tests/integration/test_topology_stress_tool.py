"""tools/topology_stress: its scenarios run and end with their owners equal to the reference; a
mismatch makes it fail (exit 1, the seed named); bad arguments exit 2."""

import json

import pytest

from tools import topology_stress
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(120)]


#: one scenario of each shape (a plain operation, one under a member's hints, one given up): the
#: tool's own plumbing; every scenario's subject has tests of its own (test_topology_inprocess.py),
#: and all of them take ~13 s here, a CI minute's fifth
SMOKE = ["replace", "join-member-back", "decommission-leaver-killed"]


def test_scenarios_run_and_their_owners_equal_the_reference():
    lines: list[str] = []
    argv = [a for kind in SMOKE for a in ("--kind", kind)]
    assert topology_stress.main([*argv, "--runs", "1", "--seed", "3", "--json"], out=lines.append) == 0
    results = [json.loads(line) for line in lines]
    assert [r["kind"] for r in results] == SMOKE
    assert all(r["failed"] == 0 and r["runs"] == 1 for r in results)


def test_a_mismatch_fails_the_run_and_names_its_seed(monkeypatch):
    monkeypatch.setattr(Cluster, "mismatches", lambda self, names=None: ["s1 column 0x5: 0 rows, reference 1"])
    lines: list[str] = []
    assert topology_stress.main(["--kind", "join", "--runs", "1", "--seed", "7"], out=lines.append) == 1
    assert lines[0].startswith("FAILED join seed=7: s1 column 0x5") and lines[1].startswith("join: 0 of 1")


@pytest.mark.parametrize("argv", [["--kind", "nope"], ["--runs", "0"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        topology_stress.main(argv)
    assert exc.value.code == 2
