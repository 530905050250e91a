"""A cluster job's driver (lease_driver.py, cluster_train.py ``_drive``) against rows it cannot use,
over in-memory registers (no sockets; each wait bounded):

* a lease row that does not decode (``LeaseRowCorrupt``: damaged bytes, a job state of a newer
  version) ends this node's part of the job with the error. Before, it raised out of the driver's
  task, which the daemon runs under its service context: the task's failure stopped the whole
  compute daemon (exit 1), at every start of every node following the job;
* a write the register client refuses (``ValueError``: a shard row grown past the register value
  cap) fails the job with the error. Before, the write stayed "in flight" for good and the job
  hung as running, on every node, with no error."""

import asyncio
import logging
import random

import msgspec
import pytest

from giaannd.client.registers import ABSENT, CasOutcome, RegisterRead
from giaannd.compute.cluster_jobs.cluster_train import ClusterJobs
from giaannd.compute.cluster_jobs.lease_driver import LeaseDriver
from giaannd.compute.cluster_jobs.lease_events import Begin, LeaseSettings
from giaannd.compute.cluster_jobs.lease_table import (
    INDEX_KEY,
    JobIndex,
    JobRow,
    decode_index,
    decode_job,
    encode_row,
    job_key,
    shard_key,
)
from giaannd.compute.cluster_jobs.leases import LeaseAgent
from giaannd.compute.train import TrainSettings
from giaannd.model.lexicon import Lexicon

S = LeaseSettings(lease_s=1.0, renew_s=0.3, probe_interval_s=0.05, lease_windows=2, parallel=2, retry_s=0.01)
JOB = JobRow(job_id="j", windows=4, shards=1, writer_id=7)
GARBAGE = b"\xc1 not a row"


class Registers:
    """In-memory registers with compare-and-set. ``refuse(key, value)``: the client raises
    ``ValueError`` for that write, as ``StorageClient.cas_register`` does for a value over the cap."""

    def __init__(self, refuse=lambda key, value: False) -> None:
        self.rows: dict[str, tuple[tuple[int, int, int], bytes]] = {}
        self.refuse = refuse

    def put(self, key: str, value: bytes) -> None:
        self.rows[key] = ((1, 1, 1), value)

    async def read_register(self, key, timeout_s=None):
        version, value = self.rows.get(key, (ABSENT, b""))
        return RegisterRead(version, value, True)

    async def cas_register(self, key, expect, value=b"", timeout_s=None):
        if expect is not None and self.refuse(key, value):
            raise ValueError(f"register value of {len(value)} bytes, over the cap (test)")
        version, current = self.rows.get(key, (ABSENT, b""))
        if expect is None or expect != version:
            return CasOutcome(expect is None, version, current)
        self.rows[key] = new = ((version[0] + 1, 1, 1), value)
        return CasOutcome(True, *new)


def newer_job_row() -> bytes:
    """A job row a newer version wrote: a state this one does not know."""
    return msgspec.msgpack.encode({"type": "job", "job_id": "j", "state": "paused", "windows": 4, "shards": 1,
                                   "writer_id": 7})


def running() -> bytes:
    return encode_row(msgspec.structs.replace(JOB, state="running"))


# (rows in the registers, the job row this node creates or None) -> a row the node cannot decode
CORRUPT = {
    "job row damaged": ({job_key("j"): GARBAGE}, None),
    "job row of a newer version": ({job_key("j"): newer_job_row()}, None),
    "shard row damaged": ({job_key("j"): running(), shard_key("j", 0, 0): GARBAGE}, None),
    "job index damaged, at creation": ({INDEX_KEY: GARBAGE}, JOB),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CORRUPT))
async def test_cluster_job_driver_corrupt_row_ends_this_nodes_part_not_the_daemon(case, caplog):
    rows, create = CORRUPT[case]
    regs = Registers()
    for key, value in rows.items():
        regs.put(key, value)
    failures: list[BaseException] = []

    def spawn(coro, name):  # as the daemon's ServiceContext.spawn: a task that raises stops the daemon
        async def supervised():
            try:
                return await coro
            except Exception as exc:
                failures.append(exc)
        return asyncio.get_running_loop().create_task(supervised(), name=name)

    jobs = ClusterJobs("n1", lambda: regs, Lexicon.default, S, TrainSettings(), spawn=spawn)
    try:
        with caplog.at_level(logging.INFO, logger="giaannd.compute.cluster_jobs.cluster_train"):
            f = jobs._follow("j", create)  # noqa: SLF001 (create: as ClusterJobs._create does)
            async with asyncio.timeout(10):
                await f.task
        assert failures == []
        assert jobs.ended["j"] == "failed" and "j" not in jobs.followed
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("job=j" in m and "does not hold" in m for m in errors), errors
    finally:
        await jobs.stop()


def oversize_shard(key: str, value: bytes) -> bool:
    """A shard row over 120 bytes is refused: it fits while it holds leases only, not once a
    completion adds the node's tally (a shard row that outgrew the 256 KiB cap, in small)."""
    return key.startswith("job/j/") and len(value) > 120


@pytest.mark.asyncio
async def test_cluster_job_driver_refused_write_fails_the_job():
    regs = Registers(refuse=oversize_shard)
    ran: list[int] = []

    async def run_window(action):
        ran.append(action.window)
        return 2

    driver = LeaseDriver(LeaseAgent("n1", "j", S, random.Random(0)), regs, run_window)
    async with asyncio.timeout(10):  # (before the fix: the write stayed in flight, the job never ended)
        end = await driver.run(Begin(JOB))
    assert ran  # the windows ran; their completion is the write refused
    assert end.state == "failed" and "over the cap" in end.error and shard_key("j", 0, 0) in end.error, end
    row = decode_job(regs.rows[job_key("j")][1])
    assert row.state == "failed" and row.error == end.error  # every node sees it failed, and why
    assert decode_index(regs.rows[INDEX_KEY][1]) == JobIndex()


@pytest.mark.asyncio
async def test_cluster_job_driver_refused_job_row_write_ends_this_nodes_part():
    """When the write that would record the failure, on the job row, is refused too, the node
    ends its part with the error rather than send that write again for good."""
    regs = Registers(refuse=lambda key, value: key == job_key("j") and decode_job(value).state != "created")

    async def run_window(action):
        raise AssertionError("no window runs: the job never starts")

    driver = LeaseDriver(LeaseAgent("n1", "j", S, random.Random(0)), regs, run_window)
    async with asyncio.timeout(10):
        end = await driver.run(Begin(JOB))
    assert end.state == "failed" and "over the cap" in end.error and job_key("j") in end.error, end
    assert decode_job(regs.rows[job_key("j")][1]).state == "created"
