"""One compute node whose shard row loses its register quorum for longer than a lease (its
renewals get no answer: its own deadline drops its leases) while its windows' batches still reach
W owners. Nobody else can take the leases over, so when the quorum is back the row still names it:
it must complete the windows it had written, not encode, train and send them again
(leases.py, module docstring, "expiry"). On the simulator (tests/sim/leases.py)."""

from typing import Any

import pytest

from giaannd.compute.cluster_jobs.lease_events import LeaseSettings, RunWindow, WindowWritten
from giaannd.compute.cluster_jobs.lease_table import JobRow, shard_key
from tests.sim.leases import LeaseSim, SimNet

pytestmark = pytest.mark.sim

SETTINGS = LeaseSettings(lease_s=2.0, renew_s=0.6, probe_interval_s=0.25, lease_windows=4, parallel=2,
                         retry_s=0.05)


class _Counting(LeaseSim):
    """Counts runs of a window by a node that had already been told that window was written."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.acked: set[tuple[str, int, int]] = set()
        self.reruns_after_ack = 0

    def _feed(self, node: Any, job_id: str, event: Any) -> None:
        if isinstance(event, WindowWritten):
            self.acked.add((node.name, event.stage, event.window))
        super()._feed(node, job_id, event)

    def _run(self, node: Any, job_id: str, action: RunWindow) -> None:
        self.reruns_after_ack += (node.name, action.stage, action.window) in self.acked
        super()._run(node, job_id, action)


def test_sim_lease_own_expiry_node_keeps_the_windows_it_wrote():
    sim = _Counting(seed=11, compute=0, storage=5, settings=SETTINGS, net=SimNet(), work_s=(0.05, 0.1))
    sim.add_compute("c0", follow=False)
    j = JobRow(job_id="j6", windows=40, shards=1, stages=1, writer_id=0xAB)
    sim.start_job("c0", j)
    assert sim.run_until(30.0, lambda: sim.register(shard_key("j6", 0, 0)) != b"")  # the shard exists
    # two of the shard row's three owners go away for 1.5 lease times: no renewal can land
    down = sim._owners(shard_key("j6", 0, 0))[:2]
    start = sim.now + 0.3
    for name in down:
        sim.at(start, lambda name=name: sim.storage_down(name))
        sim.at(start + 1.5 * SETTINGS.lease_s, lambda name=name: sim.storage_down(name, False))
    assert sim.run_until(120.0, lambda: "j6" in sim.finished), "the job did not finish"
    assert sim.finished["j6"].state == "done"
    figures = sim.check(j, 0.1)
    assert figures["takeovers"] == 0
    assert sim.reruns_after_ack == 0
