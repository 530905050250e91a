"""Storage nodes as real ``giaannd`` processes over tcp:// (tools/cluster_harness, process mode):
quorum writes, SIGKILL of an owner, hinted handoff across processes, restart from the data
directory, graceful stop with a snapshot."""

import asyncio

import numpy as np
import pytest

from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.asyncio
async def test_storage_processes_kill_owner_hint_delivered_restart(tmp_path):
    names = ["p0", "p1", "p2"]
    cluster = await Cluster(tmp_path, processes=True, names=names, replicas=3, request_timeout_s=5).start()
    client = cluster.client
    try:
        rng = np.random.default_rng(21)
        first = make_batch(rng, 30)
        await client.write(first)
        await cluster.kill("p1", noticed=False)  # the client's view is not told: it learns from failed requests
        second = make_batch(rng, 30)
        result = await client.write(second)
        assert set(result.acked) == {"p0", "p2"}
        await client.flush()
        assert result.batch_id.seq == 2
        read = await client.read_rows(second.row_column, second.row_feature)
        assert read.num_rows == second.num_rows

        await cluster.restart_node("p1")  # same data dir and port: recovers the first batch from its log
        # (the first batch's ack from p1 may also have been lost to the kill: then it is hinted too)
        async with asyncio.timeout(15):
            while client.writer_floor < 2:
                await client.confirm_hints()
                await asyncio.sleep(0.1)
        for batch in (first, second):
            digests = [await client.digests(n, batch.row_column, batch.row_feature) for n in names]
            assert all(d is not None for d in digests[1])
            assert digests[0] == digests[1] == digests[2]
        for n in names:
            usage = await client.usage(n)
            assert usage.hints_held == 0 and usage.num_rows == 60
        await cluster.stop_node("p0")  # graceful (SIGTERM): snapshot on the way out
        assert any(p.suffix == ".snap" for p in (cluster.storage_dir("p0") / "store").iterdir())
    finally:
        await cluster.close()
