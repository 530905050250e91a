"""A lease shard row stays under the register value cap whatever the number of node names that
complete windows in it (lease_table.py ``MAX_SHARD_TALLIES``): past the limit, the tallies of
nodes that hold no lease there are folded into one (``OTHERS``), and the job's counts stay exact.
Before, every node name kept a tally of its own (~1.3 KB with a full timeline), so past ~200
names the row outgrew 256 KiB and the job failed (docs/compute.md, "Known gaps")."""

from giaannd.compute.cluster_jobs import lease_table
from giaannd.compute.cluster_jobs.cluster_train import job_document
from giaannd.compute.cluster_jobs.lease_table import (
    JobRow,
    complete,
    decode_shard,
    encode_row,
    grant,
    new_shard,
    take_over,
)
from giaannd.compute.cluster_jobs.window_runner import STAGES, TRAIN_STAGE, ClusterSpec, encode_spec
from giaannd.compute.timeline import MAX_REGISTER_TIMELINE_POINTS
from giaannd.protocol import MAX_REGISTER_VALUE_BYTES

K = 4
#: windows each node completes, one at a time a second apart: a full timeline per node
PER_NODE = MAX_REGISTER_TIMELINE_POINTS


def _run(nodes: int, per_node: int = PER_NODE):
    """A shard of ``nodes * per_node`` windows, each node (a name of 40 characters, as a host name
    and a suffix) completing ``per_node`` of them one by one; the last node keeps its last lease
    open on the shard's last window."""
    windows = nodes * per_node
    job = JobRow(job_id="j", state="running", windows=windows, shards=1, stages=STAGES, stage=TRAIN_STAGE,
                 writer_id=7, spec=encode_spec(ClusterSpec(k=K, sentences=windows * K - 1, created_at=1.0)))
    shard, t = new_shard(job, TRAIN_STAGE, 0), 10.0
    for n in range(nodes):
        name = f"compute-node-{n:05d}.example.internal.lan"
        shard, lease = grant(shard, name, per_node)
        for w in range(lease.cursor, lease.stop - (n == nodes - 1)):
            shard = complete(shard, name, lease.id, w + 1, {w: K}, at=t)
            t += 1.0
    return job, shard


def test_shard_row_stays_under_the_register_cap_with_many_node_names():
    job, shard = _run(400)
    data = encode_row(shard)
    assert len(data) <= MAX_REGISTER_VALUE_BYTES, len(data)  # (before: ~530 KB)
    assert decode_shard(data) == shard
    # the counts stay exact: every window is counted once, by a node or by the folded tally
    assert sum(t.windows for t in shard.tallies) == shard.done == 400 * PER_NODE - 1
    assert sum(t.units for t in shard.tallies) == shard.done * K


def test_shard_row_fold_keeps_lease_holders_and_the_job_document_exact():
    job, shard = _run(lease_table.MAX_SHARD_TALLIES + 5, per_node=3)
    names = {t.node for t in shard.tallies}
    assert len(names) == lease_table.MAX_SHARD_TALLIES
    assert lease_table.OTHERS in names and shard.leases[0].node in names  # a lease holder keeps its own
    doc = job_document(job, [shard])
    # every window but the open one was handled; the job's last window (one sentence short) is open
    assert doc["done"] == (job.windows - 1) * K and doc["trained"] == doc["done"]
    assert sum(e["windows"] for e in doc["by_node"].values()) == job.windows - 1
    others = doc["by_node"][lease_table.OTHERS]
    # the folded timelines are summed: the job's timeline ends at its totals
    assert doc["timeline"]["done"][-1] == doc["done"] and doc["timeline"]["trained"][-1] == doc["trained"]
    assert len(others["timeline"]["t"]) <= MAX_REGISTER_TIMELINE_POINTS


def test_shard_row_fold_counts_takeovers_of_folded_nodes():
    job, shard = _run(lease_table.MAX_SHARD_TALLIES + 5, per_node=3)
    holder = shard.leases[0]
    shard, _ = take_over(shard, "taker", holder.id, holder.beats)
    doc = job_document(job, [shard])
    assert sum(e["leases_expired"] for e in doc["by_node"].values()) == 1
    assert sum(e["leases_taken_over"] for e in doc["by_node"].values()) == 1
    assert len(shard.tallies) <= lease_table.MAX_SHARD_TALLIES
