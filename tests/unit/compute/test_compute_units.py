"""Pure parts of the compute role: flag row, progress, row cache, fetcher, state file, pipeline
against a fake storage client (backpressure, retries)."""

import asyncio

import msgspec
import numpy as np
import pytest

from giaannd.compute.flags import FLAG_ROW, FlagTracker, flag_ids, flags_batch, without_flag_row
from giaannd.compute.infer import ROW_OVERHEAD_BYTES, RowCache, RowFetcher
from giaannd.compute.jobs import JobRegistry, TrainProgress
from giaannd.compute.state import STATE_FILE, STATE_RECORD, ComputeState, StateFileError
from giaannd.compute.train import TrainingJob, TrainSettings, pair_increments
from giaannd.model.columns import ColumnAssigner
from giaannd.model.rows import Row, RowBatch
from giaannd.model.tokens import load_bundled_corpus
from giaannd.model.train import train_batch
from giaannd.protocol import BatchId

pytestmark = pytest.mark.timeout(60)


def row(n, start=0):
    return Row(np.zeros(n, np.uint8), np.arange(start, start + n, dtype=np.uint64),
               np.ones(n, np.uint64), np.ones(n, np.float32))


# -- flags -------------------------------------------------------------------------------------

def test_flags_batch_round_trip():
    b = flags_batch([7, 3, 7])
    b.validate()
    assert b.key(0) == FLAG_ROW and flag_ids(b.row(0)) == {3, 7}
    assert flags_batch([]).num_rows == 0
    # the set is grow-only under storage's merge-add: writing again only raises strengths
    both = RowBatch.concat([b, flags_batch([3, 9])])
    assert flag_ids(both.row(0)) == {3, 7, 9}


def test_flag_ids_rejects_foreign_entries():
    bad = Row(np.array([1], np.uint8), np.zeros(1, np.uint64), np.ones(1, np.uint64), np.ones(1, np.float32))
    with pytest.raises(ValueError):
        flag_ids(bad)


def test_without_flag_row_drops_only_it():
    model = RowBatch.from_entries(np.array([5]), np.array([1]), np.array([2]), np.array([5]), np.array([0]),
                                  np.array([1.0]))
    mixed = RowBatch.concat([flags_batch([4]), model])
    out = without_flag_row(mixed)
    assert out.num_rows == 1 and out.key(0) == (5, 1)
    assert without_flag_row(model) is model


def test_flag_tracker_sends_each_flag_once():
    t = FlagTracker({1})
    assert t.take_unsent({1, 2}) == {2}
    assert t.take_unsent({1, 2}) == set()
    assert t.merge_remote({2, 3}) == {3}
    assert t.take_unsent({3, 4}) == {4}


# -- progress and jobs ---------------------------------------------------------------------------

class Sink:
    def __init__(self):
        self.seen = {}

    def add(self, name, amount):
        self.seen[name] = self.seen.get(name, 0) + amount


def test_progress_dict_and_sink():
    sink = Sink()
    p = TrainProgress(total=10, sink=sink)
    p.add(done=4, entries_before=300, entries_after=100, bytes_sent=2000)
    d = p.as_dict()
    assert (d["done"], d["total"], d["unit"]) == (4, 10, "sentences")
    assert d["coalescing_ratio"] == 3.0 and d["bytes_per_sentence"] == 500.0
    assert sink.seen == {"done": 4, "entries_before": 300, "entries_after": 100, "bytes_sent": 2000}


