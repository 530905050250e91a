"""Repair across processes (repair/remote.py), in one process: every storage service gets its own
data-plane listener serving a ``RepairServer``, and the repaired node only talks to them through
the transport. A replica that missed batches while down (hints lost) is rebuilt exactly; batches
whose records left a peer's log are reported, never half-applied; pages can be tiny; bad
requests get a clear refusal."""

import threading

import msgspec
import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.repair import remote
from giaannd.storage.repair.remote import RepairServer, repair_self, with_repair
from giaannd.storage.repair.wire import (
    DigestsFor,
    DigestsPage,
    LoggedFor,
    LoggedPage,
    RepairRefused,
    RowsOf,
    RowsPage,
    applied_arrays,
    decode_repair,
    decode_repair_reply,
    is_repair_request,
    spec_of,
)
from giaannd.storage.streaming.sender import apply_local
from giaannd.storage.streaming.stream import StreamReply, StreamVerify, VerifyReply
from peers.transport import connect
from tools.cluster_harness import Cluster

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio]

COLUMNS = np.random.default_rng(10).integers(1, 2**63, 60, dtype=np.uint64)
ENC = msgspec.msgpack.Encoder()


class CountingServer(RepairServer):
    """Records the type of every repair request it is handed; with ``old`` set (a class switch),
    answers digests as a server from before digest versions does (version 1, whatever is asked)."""

    old = False

    def __init__(self, service, requests):
        super().__init__(service)
        self.requests = requests

    async def handle_incoming(self, incoming):
        try:
            msg = decode_repair(incoming.payload)
            self.requests.append(type(msg).__name__)
        except ValueError:
            self.requests.append("undecodable")
            return await super().handle_incoming(incoming)
        if isinstance(msg, DigestsFor):
            self.requests.append(f"digest version {msg.digest_version}")
            if self.old:
                msg = msgspec.structs.replace(msg, digest_version=1)
        return await self.handle(msg, incoming.bulk)


