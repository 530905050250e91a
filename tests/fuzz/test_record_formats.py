"""Seeded fuzzing of the five framed-record formats through their public loaders (STYLE.md item 12).

Formats: update log segment, vocab log, job journal, storage snapshot, row export. Each is built
through its writer API, then fed to its loader whole (it must round-trip), cut at every length (the
file-format form of h11's byte-at-a-time feeding), and damaged at random (bit flips, overwritten
runs, cuts, appended zeros or garbage, inserted and deleted bytes, a record spliced in twice).

Invariant: the loader either returns content equal to the pristine file's (whole for the whole-file
formats; for the two logs a prefix of whole records that ends where the loader says the good bytes
end, with the rest reported as a torn tail) or raises the format's own corrupt error carrying a byte
offset inside the data. Any other exception, or any other content, fails; a hang hits the timeout.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from giaannd.compute.job_journal import JobJournal, JobSpec, JournalCorrupt, JournalDoc
from giaannd.model.export import SnapshotError, load_snapshot, save_snapshot
from giaannd.model.ids import feature_id
from giaannd.model.rows import RowBatch
from giaannd.model.rowstore import RowStore
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, CorruptLogError, CorruptSnapshotError
from giaannd.storage.engine.snapshot import read_snapshot, write_snapshot
from giaannd.storage.engine.update_log import UpdateLog, scan_segment, segment_name
from giaannd.storage.engine.vocab_store import VOCAB_FILE, VocabLogCorrupt, VocabStore
from tests.unit.storage._gen import random_batch

BIG = 1 << 30
TRIALS = 150


@dataclass
class Case:
    """One format: its pristine bytes, the record boundaries a torn tail may cut back to (whole-file
    formats: only the full length), a loader returning (good bytes, content), and its error type."""

    name: str
    pristine: bytes
    boundaries: list[int]
    load: Callable[[bytes, Path], tuple[int, object]]
    error: type[Exception]
    expected: object = None
    #: records carry a seq, so a record spliced in twice is corruption (the vocab log's records do
    #: not: a record written twice is a harmless re-put, and loads)
    numbered: bool = True


def _fingerprint(batch: RowBatch) -> tuple[bytes, ...]:
    return tuple(a.tobytes() for a in batch.buffers())


def _update_log(tmp: Path) -> Case:
    rng = np.random.default_rng(11)
    log = UpdateLog(tmp, 1)
    ends = [0]
    for i in range(1, 6):
        if i == 3:
            log.append_floor(4, 2)
        elif i == 4:
            log.append_drop(np.array([5, 9, 1 << 63], np.uint64))
        else:
            log.append_batch(BatchId(4, i), random_batch(rng, entries=12, columns=3, features=2))
        ends.append((tmp / segment_name(1)).stat().st_size)
    log.close()
    pristine = (tmp / segment_name(1)).read_bytes()

    def load(data: bytes, work: Path) -> tuple[int, object]:
        path = work / segment_name(1)
        path.write_bytes(data)
        scan = scan_segment(path, 1, is_last=True)
        assert scan.good_bytes + scan.torn_bytes == len(data)
        return scan.good_bytes, [(r.seq, r.kind) for r in scan.records]

    return Case("update log", pristine, ends, load, CorruptLogError)


def _vocab_log(tmp: Path) -> Case:
    v = VocabStore.open(tmp)
    ends = [0]
    for i in range(5):
        ends.append(v.put([(1, feature_id(f"w{i}.{j}"), f"w{i}.{j}") for j in range(i + 1)]).offset)
    v.close()
    pristine = (tmp / VOCAB_FILE).read_bytes()

    def load(data: bytes, work: Path) -> tuple[int, object]:
        (work / VOCAB_FILE).write_bytes(data)
        w = VocabStore.open(work)
        try:
            assert w.nbytes + w.torn_bytes == len(data)
            return w.nbytes, len(w)
        finally:
            w.close()

    return Case("vocab log", pristine, ends, load, VocabLogCorrupt, numbered=False)


def _journal(tmp: Path) -> Case:
    spec = JobSpec(corpus="c.conllu", corpus_sha256="0" * 64, limit=10, epochs=1, workers=2, coalesce=4)
    journal = JobJournal(JournalDoc(job_id="fuzz", writer_id=77, spec=spec, cursor=3, settled=2,
                                    started=[2, 2], learned={0: [1, 2], 3: [9]}))
    pristine = journal.encode()

    def load(data: bytes, work: Path) -> tuple[int, object]:
        return len(data), JobJournal.decode(data, "fuzz.journal").doc

    return Case("job journal", pristine, [len(pristine)], load, JournalCorrupt, journal.doc)


def _snapshot(tmp: Path) -> Case:
    rng = np.random.default_rng(12)
    store = ColumnStore(BIG)
    for i in range(1, 4):
        store.apply(BatchId(3, i), random_batch(rng, entries=10, columns=3, features=2))
    store.advance_floor(3, 2)
    pristine = write_snapshot(tmp, store, 3).read_bytes()

    def load(data: bytes, work: Path) -> tuple[int, object]:
        path = work / "s.snap"
        path.write_bytes(data)
        got, seq = read_snapshot(path, BIG)
        return len(data), (seq, _fingerprint(got.read_all()), got.applied.to_arrays()[1].tobytes())

    expected = (3, _fingerprint(store.read_all()), store.applied.to_arrays()[1].tobytes())
    return Case("store snapshot", pristine, [len(pristine)], load, CorruptSnapshotError, expected)


def _export(tmp: Path) -> Case:
    rng = np.random.default_rng(13)
    rows = RowStore.from_batch(random_batch(rng, entries=15, columns=3, features=2))
    save_snapshot(rows, tmp / "rows.bin")
    pristine = (tmp / "rows.bin").read_bytes()

    def load(data: bytes, work: Path) -> tuple[int, object]:
        path = work / "rows.bin"
        path.write_bytes(data)
        return len(data), _fingerprint(load_snapshot(path).export())

    return Case("row export", pristine, [len(pristine)], load, SnapshotError, _fingerprint(rows.export()))


BUILDERS = [_update_log, _vocab_log, _journal, _snapshot, _export]


def _mutate(rnd: random.Random, data: bytes, case: Case) -> tuple[bytes, str]:
    raw = bytearray(data)
    kind = rnd.randrange(8 if case.numbered else 7)
    if kind == 0:
        for _ in range(rnd.choice((1, 1, 2, 8))):
            i = rnd.randrange(len(raw))
            raw[i] ^= 1 << rnd.randrange(8)
        return bytes(raw), "flip"
    if kind == 1:
        i = rnd.randrange(len(raw))
        raw[i : i + rnd.randint(1, 16)] = rnd.randbytes(16)[: len(raw[i : i + 16])]
        return bytes(raw), "overwrite"
    if kind == 2:
        return bytes(raw[: rnd.randrange(len(raw))]), "cut"
    if kind == 3:
        return bytes(raw) + bytes(rnd.randint(1, 64)), "zeros"
    if kind == 4:
        return bytes(raw) + rnd.randbytes(rnd.randint(1, 64)), "garbage"
    if kind == 5:
        i = rnd.randrange(len(raw))
        return bytes(raw[:i] + rnd.randbytes(rnd.randint(1, 8)) + raw[i:]), "insert"
    if kind == 6:
        i = rnd.randrange(len(raw))
        return bytes(raw[:i] + raw[i + rnd.randint(1, 8) :]), "delete"
    # a whole record spliced in twice (a replayed write): wrong seq, or duplicate content
    b = case.boundaries
    if len(b) > 2:
        k = rnd.randrange(len(b) - 1)
        rec = raw[b[k] : b[k + 1]]
        return bytes(raw[: b[k + 1]] + rec + raw[b[k + 1] :]), "splice"
    return bytes(raw) + bytes(raw), "doubled"


def _check(case: Case, data: bytes, work: Path, what: str) -> str:
    """Load ``data``: 'ok' or 'torn' (content as the invariant says) or 'error' (the format's own)."""
    try:
        good, content = case.load(data, work)
    except case.error as exc:
        offset = getattr(exc, "offset", None)
        assert isinstance(offset, int) and 0 <= offset <= len(data), (case.name, what, exc)
        return "error"
    assert good in case.boundaries, (case.name, what, good)
    assert data[:good] == case.pristine[:good], (case.name, what)  # nothing damaged was accepted
    if good == len(case.pristine) and case.expected is not None:
        assert content == case.expected, (case.name, what)
    return "ok" if good == len(data) else "torn"


@pytest.fixture(params=BUILDERS, ids=lambda b: b.__name__.strip("_"))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Case:
    src = tmp_path / "src"
    src.mkdir()
    built: Case = request.param(src)
    return built


@pytest.mark.timeout(240)
def test_fuzz_record_formats_round_trip_and_every_cut(case: Case, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    assert _check(case, case.pristine, work, "pristine") == "ok"
    whole_file = len(case.boundaries) == 1
    for cut in range(len(case.pristine)):  # byte at a time: every prefix
        outcome = _check(case, case.pristine[:cut], work, f"cut {cut}")
        if whole_file:
            assert outcome == "error", (case.name, cut)
        else:  # a log: exactly the whole records before the cut, the rest torn
            assert outcome != "error", (case.name, cut)


@pytest.mark.timeout(240)
def test_fuzz_record_formats_random_damage(case: Case, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    rnd = random.Random(f"records-{case.name}")
    outcomes = {"ok": 0, "torn": 0, "error": 0}
    for trial in range(TRIALS):
        data, what = _mutate(rnd, case.pristine, case)
        outcomes[_check(case, data, work, f"trial {trial}: {what}")] += 1
    assert outcomes["error"] > 0, outcomes
    if len(case.boundaries) > 2:
        assert outcomes["torn"] > 0, outcomes