@pytest.mark.asyncio
async def test_job_registry_states():
    reg = JobRegistry(max_finished=2)

    async def ok(job):
        return {"x": 1}

    async def bad(job):
        raise RuntimeError("boom")

    async def hang(job):
        await asyncio.Event().wait()

    a, b, c = (reg.start("train", TrainProgress(), f) for f in (ok, bad, hang))
    await asyncio.wait_for(asyncio.gather(a.task, b.task), 5)
    assert a.as_dict()["state"] == "succeeded" and a.result == {"x": 1}
    assert b.state == "failed" and "boom" in b.as_dict()["error"]
    assert reg.running() == [c]
    await asyncio.wait_for(reg.cancel_all(), 5)
    assert c.state == "cancelled"
    for _ in range(3):
        reg.start("train", TrainProgress(), ok)
    await asyncio.sleep(0.01)
    assert reg.get(a.job_id) is None  # forgotten: only the newest finished jobs are kept


# -- row cache and fetcher -------------------------------------------------------------------

def test_row_cache_lru_bytes_and_invalidation():
    size = row(10).nbytes + ROW_OVERHEAD_BYTES
    cache = RowCache(3 * size)
    for i in range(4):
        cache.put((i, 0), row(10), cache.generation)
    assert (0, 0) not in cache and cache.evictions == 1 and cache.bytes == 3 * size
    assert cache.get((1, 0)) is not None and cache.get((0, 0)) is None
    gen = cache.generation
    cache.invalidate([(1, 0)])
    assert (1, 0) not in cache
    cache.put((1, 0), row(10), gen)  # a fetch started before the invalidation is not cached
    assert (1, 0) not in cache
    assert cache.stats()["hit_rate"] == 0.5
    cache.clear()
    assert cache.bytes == 0 and cache.stats()["rows"] == 0
    assert RowCache(0).max_bytes == 0
    with pytest.raises(ValueError):
        RowCache(-1)


