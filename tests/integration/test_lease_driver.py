"""Lease drivers (giaannd/compute/lease_driver.py) of four "compute nodes" running one job against
three StorageServices (mem://, R = 3, W = 2): the job row and lease tables in real registers, each
window's batch written under (writer, window + 1). A node killed mid-job loses its leases to the
others, a node halted gives its windows back; every window ends up applied exactly once. Every
wait is bounded."""

from __future__ import annotations

import asyncio
import random
import secrets

import numpy as np
import pytest

from giaannd.client.storage_client import StorageClient
from giaannd.compute.cluster_jobs.lease_driver import LeaseDriver
from giaannd.compute.cluster_jobs.lease_events import Begin, LeaseSettings, RunWindow, batch_seq
from giaannd.compute.cluster_jobs.lease_table import JobRow, decode_index, decode_job, job_key
from giaannd.compute.cluster_jobs.leases import LeaseAgent
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SETTINGS = LeaseSettings(lease_s=1.0, renew_s=0.3, probe_interval_s=0.1, lease_windows=2, parallel=2, retry_s=0.05)
WINDOWS = 40


def window_batch(window: int) -> RowBatch:
    """Window ``w``'s delta: one entry of strength 1 in row (w + 1, 1). Applied twice, it would read 2."""
    one = np.ones(1, np.uint64)
    return RowBatch.from_entries(np.array([window + 1], np.uint64), one, np.zeros(1, np.uint8), one, one,
                                 np.ones(1, np.float32))


class Node:
    def __init__(self, cluster: Cluster, name: str) -> None:
        self.name = name
        self.client = StorageClient(cluster.client_topology, cluster.client.transports, request_timeout_s=1.0,
                                    connect_timeout_s=0.5)
        self.ran: list[int] = []

    async def run_window(self, action: RunWindow) -> None:
        self.ran.append(action.window)
        await asyncio.sleep(0.05)  # the work
        bid = BatchId(action.writer_id, batch_seq(action.window))
        for attempt in range(20):  # the same id every time: storage drops what it already has
            try:
                await self.client.write(window_batch(action.window), bid)
                return
            except Exception:
                await asyncio.sleep(0.05 * (attempt + 1))
        raise RuntimeError(f"window {action.window} not written")

    def driver(self, job_id: str) -> LeaseDriver:
        agent = LeaseAgent(self.name, job_id, SETTINGS, random.Random(self.name))
        return LeaseDriver(agent, self.client, self.run_window)


@pytest.mark.asyncio
async def test_lease_drivers_finish_one_job_across_nodes_despite_a_crash(tmp_path):
    cluster = await Cluster(tmp_path, 3, request_timeout_s=1.0).start()
    nodes = [Node(cluster, f"c{i}") for i in range(4)]
    try:
        job = JobRow(job_id="j", windows=WINDOWS, shards=2, writer_id=secrets.randbits(63))
        tasks = {n.name: asyncio.create_task(n.driver("j").run(Begin(job) if n.name == "c0" else Begin()))
                 for n in nodes[:2]}
        # c1 is killed (its task cancelled: nothing more from it) once it has started some windows;
        # c2 and c3 join only then (with all four from the start, a loaded host could let the
        # others finish every window before c1 leased one: the wait below then never ended)
        async with asyncio.timeout(20):
            while len(nodes[1].ran) < 2:
                await asyncio.sleep(0.01)
        tasks.update({n.name: asyncio.create_task(n.driver("j").run(Begin())) for n in nodes[2:]})
        tasks["c1"].cancel()
        results = {}
        async with asyncio.timeout(60):
            for name in ("c0", "c2", "c3"):
                results[name] = await tasks[name]
        assert {r.state for r in results.values()} == {"done"}
        row = await nodes[0].client.read_register(job_key("j"))
        assert decode_job(row.value).state == "done"
        index = await nodes[0].client.read_register("jobs")
        assert "j" not in decode_index(index.value).jobs
        ran = [w for n in nodes for w in n.ran]
        assert set(ran) == set(range(WINDOWS))
        got = await nodes[0].client.read_rows(np.arange(1, WINDOWS + 1, dtype=np.uint64),
                                              np.ones(WINDOWS, np.uint64))
        assert got.num_rows == WINDOWS and np.all(got.strength == 1.0)  # each window counted once
        assert len(ran) > WINDOWS  # what c1 held when it died was taken over and run again
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for n in nodes:
            await n.client.close()
        await cluster.close()


@pytest.mark.asyncio
async def test_lease_driver_halt_gives_windows_back(tmp_path):
    cluster = await Cluster(tmp_path, 3, request_timeout_s=1.0).start()
    nodes = [Node(cluster, f"c{i}") for i in range(2)]
    try:
        job = JobRow(job_id="h", windows=WINDOWS, shards=1, writer_id=secrets.randbits(63))
        drivers = [n.driver("h") for n in nodes]
        first = asyncio.create_task(drivers[0].run(Begin(job)))
        async with asyncio.timeout(20):
            while len(nodes[0].ran) < 3:
                await asyncio.sleep(0.01)
        drivers[0].halt()
        async with asyncio.timeout(20):
            assert (await first).state == "released"
        second = asyncio.create_task(drivers[1].run())
        async with asyncio.timeout(30):
            assert (await second).state == "done"
        assert set(nodes[0].ran) | set(nodes[1].ran) == set(range(WINDOWS))
        got = await nodes[0].client.read_rows(np.arange(1, WINDOWS + 1, dtype=np.uint64),
                                              np.ones(WINDOWS, np.uint64))
        assert got.num_rows == WINDOWS and np.all(got.strength == 1.0)
    finally:
        for n in nodes:
            await n.client.close()
        await cluster.close()
