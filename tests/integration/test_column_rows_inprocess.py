"""Issue 21, server side: ``GET /v1/columns/{column}/rows`` (a column's contents) and the row-size
distribution in ``GET /v1/ring/usage``, on in-process daemons wired as ``giaannd`` wires them: two
storage nodes and a compute node that trains a few sentences. Real loopback sockets; every wait is
bounded."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

from giaannd.compute.service import ComputeService
from giaannd.compute.train import TrainSettings
from giaannd.daemon import Daemon, build_role_services
from giaannd.model.ids import column_id
from giaannd.model.tokens import load_bundled_corpus
from giaannd.runtime.node import NodeRuntime
from giaannd.services.membership import MembershipService
from giaannd.services.roles import StorageRole
from peers.keyring import Keyring
from tests.integration.test_cluster_inprocess import wait_async
from tests.integration.test_column_info_inprocess import Role, RoleNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class ComputeNode(RoleNode):
    """``RoleNode`` that keeps its role services (the test trains through the compute one), with
    a small default answer for ``column rows``."""

    def __init__(self, root: Path, name: str, key_file: str, roles: list[Role]) -> None:
        super().__init__(root, name, key_file, roles)
        self.config = msgspec.structs.replace(self.config, compute=msgspec.structs.replace(
            self.config.compute, column_rows_default_entries=50, column_rows_max_entries=100_000))
        self.runtime = NodeRuntime(self.config)
        self.membership = MembershipService(self.runtime)
        self.services, unavailable = build_role_services(self.config, self.runtime)
        assert not unavailable
        self.daemon = Daemon(self.config, [self.runtime, self.membership, *self.services],
                             handle_signals=False, runtime=self.runtime)


def _export_lines_of(path: Path, lemma: str) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [x for x in lines if x["source_lemma"] == lemma]


@pytest.mark.asyncio
async def test_column_rows_equal_the_export_and_ring_usage_shows_row_sizes(tmp_path: Path) -> None:
    key_file = str(tmp_path / "cluster.key")
    Keyring.generate().save(key_file)
    nodes = [ComputeNode(tmp_path, "a", key_file, ["storage"]), ComputeNode(tmp_path, "b", key_file, ["storage"]),
             ComputeNode(tmp_path, "c", key_file, ["compute"])]
    started: list[ComputeNode] = []
    try:
        for node in nodes:
            await node.start()
            started.append(node)
        a, b, c = nodes
        for node in (b, c):
            status, doc = await node.call("POST", "/v1/node/join", {"seeds": [a.gossip_addr]})
            assert status == 200 and doc["joined"], doc

        async def storage_seen_everywhere() -> bool:
            return all(len(n.runtime.topology.live()) == 2 for n in nodes)
        await wait_async(storage_seen_everywhere, "every node sees both storage nodes")

        compute = next(s for s in c.services if isinstance(s, ComputeService))
        await compute.train(load_bundled_corpus(60), TrainSettings(workers=1, coalesce_sentences=16))
        export = tmp_path / "export.jsonl"
        await compute.export(export)
        lemma = Counter(json.loads(x)["source_lemma"] for x in export.read_text().splitlines()).most_common(1)[0][0]
        want = _export_lines_of(export, lemma)
        assert len(want) > 50

        # the column by word (any case) and by id, every entry, equal to the export's lines of it
        status, doc = await c.call("GET", f"/v1/columns/{lemma.upper()}/rows?limit=100000")
        assert status == 200, doc
        assert doc["column"] == column_id(lemma) and doc["word"] == lemma
        assert doc["total_entries"] == len(want) and doc["truncated"] is False
        e = doc["entries"]
        got = [{"source_lemma": lemma, "source_word": e["source_feature"][i], "source_prime": e["source_prime"][i],
                "segment": e["segment"][i], "target_lemma": e["target_column"][i],
                "target_word": e["target_feature"][i], "target_prime": e["target_prime"][i],
                "strength": e["strength"][i]} for i in range(len(e["strength"]))]
        assert got == want
        f = doc["features"]
        assert sum(f["entries"]) == len(want) and len(f["feature"]) == len(f["prime"]) == len(f["entries"])
        assert f["feature"][0] == lemma and f["prime"][0] is True  # the prime neuron's row comes first
        status, by_id = await c.call("GET", f"/v1/columns/{column_id(lemma):#x}/rows?limit=100000")
        assert status == 200 and by_id == doc

        # no limit: compute.column-rows-default-entries (50 here); the cut keeps key order
        status, cut = await c.call("GET", f"/v1/columns/{lemma}/rows")
        assert status == 200 and cut["truncated"] is True and cut["total_entries"] == len(want)
        assert cut["entries"]["strength"] == e["strength"][:50] and sum(cut["features"]["entries"]) == 50
        assert cut["entries"]["target_feature"] == e["target_feature"][:50]

        # refusals: no rows (404), a bad column or limit (400)
        status, err = await c.call("GET", "/v1/columns/0x1/rows")
        assert status == 404 and err["code"] == "not_found" and "has no rows" in err["error"], err
        status, err = await c.call("GET", "/v1/columns/0/rows")  # the flag row is no column
        assert status == 404, err
        for bad in (f"/v1/columns/{'9' * 30}/rows", f"/v1/columns/{lemma}/rows?limit=0",
                    f"/v1/columns/{lemma}/rows?limit=100001", f"/v1/columns/{lemma}/rows?limit=x"):
            status, err = await c.call("GET", bad)
            assert status == 400 and err["code"] == "bad_request", (bad, err)

        # ring usage: each storage node's row sizes add up to its rows
        status, usage = await a.call("GET", "/v1/ring/usage")
        assert status == 200, usage
        for node in usage["nodes"]:
            sizes = node["row_sizes"]
            assert sizes and sizes[-1] > 0 and sum(sizes) == node["rows"] > 0, node
            assert sum(n * 2**k for k, n in enumerate(sizes)) <= node["entries"] < \
                sum(n * 2 ** (k + 1) for k, n in enumerate(sizes))
        role = next(s for s in a.services if isinstance(s, StorageRole))
        held = np.diff(role.service.store.store.read_all().offsets)
        assert usage["nodes"][[n["name"] for n in usage["nodes"]].index("a")]["row_sizes"] == \
            np.bincount(np.floor(np.log2(held)).astype(int)).tolist()
    finally:
        for node in reversed(started):
            await node.stop()