class RepairCluster(Cluster):
    """The harness's Cluster plus one listener per live node serving its RepairServer next to its stream
    endpoint (``with_repair``, as the daemon's endpoint does), re-opened on restart."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.repair_listeners = {}
        self.repair_addresses = {}
        self.requests: list[str] = []  # request types served, in order
        self.repair_transport = self.transport("repairer")

    async def _open_repair(self, name: str) -> None:
        handler = with_repair(CountingServer(self.services[name], self.requests), self.endpoints[name].handle)
        address = f"mem://{name}-repair" if self.scheme == "mem" else "tcp://127.0.0.1:0"
        listener = await self.transport(f"{name}-repair").listen(address, handler)
        self.repair_listeners[name] = listener
        self.repair_addresses[name] = listener.address

    async def start(self, **kw):
        await super().start(**kw)
        for name in self.names:
            await self._open_repair(name)
        return self

    async def kill(self, name: str) -> None:
        await self.repair_listeners.pop(name).close()
        del self.repair_addresses[name]
        await super().kill(name)

    async def restart_node(self, name: str):
        svc = await super().restart_node(name)
        await self._open_repair(name)
        return svc

    async def close(self) -> None:
        for listener in self.repair_listeners.values():
            await listener.close()
        await super().close()

    async def repair(self, name: str, **kw):
        peers = {n: a for n, a in self.repair_addresses.items() if n != name}
        return await repair_self(self.services[name], self.repair_transport, peers,
                                 self.client_topology.placement, **kw)


async def lose_hints_for(cluster, target):
    """The hint holders lose what they held for ``target`` (a holder's disk died)."""
    await cluster.client.flush()
    lost = set()
    for svc in cluster.services.values():
        for hint in svc.hints.pending(target):
            svc.hints.delivered(target, hint.batch_id)
            lost.add(hint.batch_id)
    return len(lost)


async def cluster_with_a_gap(tmp_path, n, seed, target, **kw):
    """``target`` was down during some W=1 writes and their hints were lost."""
    cluster = await RepairCluster(tmp_path, n, replicas=3, write_quorum=1, **kw).start()
    rng = np.random.default_rng(seed)
    await cluster.write_many(rng, 15, COLUMNS)
    await cluster.kill(target)
    await cluster.write_many(rng, 20, COLUMNS)
    assert await lose_hints_for(cluster, target) > 0
    await cluster.restart_node(target)
    await cluster.write_many(rng, 5, COLUMNS)
    await cluster.client.flush()
    applied = cluster.services[target].store.store.applied
    missing = sum(bid not in applied for bid, _ in cluster.written)
    assert missing > 0 and any(target in m for m in cluster.mismatches())
    return cluster, missing


@pytest.mark.parametrize("scheme", ["mem", "tcp"])
async def test_repair_self_fills_exactly_the_missing_batches(tmp_path, scheme):
    cluster, missing = await cluster_with_a_gap(tmp_path, 4, 1, "s2", scheme=scheme)
    try:
        report = await cluster.repair("s2")
        assert report["peers_failed"] == {} and report["unrecoverable"] == {}
        assert report["batches_shipped"] == missing and report["rows_shipped"] > 0
        assert report["rows_divergent"] == [] and report["rows_compared"] > 0
        assert cluster.mismatches() == []  # every owner equals the single-store reference
        applied = cluster.services["s2"].store.store.applied
        assert all(bid in applied for bid, _ in cluster.written)
        again = await cluster.repair("s2")  # idempotent
        assert again["batches_shipped"] == 0 and again["rows_divergent"] == []
        assert again["rows_compared"] == report["rows_compared"]
    finally:
        await cluster.close()


async def test_repair_lists_its_keys_by_peer_in_a_worker_thread(tmp_path, monkeypatch):
    """The listing of every held key by peer is O(rows): since Nov 30 it runs in a worker thread
    behind the fold gate (background_fold.py ``whole_store``), not on the event loop."""
    cluster, missing = await cluster_with_a_gap(tmp_path, 3, 5, "s1")
    try:
        threads = []
        real = remote._keys_by_peer

        def noting(*args):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread())
            return real(*args)

        monkeypatch.setattr(remote, "_keys_by_peer", noting)
        report = await cluster.repair("s1")
        assert report["batches_shipped"] == missing and cluster.mismatches() == []
        assert threads and all(t is not threading.main_thread() for t in threads)
    finally:
        await cluster.close()


async def test_repair_self_pages_with_a_tiny_byte_limit(tmp_path):
    cluster, missing = await cluster_with_a_gap(tmp_path, 3, 4, "s1")
    try:
        cluster.requests.clear()
        report = await cluster.repair("s1", page_bytes=1)
        assert report["batches_shipped"] == missing and report["rows_divergent"] == []
        assert cluster.mismatches() == []
        # one record per page: at least one LoggedFor per missing batch per peer
        assert cluster.requests.count("LoggedFor") >= 2 * missing
    finally:
        await cluster.close()


async def test_repair_self_reports_batches_that_left_a_log_and_applies_nothing_of_them(tmp_path):
    cluster, missing = await cluster_with_a_gap(tmp_path, 3, 2, "s1")
    try:
        s1 = cluster.services["s1"].store.store
        before = applied_arrays(s1.applied)
        keys = s1.keys()
        rows_before = {k: s1.row(k).strength.copy() for k in keys}
        await cluster.services["s0"].snapshot()  # s0's records leave its log; s2 still has them
        report = await cluster.repair("s1")
        assert report["batches_shipped"] == 0
        assert len(report["unrecoverable"]["s1"]) == missing
        assert all("applied on s0 but no longer in its log" in r for r in report["unrecoverable"]["s1"])
        assert all(np.array_equal(a, b) for a, b in zip(applied_arrays(s1.applied), before))
        assert s1.keys() == keys
        assert all(np.array_equal(s1.row(k).strength, v) for k, v in rows_before.items())
        assert report["rows_divergent"]  # and the comparison says so
        await cluster.services["s2"].snapshot()  # now in no log at all: unlogged, not candidates
        report = await cluster.repair("s1")
        assert report["batches_shipped"] == 0 and report["unrecoverable"] == {}
        assert report["unlogged"]["s1"] == {"s0": missing, "s2": missing}
    finally:
        await cluster.close()


