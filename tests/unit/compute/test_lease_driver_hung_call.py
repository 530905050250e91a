"""A register call that never answers (a storage node that accepts the request and sends nothing
back) must not hold a cluster job's row for good. The agent sends one request per row at a time,
so before, such a call held the row past the lease's end: the holder dropped its windows (lost
its lease) and no retry was ever sent; the job hung. The driver now bounds each register call
(``lease_driver.register_timeout_s``: half of ``lease_s - renew_s``); a call past it is an
``OpFailed`` and the agent sends the write (or read) again, in time to keep its lease.

In-memory registers as in test_cluster_job_driver_rows.py; every wait is bounded."""

import asyncio
import random

import pytest

from giaannd.client.registers import ABSENT, CasOutcome, RegisterRead
from giaannd.client.storage_client import DEFAULT_REQUEST_TIMEOUT_S
from giaannd.compute.cluster_jobs.lease_driver import LeaseDriver, register_timeout_s
from giaannd.compute.cluster_jobs.lease_events import Begin, LeaseSettings
from giaannd.compute.cluster_jobs.lease_table import JobRow, decode_job, job_key, shard_key
from giaannd.compute.cluster_jobs.leases import LeaseAgent
from giaannd.config import ComputeConfig

#: a renewal falls due 0.6 s after the last confirming write; the lease ends at 3 s
S = LeaseSettings(lease_s=3.0, renew_s=0.6, probe_interval_s=0.05, lease_windows=2, parallel=2, retry_s=0.01)
JOB = JobRow(job_id="j", windows=4, shards=1, writer_id=7)


class HangingRegisters:
    """In-memory registers; once ``armed``, the first call of ``kind`` on ``key`` never answers
    (it waits until cancelled), every later one answers as usual."""

    def __init__(self, kind: str, key: str) -> None:
        self.rows: dict[str, tuple[tuple[int, int, int], bytes]] = {}
        self.kind, self.key = kind, key
        self.armed = False
        self.hung = 0  # calls that never answered
        self.cancelled = 0  # of those, the ones the driver gave up on
        self.answered_after_hang = asyncio.Event()

    async def _maybe_hang(self, kind: str, key: str) -> None:
        if not (self.armed and kind == self.kind and key == self.key):
            return
        if self.hung:
            self.answered_after_hang.set()
            return
        self.hung += 1
        try:
            await asyncio.Event().wait()  # accepted, never answered
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def read_register(self, key, timeout_s=None):
        await self._maybe_hang("read", key)
        version, value = self.rows.get(key, (ABSENT, b""))
        return RegisterRead(version, value, True)

    async def cas_register(self, key, expect, value=b"", timeout_s=None):
        await self._maybe_hang("cas", key)
        version, current = self.rows.get(key, (ABSENT, b""))
        if expect is None or expect != version:
            return CasOutcome(expect is None, version, current)
        self.rows[key] = new = ((version[0] + 1, 1, 1), value)
        return CasOutcome(True, *new)


def test_lease_driver_register_timeout_leaves_time_to_retry_before_the_lease_ends() -> None:
    """With the defaults (compute.lease-s 10 s, a renewal due after 10/3 s, retry after ~0.25 s),
    one request alone may wait the StorageClient's 10 s for an owner the quorum needs: longer than
    the 6.7 s from a renewal falling due to the lease's end. The bound (3.3 s) lets a renewal that
    gets no answer be sent again ~2.9 s before the lease ends."""
    c = ComputeConfig()
    defaults = LeaseSettings(lease_s=c.lease_s, renew_s=c.lease_s / 3, probe_interval_s=c.lease_probe_interval_s,
                             lease_windows=c.lease_windows, parallel=1, retry_s=c.lease_probe_interval_s / 4)
    assert DEFAULT_REQUEST_TIMEOUT_S > defaults.lease_s - defaults.renew_s  # what the bound is for
    bound = register_timeout_s(defaults)
    retry_sent_by = defaults.renew_s + bound + 1.5 * defaults.retry_s  # (the agent's retry jitter: 0.5-1.5)
    assert bound > 0 and defaults.lease_s - retry_sent_by > 2.5


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "key"), [("cas", shard_key("j", 0, 0)), ("read", job_key("j"))],
                         ids=["shard write", "job row read"])
async def test_lease_driver_hung_register_call_is_retried_and_the_lease_kept(kind: str, key: str) -> None:
    regs = HangingRegisters(kind, key)
    release = asyncio.Event()
    dropped: list[int] = []  # windows cancelled: the holder's deadline passed (its lease lost)

    async def run_window(action):
        regs.armed = True  # the node holds a lease: its next call on the row never answers
        try:
            await release.wait()
        except asyncio.CancelledError:
            dropped.append(action.window)
            raise
        return 2

    async def release_after_retry() -> None:
        await regs.answered_after_hang.wait()
        release.set()

    driver = LeaseDriver(LeaseAgent("n1", "j", S, random.Random(0)), regs, run_window)
    helper = asyncio.get_running_loop().create_task(release_after_retry())
    try:
        # before the fix: the hung call held the row for good, the windows were dropped at the
        # lease's end and the job never ended (this timeout)
        async with asyncio.timeout(20):
            end = await driver.run(Begin(JOB))
    finally:
        helper.cancel()
    assert (regs.hung, regs.cancelled) == (1, 1)  # the driver gave up on the call and sent another
    assert end.state == "done" and dropped == [], (end, dropped)
    assert decode_job(regs.rows[job_key("j")][1]).state == "done"