def test_row_cache_charges_a_shared_reply_once_until_its_last_row_goes():
    reply = RowBatch.from_rows({(1, 0): row(10), (2, 0): row(20), (3, 0): row(30)})
    entries = sum(a.nbytes for a in reply.buffers()[3:])
    cache = RowCache(1 << 20)
    cache.put_reply([(1, 0), (2, 0), (3, 0), (4, 0)], dict(reply), reply, cache.generation)
    assert (4, 0) in cache and len(cache.get((4, 0))) == 0  # absent: cached empty
    assert cache.get((2, 0)).strength.base is reply.strength  # a view of the reply, not a copy
    assert cache.bytes == entries + 4 * ROW_OVERHEAD_BYTES
    cache.invalidate([(1, 0), (2, 0)])  # the reply stays while a row of it is cached
    assert cache.bytes == entries + 2 * ROW_OVERHEAD_BYTES
    cache.invalidate([(3, 0)])
    assert cache.bytes == ROW_OVERHEAD_BYTES
    # the LRU frees a reply only with its last row: the bound holds on the memory really kept
    size = entries + 3 * ROW_OVERHEAD_BYTES
    cache = RowCache(8 * size)
    for i in range(20):
        other = RowBatch.from_rows({(10 * i + j, 0): row(10 * (j + 1)) for j in range(3)})
        cache.put_reply([(10 * i + j, 0) for j in range(3)], dict(other), other, cache.generation)
        cache.get((10 * i, 0))  # one row of each reply used again: it outlives the others of its reply
        assert cache.bytes <= cache.max_bytes
    kept = {10 * i + j for i in range(20) for j in range(3) if (10 * i + j, 0) in cache}
    replies = {k // 10 for k in kept}
    assert cache.bytes == len(replies) * entries + len(kept) * ROW_OVERHEAD_BYTES
    # a reply over max_bytes / SHARED_BLOCK_FRACTION is cached row by row, as compact copies
    small = RowCache(entries)
    small.put_reply([(1, 0), (2, 0)], dict(reply), reply, small.generation)
    assert small.get((1, 0)).strength.base is None and small.bytes <= small.max_bytes


@pytest.mark.asyncio
async def test_row_fetcher_batches_single_flight_and_caches():
    calls = []
    stored = RowBatch.from_entries(np.array([1, 2]), np.array([0, 0]), np.array([8, 8]), np.array([5, 6]),
                                   np.array([0, 0]), np.array([1.0, 2.0]))

    async def read(cols, feats):
        calls.append(list(zip(cols.tolist(), feats.tolist())))
        await asyncio.sleep(0)
        keep = np.isin(stored.row_column, cols)
        return stored.select_rows(keep)

    f = RowFetcher(read, RowCache(1 << 20))
    rows = await asyncio.gather(f.get((1, 0)), f.get((2, 0)), f.get((1, 0)), f.get((3, 0)))
    assert len(calls) == 1 and sorted(calls[0]) == [(1, 0), (2, 0), (3, 0)]
    assert rows[0].strength.tolist() == [1.0] and len(rows[3]) == 0  # absent row: empty
    # the second (1, 0) joined the read in flight: not a miss (issue 19: it made the hit rate fall)
    assert (f.cache.misses, f.cache.in_flight_joins, f.cache.hits) == (3, 1, 0)
    await f.get((3, 0))
    assert len(calls) == 1  # absent rows are cached too
    assert f.cache.stats()["hits"] == 1 and f.cache.stats()["join_rate"] == 0.2
    f.prefetch([(1, 0), (4, 0)])
    await asyncio.sleep(0.01)
    assert calls[-1] == [(4, 0)]


@pytest.mark.asyncio
async def test_row_fetcher_propagates_failures_and_recovers():
    fail = [True]

    async def read(cols, feats):
        if fail[0]:
            raise OSError("all replicas down")
        return RowBatch.empty()

    f = RowFetcher(read, RowCache(1 << 20))
    f.prefetch([(9, 9)])  # a failed prefetch is swallowed
    with pytest.raises(OSError):
        await f.get((1, 1))
    fail[0] = False
    assert len(await f.get((1, 1))) == 0


# -- state file ------------------------------------------------------------------------------

def test_state_round_trip_and_corruption(tmp_path):
    st = ComputeState()
    st.vocab.add_column("cat")
    st.vocab.add_feature("the")
    st.deterministic = {5: True}
    st.probabilistic = {9}
    st.rows_written = 7
    st.save(tmp_path)
    back = ComputeState.load(tmp_path)
    assert back.vocab.column_lemma(st.vocab.add_column("cat")) == "cat"
    assert back.deterministic == {5: True} and back.probabilistic == {9}
    assert back.rows_written == 7
    assert ComputeState.load(tmp_path / "absent").vocab.num_columns == 0
    (tmp_path / STATE_FILE).write_bytes(b"\x93garbage")
    with pytest.raises(StateFileError):
        ComputeState.load(tmp_path)


def test_state_file_of_version_1_loads_with_its_keys_counted_and_saves_without_them(tmp_path):
    """Version 1 kept every row key written (at the mission's size, the model's row index, saved
    again after every job); version 2 keeps a count. A version 1 file still loads."""
    old = {"version": 1, "columns": [], "features": [], "deterministic": [[5, True]], "probabilistic": [9],
           "row_column": [1, 3], "row_feature": [2, 0]}
    (tmp_path / STATE_FILE).write_bytes(msgspec.msgpack.encode(old))
    back = ComputeState.load(tmp_path)
    assert back.rows_written == 2 and back.deterministic == {5: True} and back.probabilistic == {9}
    back.save(tmp_path)
    raw = msgspec.msgpack.decode(STATE_RECORD.decode_file((tmp_path / STATE_FILE).read_bytes()).payload)
    assert raw["version"] == 3 and raw["rows_written"] == 2 and raw["row_column"] == []
    (tmp_path / STATE_FILE).write_bytes(msgspec.msgpack.encode({**old, "version": 3}))
    with pytest.raises(StateFileError, match="version 3"):
        ComputeState.load(tmp_path)
    (tmp_path / STATE_FILE).write_bytes(msgspec.msgpack.encode({**old, "version": 2, "rows_written": 4}))
    assert ComputeState.load(tmp_path).rows_written == 4  # a bare version 2 file (no frame) still loads
    (tmp_path / STATE_FILE).write_bytes(msgspec.msgpack.encode({**old, "row_feature": [2]}))
    with pytest.raises(StateFileError, match="differ in length"):
        ComputeState.load(tmp_path)


def test_state_file_damaged_anywhere_is_an_error_not_a_different_state(tmp_path):
    """Every single-bit flip and every cut of a saved state file is refused naming the file: the
    flags and the count are checked by nothing else (a flipped ``true`` loaded as ``false``)."""
    st = ComputeState()
    st.vocab.add_column("cat")
    st.vocab.add_feature("the")
    st.deterministic = {5: True, 9: False}
    st.probabilistic = {7, 1234567}
    st.rows_written = 300
    path = st.save(tmp_path)
    pristine = path.read_bytes()
    damaged = [pristine[:cut] for cut in range(1, len(pristine))]
    for i in range(len(pristine)):
        for bit in range(8):
            raw = bytearray(pristine)
            raw[i] ^= 1 << bit
            damaged.append(bytes(raw))
    loaded = []
    for data in damaged:
        path.write_bytes(data)
        try:
            got = ComputeState.load(tmp_path)
        except StateFileError as exc:
            assert str(path) in str(exc)
            continue
        loaded.append((data, got.deterministic, got.probabilistic, got.rows_written))
    assert loaded == []


# -- pipeline against a fake client -------------------------------------------------------------

class FakeClient:
    """Applies writes to a dict of batches; optional failures and a gate to hold writes."""

    def __init__(self, fail_first=0):
        self.applied = {}
        self.fail_left = fail_first
        self.gate = None
        self.inflight = self.max_inflight = 0
        self.seq = 0
        self.abandoned = []
        self.vocab = {}

    def next_batch_id(self):
        self.seq += 1
        return BatchId(1, self.seq)

    def abandon(self, bid):
        self.abandoned.append(bid)

    async def put_vocab(self, entries):
        self.vocab.update({(kind, ident): text for kind, ident, text in entries})
        return len(entries)

    async def get_vocab(self, keys):
        return {k: self.vocab[k] for k in keys if k in self.vocab}

    async def write(self, batch, batch_id=None):
        self.inflight += batch.nbytes
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_left:
                self.fail_left -= 1
                raise OSError("connection reset")
            self.applied.setdefault(batch_id, batch)  # idempotent by id, as storage is
        finally:
            self.inflight -= batch.nbytes

    async def read_rows(self, cols, feats):
        return RowBatch.empty()


@pytest.fixture(scope="module")
def sentences():
    return load_bundled_corpus(300)


@pytest.mark.asyncio
async def test_pipeline_one_worker_sums_like_train_batch(sentences):
    client = FakeClient(fail_first=2)
    progress = TrainProgress()
    result = await TrainingJob(sentences, client, TrainSettings(coalesce_sentences=50, retry_backoff_s=0),
                               progress).run()
    a = ColumnAssigner()
    ref = train_batch([e for s in sentences if (e := a.encode(s)) is not None]).rows
    got = without_flag_row(RowBatch.concat(list(client.applied.values())))
    assert np.array_equal(got.row_column, ref.row_column) and np.array_equal(got.target_feature, ref.target_feature)
    assert np.allclose(got.strength, ref.strength, rtol=1e-6)
    assert progress.retries == 2 and progress.batches == len(client.applied) == 6
    assert result.probabilistic_flags == a.probabilistic_flags
    assert np.array_equal(result.row_column, ref.row_column)
    assert progress.entries_before > progress.entries_after == sum(b.num_entries for b in client.applied.values())


@pytest.mark.asyncio
async def test_pipeline_backpressure_bounds_inflight_bytes(sentences):
    client = FakeClient()
    client.gate = asyncio.Event()
    limit = 1  # each batch goes alone
    job = TrainingJob(sentences, client, TrainSettings(coalesce_sentences=30, max_inflight_bytes=limit))
    task = asyncio.create_task(job.run())
    await asyncio.sleep(0.05)
    assert len(client.applied) == 0 and job.progress.done == 0  # blocked: one batch out, workers wait
    client.gate.set()
    await asyncio.wait_for(task, 30)
    assert client.max_inflight == max(b.nbytes for b in client.applied.values())


@pytest.mark.asyncio
async def test_pipeline_gives_up_after_max_attempts(sentences):
    client = FakeClient(fail_first=100)
    job = TrainingJob(sentences[:40], client, TrainSettings(max_attempts=3, retry_backoff_s=0))
    with pytest.raises(OSError):
        await asyncio.wait_for(job.run(), 10)
    # the failed id is kept unsettled (never abandoned): the writer floor cannot pass it, so a
    # resumed run may still send it
    assert not client.abandoned and job.progress.retries == 2


def test_pair_increments_counts_raw_pairs(sentences):
    a = ColumnAssigner()
    enc = [e for s in sentences[:50] if (e := a.encode(s)) is not None]
    per = [pair_increments([e]) for e in enc]
    assert sum(per) == pair_increments(enc)
    # summing can only merge increments: each sentence's deltas have at most that many entries
    assert all(train_batch([e]).rows.num_entries <= n for e, n in zip(enc, per))
    assert sum(per) >= train_batch(enc).rows.num_entries


def test_train_settings_validation():
    with pytest.raises(ValueError):
        TrainSettings(workers=0)
    with pytest.raises(ValueError):
        TrainSettings(max_inflight_bytes=0)


def test_with_flags_prepends_canonically():
    from giaannd.compute.flags import with_flags

    model = RowBatch.from_entries(np.array([5, 5, 9]), np.array([1, 2, 0]), np.array([2, 3, 8]),
                                  np.array([5, 5, 9]), np.array([0, 1, 0]), np.array([1.0, 2.0, 3.0]))
    out = with_flags(model, {11, 4})
    out.validate()
    assert out.key(0) == FLAG_ROW and flag_ids(out.row(0)) == {4, 11}
    assert without_flag_row(out).num_entries == model.num_entries
    assert np.array_equal(RowBatch.concat([flags_batch({4, 11}), model]).strength, out.strength)
    assert with_flags(model, []) is model and with_flags(RowBatch.empty(), [3]).num_rows == 1
    with pytest.raises(ValueError):
        with_flags(out, [1])


@pytest.mark.asyncio
async def test_pipeline_coalescing_reduces_bytes(sentences):
    sent = {}
    for k in (1, 100):
        progress = TrainProgress()
        client = FakeClient()
        await TrainingJob(sentences, client, TrainSettings(coalesce_sentences=k), progress).run()
        assert progress.bytes_sent == sum(b.nbytes for b in client.applied.values())
        sent[k] = progress.bytes_sent
    assert sent[100] < 0.95 * sent[1]


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [1, 4])
async def test_pipeline_counts_sentences_of_a_window_without_rows_as_the_core_does(sentences, k):
    from giaannd.model.engine import Engine
    from giaannd.model.tokens import Token

    # nine names merge into one concept token: trained (encoded) but no pair, so no row and no flag
    names = tuple(Token(f"Name{i}", f"name{i}", "PROPN", "NNP") for i in range(9))
    corpus = [names] * k + list(sentences[:10]) + [names] * k  # the first and the last window have no rows
    client, progress = FakeClient(), TrainProgress()
    await TrainingJob(corpus, client, TrainSettings(coalesce_sentences=k, workers=2), progress).run()
    core = Engine(batch_sentences=k).train(corpus)
    assert (progress.done, progress.trained, progress.skipped, progress.tokens) == (
        len(corpus), core.sentences_trained, len(corpus) - core.sentences_trained, core.tokens)
    assert progress.batches == len(client.applied) and progress.bytes_sent == sum(
        b.nbytes for b in client.applied.values())