@pytest.mark.parametrize("old_peers", [False, True])
async def test_repair_self_compares_strengths_within_tolerance(tmp_path, monkeypatch, old_peers):
    """With peers of this version (digest version 2, computed per page) and with peers from before
    digest versions (version 1, per row: the asker hashes its rows the same way)."""
    monkeypatch.setattr(CountingServer, "old", old_peers)
    cluster = await RepairCluster(tmp_path, 3, replicas=3).start()
    try:
        await cluster.write_many(np.random.default_rng(3), 10, COLUMNS)
        await cluster.client.flush()
        s0 = cluster.services["s0"]
        key = s0.store.store.keys()[0]
        row = s0.store.store.row(key)

        def nudge(delta):
            return RowBatch.from_entries(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64),
                                         row.segment[:1].copy(), row.target_column[:1].copy(),
                                         row.target_feature[:1].copy(), np.array([delta], np.float32))

        async def drift(seq, delta):
            """s0 applies other contents than s1 and s2 under one id (not a missing batch)."""
            for name in ("s1", "s2"):
                await apply_local(cluster.services[name], BatchId(0xDEAD, seq), RowBatch.empty())
            await apply_local(s0, BatchId(0xDEAD, seq), nudge(delta))

        # a last-bit difference (as replicas summing in different orders have): within tolerance
        await drift(1, float(row.strength[0]) * 1e-6)
        report = await cluster.repair("s1")
        assert report["batches_shipped"] == 0 and report["rows_divergent"] == []
        assert "RowsOf" in cluster.requests
        assert "digest version 2" in cluster.requests  # (what this version asks for)
        await drift(2, 1.0)  # a real difference
        report = await cluster.repair("s1")
        assert report["rows_divergent"] == [f"row {key}: s0 differs from s1"]
        assert report["rows_divergent_count"] == 1
    finally:
        await cluster.close()


async def test_repair_server_refuses_bad_requests_clearly(tmp_path):
    cluster = await RepairCluster(tmp_path, 3, replicas=3).start()
    try:
        await cluster.write_many(np.random.default_rng(6), 3, COLUMNS)
        await cluster.client.flush()
        conn = await connect(cluster.repair_transport, cluster.repair_addresses["s0"], timeout_s=5.0)
        spec = spec_of(cluster.client_topology.placement)
        applied = applied_arrays(None)

        async def ask(payload, bulk=()):
            res = await conn.request(payload, list(bulk), timeout_s=5.0)
            return decode_repair_reply(res.payload)

        cases = [
            (ENC.encode({"type": 200, "node": 5}), (), "undecodable repair request"),
            (ENC.encode({"type": 229}), (), "undecodable repair request"),
            (ENC.encode(LoggedFor("nobody", spec)), applied, "not a member of the placement"),
            (ENC.encode(LoggedFor("s1", msgspec.structs.replace(spec, replicas=2))), applied, "epoch mismatch"),
            (ENC.encode(LoggedFor("s1", spec)), applied[:2], "expected 4 arrays"),
            (ENC.encode(LoggedFor("s1", spec)), [a.astype(np.float64) for a in applied], "uint64"),
            (ENC.encode(DigestsFor("s1", spec)), applied[:1], "takes no bulk"),
            (ENC.encode(RowsOf()), [np.zeros(2, np.uint64), np.zeros(3, np.uint64)], "equal-length"),
        ]
        for payload, bulk, why in cases:
            assert is_repair_request(payload)
            reply = await ask(payload, bulk)
            assert isinstance(reply, RepairRefused), why
            assert why in reply.reason
        # a digest version this node does not know: a newer asker, answered in the newest it knows
        page = await ask(ENC.encode(DigestsFor("s1", spec, digest_version=9)))
        assert isinstance(page, DigestsPage) and page.digest_version == 2
        # RowsOf serves as many keys as fit its bytes (16 + 21 per entry each), one at least
        store = cluster.services["s0"].store.store
        cols, feats = store.key_arrays()
        seven = np.array([7], np.uint64)
        keys = [np.append(cols[:3], seven), np.append(feats[:3], seven)]  # the last one is not stored
        sizes = (16 + 21 * store.row_lengths(*keys)).tolist()
        assert sizes[-1] == 16
        for max_bytes, served in ((1, 1), (sizes[0] + sizes[1], 2), (sum(sizes) - 1, 3), (sum(sizes), 4)):
            reply = await ask(ENC.encode(RowsOf(max_bytes)), keys)
            assert isinstance(reply, RowsPage) and reply.served == served, reply
        ok = await ask(ENC.encode(LoggedFor("s1", spec)), applied)  # and the server still serves
        assert isinstance(ok, LoggedPage) and ok.done and ok.server == "s0"
        # stream messages on the same listener still reach the stream endpoint
        key = cluster.services["s0"].store.store.keys()[0]
        res = await conn.request(ENC.encode(StreamVerify(1)), [np.array([key[0]], np.uint64),
                                                                np.array([key[1]], np.uint64)], timeout_s=5.0)
        assert isinstance(msgspec.msgpack.decode(res.payload, type=StreamReply), VerifyReply)
        assert res.bulk[0].tolist() == [1]
        await conn.close()
    finally:
        await cluster.close()


