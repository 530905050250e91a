"""Dropping the hints held for a member removed for good, through the in-process control and the
remote source control (both ``HintStore.drop``): every hint for it goes, its log too, and no
other target's."""

import numpy as np
import pytest

from giaannd.storage.rebalance import source_control as sc
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90)]

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 40, dtype=np.uint64)


async def _two_hinted_writes(cluster, gone):
    client = cluster.client
    await cluster.kill(gone)
    for seed in (7, 8):
        res = await client.write(make_batch(np.random.default_rng(seed), COLUMNS.size, columns=COLUMNS))
        assert gone in res.hinted
    await client.flush()
    return [s for s in cluster.services.values() if s.hints.pending(gone)]


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["local", "remote"])
async def test_drop_hints_forgets_every_hint_for_the_target(tmp_path, via):
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        holders = await _two_hinted_writes(cluster, "s2")
        held = sum(len(s.hints.pending("s2")) for s in holders)
        assert held == 2
        if via == "local":
            assert await cluster.control().drop_hints_for("s2") == held
        else:
            for svc in holders:
                n, address = len(svc.hints.pending("s2")), cluster.stream_addresses[svc.node_name]
                assert await sc.drop_hints(cluster.ops_transport, address, "s2") == n
        for svc in holders:
            assert not svc.hints.pending("s2") and svc.hints.held_bytes == 0
            assert not (svc.hints.directory / ("t-" + b"s2".hex())).exists()
    finally:
        await cluster.close()