@pytest.mark.asyncio
async def test_a_failed_worker_stops_the_others_before_the_job_reports_the_failure(sentences):
    class FailingFlagRead(FakeClient):
        """Worker 0's first flag read fails (not retryable); every read yields to the loop."""

        def __init__(self):
            super().__init__()
            self.reads = 0
            self.ended = False
            self.late = []  # storage calls made after run() raised

        async def read_rows(self, cols, feats):
            self.reads += 1
            n = self.reads
            if self.ended:
                self.late.append(("read", n))
            await asyncio.sleep(0)
            if n == 2:  # 1: the job's initial read; 2: worker 0 before window 0
                raise RuntimeError("worker 0 broke")
            return RowBatch.empty()

        async def write(self, batch, batch_id=None):
            if self.ended:
                self.late.append(("write", batch_id.seq))
            await super().write(batch, batch_id)

    client = FailingFlagRead()
    progress = TrainProgress()
    job = TrainingJob(sentences[:100], client, TrainSettings(coalesce_sentences=5, workers=2), progress)
    with pytest.raises(RuntimeError, match="worker 0 broke"):
        await asyncio.wait_for(job.run(), 10)
    client.ended = True
    for _ in range(50):
        await asyncio.sleep(0)
    # worker 1 went on encoding windows and reading storage for a job already reported failed
    assert client.late == []


