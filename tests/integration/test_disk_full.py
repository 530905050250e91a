"""A storage daemon whose disk fills up (issue 16 item 2), in-process on a small tmpfs.

What must hold: a periodic snapshot that hits ENOSPC is logged, its temporary removed, and retried
with backoff, while the daemon keeps running; writes are refused with ``full``/``disk_full`` in
status, gossip and metrics, reads still served, and a few log lines however many writes were
refused; once space returns, writes resume by themselves; a graceful stop whose final snapshot
fails exits non-zero. Every wait is bounded; the tmpfs is always unmounted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from giaannd.client.storage_client import RemoteUnavailable
from giaannd.config import Config
from giaannd.daemon import Daemon, build_role_services
from giaannd.protocol import BatchId
from giaannd.runtime.node import NodeRuntime
from giaannd.services.membership import MembershipService
from tests.integration.small_fs import fill, small_tmpfs
from tools.cluster_harness import make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WAIT_S = 20.0


async def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            while not (value := predicate()):
                await asyncio.sleep(0.05)
            return value
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}") from None


def storage_config(data_dir: Path, **storage: Any) -> Config:
    base = Config.loopback(str(data_dir), name="full", roles=["storage"])
    return msgspec.structs.replace(base, storage=msgspec.structs.replace(
        base.storage, join_mode="bootstrap", **storage))


@asynccontextmanager
async def running(config: Config) -> AsyncIterator[tuple[Daemon, NodeRuntime, asyncio.Task[int]]]:
    runtime = NodeRuntime(config)
    roles, _ = build_role_services(config, runtime)
    daemon = Daemon(config, [runtime, MembershipService(runtime), *roles], handle_signals=False,
                    runtime=runtime)
    task = asyncio.create_task(daemon.run())
    try:
        await wait_until(lambda: daemon.state != "starting" or task.done(), "daemon started")
        assert daemon.state == "running", task.exception() if task.done() else daemon.status()
        yield daemon, runtime, task
    finally:
        daemon.request_stop("test over")
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(task, return_exceptions=True)


def storage_health(daemon: Daemon) -> dict[str, Any]:
    return dict(daemon.status()["services"]["storage"])


@pytest.mark.asyncio
async def test_disk_full_daemon_refuses_writes_keeps_serving_and_resumes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with small_tmpfs(tmp_path / "fs") as fs:
        config = storage_config(fs / "data", snapshot_interval_s=0.2, retry_base_s=0.05, retry_cap_s=0.2,
                                disk_full_probe_s=0.1, disk_resume_free_bytes=1 << 20)
        async with running(config) as (daemon, runtime, task):
            client = runtime.storage_client(request_timeout_s=5.0)
            rng = np.random.default_rng(7)
            written = make_batch(rng, 16)
            await client.apply_to("full", BatchId(9, 1), written)
            filler = fill(fs)

            # writes fail for lack of space (the first few may still fit in the log's last page);
            # the node says so and refuses the rest
            seq = 1
            for seq in range(2, 40):
                try:
                    await client.apply_to("full", BatchId(9, seq), make_batch(rng, 16))
                except RemoteUnavailable as exc:
                    assert "No space left" in str(exc) or "disk full" in str(exc)
                    break
            else:
                raise AssertionError("writes still succeed on a full disk")
            refused = 0
            for later in range(seq + 1, seq + 101):
                with pytest.raises(RemoteUnavailable, match="disk full"):
                    await client.apply_to("full", BatchId(9, later), make_batch(rng, 16))
                refused += 1
            health = storage_health(daemon)
            assert health["disk_full"] is True and health["full"] is True and health["is_full"] is True
            assert runtime.node_meta().full  # gossiped
            metrics = daemon.metrics.render().decode()
            assert "giaannd_storage_disk_full 1.0" in metrics
            assert "giaannd_storage_full 1.0" in metrics
            # reads are still served
            got = await client.read_rows(written.row_column, written.row_feature)
            assert got.num_rows == written.num_rows

            # the periodic snapshot fails too: retried, its temporary removed, the daemon runs on
            await wait_until(lambda: storage_health(daemon).get("snapshot_failures", 0) >= 2,
                             "snapshot retried")
            assert daemon.state == "running" and not task.done()
            store_dir = fs / "data" / "storage" / "store"
            assert not list(store_dir.glob(".snapshot-*.tmp"))
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert refused == 100 and len(errors) <= 3, [r.getMessage() for r in errors]

            # space comes back: writes resume by themselves, the snapshot catches up
            filler.unlink()
            await wait_until(lambda: not storage_health(daemon)["disk_full"], "disk_full cleared")
            await client.apply_to("full", BatchId(9, 200), make_batch(rng, 16))
            await wait_until(lambda: storage_health(daemon).get("snapshot_failures") == 0,
                             "snapshot succeeded after space returned")
            assert not runtime.node_meta().full
            assert "giaannd_storage_disk_full 0.0" in daemon.metrics.render().decode()

            # the disk fills again just before a graceful stop: the final snapshot fails, and the
            # stop says so with its exit status
            fill(fs, "filler2")
            daemon.request_stop("test: stop on a full disk")
            async with asyncio.timeout(WAIT_S):
                code = await task
        assert code != 0
        assert "final snapshot failed" in caplog.text


class FailingStop:
    """A service whose graceful stop fails (as the storage role's does when its final snapshot
    cannot be written)."""

    name = "failing-stop"

    async def start(self, ctx: Any) -> None:
        pass

    async def stop(self, graceful: bool) -> None:
        if graceful:
            raise OSError(28, "No space left on device")

    def health(self) -> dict[str, Any]:
        return {}


@pytest.mark.asyncio
async def test_disk_full_failed_graceful_stop_exits_nonzero(tmp_path: Path) -> None:
    config = Config.loopback(str(tmp_path / "data"), name="n", roles=[])
    daemon = Daemon(config, [FailingStop()], handle_signals=False)
    task = asyncio.create_task(daemon.run())
    await wait_until(lambda: daemon.state != "starting" or task.done(), "daemon started")
    daemon.request_stop("test")
    async with asyncio.timeout(WAIT_S):
        assert await task == 1
