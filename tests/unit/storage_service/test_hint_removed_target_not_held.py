"""A hint for a target the holder's ring marks removed and that is not live is acknowledged as held
without being written: the holder's next delivery round would drop it anyway (hint_delivery.py, "A
target removed for good"), so storing it was one durable write for nothing. The writer still
records the holder, and its next ``HeldHints`` question settles the seq (hint_confirm.py).
docs/replication.md, "A hinted owner that left the placement"."""

import numpy as np
import pytest

from tests.unit.storage_service.test_hint_left_target import COLUMNS
from tests.unit.storage_service.test_hint_removed_target import _remove_everywhere_but, past_start
from tools.cluster_harness import Cluster, make_batch

pytestmark = [pytest.mark.timeout(90)]


@pytest.mark.asyncio
async def test_hint_for_a_removed_target_is_acknowledged_without_a_hint_log(tmp_path):
    """The writer's stranded share of ``s2``, sent again as a hint after ``s2`` was removed (down):
    the holder answers it held, counts it received, and writes no hint log; the seq settles."""
    cluster = await Cluster(tmp_path, 4, replicas=3).start()
    try:
        client = cluster.client
        await cluster.kill("s2")
        for svc in cluster.services.values():
            svc.hints.max_bytes = 0  # no node will hold s2's hint: stranded
        res = await client.write(make_batch(np.random.default_rng(7), COLUMNS.size, columns=COLUMNS))
        await client.flush()
        bid = res.batch_id
        assert client.writer_floor < bid.seq and client._writes._stranded.get("s2")
        await _remove_everywhere_but(cluster, "s2", skip="")
        for svc in cluster.services.values():
            svc.hints.max_bytes = 1 << 30
        await past_start(next(iter(cluster.services.values())))
        await client.confirm_hints()  # sent again: as a hint for the removed s2
        assert sum(s.counters.hints_received for s in cluster.services.values()) == 1
        for svc in cluster.services.values():
            assert not svc.hints.pending("s2") and svc.hints.held_bytes == 0
            assert not (svc.hints.directory / ("t-" + b"s2".hex())).exists()  # nothing written
        await client.confirm_hints()
        assert client.writer_floor >= bid.seq
    finally:
        await cluster.close()
