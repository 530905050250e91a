"""What a cluster job counts after a take-over (docs/compute.md, "Cluster jobs in the service"):

* the job document's ``by_node.tagged`` (the flag pass's tallies) sums to the sentences tagged
  once in the cluster, also when the node that tagged a window lost its lease before completing
  it (before, the window's sentences were counted by no node: the tagger never completed it, and
  the node that took it over found it tagged and counted 0);
* a node's Prometheus counters count the work it did: a window written late by the node that
  lost its lease, and again by the one that took it over, is counted once on each node, while the
  job document counts it once (the tallies: only the holder completes a window)."""

import msgspec
import pytest

from giaannd.compute.cluster_jobs.cluster_train import job_document
from giaannd.compute.cluster_jobs.corpus_chunks import GROUPED, chunk_key, encode_texts, encode_window
from giaannd.compute.cluster_jobs.flag_pass import INITIAL, encode_findings, findings_key, initial_findings
from giaannd.compute.cluster_jobs.lease_events import RunWindow
from giaannd.compute.cluster_jobs.lease_table import (
    JobRow,
    LeaseRefused,
    complete,
    grant,
    new_shard,
    take_over,
)
from giaannd.compute.cluster_jobs.window_runner import (
    FLAG_STAGE,
    STAGES,
    TRAIN_STAGE,
    ClusterSpec,
    WindowRunner,
    encode_spec,
)
from giaannd.compute.jobs import TrainProgress
from giaannd.compute.train import TrainSettings
from giaannd.model.lexicon import Lexicon
from giaannd.model.tokens import Token, load_bundled_corpus

from ._write_once import WriteOnceRegisters

K = 10


class Tagger:
    """Text i -> sentence i of the bundled corpus."""

    def __init__(self, sentences) -> None:
        self.sentences = sentences

    async def tag(self, texts):
        return [tuple(Token(t.form, t.lemma, t.upos, t.xpos) for t in self.sentences[int(x)]) for x in texts]


class Sink:
    """A node's Prometheus counters (jobs.py ``ProgressSink``)."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}

    def add(self, name: str, amount: float) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount


class Storage(WriteOnceRegisters):
    """Registers plus the two storage calls a training window makes; batch ids are applied once."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, int]] = []
        self.applied: set[tuple[int, int]] = set()

    async def put_vocab(self, entries, timeout_s=None):
        return None

    async def write(self, batch, batch_id, timeout_s=None):
        self.sent.append((batch_id.writer, batch_id.seq))
        self.applied.add((batch_id.writer, batch_id.seq))


def _job(spec: ClusterSpec) -> JobRow:
    return JobRow(job_id="j", state="running", windows=1, shards=1, stages=STAGES, writer_id=7,
                  spec=encode_spec(spec), stage=FLAG_STAGE)


def _runner(regs, spec, sink, tagger=None) -> WindowRunner:
    return WindowRunner(regs, "j", spec, Lexicon.default(), TrainSettings(),  # type: ignore[arg-type]
                        TrainProgress(sink=sink), tagger=tagger)


def _taken_over(job: JobRow, stage: int):
    """Stage ``stage``'s shard after node a's lease on the window was taken over by node b."""
    shard, lease = grant(new_shard(job, stage, 0), "a", 1)
    return take_over(shard, "b", lease.id, lease.beats)


@pytest.mark.asyncio
async def test_cluster_job_tagged_counts_a_window_tagged_before_a_takeover():
    spec = ClusterSpec(k=K, sentences=K, text=True)
    regs, sentences = Storage(), load_bundled_corpus(K)
    for part, data in enumerate(encode_texts([str(i) for i in range(K)])):
        regs.stored[chunk_key("j", 0, part)] = data
    a, b = Sink(), Sink()
    # node a tags and stores the window, then loses its lease (frozen, or dead) before completing it
    assert await _runner(regs, spec, a, Tagger(sentences))(RunWindow(FLAG_STAGE, 0, 7)) == K
    shard, lease = _taken_over(_job(spec), FLAG_STAGE)
    with pytest.raises(LeaseRefused):
        complete(shard, "a", 0, 1, {0: K})
    # node b, which took the lease over, finds the window tagged and completes it
    units = await _runner(regs, spec, b, Tagger(sentences))(RunWindow(FLAG_STAGE, 0, 7))
    shard = complete(shard, "b", lease.id, 1, {0: units})
    doc = job_document(_job(spec), [shard])
    assert sum(e["tagged"] for e in doc["by_node"].values()) == K  # (before: 0)
    # the counters count the tagging where it was done: once in the cluster
    assert a.counts.get("tagged") == K and "tagged" not in b.counts


@pytest.mark.asyncio
async def test_cluster_job_tagged_counts_nothing_for_a_tagged_corpus():
    spec = ClusterSpec(k=K, sentences=K, group=4)
    regs = Storage()
    for part, data in enumerate(encode_window(load_bundled_corpus(K))):
        regs.stored[chunk_key("j", 0, part, GROUPED)] = data
    assert await _runner(regs, spec, Sink())(RunWindow(FLAG_STAGE, 0, 7)) == 0


@pytest.mark.asyncio
async def test_cluster_job_counters_count_a_late_window_on_each_node_that_wrote_it():
    spec = ClusterSpec(k=K, sentences=K, group=4)
    regs = Storage()
    for part, data in enumerate(encode_window(load_bundled_corpus(K))):
        regs.stored[chunk_key("j", 0, part, GROUPED)] = data
    regs.stored[findings_key("j", INITIAL)] = encode_findings(initial_findings(()))
    await _runner(regs, spec, Sink())(RunWindow(FLAG_STAGE, 0, 7))  # the flag pass's findings
    a, b = Sink(), Sink()
    job = msgspec.structs.replace(_job(spec), stage=TRAIN_STAGE)
    shard, lease = _taken_over(job, TRAIN_STAGE)
    trained = await _runner(regs, spec, b, None)(RunWindow(TRAIN_STAGE, 0, 7))
    shard = complete(shard, "b", lease.id, 1, {0: trained})
    # node a, frozen while its lease was taken over, wakes up and writes the same window late
    assert await _runner(regs, spec, a, None)(RunWindow(TRAIN_STAGE, 0, 7)) == trained
    with pytest.raises(LeaseRefused):
        complete(shard, "a", 0, 1, {0: trained})
    assert regs.sent == [(7, 1), (7, 1)] and regs.applied == {(7, 1)}  # storage applies it once
    # each node counts the work it did (its counters: sentences handled, batches and bytes sent)
    for sink in (a, b):
        assert sink.counts["done"] == K and sink.counts["trained"] == trained and sink.counts["batches"] == 1
    # the job document counts the window once
    doc = job_document(job, [msgspec.structs.replace(new_shard(job, FLAG_STAGE, 0), next=1, done=1), shard])
    assert doc["done"] == K and doc["trained"] == trained
    assert doc["by_node"]["b"]["windows"] == 1 and doc["by_node"]["a"]["windows"] == 0

