"""Topology operations on real ``giaannd`` daemons when a node crashes in the middle of them (kill -9
of a source, of a receiver, of a decommission's coordinator; a graceful stop of a joiner while a job
trains).

Each test starts a small loopback cluster, trains, crashes a node mid-operation, brings it back,
runs the documented verbs an operator would, and compares the cluster's export with the
single-process core trained on the same sentences (no update lost or counted twice). Every wait is
bounded; the cluster is always stopped (SIGKILL as a last resort). The helpers are those of
test_topology_daemons.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from giaannd.sdk.local_cluster import LocalCluster, Node
from tests.integration.test_topology_daemons import (
    _op_started,
    assert_export_equals,
    job_doc,
    ring_active,
    start_job,
    topology_op,
    training_cluster,
    wait_job,
    wait_job_started,
    wait_op_done,
    wait_until,
)
from tests.integration.test_topology_daemons import reference as reference  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def wait_op_ended(node: Node, timeout_s: float = 120.0) -> dict[str, Any]:
    """The node's last topology operation once it ended, whatever its outcome."""
    def ended() -> dict[str, Any] | None:
        if not _op_started(node):
            return None
        doc = topology_op(node)
        return doc if doc["state"] in ("done", "failed", "cancelled") else None
    doc: dict[str, Any] = wait_until(ended, f"the topology operation on {node.name} ended", timeout_s)
    return doc


def wait_rings(cluster: LocalCluster, names: list[str]) -> None:
    for node in cluster.nodes:
        if node.proc is not None and node.proc.poll() is None:
            wait_until(lambda node=node: ring_active(node) == names, f"{node.name}'s ring is {names}", 30)


def _trained(cluster: LocalCluster, corpus: Path) -> Node:
    compute = cluster.node("compute-1")
    wait_job(compute, start_job(compute, corpus))
    return compute


