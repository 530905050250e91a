"""tools/topology_stress: each scenario runs and ends with its owners equal to the reference; a
mismatch makes it fail (exit 1, the seed named); bad arguments exit 2."""

import json

import pytest

from tools import topology_stress
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(120)]


def test_every_scenario_runs_once_and_its_owners_equal_the_reference():
    lines: list[str] = []
    assert topology_stress.main(["--runs", "1", "--seed", "3", "--json"], out=lines.append) == 0
    results = [json.loads(line) for line in lines]
    assert [r["kind"] for r in results] == list(topology_stress.KINDS)
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
