"""Topology operations on real ``giaannd`` daemons while a training job runs (issue 8 fault suite).

Each test starts a small loopback cluster (tools/local_cluster), starts a one-worker training job
through the compute node's admin API, changes the topology in the middle of it (a storage node
joins; one is decommissioned; one is killed with SIGKILL and removed), waits for the job and the
operation, and compares the cluster's export with the single-process core trained on the same
sentences: the same entries with the same strengths (no update lost or counted twice).
Every wait is bounded; the cluster is always stopped (SIGKILL as a last resort).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from giaannd.config import StorageConfig
from giaannd.model.tokens import load_bundled_corpus, write_conllu
from giaannd.sdk.errors import ClientError
from giaannd.sdk.local_cluster import LocalCluster, Node, running_cluster
from tools.local_cluster.exports import diff_exports, read_export, reference_export

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
#: items a stream keeps on the wire (storage.stream-window): what a receiver restart may re-send
WINDOW = StorageConfig().stream_window

SENTENCES = 1500
#: Small coalescing windows: many quorum writes, so the job outlasts the topology change.
COALESCE = 2
WAIT_S = 120.0


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.2)


@contextmanager
def training_cluster(tmp_path: Path, corpus: Path, storage: int, **options: Any) -> Iterator[LocalCluster]:
    """``storage`` storage daemons (R = 2, W = 1) and one compute daemon on loopback tcp, converged."""
    with running_cluster(tmp_path / "c", corpus_dir=corpus.parent, export_dir=tmp_path / "exports",
                         storage=storage, compute=1, transport="tcp",
                         replication_factor=2, write_quorum=1, **options) as cluster:
        cluster.wait_converged()
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The training corpus and the single-process core's export of it."""
    corpus = load_bundled_corpus(SENTENCES)
    path = tmp_path_factory.mktemp("corpus") / "train.conllu"
    write_conllu(corpus, path)
    return path, reference_export(corpus)


def start_job(compute: Node, corpus: Path) -> str:
    job = compute.admin.json("POST", "/v1/train", {"corpus": str(corpus), "workers": 1,
                                                 "coalesce": COALESCE, "cluster": False})
    return str(job["job_id"])