def test_daemon_decommissioning_node_killed_mid_stream_can_decommission_again(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:  # noqa: F811
    """kill -9 of a decommissioning node (the coordinator and the only source) mid-stream; after its
    restart the operator runs ``node decommission`` again: it completes and the export equals the
    core's."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 3) as cluster:
        compute = _trained(cluster, corpus)
        leaving = cluster.node("storage-3")
        proc = leaving.ctl("--json", "node", "decommission", "--rate", "100000")
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: topology_op(leaving)["bytes_done"] > 0, "the decommission streamed something", 60)
        cluster.kill(leaving)
        cluster.restart(leaving)
        cluster.wait_converged()
        # The first run after the crash meets the old streams (their sender died with its queue
        # of forwarded writes): it fails and its receivers drop what they brought. Before, it
        # failed with "this node already holds ... rows ... wipe this node's data directory" on
        # storage-1 / storage-2, and so did every later run until their idle sweep (2 h).
        proc = leaving.ctl("--json", "node", "decommission")
        assert proc.returncode == 0, proc.stderr
        doc = wait_op_ended(leaving)
        assert doc["state"] == "failed" and "another sender" in doc["error"], doc
        assert doc["discarded_rows"] > 0 and doc["discard_errors"] == [], doc
        proc = leaving.ctl("--json", "node", "decommission")  # the verb again: new streams
        assert proc.returncode == 0, proc.stderr
        doc = wait_op_ended(leaving)
        assert doc["state"] == "done", doc
        wait_rings(cluster, ["storage-1", "storage-2"])
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


def test_daemon_source_killed_mid_join_then_join_again_equals_core(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:  # noqa: F811
    """kill -9 of a source (storage-1) of a throttled join, restarted at once: the join fails
    clearly (the source's queue of forwarded writes died with it) and its receiver drops what the
    streams brought; ``node join-ring`` again completes and the export equals the core's."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute = _trained(cluster, corpus)
        joiner = cluster.add_node("storage-3", ["storage"], join_mode="manual")
        proc = joiner.ctl("--json", "node", "join-ring", "--rate", "60000")
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: all(s["items_acked"] for s in topology_op(joiner)["streams"]),
                   "every stream of the join delivered an item", 60)
        source = cluster.node("storage-1")
        cluster.kill(source)
        cluster.restart(source)  # on another stream port (stream-bind port 0, the default)
        # It fails on the restarted source's refusal; before, the coordinator dialled the source's
        # old address until SOURCE_UNREACHABLE_S (120 s) and failed with "unreachable".
        doc = wait_op_ended(joiner, 180)
        assert doc["state"] == "failed" and "storage-1->storage-3" in doc["error"], doc
        assert "restarted" in doc["error"], doc
        # ... at once: the other source's stream had not caught up (before, the operation waited
        # for every other stream to catch up before it looked at the failed one)
        other = next(s for s in doc["streams"] if s["stream"] == "storage-2->storage-3")
        assert other["bytes_done"] < other["bytes_total_estimate"], doc
        doc = wait_until(lambda: (d := topology_op(joiner))["discarded_rows"] and d,
                         "the failed join discarded its rows", 60)
        assert doc["discard_errors"] == [], doc
        assert joiner.status()["services"]["storage"]["rows"] == 0
        cluster.wait_converged()
        proc = joiner.ctl("--json", "node", "join-ring")
        assert proc.returncode == 0, proc.stderr
        assert wait_op_ended(joiner)["state"] == "done", topology_op(joiner)
        wait_rings(cluster, ["storage-1", "storage-2", "storage-3"])
        assert joiner.status()["services"]["storage"]["rows"] > 0
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


def test_daemon_receiver_killed_mid_decommission_is_followed_to_its_new_address(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:  # noqa: F811
    """kill -9 of a receiver (storage-1) of a throttled decommission, restarted on another stream
    port (stream-bind port 0, the default): the leaving node's streams find it there and resume
    from its durable position; the decommission completes and the export equals the core's.
    Before, they dialled the old address until the stream timeout (1 h)."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 3) as cluster:
        compute = _trained(cluster, corpus)
        leaving = cluster.node("storage-3")
        proc = leaving.ctl("--json", "node", "decommission", "--rate", "100000")
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: all(s["items_acked"] for s in topology_op(leaving)["streams"]),
                   "every stream of the decommission delivered an item", 60)
        receiver = cluster.node("storage-1")
        cluster.kill(receiver)
        cluster.restart(receiver)
        leaving.ctl("--json", "node", "topology", "rate", "none")
        doc = wait_op_ended(leaving, 90)
        assert doc["state"] == "done", doc
        assert any(s["reconnects"] for s in doc["streams"] if s["stream"] == "storage-3->storage-1"), doc
        wait_rings(cluster, ["storage-1", "storage-2"])
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


@pytest.mark.slow
def test_daemon_joiner_stopped_mid_join_during_training_joins_afresh_equals_core(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:  # noqa: F811
    """SIGTERM of the joining node mid-stream while a training job writes (its sources forward
    the job's writes): the stop cancels the join and cleans up; after the restart ``join-ring``
    completes and the export equals the core's."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute = cluster.node("compute-1")
        job = start_job(compute, corpus)
        wait_job_started(compute, job)
        joiner = cluster.add_node("storage-3", ["storage"], join_mode="manual")
        proc = joiner.ctl("--json", "node", "join-ring", "--rate", "100000")
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: topology_op(joiner)["bytes_done"] > 0, "the join streamed something", 60)
        assert job_doc(compute, job)["state"] == "running"  # the job's writes straddle the stop
        assert cluster.stop_node(joiner) == 0
        cluster.restart(joiner)
        assert joiner.status()["services"]["storage"]["rows"] == 0
        proc = joiner.ctl("--json", "node", "join-ring")
        assert proc.returncode == 0, proc.stderr
        wait_op_done(joiner)
        wait_rings(cluster, ["storage-1", "storage-2", "storage-3"])
        wait_job(compute, job)
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


@pytest.mark.slow
def test_daemon_decommissioning_node_killed_mid_stream_for_good_then_removenode_equals_core(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:  # noqa: F811
    """kill -9 of a decommissioning node mid-stream, never restarted: ``node removenode`` of it
    on a survivor completes (its streams go to the receivers of the dead decommission's streams,
    which first discard the dead node's open streams: ``DiscardStreamsFrom``) and the export
    equals the core's. It failed before: the receivers refused the removenode's streams until
    their idle sweep, 2 h later."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 3) as cluster:
        compute = _trained(cluster, corpus)
        leaving, survivor = cluster.node("storage-3"), cluster.node("storage-1")
        proc = leaving.ctl("--json", "node", "decommission", "--rate", "100000")
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: all(s["items_acked"] for s in topology_op(leaving)["streams"]),
                   "every stream of the decommission delivered an item", 60)
        cluster.kill(leaving)
        wait_until(lambda: {m["name"]: m["status"] for m in
                            survivor.admin.json("GET", "/v1/members")["members"]}["storage-3"] == "dead",
                   "storage-3 declared dead", 60)
        proc = survivor.ctl("--json", "node", "removenode", "storage-3")
        assert proc.returncode == 0, proc.stderr
        doc = wait_op_ended(survivor)
        assert doc["state"] == "done", doc
        cluster.nodes.remove(leaving)
        wait_rings(cluster, ["storage-1", "storage-2"])
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")
