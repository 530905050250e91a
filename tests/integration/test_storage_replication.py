"""Storage services and replication, several nodes in one process over mem:// and tcp:// (each
node built as the daemon builds it: tools/cluster_harness)."""

import asyncio

import msgspec
import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.client.storage_client import (
    QuorumNotReached,
    ReadFailed,
    RemoteNotOwner,
    RemoteStoreFull,
    StorageClient,
)
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from peers.transport import connect
from tools.cluster_harness import Cluster, make_batch

pytestmark = pytest.mark.timeout(60)

SCHEMES = ["mem", "tcp"]


async def wait_for(predicate, timeout_s=5.0):
    """Poll ``predicate`` until true (bounded); the condition is external (a background delivery)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def replica_digests(cluster, batch, names=None):
    out = {}
    for name in names or cluster.names:
        out[name] = await cluster.client.digests(name, batch.row_column, batch.row_feature)
    return out


def same_rows(a: RowBatch, b: RowBatch) -> bool:
    return (a.num_rows == b.num_rows and all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers())))


@pytest.mark.asyncio
@pytest.mark.parametrize("scheme", SCHEMES)
async def test_storage_quorum_write_then_read(tmp_path, scheme):
    cluster = await Cluster(tmp_path, 3, scheme=scheme).start()
    try:
        batch = make_batch(np.random.default_rng(1), 40)
        result = await cluster.client.write(batch)
        assert result.quorum == 2 and len(result.acked) >= 2
        assert same_rows(await cluster.client.read_rows(batch.row_column, batch.row_feature), batch)
        await cluster.client.flush()
        digests = await replica_digests(cluster, batch)
        assert all(d is not None for d in digests["s0"])
        assert digests["s0"] == digests["s1"] == digests["s2"]
        assert sum(s.counters.applies for s in cluster.services.values()) == 3
        assert cluster.client.writer_floor == 1  # every owner acknowledged seq 1 directly
    finally:
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("scheme", SCHEMES)
async def test_storage_owner_down_hint_held_then_delivered(tmp_path, scheme):
    cluster = await Cluster(tmp_path, 3, scheme=scheme).start()
    try:
        rng = np.random.default_rng(2)
        await cluster.stop_node("s1")
        batch = make_batch(rng, 30)
        result = await cluster.client.write(batch)
        assert set(result.acked) == {"s0", "s2"}
        await cluster.client.flush()
        held = {n: s.hints.held for n, s in cluster.services.items()}
        assert sum(held.values()) == 1, held  # s1's whole share kept by one node
        assert cluster.client.writer_floor == 0  # s1 has not confirmed seq 1

        await cluster.restart_node("s1")
        await wait_for(lambda: all(s.hints.held == 0 for s in cluster.services.values()))
        assert sum(s.counters.hints_delivered for s in cluster.services.values()) == 1
        digests = await replica_digests(cluster, batch)
        assert all(d is not None for d in digests["s1"])
        assert digests["s0"] == digests["s1"] == digests["s2"]
        assert await cluster.client.confirm_hints() == 1
        assert cluster.client.writer_floor == 1
        # the hint directory is gone once delivered
        assert not any(list((cluster.storage_dir(n) / "hints").iterdir()) for n in cluster.names if n != "s1")
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_writes_confirm_delivered_hints_on_their_own(tmp_path, monkeypatch):
    from giaannd.client import writes as client_module  # CONFIRM_HINTS_INTERVAL_S lives there

    monkeypatch.setattr(client_module, "CONFIRM_HINTS_INTERVAL_S", 0.0)
    cluster = await Cluster(tmp_path, 3).start()
    try:
        rng = np.random.default_rng(20)
        await cluster.stop_node("s0")
        await cluster.client.write(make_batch(rng, 5))
        await cluster.client.flush()
        assert cluster.client.writer_floor == 0
        await cluster.restart_node("s0")
        await wait_for(lambda: all(s.hints.held == 0 for s in cluster.services.values()))
        await cluster.client.write(make_batch(rng, 5))  # starts a confirm_hints in the background
        await cluster.client.flush()
        assert cluster.client.writer_floor == 2
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_hint_survives_holder_restart(tmp_path):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        await cluster.stop_node("s2")
        batch = make_batch(np.random.default_rng(3), 10)
        await cluster.client.write(batch)
        await cluster.client.flush()
        holder = next(n for n, s in cluster.services.items() if s.hints.held)
        await cluster.stop_node(holder, graceful=False)
        await cluster.restart_node(holder)
        assert cluster.services[holder].hints.held == 1  # recovered from its hint log
        await cluster.restart_node("s2")
        await wait_for(lambda: cluster.services[holder].hints.held == 0)
        got = await cluster.client.read_from("s2", batch.row_column, batch.row_feature)
        assert same_rows(got, batch)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_retried_batch_counts_once(tmp_path):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        batch = make_batch(np.random.default_rng(4), 20)
        first = await cluster.client.write(batch)
        again = await cluster.client.write(batch, batch_id=first.batch_id)
        assert again.batch_id == first.batch_id
        await cluster.client.flush()
        for name in cluster.names:  # exact strengths on every replica: applied once
            got = await cluster.client.read_from(name, batch.row_column, batch.row_feature)
            assert same_rows(got, batch)
        assert sum(s.counters.applies_duplicate for s in cluster.services.values()) == 3
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_quorum_not_reached_then_retry_succeeds_once(tmp_path):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        batch = make_batch(np.random.default_rng(5), 10)
        # Two owners fail without the views knowing (no mark_down): the client sees the errors.
        for name in ("s1", "s2"):
            await cluster.stop_node(name, noticed=False)
        with pytest.raises(QuorumNotReached) as err:
            await cluster.client.write(batch)
        await cluster.client.flush()
        bid = err.value.batch_id
        assert err.value.min_acks == 1
        for name in ("s1", "s2"):
            await cluster.restart_node(name)
        await cluster.client.write(batch, batch_id=bid)
        await cluster.client.flush()
        for name in cluster.names:
            assert same_rows(await cluster.client.read_from(name, batch.row_column, batch.row_feature), batch)
    finally:
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mark_down", [False, True])
async def test_storage_reads_fail_over(tmp_path, mark_down):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        batch = make_batch(np.random.default_rng(6), 30)
        await cluster.client.write(batch)
        await cluster.client.flush()
        primaries = {cluster.owners(int(c))[0] for c in batch.row_column}
        victim = sorted(primaries)[0]
        if mark_down:
            await cluster.stop_node(victim)
        else:
            await cluster.stop_node(victim, noticed=False)
        assert same_rows(await cluster.client.read_rows(batch.row_column, batch.row_feature), batch)
        for name in list(cluster.services):
            await cluster.stop_node(name, noticed=False)
        with pytest.raises(ReadFailed):
            await cluster.client.read_rows(batch.row_column, batch.row_feature)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_read_prefers_local_owner(tmp_path):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        batch = make_batch(np.random.default_rng(7), 30)
        await cluster.client.write(batch)
        await cluster.client.flush()
        cluster.client_topology.local = "s2"  # a compute node co-located with storage node s2
        before = {n: s.counters.reads for n, s in cluster.services.items()}
        await cluster.client.read_rows(batch.row_column, batch.row_feature)
        after = {n: s.counters.reads for n, s in cluster.services.items()}
        assert after["s2"] > before["s2"]
        assert after["s0"] == before["s0"] and after["s1"] == before["s1"]  # R=3 of 3: s2 owns all
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_full_is_a_typed_error(tmp_path):
    cluster = await Cluster(tmp_path, 3, capacity_bytes=64 << 10).start()
    try:
        big = make_batch(np.random.default_rng(8), 200, entries_per_row=20)
        with pytest.raises(RemoteStoreFull) as err:
            await cluster.client.apply_to("s0", BatchId(1, 1), big)
        assert err.value.reply.capacity_bytes == 64 << 10
        with pytest.raises(QuorumNotReached) as qerr:
            await cluster.client.write(big)
        assert qerr.value.store_full
        assert cluster.services["s0"].store.store.usage().num_rows == 0  # nothing changed
        small = make_batch(np.random.default_rng(9), 2)
        await cluster.client.write(small)  # the node keeps serving
        usage = await cluster.client.usage("s0")
        assert usage.num_rows == 2 and not usage.is_full
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_not_owner_is_typed(tmp_path):
    cluster = await Cluster(tmp_path, 4, replicas=1).start()
    try:
        batch = make_batch(np.random.default_rng(10), 40)
        owners = {cluster.owners(int(c))[0] for c in batch.row_column}
        outsider_rows = batch.select_rows(np.array([cluster.owners(int(c))[0] != "s0" for c in batch.row_column]))
        assert len(owners) > 1 and outsider_rows.num_rows
        with pytest.raises(RemoteNotOwner) as err:
            await cluster.client.apply_to("s0", BatchId(1, 1), outsider_rows)
        assert err.value.epoch == cluster.client_topology.epoch
        result = await cluster.client.write(batch)  # R=1, W=1: each row to its one owner
        assert result.quorum == 1
        assert same_rows(await cluster.client.read_rows(batch.row_column, batch.row_feature), batch)
    finally:
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("scheme", SCHEMES)
async def test_storage_garbage_gets_typed_errors_and_service_keeps_serving(tmp_path, scheme):
    cluster = await Cluster(tmp_path, 1, scheme=scheme, replicas=1).start()
    try:
        conn = await connect(cluster.client.transports[scheme], cluster.addresses["s0"], timeout_s=2)

        async def ask(payload, bulk=()):
            res = await conn.request(payload, list(bulk), timeout_s=2)
            return p.decode_reply(res.payload)

        rng = np.random.default_rng(11)
        good = make_batch(rng, 5)
        bufs = good.buffers()
        apply = p.encode(p.ApplyBatch(1, 1))
        cases = [
            # (bytes that are not msgpack at all break the transport's framing: its own tests)
            (msgspec.msgpack.encode([1, 2, 3]), []),
            (msgspec.msgpack.encode("hello"), []),
            (msgspec.msgpack.encode({"type": "x"}), []),
            (msgspec.msgpack.encode({"type": 999}), []),
            (msgspec.msgpack.encode({"type": 2, "writer": -1, "seq": 1}), bufs),
            (msgspec.msgpack.encode({"type": 2, "writer": 1, "seq": 0}), bufs),
            (apply, bufs[:6]),
            (apply, [bufs[1], bufs[0], *bufs[2:]]),  # rows not sorted
            (apply, [*bufs[:6], np.full(good.num_entries, np.nan, np.float32)]),
            (apply, [*bufs[:3], np.full(good.num_entries, 200, np.uint8), *bufs[4:]]),  # bad segment
            (apply, [bufs[0], bufs[1], bufs[2][::-1].copy(), *bufs[3:]]),  # bad offsets
            (apply, [b.astype(np.float64) for b in bufs]),
            (p.encode(p.ReadRows()), [np.zeros(3, np.uint64)]),
            (p.encode(p.ReadRows()), [np.zeros(3, np.uint64), np.zeros(2, np.uint64)]),
            (p.encode(p.ReadRows()), [np.zeros(p.MAX_READ_ROWS + 1, np.uint64)] * 2),
            (p.encode(p.BatchesApplied(1, [1] * (p.MAX_QUERY_SEQS + 1))), []),
        ]
        for payload, bulk in cases:
            reply = await ask(payload, bulk)
            assert isinstance(reply, p.BadRequest), (payload[:20], reply)
        svc = cluster.services["s0"]
        assert svc.counters.errors["BadRequest"] == len(cases)
        assert svc.store.store.usage().num_rows == 0 and svc.store.log.last_seq == 0  # nothing logged
        assert isinstance(await ask(apply, bufs), p.ApplyAck)
        rows = await cluster.client.read_rows(good.row_column, good.row_feature)
        assert same_rows(rows, good)
        await conn.close()
    finally:
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("graceful", [True, False])
async def test_storage_restart_gives_same_rows(tmp_path, graceful):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        rng = np.random.default_rng(12)
        batches = [make_batch(rng, 20) for _ in range(5)]
        for b in batches:
            await cluster.client.write(b)
        await cluster.client.flush()
        expected = RowBatch.concat(batches)
        for name in cluster.names:
            await cluster.stop_node(name, graceful=graceful)
        for name in cluster.names:
            await cluster.restart_node(name)
        for name in cluster.names:
            got = await cluster.client.read_from(name, expected.row_column, expected.row_feature)
            assert same_rows(got, expected)
            rec = cluster.services[name].store.recovery
            assert (rec.snapshot is not None) == graceful  # graceful stop snapshots, else log replay
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_group_commit_shares_fsyncs(tmp_path):
    cluster = await Cluster(tmp_path, 1, replicas=1).start(fsync_group_commit_ms=2.0)
    try:
        rng = np.random.default_rng(13)
        batches = [make_batch(rng, 3) for _ in range(40)]
        await asyncio.gather(*(cluster.client.write(b) for b in batches))
        svc = cluster.services["s0"]
        assert svc.counters.applies == 40
        assert 1 <= svc.counters.fsync_batches < 40
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_writer_floor_travels_and_compacts(tmp_path):
    cluster = await Cluster(tmp_path, 3, replicas=1).start()
    try:
        rng = np.random.default_rng(14)
        for _ in range(30):  # each batch one row: seqs spread over the owners with gaps
            await cluster.client.write(make_batch(rng, 1))
        await cluster.client.write(make_batch(rng, 3))  # carries floor 30 to its owners
        writer = cluster.client.writer_id
        floors = [s.store.store.applied.floor(writer) for s in cluster.services.values()]
        assert max(floors) >= 30
        # a foreign writer's id carries no floor of ours
        await cluster.client.write(make_batch(rng, 3), batch_id=BatchId(writer ^ 1, 100))
        assert all(s.store.store.applied.floor(writer ^ 1) == 0 for s in cluster.services.values())
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_client_without_members_raises(tmp_path):
    client = StorageClient(ClusterView())
    with pytest.raises(LookupError):
        await client.write(make_batch(np.random.default_rng(0), 1))
    topo = ClusterView(replicas=2)
    topo.set_members([StorageNode("a", "mem://nowhere-a"), StorageNode("b", "mem://nowhere-b")])
    client = StorageClient(topo)
    with pytest.raises(QuorumNotReached):
        await client.write(make_batch(np.random.default_rng(0), 1))
    await client.close()


@pytest.mark.asyncio
async def test_storage_snapshot_timer_truncates_the_log(tmp_path):
    cluster = await Cluster(tmp_path, 1, replicas=1).start(snapshot_interval_s=0.05)
    try:
        svc = cluster.services["s0"]
        stopping = asyncio.Event()
        loop_task = asyncio.create_task(svc.run_snapshots(stopping))
        await cluster.client.write(make_batch(np.random.default_rng(30), 5))
        seq = svc.store.log.last_seq
        await wait_for(lambda: svc.store.snapshot_seq >= seq)
        assert list((cluster.storage_dir("s0") / "store").glob("*.snap"))
        stopping.set()
        await asyncio.wait_for(loop_task, 5)
    finally:
        await cluster.close()


@pytest.mark.asyncio
async def test_storage_slow_owner_slows_the_writer(tmp_path):
    cluster = await Cluster(tmp_path, 3).start()
    try:
        cluster.client.max_inflight = 1  # one request in flight per owner (a larger one goes alone)
        slow = cluster.services["s2"]
        inner = slow._durable
        state = {"now": 0, "max": 0}

        async def slow_durable(step):
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
            try:
                await asyncio.sleep(0.2)
                return await inner(step)
            finally:
                state["now"] -= 1

        slow._durable = slow_durable
        rng = np.random.default_rng(40)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(4):
            await cluster.client.write(make_batch(rng, 4))  # W=2 is met by s0, s1 at once
        elapsed = loop.time() - start
        await cluster.client.flush()
        assert state["max"] == 1  # never more than the budget queued at the slow owner
        assert elapsed >= 3 * 0.2 - 0.05  # writes 2..4 each waited for s2's previous share
        assert slow.counters.applies == 4
    finally:
        await cluster.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [50, 51, 52])
async def test_storage_churn_converges_to_exact_sums(tmp_path, seed):
    """Seeded churn: owners crash (known or unknown to the views) and return while a writer keeps
    writing and retrying. At the end every replica holds exactly the sum of every batch: nothing
    acknowledged is lost, nothing retried or re-delivered counts twice."""
    cluster = await Cluster(tmp_path, 4).start()
    rng = np.random.default_rng(seed)
    columns = rng.integers(1, 2**63, 12, dtype=np.uint64)  # few columns: rows overlap across batches
    written = []
    try:
        for _step in range(40):
            action = rng.random()
            up = sorted(cluster.services)
            down = [n for n in cluster.names if n not in cluster.services]
            if action < 0.15 and len(up) > 3:
                victim = str(rng.choice(up))
                if rng.random() < 0.5:
                    await cluster.stop_node(victim, graceful=bool(rng.random() < 0.5))
                else:  # a crash the views have not noticed yet
                    await cluster.kill(victim, noticed=False)
            elif action < 0.3 and down:
                await cluster.restart_node(str(rng.choice(down)))
            batch = make_batch(rng, 3, columns=rng.choice(columns, 3, replace=False))
            bid = None
            for _ in range(5):
                try:
                    bid = (await cluster.client.write(batch, batch_id=bid)).batch_id
                    break
                except QuorumNotReached as exc:
                    bid = exc.batch_id
                    for name in [n for n in cluster.names if n not in cluster.services][:1]:
                        await cluster.restart_node(name)
            else:
                pytest.fail("write never reached its quorum")
            written.append(batch)
        for name in [n for n in cluster.names if n not in cluster.services]:
            await cluster.restart_node(name)
        await cluster.client.flush()
        async with asyncio.timeout(20):  # what the periodic hint retry does (every hint_retry_s)
            while any(s.hints.held for s in cluster.services.values()):
                for svc in list(cluster.services.values()):
                    await svc.deliver_hints()
                await asyncio.sleep(0.05)
        expected = RowBatch.concat(written)
        for name in cluster.names:
            own = np.array([name in cluster.owners(int(c)) for c in expected.row_column])
            want = expected.select_rows(own)
            got = await cluster.client.read_from(name, want.row_column, want.row_feature)
            assert same_rows(got, want), name
    finally:
        await cluster.close()
