"""The job journal (corruption, atomicity, cursor) and resumable training with deterministic ids."""

import asyncio
import os

import numpy as np
import pytest

from giaannd.compute.flags import without_flag_row
from giaannd.compute.job_journal import (
    JobJournal,
    JobSpec,
    JournalCorrupt,
    JournalWriter,
    journal_path,
    load_journals,
)
from giaannd.compute.train import TrainingJob, TrainSettings
from giaannd.model.columns import ColumnAssigner
from giaannd.model.rows import RowBatch
from giaannd.model.tokens import Token, load_bundled_corpus
from giaannd.model.train import train_batch
from giaannd.protocol import BatchId

SPEC = JobSpec("/c.conllu", "ab" * 32, None, 1, 2, 10)


def _journal() -> JobJournal:
    j = JobJournal.create(SPEC, job_id="0123abcd", writer_id=77)
    j.begin({5, 3}, 95)
    j.start_window(0, {9})
    j.start_window(1, set())
    return j


def test_journal_round_trip_and_replay_plan():
    j = _journal()
    back = JobJournal.decode(j.encode())
    assert back.doc == j.doc and back.doc.initial_flags == [3, 5]
    assert back.is_started(0) and back.is_started(1) and not back.is_started(2)
    assert back.learned_before(0) == {9} and back.learned_before(1) == set()
    assert [back.worker_of(i) for i in range(4)] == [0, 1, 0, 1]


def test_journal_start_window_must_follow_worker_order():
    j = _journal()
    with pytest.raises(ValueError):
        j.start_window(4, ())  # worker 0 is at its second window (2), not its third
    with pytest.raises(ValueError):
        j.start_window(0, ())  # already started


def test_journal_cursor_moves_over_contiguous_acks_and_settled_never_passes_it():
    j = _journal()
    assert not j.acknowledge(2, settled_floor=0)  # a gap at 0 and 1
    assert j.doc.cursor == 0
    assert j.acknowledge(0, settled_floor=5)  # the floor may run ahead; settled stays <= cursor
    assert j.doc.cursor == 1 and j.doc.settled == 1
    assert j.acknowledge(1, settled_floor=1)
    assert j.doc.cursor == 3 and j.doc.settled == 1 and j.restart_window == 1
    assert not j.acknowledge(1, settled_floor=0)  # an old window: nothing moves backwards
    assert j.doc.settled == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "version", "empty", "garbage_doc"])
def test_journal_corruption_is_reported_and_the_file_kept(tmp_path, damage):
    w = JournalWriter(tmp_path, _journal())
    w.save_now()
    path = journal_path(tmp_path, "0123abcd")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[:-5]
    elif damage == "magic":
        data[0:4] = b"XXXX"
    elif damage == "version":
        data[4] = 9
    elif damage == "empty":
        data = bytearray()
    else:  # a well-formed header over a payload that is not a journal document
        import struct

        import xxhash
        payload = b"\x93\x01\x02\x03"
        data = bytearray(struct.pack("<4sHIQ", b"GJNL", 1, len(payload), xxhash.xxh3_64_intdigest(payload))
                         + payload)
    path.write_bytes(bytes(data))
    [item] = load_journals(tmp_path)
    assert isinstance(item, JournalCorrupt) and str(path) in str(item)
    assert path.read_bytes() == bytes(data)  # never discarded or rewritten by the loader


def test_journal_file_named_for_another_job_is_corrupt(tmp_path):
    w = JournalWriter(tmp_path, _journal())
    w.save_now()
    os.rename(w.path, w.path.with_name("ffff.journal"))
    [item] = load_journals(tmp_path)
    assert isinstance(item, JournalCorrupt) and "holds job" in str(item)


@pytest.mark.asyncio
async def test_journal_commit_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    j = _journal()
    w = JournalWriter(tmp_path, j)
    await w.commit()
    before = w.path.read_bytes()
    j.acknowledge(0, 0)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        await w.commit()
    monkeypatch.undo()
    assert w.path.read_bytes() == before  # the old version, whole
    assert [p.name for p in w.path.parent.iterdir()] == [w.path.name]  # no temporary left behind
    [loaded] = load_journals(tmp_path)
    assert loaded.doc.cursor == 0
    await w.commit()
    [loaded] = load_journals(tmp_path)
    assert loaded.doc.cursor == 1


@pytest.mark.asyncio
async def test_journal_concurrent_commits_coalesce(tmp_path):
    j = _journal()
    w = JournalWriter(tmp_path, j)
    writes = []
    import giaannd.compute.job_journal as mod
    real = mod.atomic_write_bytes

    def counting(path, data):
        writes.append(data)
        real(path, data)

    mod.atomic_write_bytes = counting
    try:
        await asyncio.gather(*(w.commit() for _ in range(10)))
    finally:
        mod.atomic_write_bytes = real
    assert 1 <= len(writes) <= 2 and JobJournal.decode(w.path.read_bytes()).doc == j.doc


# -- resumable training against a fake storage ----------------------------------------------------

class Storage:
    """What storage keeps across a compute crash: applied batches by id (idempotent)."""

    def __init__(self):
        self.applied: dict[BatchId, RowBatch] = {}
        self.duplicates: list[BatchId] = []
        self.conflicts: list[BatchId] = []
        self.vocab = {}