def job_doc(compute: Node, job_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = compute.admin.json("GET", f"/v1/jobs/{job_id}")
    return doc


def wait_job_started(compute: Node, job_id: str) -> None:
    wait_until(lambda: job_doc(compute, job_id).get("done", 0) > 0 or
               job_doc(compute, job_id)["state"] != "running", "the job made progress", 60)


def wait_job(compute: Node, job_id: str) -> dict[str, Any]:
    doc = wait_until(lambda: (d := job_doc(compute, job_id))["state"] != "running" and d,
                     "the training job ended", 240)
    assert doc["state"] == "succeeded", doc
    return doc


def topology_op(node: Node) -> dict[str, Any]:
    doc: dict[str, Any] = node.admin.json("GET", "/v1/node/topology")
    return doc


def assert_still_running(compute: Node, job_id: str) -> None:
    """The topology change really overlapped the job."""
    doc = job_doc(compute, job_id)
    assert doc["state"] == "running", f"the job ended before the topology change: {doc}"


def wait_op_done(node: Node) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        if not _op_started(node):
            return None
        doc = topology_op(node)
        return doc if doc["state"] in ("done", "failed", "cancelled") else None
    doc = wait_until(ended, f"the topology operation on {node.name} ended", 180)
    assert doc["state"] == "done", doc
    return doc


def kill_storage_during_job(cluster: LocalCluster, compute: Node, job_id: str) -> tuple[Node, Node]:
    """SIGKILL storage-3 while the job runs; return (victim, storage-1) once storage-1's
    membership declares it dead."""
    victim, survivor = cluster.node("storage-3"), cluster.node("storage-1")
    cluster.kill(victim)
    assert_still_running(compute, job_id)
    wait_until(lambda: {m["name"]: m["status"] for m in
                        survivor.admin.json("GET", "/v1/members")["members"]}["storage-3"] == "dead",
               "storage-3 declared dead", 60)
    return victim, survivor


def _op_started(node: Node) -> bool:
    try:
        topology_op(node)
    except ClientError:  # 404 until an operation has started
        return False
    return True


def ring_active(node: Node) -> list[str]:
    doc = node.admin.json("GET", "/v1/ring")
    return sorted(doc["ring"]["active"])


def assert_export_equals(compute: Node, reference: list[dict[str, Any]], out: Path) -> None:
    compute.admin.json("POST", "/v1/export", {"path": str(out)})
    diff = diff_exports(reference, read_export(out))
    assert diff.clean and diff.got == diff.reference > 5000, diff


def test_daemon_join_during_training_equals_core(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 2, storage_options={"release_delay_s": 1.0}) as cluster:
        compute = cluster.node("compute-1")
        job = start_job(compute, corpus)
        wait_job_started(compute, job)
        joiner = cluster.add_node("storage-3", ["storage"], join_mode="auto")
        wait_until(lambda: _op_started(joiner), "the join started", 60)
        assert_still_running(compute, job)
        wait_op_done(joiner)
        for node in cluster.nodes:
            wait_until(lambda node=node: ring_active(node) == ["storage-1", "storage-2", "storage-3"],
                       f"{node.name} has storage-3 in its ring", 30)
        wait_job(compute, job)
        rows = joiner.status()["services"]["storage"]["rows"]
        assert rows > 0  # it streamed its share
        # The old owners delete the columns they gave away (storage.release-delay-s after the
        # ring changed), and the export below still has every entry.
        wait_until(lambda: all(cluster.node(n).status()["services"]["storage"].get("released_rows", 0) > 0
                               for n in ("storage-1", "storage-2")), "old owners released rows", 60)
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


def test_daemon_decommission_during_training_equals_core(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 3) as cluster:
        compute = cluster.node("compute-1")
        job = start_job(compute, corpus)
        wait_job_started(compute, job)
        leaving = cluster.node("storage-3")
        proc = leaving.ctl("--json", "node", "decommission")
        assert proc.returncode == 0, proc.stderr
        assert_still_running(compute, job)
        wait_op_done(leaving)
        for node in cluster.nodes:
            wait_until(lambda node=node: ring_active(node) == ["storage-1", "storage-2"],
                       f"{node.name} dropped storage-3 from its ring", 30)
        wait_job(compute, job)
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")
        # The decommissioned node keeps its files (they go with its data directory); it is a
        # standby member now and owns nothing.
        assert leaving.admin.json("GET", "/v1/ring")["standby"]


def test_daemon_kill9_storage_during_training_then_removenode_and_repair_equals_core(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 3) as cluster:
        compute = cluster.node("compute-1")
        job = start_job(compute, corpus)
        wait_job_started(compute, job)
        victim, survivor = kill_storage_during_job(cluster, compute, job)
        wait_job(compute, job)  # writes go on with W=1 and hints
        proc = survivor.ctl("--json", "node", "removenode", "storage-3")
        assert proc.returncode == 0, proc.stderr
        wait_op_done(survivor)
        for node in (n for n in cluster.nodes if n is not victim):
            wait_until(lambda node=node: ring_active(node) == ["storage-1", "storage-2"],
                       f"{node.name} removed storage-3 from its ring", 30)
        proc = survivor.ctl("--json", "node", "repair", timeout_s=120)
        assert proc.returncode == 0, proc.stderr
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


def test_daemon_joining_node_killed_mid_stream_resumes_after_restart(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """kill -9 the receiving (and coordinating) node of a throttled join while a training job
    runs; after its restart the join resumes the sources' streams from its durable positions
    (re-sending at most one item per stream) and completes; the export equals the core's."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute = cluster.node("compute-1")
        job = start_job(compute, corpus)
        wait_job_started(compute, job)
        joiner = cluster.add_node("storage-3", ["storage"], join_mode="manual")
        proc = joiner.ctl("--json", "node", "join-ring", "--rate", "200000")
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: topology_op(joiner)["bytes_done"] > 0, "the join streamed something", 60)
        before = topology_op(joiner)
        assert before["state"] == "streaming" and before["bytes_done"] < before["bytes_total"], before
        cluster.kill(joiner)
        cluster.restart(joiner)
        proc = joiner.ctl("--json", "node", "join-ring")  # manual mode: the operator re-issues it
        assert proc.returncode == 0, proc.stderr
        joiner.ctl("--json", "node", "topology", "rate", "none")
        done = wait_op_done(joiner)
        assert all(s["resent_items"] <= WINDOW for s in done["streams"]), done["streams"]
        assert sum(s["reconnects"] for s in done["streams"]) >= 1, done["streams"]
        for node in cluster.nodes:
            wait_until(lambda node=node: ring_active(node) == ["storage-1", "storage-2", "storage-3"],
                       f"{node.name} has storage-3 in its ring", 30)
        wait_job(compute, job)
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


def join_ring_completes(cluster: LocalCluster, joiner: Node) -> None:
    """join-ring on ``joiner``: it ends done and every node's ring has it."""
    proc = joiner.ctl("--json", "node", "join-ring")
    assert proc.returncode == 0, proc.stderr
    wait_op_done(joiner)
    for node in cluster.nodes:
        wait_until(lambda node=node: ring_active(node) == ["storage-1", "storage-2", "storage-3"],
                   f"{node.name} has storage-3 in its ring", 30)


def override_on(node: Node) -> bool:
    return bool(node.status()["services"]["runtime"]["ring"]["override"])


def repair_report(node: Node) -> dict[str, Any]:
    proc = node.ctl("--json", "node", "repair", timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def _join_coordinator_killed_in_its_cutover(cluster: LocalCluster, corpus: Path,
                                            training: bool = True) -> tuple[Node, str, Node]:
    """With ``training``, a training job runs; a manual-mode storage-3 runs join-ring with a
    failpoint that holds it right after its writers switched (cutover step b); it is killed there
    (SIGKILL). Returns (compute-1, the job or "", storage-3) once compute-1 dropped the override
    the dead coordinator left (its lease: giaannd/services/override_lease.py; before, it kept it
    until its own restart) and the operator unsealed the registers its handoff sealed on the old
    owners (docs/operations.md: no node shows an override any more)."""
    compute = cluster.node("compute-1")
    job = start_job(compute, corpus) if training else ""
    if training:
        wait_job_started(compute, job)
    joiner = cluster.add_node("storage-3", ["storage"], join_mode="manual",
                              env={"GIAANND_FAILPOINTS": "cutover.after-writers=sleep:600"})
    proc = joiner.ctl("--json", "node", "join-ring")
    assert proc.returncode == 0, proc.stderr
    wait_until(lambda: topology_op(joiner)["state"] == "cutover" and override_on(compute),
               "the join's writers switched", 120)
    if training:
        assert_still_running(compute, job)
    cluster.kill(joiner)
    wait_until(lambda: not override_on(compute), "compute-1 dropped the dead coordinator's override", 60)
    lease = compute.status()["services"]["membership"]["override_lease"]
    assert lease["dropped"] == 1 and "storage-3" in lease["last_drop"], lease
    for name in ("storage-1", "storage-2"):
        node = cluster.node(name)
        assert not override_on(node)
        proc = node.ctl("--json", "node", "registers", "unseal")
        assert proc.returncode == 0, proc.stderr
    return compute, job, joiner


def test_daemon_join_coordinator_killed_in_its_cutover_leaves_no_override_behind(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """The joining node, which coordinates its own join, killed in its cutover (no job: the
    override is what is checked): the compute node drops the override it left (the helper's
    waits and asserts; before leases it kept it until its own restart), and a restarted joiner's
    join-ring completes and puts it in every node's ring."""
    corpus, _ = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute, _, joiner = _join_coordinator_killed_in_its_cutover(cluster, corpus, training=False)
        joiner.env.clear()
        cluster.restart(joiner)
        join_ring_completes(cluster, joiner)
        assert not override_on(compute)


@pytest.mark.xfail(strict=False, reason=(
    "known gap (docs/topology.md, Known gaps): with writes running, the join resumed after its "
    "coordinator was killed in the cutover lost writes or left replicas divergent in 6 of 7 loaded "
    "runs, with override leases and without them alike; it passes on a quiet host"))
def test_daemon_join_coordinator_killed_in_its_cutover_resumes_after_restart(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """The joining node, which coordinates its own join, killed in its cutover while a job trains
    (``_join_coordinator_killed_in_its_cutover``); restarted without the failpoint, join-ring again
    completes (the same operation: its streams resume); the export should equal the core's and
    the replicas agree row for row. On a quiet host it passed 6 runs of 6; with a CPU hog beside
    it the export lost 894-18,298 of 318,237 entries in 5 runs of 7 that got that far and a repair
    found the replicas divergent in a sixth (3 of those 7 runs with override leases turned off:
    two lost entries, one divergent), and a CI run lost 12,333."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute, job, joiner = _join_coordinator_killed_in_its_cutover(cluster, corpus)
        joiner.env.clear()
        cluster.restart(joiner)
        join_ring_completes(cluster, joiner)
        wait_job(compute, job)
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")
        for node in cluster.nodes:
            if "storage" in node.roles:
                report = repair_report(node)
                assert report["rows_divergent_count"] == 0 and not report["peers_failed"], (node.name, report)


@pytest.mark.xfail(strict=True, reason=(
    "known gap (docs/topology.md, Known gaps): writes acknowledged under the dead coordinator's "
    "override never reached the owners it displaced, and the writer's floor, carried by its later "
    "writes, makes those owners count the seqs as applied, so repair cannot rebuild them"))
def test_daemon_join_coordinator_killed_in_its_cutover_for_good_leaves_replicas_divergent(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """As above, but the joining node never comes back: the job completes on the old ring, and a
    repair of each old owner should leave the replicas equal. They are not (xfail): ~1,800 of
    ~10,700 rows differ between the two old owners in each run tried, and the repair ships only
    the few batches still above the writer's floor."""
    corpus, _ = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute, job, _ = _join_coordinator_killed_in_its_cutover(cluster, corpus)
        wait_job(compute, job)
        assert ring_active(compute) == ["storage-1", "storage-2"]
        for name in ("storage-1", "storage-2"):
            report = repair_report(cluster.node(name))
            assert report["rows_divergent_count"] == 0, (name, report["rows_divergent_count"])


def _throttled_join_under_way(cluster: LocalCluster, corpus: Path) -> tuple[Node, Node]:
    """The job trained to its end, then a manual-mode storage-3 started and its join-ring begun
    at 100 kB/s; returns (compute-1, storage-3) once the join streamed something."""
    compute = cluster.node("compute-1")
    wait_job(compute, start_job(compute, corpus))
    joiner = cluster.add_node("storage-3", ["storage"], join_mode="manual")
    proc = joiner.ctl("--json", "node", "join-ring", "--rate", "100000")
    assert proc.returncode == 0, proc.stderr
    wait_until(lambda: topology_op(joiner)["bytes_done"] > 0, "the join streamed something", 60)
    return compute, joiner


def _join_again_and_check(cluster: LocalCluster, compute: Node, joiner: Node, ref: list[dict[str, Any]],
                          out: Path) -> None:
    """join-ring on a node that holds nothing of the abandoned join: it completes, every node's
    ring has the newcomer, and the export equals the core's."""
    assert joiner.status()["services"]["storage"]["rows"] == 0
    assert (joiner.data_dir / "storage" / "join-generation").read_text().strip() == "1"
    join_ring_completes(cluster, joiner)
    assert joiner.status()["services"]["storage"]["rows"] > 0
    assert_export_equals(compute, ref, out)


def test_daemon_cancelled_join_cleans_up_and_the_node_joins_again(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """An operator cancels a throttled join mid-stream: the joining node drops the partial rows it
    received (before, it kept them, and every later join-ring was refused until its data directory
    was wiped), its join generation goes up, and join-ring again completes; the export equals the
    core's."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute, joiner = _throttled_join_under_way(cluster, corpus)
        proc = joiner.ctl("--json", "node", "topology", "cancel")
        assert proc.returncode == 0, proc.stderr
        doc = wait_until(lambda: (d := topology_op(joiner))["state"] == "cancelled" and d["discarded_rows"] and d,
                         "the cancelled join discarded its rows", 60)
        assert doc["discard_errors"] == [], doc
        _join_again_and_check(cluster, compute, joiner, ref, tmp_path / "exports" / "export.jsonl")


def test_daemon_joining_node_stopped_mid_stream_joins_afresh_after_restart(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """A graceful stop (SIGTERM) of the joining node mid-stream cancels its join, which cleans up
    before the node's endpoint closes (its partial rows dropped, its join generation raised); at
    the next start join-ring opens new streams and completes. (kill -9 leaves the streams to resume:
    test_daemon_joining_node_killed_mid_stream_resumes_after_restart.)"""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 2) as cluster:
        compute, joiner = _throttled_join_under_way(cluster, corpus)
        assert cluster.stop_node(joiner) == 0
        cluster.restart(joiner)
        _join_again_and_check(cluster, compute, joiner, ref, tmp_path / "exports" / "export.jsonl")


def test_daemon_replace_dead_node_with_new_host_equals_core(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """kill -9 a storage node during training; a new host started in manual join mode takes
    over its columns with ``giaannctl node replace``; the ring swaps them and the export equals
    the core's."""
    corpus, ref = reference
    with training_cluster(tmp_path, corpus, 3) as cluster:
        compute = cluster.node("compute-1")
        job = start_job(compute, corpus)
        wait_job_started(compute, job)
        victim, _ = kill_storage_during_job(cluster, compute, job)
        newcomer = cluster.add_node("storage-4", ["storage"], join_mode="manual")
        proc = newcomer.ctl("--json", "node", "replace", "storage-3", "--wait", timeout_s=180)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["state"] == "done"
        for node in (n for n in cluster.nodes if n is not victim):
            wait_until(lambda node=node: ring_active(node) == ["storage-1", "storage-2", "storage-4"],
                       f"{node.name} swapped storage-3 for storage-4", 30)
        wait_job(compute, job)
        assert newcomer.status()["services"]["storage"]["rows"] > 0
        assert_export_equals(compute, ref, tmp_path / "exports" / "export.jsonl")


def test_daemon_second_operation_elsewhere_is_refused_while_one_runs(
        tmp_path: Path, reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """The cluster's topology lock (rebalance/cluster_lock.py) across daemons: while storage-4
    decommissions itself (throttled, so it lasts), storage-3's own decommission is refused at once
    with the holder named; it runs once the first ended."""
    corpus, _ = reference
    with training_cluster(tmp_path, corpus, 4) as cluster:
        compute = cluster.node("compute-1")
        job = start_job(compute, corpus)
        wait_job_started(compute, job)
        first, second = cluster.node("storage-4"), cluster.node("storage-3")
        proc = first.ctl("--json", "node", "decommission", "--rate", "200000")
        assert proc.returncode == 0, proc.stderr
        assert topology_op(first)["cluster_lock"] == "held"
        proc = second.ctl("node", "decommission")
        assert proc.returncode == 1 and "another topology operation runs in the cluster" in proc.stderr, proc
        assert "storage-4" in proc.stderr and not _op_started(second)
        assert first.ctl("--json", "node", "topology", "rate", "none").returncode == 0  # finish it
        assert wait_op_done(first)["cluster_lock"] == "released"
        proc = second.ctl("--json", "node", "decommission")
        assert proc.returncode == 0, proc.stderr
        wait_op_done(second)
        wait_job(compute, job)