@pytest.mark.asyncio
async def test_inference_failure_surfaces_as_the_storage_error():
    from giaannd.compute.infer import Inference
    from giaannd.model.infer import TRAIN_SET, NoDelimiters

    a = ColumnAssigner()
    enc = [e for s in load_bundled_corpus(20) if (e := a.encode(s, update_flags=False)) is not None]

    async def read(cols, feats):
        raise OSError("every replica down")

    inference = Inference(RowFetcher(read, RowCache(1 << 20)), max_sessions=4)
    with pytest.raises(OSError, match="every replica"):
        await asyncio.wait_for(inference.evaluate(enc, NoDelimiters(), TRAIN_SET), 10)


def test_service_finds_a_storage_client_among_the_node_services():
    from types import SimpleNamespace

    from giaannd.client.storage_client import StorageClient
    from giaannd.cluster.view import ClusterView
    from giaannd.compute.service import _client_from_services

    topo = ClusterView(local="s1")
    storage = SimpleNamespace(topology=topo, transports={}, identity=None)
    client = _client_from_services({"storage": storage})
    assert isinstance(client, StorageClient) and client.topology is topo
    runtime_client = StorageClient(ClusterView())
    assert _client_from_services({"runtime": SimpleNamespace(storage_client=runtime_client),
                                  "storage": storage}) is runtime_client
    assert _client_from_services({"storage": SimpleNamespace(topology=None)}) is None


@pytest.mark.asyncio
@pytest.mark.parametrize("fewest", [True, False, None])
async def test_service_inference_reads_group_rows_per_config(tmp_path, fewest):
    """The service's row fetcher asks storage for the fewest-nodes grouping unless
    ``compute.infer-read-fewest-nodes`` is off (None: the default, on)."""
    from giaannd.compute.service import ComputeService
    from giaannd.config import ComputeConfig

    asked = []

    class Storage:
        async def read_rows(self, row_column, row_feature, timeout_s=None, *, fewest=None):
            asked.append(fewest)
            return RowBatch.empty()

    settings = ComputeConfig() if fewest is None else ComputeConfig(infer_read_fewest_nodes=fewest)
    svc = ComputeService(settings, tmp_path, storage=Storage())  # type: ignore[arg-type]
    fetcher = svc._infer().fetcher
    assert (await fetcher.get((1, 2))).nbytes == 0
    assert asked == [True if fewest is None else fewest]
