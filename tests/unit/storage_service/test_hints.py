"""giaannd.storage.replication.hints: durable per-target hint logs."""

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.errors import CorruptLogError
from giaannd.storage.engine.update_log import list_segments
from giaannd.storage.replication.hints import HintSpaceFull, HintStore


def _batch(seed, rows=3):
    rng = np.random.default_rng(seed)
    n = rows * 2
    return RowBatch.from_entries(np.repeat(rng.integers(1, 99, rows, dtype=np.uint64), 2),
                                 np.zeros(n, np.uint64), np.zeros(n, np.uint8),
                                 rng.integers(1, 9, n, dtype=np.uint64), np.arange(n, dtype=np.uint64),
                                 np.ones(n, np.float32))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def test_hints_survive_reopen_in_order(tmp_path):
    hs = HintStore.open(tmp_path)
    batches = {BatchId(1, s): _batch(s) for s in (3, 1, 2)}
    for bid, b in batches.items():
        assert hs.add("node-b", bid, b)
        hs.sync("node-b")
    assert not hs.add("node-b", BatchId(1, 3), batches[BatchId(1, 3)])  # already held
    hs.add("node/c ü", BatchId(2, 1), _batch(9))  # any name: hex-encoded directory
    hs.close()
    again = HintStore.open(tmp_path)
    assert again.targets() == ["node-b", "node/c ü"] and again.held == 4
    got = again.pending("node-b")
    assert [h.batch_id for h in got] == list(batches)
    assert all(_same(h.batch, batches[h.batch_id]) for h in got)
    assert again.held_bytes == hs.held_bytes


def test_hints_delivered_deletes_the_log(tmp_path):
    hs = HintStore.open(tmp_path)
    hs.add("b", BatchId(1, 1), _batch(1))
    hs.add("b", BatchId(1, 2), _batch(2))
    hs.delivered("b", BatchId(1, 1))
    assert hs.held == 1 and len(list(tmp_path.iterdir())) == 1
    hs.delivered("b", BatchId(1, 2))
    assert hs.held == 0 and hs.held_bytes == 0 and list(tmp_path.iterdir()) == []
    hs.delivered("b", BatchId(1, 2))  # unknown: no-op
    hs.close()
    assert HintStore.open(tmp_path).held == 0


def test_hints_budget(tmp_path):
    b = _batch(1)
    hs = HintStore.open(tmp_path, max_bytes=b.nbytes * 2)
    hs.add("b", BatchId(1, 1), b)
    hs.add("c", BatchId(1, 2), b)
    with pytest.raises(HintSpaceFull):
        hs.add("b", BatchId(1, 3), b)
    with pytest.raises(ValueError):
        hs.add("x" * 200, BatchId(1, 4), _batch(2, rows=0))


def test_hints_torn_tail_cut_corruption_stops(tmp_path):
    hs = HintStore.open(tmp_path)
    hs.add("b", BatchId(1, 1), _batch(1))
    hs.add("b", BatchId(1, 2), _batch(2))
    hs.close()
    (seg,) = [path for _, path in list_segments(next(tmp_path.iterdir()))]
    data = seg.read_bytes()
    seg.write_bytes(data[:-5])  # torn last record: it was never acknowledged
    again = HintStore.open(tmp_path)
    assert [h.batch_id for h in again.pending("b")] == [BatchId(1, 1)]
    again.close()
    raw = bytearray(seg.read_bytes())
    raw[60] ^= 0xFF  # damage inside the first (and now only, yet not last-torn) record's payload
    seg.write_bytes(bytes(raw) + data[len(raw):])
    with pytest.raises(CorruptLogError):
        HintStore.open(tmp_path)


@pytest.mark.parametrize("keep_records", [0, 2])
def test_hints_a_segment_cut_short_before_the_last_stops_start_up(tmp_path, keep_records):
    """A segment before the last that lost its end at a record boundary (or all of it) leaves a gap
    in the seqs: start-up stops naming the file, as for the store's update log, instead of
    silently forgetting acknowledged hints."""
    hs = HintStore.open(tmp_path)
    for s in (1, 2):
        hs.add("b", BatchId(1, s), _batch(s))  # seq 1: the epoch record, then 2, 3
    hs.sync("b")
    hs.close()
    hs = HintStore.open(tmp_path)  # a reopen starts a second segment (at seq 4)
    hs.add("b", BatchId(1, 3), _batch(3))
    hs.sync("b")
    hs.close()
    (_, first), (_, last) = list_segments(next(tmp_path.iterdir()))
    data = first.read_bytes()
    ends = [0]
    while ends[-1] < len(data):  # record boundaries: header (40 B) + payload length at offset 8
        ends.append(ends[-1] + 40 + int.from_bytes(data[ends[-1] + 8 : ends[-1] + 16], "little"))
    first.write_bytes(data[: ends[keep_records]])
    with pytest.raises(CorruptLogError) as err:
        HintStore.open(tmp_path)
    assert err.value.file_path == str(last)
    assert first.stat().st_size == ends[keep_records] and last.exists()  # files left for the operator
