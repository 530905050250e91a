"""A real cluster on loopback: 3 storage + 1 compute ``giaannd`` processes, driven with
``giaannctl`` subprocesses exactly as an operator would (tools/local_cluster.py launches them).

One cluster per module (starting four daemons costs seconds); the tests run in file order and the
last ones crash a storage node. Every wait is bounded and the fixture always stops the cluster,
killing leftovers in a ``finally``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from giaannd.sdk.local_cluster import LocalCluster, Node, split_corpus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WAIT_S = 30.0


@pytest.fixture(scope="module", params=[
    "tcp",
    # The demo's default (UCX bulk where ucxx starts, else TCP): the same checks, in test-all.
    pytest.param("auto", marks=pytest.mark.slow),
])
def cluster(tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("cluster")
    c = LocalCluster(root, storage=3, compute=1, transport=request.param)
    try:
        c.start()
        c.wait_converged()
        yield c
        codes = c.stop()
        assert codes == {n.name: 0 for n in c.nodes}, codes  # all stopped by SIGTERM exit 0
    finally:
        c.kill_all()


@pytest.fixture(scope="module")
def corpus(cluster: LocalCluster) -> tuple[Path, Path]:
    train, held, _, _ = split_corpus(cluster.corpus_dir, 120, 30)  # where the nodes may read
    return train, held


def ctl_json(node: Node, *args: str) -> Any:
    proc = node.ctl("--json", *args)
    assert proc.returncode == 0, f"giaannctl {' '.join(args)} on {node.name}: {proc.stderr}"
    return json.loads(proc.stdout)


def members(node: Node) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in ctl_json(node, "members", "list")["members"]}


def wait_until(predicate: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.2)


def test_cluster_members_list_shows_every_node_with_roles(cluster: LocalCluster) -> None:
    expected = {"storage-1": "storage", "storage-2": "storage", "storage-3": "storage",
                "compute-1": "compute"}
    for node in cluster.nodes:
        table = members(node)
        assert {k: v["roles"] for k, v in table.items()} == expected, node.name
        assert all(v["status"] == "alive" for v in table.values())
        assert all("tcp://127.0.0.1:" in v["data_plane"] for v in table.values())
    human = cluster.nodes[0].ctl("members", "list")
    assert human.returncode == 0 and "compute-1" in human.stdout and "ROLES" in human.stdout


def test_cluster_ring_owners_agree_across_nodes(cluster: LocalCluster) -> None:
    for column in ("water", "earth", "12345", "0xdeadbeef"):
        answers = [ctl_json(node, "ring", "owners", column) for node in cluster.nodes]
        owners = {tuple(o["name"] for o in a["owners"]) for a in answers}
        epochs = {a["epoch"] for a in answers}
        assert len(owners) == 1 and len(epochs) == 1, (column, answers)
        assert len(next(iter(owners))) == 3  # R = 3 distinct storage owners
    ring = ctl_json(cluster.nodes[0], "ring", "show")
    assert sorted(m["name"] for m in ring["members"]) == ["storage-1", "storage-2", "storage-3"]


def test_cluster_bad_requests_get_clear_errors(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    # refused as given (400): bad input, exit 2 as a usage error (giaannd/admin/ctl.py)
    bad = node.ctl("ring", "owners", "0x" + "f" * 17)
    assert bad.returncode == 2 and "64-bit" in bad.stderr
    join = node.ctl("node", "join", "not-an-address")
    assert join.returncode == 2 and "host:port" in join.stderr


def test_cluster_train_eval_generate_export_through_giaannctl(
        cluster: LocalCluster, corpus: tuple[Path, Path]) -> None:
    compute = cluster.node("compute-1")
    train, held = corpus
    job = ctl_json(compute, "train", "start", str(train))
    assert job["state"] == "succeeded" and job["trained"] > 0, job
    # a cluster job by default (compute.cluster-jobs): the windows the node wrote, from the registers
    assert job["cluster"] and job["by_node"]["compute-1"]["windows"] > 0 and job["sentences_per_s"] > 0, job
    # Every storage node holds rows (R = 3 of 3 storage nodes: each holds a replica of all).
    for node in cluster.nodes:
        if "storage" in node.roles:
            health = node.status()["services"]["storage"]
            assert health["rows"] > 0 and health["counters"]["applies"] > 0, node.name
    ev = ctl_json(compute, "eval", "--corpus", held.name)  # relative: inside compute.corpus-dir
    assert 0.0 <= ev["top1"] <= 1.0 and ev["prediction_tokens"] > 0, ev
    gen = ctl_json(compute, "generate", "In the beginning, God created the heavens",
                   "--max-tokens", "5")
    assert 0 < len(gen["tokens"]) <= 5, gen
    ctl_json(compute, "export", "export.jsonl")  # relative: inside compute.export-dir
    lines = (cluster.export_dir / "export.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line) for line in lines[:10])


def test_cluster_kill9_storage_is_marked_dead_and_writes_continue(
        cluster: LocalCluster, corpus: tuple[Path, Path]) -> None:
    victim = cluster.node("storage-3")
    owners_before = ctl_json(cluster.nodes[0], "ring", "owners", "water")
    cluster.kill(victim)
    survivors = [n for n in cluster.nodes if n is not victim]
    for node in survivors:
        wait_until(lambda node=node: members(node)["storage-3"]["status"] == "dead",
                   f"{node.name} marks storage-3 dead")
    # A failed member keeps its placement (hinted handoff covers its writes): owners unchanged
    # and still agreed on by every survivor.
    for node in survivors:
        answer = ctl_json(node, "ring", "owners", "water")
        assert [o["name"] for o in answer["owners"]] == \
            [o["name"] for o in owners_before["owners"]]
        assert {o["name"]: o["live"] for o in answer["owners"]}["storage-3"] is False
    compute = cluster.node("compute-1")
    train, _ = corpus
    job = ctl_json(compute, "train", "start", str(train))
    assert job["state"] == "succeeded" and job["trained"] > 0, job
    hints = sum(n.status()["services"]["storage"].get("hints_held", 0)
                for n in survivors if "storage" in n.roles)
    assert hints > 0  # storage-3's share is held for it by the survivors


def test_cluster_restarted_storage_rejoins_and_receives_its_hints(cluster: LocalCluster) -> None:
    victim = cluster.node("storage-3")
    survivors = [n for n in cluster.nodes if n is not victim]
    held_before = sum(n.status()["services"]["storage"].get("hints_held", 0)
                      for n in survivors if "storage" in n.roles)
    assert held_before > 0  # left by the previous test's writes
    old_id = members(survivors[0])["storage-3"]["node_id"]
    cluster.restart(victim)
    for node in survivors:
        wait_until(lambda node=node: members(node)["storage-3"]["status"] == "alive",
                   f"{node.name} sees storage-3 alive again")
    row = members(survivors[0])["storage-3"]
    assert row["node_id"] == old_id and row["incarnation"] >= 1  # same identity, newer life

    def hints_held() -> int:
        return sum(n.status()["services"]["storage"].get("hints_held", 0)
                   for n in survivors if "storage" in n.roles)
    wait_until(lambda: hints_held() == 0, "hints delivered to storage-3", timeout_s=60)
    counters = victim.status()["services"]["storage"]["counters"]
    assert counters["applies"] > 0  # the hinted batches, applied on the restarted node