class Client:
    """A fresh job client over ``Storage``: seqs from 1, unsettled ids, writer floor; ``stop_after``
    writes then hangs (the crash point)."""

    def __init__(self, storage, writer=42, stop_after=None):
        self.storage, self.writer_id = storage, writer
        self.next_seq, self.unsettled = 1, set()
        self.stop_after, self.writes = stop_after, 0

    def next_batch_id(self):
        bid = BatchId(self.writer_id, self.next_seq)
        self.next_seq += 1
        self.unsettled.add(bid.seq)
        return bid

    def abandon(self, bid):
        self.unsettled.discard(bid.seq)

    @property
    def writer_floor(self):
        return min(self.unsettled, default=self.next_seq) - 1

    async def put_vocab(self, entries):
        self.storage.vocab.update({(k, i): t for k, i, t in entries})

    async def write(self, batch, batch_id):
        lose_ack = self.stop_after is not None and self.writes >= self.stop_after
        self.writes += 1
        old = self.storage.applied.get(batch_id)
        if old is None:
            self.storage.applied[batch_id] = batch
        else:
            self.storage.duplicates.append(batch_id)
            if not (np.array_equal(old.target_feature, batch.target_feature)
                    and np.array_equal(old.strength, batch.strength)):
                self.storage.conflicts.append(batch_id)
        if lose_ack:  # applied by storage, but the node dies before the ack arrives
            await asyncio.Event().wait()
        self.unsettled.discard(batch_id.seq)

    async def read_rows(self, cols, feats):
        from giaannd.compute.flags import FLAG_ROW, flags_batch
        flags = set()
        for b in self.storage.applied.values():
            if b.num_rows and b.key(0) == FLAG_ROW:
                flags |= set(b.row(0).target_feature.tolist())
        return flags_batch(flags)


@pytest.fixture(scope="module")
def sentences():
    return load_bundled_corpus(240)


def _total(storage) -> RowBatch:
    from giaannd.model.rowstore import RowStore
    store = RowStore.from_batch(RowBatch.concat(list(storage.applied.values())))
    return without_flag_row(store.export())


@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [1, 3])
async def test_batch_ids_are_window_numbers(sentences, workers):
    storage = Storage()
    settings = TrainSettings(workers=workers, coalesce_sentences=20, retry_backoff_s=0)
    await TrainingJob(sentences, Client(storage), settings).run()
    assert sorted(b.seq for b in storage.applied) == list(range(1, 13))  # 240 / 20 windows
    if workers == 1:  # window i is exactly train_batch of sentences[20i:20i+20] (+ its flags)
        a = ColumnAssigner()
        for i in range(12):
            ref = train_batch([e for s in sentences[20 * i:20 * i + 20] if (e := a.encode(s)) is not None]).rows
            got = without_flag_row(storage.applied[BatchId(42, i + 1)])
            assert np.array_equal(got.target_feature, ref.target_feature)
            assert np.array_equal(got.strength, ref.strength)


async def _crash_and_resume(tmp_path, sentences, workers, stop_after):
    storage = Storage()
    settings = TrainSettings(workers=workers, coalesce_sentences=20, retry_backoff_s=0)
    spec = JobSpec("/x", "00", None, 1, workers, 20)
    writer = JournalWriter(tmp_path, JobJournal.create(spec, job_id="feed", writer_id=42))
    writer.save_now()
    job = TrainingJob(sentences, Client(storage, stop_after=stop_after), settings, journal=writer)
    task = asyncio.create_task(job.run())
    while len(storage.applied) < stop_after + 1:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    task.cancel()  # the crash: nothing after this point of the first run reaches disk or storage
    with pytest.raises(asyncio.CancelledError):
        await task
    [journal] = load_journals(tmp_path)
    assert journal.doc.state == "running" and 0 < journal.doc.cursor <= stop_after
    resumed_from = journal_cursor_sentences(journal)
    again = TrainingJob(sentences, Client(storage), settings, journal=JournalWriter(tmp_path, journal))
    await again.run()
    assert again.progress.resumed_from == resumed_from
    assert again.progress.done == len(sentences)
    return storage


def journal_cursor_sentences(journal):
    """Sentences the journal says were acknowledged: windows below the cursor and past it (``acked``)."""
    return journal.acknowledged_sentences(journal.doc.total_sentences)


@pytest.mark.asyncio
async def test_resumed_job_equals_an_uninterrupted_one(tmp_path, sentences):
    reference = Storage()
    await TrainingJob(sentences, Client(reference), TrainSettings(coalesce_sentences=20)).run()
    storage = await _crash_and_resume(tmp_path, sentences, 1, stop_after=5)
    assert storage.duplicates and not storage.conflicts  # re-sent windows were byte-identical
    assert set(storage.applied) == set(reference.applied)
    got, ref = _total(storage), _total(reference)
    assert np.array_equal(got.target_feature, ref.target_feature) and np.array_equal(got.strength, ref.strength)


@pytest.mark.asyncio
async def test_resumed_multi_worker_job_resends_identical_windows(tmp_path, sentences):
    storage = await _crash_and_resume(tmp_path, sentences, 3, stop_after=4)
    assert not storage.conflicts
    assert sorted(b.seq for b in storage.applied) == list(range(1, 13))


def test_journal_binds_the_sentences_before_the_first_window(sentences):
    from giaannd.compute.job_journal import sentences_digest

    j = JobJournal.create(SPEC)
    j.check_sentences(sentences_digest(sentences[:10]), 10)  # not started: binds (and may rebind)
    j.check_sentences(sentences_digest(sentences[:20]), 20)
    j.begin(set(), 20)
    j.check_sentences(sentences_digest(sentences[:20]), 20)  # same sentences: fine
    retagged = [tuple(Token(t.form, t.lemma, "X", t.xpos) if i == 0 else t for i, t in enumerate(s))
                for s in sentences[:20]]
    with pytest.raises(ValueError, match="not resumed"):
        j.check_sentences(sentences_digest(retagged), 20)  # same count, different tagging
    with pytest.raises(ValueError):
        j.check_sentences(sentences_digest(sentences[:19]), 19)
