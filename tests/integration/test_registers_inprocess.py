"""Replicated registers end to end: StorageClient.read_register / cas_register against three
StorageServices (mem://, R = 3): concurrent proposers, an owner down, a restart keeps promises and
values. Every wait is bounded."""

from __future__ import annotations

import asyncio

import pytest

from giaannd.client.errors import RegisterUnavailable
from giaannd.client.registers import ABSENT, CasOutcome, register_owners
from giaannd.client.storage_client import StorageClient
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.asyncio
async def test_registers_cas_over_storage_services(tmp_path):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        c = cluster.client
        created = await c.cas_register("job/a", ABSENT, b"created")
        assert created.ok and created.version[0] == 1
        assert await c.cas_register("job/a", ABSENT, b"again") == CasOutcome(False, created.version, b"created")
        read = await c.read_register("job/a")
        assert (read.version, read.value) == (created.version, b"created")

        # two more clients (their own proposer ids) bump one counter concurrently
        others = [StorageClient(cluster.client_topology, c.transports, request_timeout_s=2.0) for _ in range(2)]
        for x in (c, *others):  # liveness under contention is not what this checks (see registers.py)
            x.registers.max_rounds = 10_000

        async def bump(client: StorageClient, times: int) -> list[int]:
            won = []
            for _ in range(times):
                cur = await client.cas_register("counter", None)
                while not (out := await client.cas_register("counter", cur.version,
                                                            str(int(cur.value or b"0") + 1).encode())).ok:
                    cur = out
                won.append(out.version)
            return won

        results = await asyncio.wait_for(asyncio.gather(*(bump(x, 10) for x in (c, *others))), 30)
        assert sorted(v[0] for r in results for v in r) == list(range(1, 31))
        assert (await c.read_register("counter")).value == b"30"

        # one owner down: a majority still decides; two down: unavailable, nothing changed
        owners = register_owners(cluster.client_topology, "job/a")
        await cluster.stop_node(owners[0])
        running = await c.cas_register("job/a", created.version, b"running")
        assert running.ok
        await cluster.stop_node(owners[1])
        with pytest.raises(RegisterUnavailable):
            await c.cas_register("job/a", running.version, b"done")
        await cluster.restart_node(owners[0])
        await cluster.restart_node(owners[1])
        # the restarted acceptors kept what they promised and accepted (durable before answering)
        out = await c.cas_register("job/a", running.version, b"done")
        assert out.ok and out.version[0] == 3
        for o in others:
            await o.close()
    finally:
        await cluster.close()
