"""Files written before the shared record codec (giaannd/records.py) still load, and the writers still
produce them byte for byte.

The fixtures under ``fixtures/records/`` were written by the builders below with the code as it was
before the five formats moved onto the codec (update log, vocab log, job journal, storage snapshot,
row export). They are golden files: never regenerate them to make a test pass. A deliberate format
change gets a new version and new fixtures *next to* these, which must keep loading.

The inputs are literal arrays (no random generator), so the bytes do not depend on numpy's streams.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from giaannd.compute.job_journal import JobJournal, JobSpec, JournalDoc
from giaannd.model.export import load_snapshot, save_snapshot
from giaannd.model.ids import column_id, feature_id
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore
from giaannd.storage.engine.snapshot import read_snapshot, snapshot_name, write_snapshot
from giaannd.storage.engine.update_log import KIND_BATCH, KIND_DROP, KIND_FLOOR, UpdateLog, scan_segment, segment_name
from giaannd.storage.engine.vocab_store import VOCAB_FILE, VocabStore

FIXTURES = Path(__file__).parent / "fixtures" / "records"
BIG = 1 << 30
_TOP = 1 << 63  # column ids have their top bit set (giaannd.model.ids)


def _batch(cols: list[int], feats: list[int], segs: list[int], tcols: list[int], tfeats: list[int],
           strengths: list[float]) -> RowBatch:
    return RowBatch.from_entries(
        np.array([c | _TOP for c in cols], np.uint64), np.array(feats, np.uint64), np.array(segs, np.uint8),
        np.array([c | _TOP for c in tcols], np.uint64), np.array(tfeats, np.uint64),
        np.array(strengths, np.float32))


BATCH_A = _batch([1, 1, 2, 3], [0, 4, 0, 0], [8, 2, 3, 8], [2, 2, 1, 3], [0, 5, 0, 7], [5.0, 0.5, 1.25, 2.0])
BATCH_B = _batch([2, 5, 5], [0, 0, 9], [1, 8, 0], [5, 5, 2], [0, 0, 4], [0.75, 3.0, 10.0 / 7.0])
DROPPED = np.array([3 | _TOP], np.uint64)
VOCAB_PUTS = [[(0, column_id("cat"), "cat"), (1, feature_id("the"), "the")],
              [(0, column_id("mat"), "mat")]]


def _journal() -> JobJournal:
    spec = JobSpec(corpus="/data/corpus.conllu", corpus_sha256="ab" * 32, limit=None, epochs=1, workers=2,
                   coalesce=20)
    return JobJournal(JournalDoc(job_id="compat0000000001", writer_id=0x1234_5678_9ABC_DEF0, spec=spec,
                                 total_sentences=99, sentences_digest="cd" * 16, initial_flags=[3, 7],
                                 cursor=2, settled=1, started=[2, 1], learned={1: [11, 12]}, resumes=1))


def _snapshot_store(track: bool = False) -> ColumnStore:
    """``track``: writer 7 is a tracked training writer (per-column idempotency, applied_set.py):
    format 2 writes its applied columns; format 1 predates them."""
    store = ColumnStore(BIG)
    if track:
        store.applied.promise(7, 0)
    store.apply(BatchId(7, 1), BATCH_A)
    store.apply(BatchId(7, 3), BATCH_B)
    store.apply(BatchId(9, 1), BATCH_B)
    store.advance_floor(9, 1)
    return store


def build_update_log(tmp: Path) -> bytes:
    log = UpdateLog(tmp, 1)
    log.append_batch(BatchId(7, 1), BATCH_A)
    log.append_floor(7, 1)
    log.append_drop(DROPPED)
    log.append_batch(BatchId(7, 2), BATCH_B)
    log.close()
    return (tmp / segment_name(1)).read_bytes()


def build_vocab_log(tmp: Path) -> bytes:
    v = VocabStore.open(tmp)
    for entries in VOCAB_PUTS:
        v.put(entries)
    v.sync()
    v.close()
    return (tmp / VOCAB_FILE).read_bytes()


def build_journal(tmp: Path) -> bytes:
    return _journal().encode()


def build_snapshot(tmp: Path) -> bytes:
    return write_snapshot(tmp, _snapshot_store(track=True), 4).read_bytes()


def build_export(tmp: Path) -> bytes:
    save_snapshot(RowStore.from_batch(RowBatch.concat([BATCH_A, BATCH_B])), tmp / "rows.bin")
    return (tmp / "rows.bin").read_bytes()


BUILDERS = {
    "update_log.seg": build_update_log,
    "vocab.log": build_vocab_log,
    "job.journal": build_journal,
    "store_v3.snap": build_snapshot,
    "rows.bin": build_export,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_records_compat_writers_produce_the_fixture_bytes(tmp_path: Path, name: str) -> None:
    assert BUILDERS[name](tmp_path) == (FIXTURES / name).read_bytes()


def _same_batch(a: RowBatch, b: RowBatch) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def test_records_compat_update_log_fixture_loads(tmp_path: Path) -> None:
    seg = tmp_path / segment_name(1)
    shutil.copyfile(FIXTURES / "update_log.seg", seg)
    scan = scan_segment(seg, 1, is_last=True)
    assert scan.torn_bytes == 0 and scan.good_bytes == seg.stat().st_size
    kinds = [(r.seq, r.kind) for r in scan.records]
    assert kinds == [(1, KIND_BATCH), (2, KIND_FLOOR), (3, KIND_DROP), (4, KIND_BATCH)]
    first, floor, drop, last = scan.records
    assert first.batch_id == BatchId(7, 1) and first.batch is not None and _same_batch(first.batch, BATCH_A)
    assert (floor.writer, floor.floor) == (7, 1)
    assert drop.columns is not None and np.array_equal(drop.columns, DROPPED)
    assert last.batch_id == BatchId(7, 2) and last.batch is not None and _same_batch(last.batch, BATCH_B)


def test_records_compat_vocab_fixture_loads(tmp_path: Path) -> None:
    shutil.copyfile(FIXTURES / "vocab.log", tmp_path / VOCAB_FILE)
    v = VocabStore.open(tmp_path)
    try:
        assert v.torn_bytes == 0 and len(v) == 3
        for kind, ident, text in (e for put in VOCAB_PUTS for e in put):
            assert v.get(kind, ident) == text
    finally:
        v.close()


def test_records_compat_journal_fixture_loads() -> None:
    back = JobJournal.decode((FIXTURES / "job.journal").read_bytes(), "job.journal")
    assert back.doc == _journal().doc


@pytest.mark.parametrize("name", ["store.snap", "store_v2.snap", "store_v3.snap"])
def test_records_compat_snapshot_fixture_loads(tmp_path: Path, name: str) -> None:
    """Format 1 (row regions, before the row engine), format 2 (one body checksum; no writer builds
    either any more) and format 3."""
    path = tmp_path / snapshot_name(4)
    shutil.copyfile(FIXTURES / name, path)
    store, seq = read_snapshot(path, BIG)
    ref = _snapshot_store(track=name != "store.snap")
    assert seq == 4 and store.applied == ref.applied
    assert _same_batch(store.read_all(), ref.read_all())
    if name == "store.snap":  # before the columns: every applied id counts as whole, as it did
        assert not store.applied.tracked(7) and store.applied.columns(BatchId(7, 1)) is None
    else:
        assert all(np.array_equal(a, b) for a, b in zip(store.applied.column_arrays(), ref.applied.column_arrays()))
        assert store.applied.columns(BatchId(7, 3)).tolist() == np.unique(BATCH_B.row_column).tolist()


def test_records_compat_export_fixture_loads() -> None:
    store = load_snapshot(FIXTURES / "rows.bin")
    ref = RowStore.from_batch(RowBatch.concat([BATCH_A, BATCH_B]))
    assert store.keys() == ref.keys() and all(store.get(k).equals(r) for k, r in ref)


def test_records_compat_snapshot_formats_2_and_3_differ_only_in_the_checksum() -> None:
    """Format 3 is format 2's layout with the body hashed in four parts: the same body bytes, and a
    header that differs in its version and body checksum (and so its own checksum) only."""
    v2, v3 = (FIXTURES / "store_v2.snap").read_bytes(), (FIXTURES / "store_v3.snap").read_bytes()
    assert v2[64:] == v3[64:]
    differ = [i for i in range(64) if v2[i] != v3[i]]
    assert differ and all(8 <= i < 12 or 48 <= i < 64 for i in differ)
