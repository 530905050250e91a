"""The storage ring across real ``giaannd`` processes (tools/local_cluster): the initial storage
nodes bootstrap one ring, and a ring change pushed to one node reaches every node, the compute-only
one included, within a bounded wait (ring sync: gossiped digest + pull)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from giaannd.client.ring_calls import push_ring
from giaannd.cluster.ring import RING_FILE, Ring
from giaannd.sdk.local_cluster import LocalCluster
from peers.keyring import Keyring
from peers.transport import Identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WAIT_S = 30.0


def test_ring_change_pushed_to_one_process_reaches_every_process(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", storage=2, compute=1, transport="tcp")
    try:
        cluster.start()  # returns once every node holds the same ring: both storage nodes active
        docs = cluster.ring_docs()
        assert {d["ring"]["digest"] for d in docs.values()} != {f"{0:016x}"}
        first = cluster.node("storage-1")
        target = first.status()["services"]["runtime"]["advertised"]["tcp"]
        ring = Ring.load(first.data_dir / RING_FILE)
        assert ring.active() == [("storage-1", 1.0), ("storage-2", 1.0)]

        # A tombstone for a member that never existed: a change of the ring (and its digest)
        # that moves no column.
        identity = Identity("test-client", "giaann-local", Keyring.load(cluster.key_file).keys)
        merged = asyncio.run(push_ring({}, identity, target, ring.with_removed("ghost")))
        assert merged.get("ghost") is not None and merged.active() == ring.active()
        want = f"{merged.digest():016x}"
        deadline = time.monotonic() + WAIT_S
        while {d["ring"]["digest"] for d in cluster.ring_docs().values()} != {want}:
            assert time.monotonic() < deadline, f"ring not everywhere in {WAIT_S}s: {cluster.ring_docs()}"
            time.sleep(0.1)
        for node in cluster.nodes:  # persisted by every node, compute included
            assert Ring.load(node.data_dir / RING_FILE) == merged, node.name
        assert cluster.stop() == {n.name: 0 for n in cluster.nodes}
    finally:
        cluster.kill_all()
