"""After a join, the old owners release the columns they lost (release.py): every owner still
holds exactly the reference rows, the old owners' stores shrink by what they no longer own, and
the release survives a restart."""

import numpy as np
import pytest

from giaannd.cluster.view import StorageNode
from giaannd.storage.engine.column_store import DropResult
from giaannd.storage.rebalance.operations import Rebalance, members_after
from giaannd.storage.rebalance.release import release_unowned, unowned_columns
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(0).integers(1, 2**63, 80, dtype=np.uint64)


async def test_release_after_join_frees_the_old_owners(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=2).start()
    try:
        rng = np.random.default_rng(1)
        await cluster.write_many(rng, 40, COLUMNS)
        await cluster.add_node("s3")
        op = Rebalance(cluster.control(), "join",
                       members_after(cluster.client_topology, add=[StorageNode("s3", cluster.addresses["s3"])]),
                       chunk_bytes=4096)
        assert (await op.run())["state"] == "done"
        await cluster.client.flush()
        placement = cluster.client_topology.placement
        lost = {}
        for name in ("s0", "s1", "s2"):
            store = cluster.services[name].store.store
            lost[name] = unowned_columns(placement, name, store.held_columns())
        assert sum(c.size for c in lost.values()) > 0  # the join took columns from old owners
        for name in ("s0", "s1", "s2"):
            store = cluster.services[name].store.store
            before = store.usage()
            rows_lost = sum(1 for k in store.keys() if k[0] in set(lost[name].tolist()))
            result = await release_unowned(cluster.services[name])
            assert result.rows == rows_lost and before.used_bytes - store.used_bytes == result.bytes
            assert unowned_columns(placement, name, store.held_columns()).size == 0
        assert await release_unowned(cluster.services["s3"]) == DropResult(0, 0)
        assert cluster.mismatches() == []  # every owner still has every acknowledged update
        # writes go on; a restarted old owner replays its drop and still matches
        await cluster.write_many(rng, 10, COLUMNS)
        await cluster.client.flush()
        await cluster.kill("s0")
        await cluster.restart_node("s0")
        assert unowned_columns(placement, "s0", cluster.services["s0"].store.store.held_columns()).size == 0
        assert cluster.mismatches() == []
    finally:
        await cluster.close()