async def test_repair_self_applies_nothing_when_a_peer_cannot_answer(tmp_path):
    cluster, missing = await cluster_with_a_gap(tmp_path, 4, 5, "s3")
    try:
        peers = {n: a for n, a in cluster.repair_addresses.items() if n != "s3"}
        peers["s1"] = "mem://nobody-here"
        report = await repair_self(cluster.services["s3"], cluster.repair_transport, peers,
                                   cluster.client_topology.placement)
        assert set(report["peers_failed"]) == {"s1"} and report["batches_shipped"] == 0
        applied = cluster.services["s3"].store.store.applied
        assert sum(bid not in applied for bid, _ in cluster.written) == missing
    finally:
        await cluster.close()


async def test_repair_while_a_peer_folds(tmp_path, monkeypatch):
    """A peer whose fold holds its rows mid-move answers the repair's digest and row pages once the
    fold ends, without blocking the event loop meanwhile (the fold is let go from the loop: before,
    the repair server read the rows at once and waited on the engine's lock with the loop blocked,
    so the release never came and the fold timed out); the repair then ends as usual."""
    import asyncio

    from tests.unit.storage_service.test_background_fold import PausedFold

    cluster, missing = await cluster_with_a_gap(tmp_path, 4, 3, "s2")
    try:
        paused = PausedFold(monkeypatch)
        rng = np.random.default_rng(30)
        engine = cluster.services["s0"].store.store.engine
        for _ in range(50):  # delta runs for s0 to fold
            await cluster.write_many(rng, 1, COLUMNS)
            await cluster.client.flush()
            if engine.num_deltas and not cluster.services["s0"].folds.running:
                break
        assert engine.num_deltas
        folds = cluster.services["s0"].folds
        assert folds is not None
        paused.armed = True
        fold = asyncio.create_task(folds.fold())
        await paused.entered()
        paused.armed = False
        repaired = asyncio.create_task(cluster.repair("s2"))
        await asyncio.sleep(0.3)
        paused.release.set()
        await fold
        report = await repaired
        await paused.left()
        assert paused.held == [True]
        assert report["peers_failed"] == {} and report["batches_shipped"] == missing
        assert report["rows_divergent"] == []
        await cluster.client.flush()
        assert cluster.mismatches() == []
    finally:
        await cluster.close()
