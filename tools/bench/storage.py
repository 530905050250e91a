"""Storage benchmarks: each measurement next to its baseline from the same run (ARCHITECTURE §11).

    python -m tools.bench.storage [--rows-mb 256] [--quick] [--append-after-sync [--json]]

Prints Markdown tables:

1. apply throughput (delta entries/s): the store's planned merge-add vs the plain numpy merge
   (concatenate + lexsort + reduce, ``rows.merge_rows``) on the same rows and deltas; and on the
   real training stream (bundled corpus, K-sentence delta batches): the store's batch apply, the
   per-row plan + merge it replaced, and the core's in-memory ``RowStore.apply`` (the baseline);
2. update-log throughput: appends with a group-commit fsync every k records, with an fsync per
   record, and raw ``os.write`` of the same bytes with no fsync; and the latency of an append right
   after a sync: the store's log (drops what it synced from the page cache) against one that keeps
   its pages (the baseline: no page to read back);
3. restart: snapshot write, snapshot load (+ row verification) and log replay, scaled to s/GB;
4. row reads: ``read_rows`` (gather into a RowBatch) vs ``memcpy`` of the same number of bytes;
5. placement: ``owner_indices`` over many keys;
6. storage service and replication (tcp on loopback, in-process): a row read through the service
   (``StorageClient.read_rows``: request, ReadRows decode, store gather, RowBatch validation) vs a raw
   transport request returning the same bytes; a quorum write (R=3, W=2, group commit) vs the same
   batch applied to one in-process ``DurableStore`` with an fsync.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from giaannd.model.rows import Row, RowBatch, merge_rows
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, DurableStore
from giaannd.storage.engine.column_store import ENTRY_BYTES, row_from_region
from giaannd.storage.engine.row_merge import add_in_place, merge_into, plan_merge
from peers.placement import Member, Placement
from tools.bench.report import emit_figure, print_table

BIG = 1 << 44


def _best(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _base_batch(rng: np.random.Generator, rows: int, entries_per_row: int) -> RowBatch:
    n = rows * entries_per_row
    return RowBatch.from_entries(
        np.repeat(rng.integers(0, 2**63, rows, dtype=np.uint64), entries_per_row),
        np.zeros(n, np.uint64),
        rng.integers(0, 9, n), rng.integers(0, 2**63, n, dtype=np.uint64),
        rng.integers(0, 64, n), rng.random(n, dtype=np.float32),
    )


def _delta_for(base: RowBatch, rng: np.random.Generator, per_row: int, new_share: float) -> RowBatch:
    """Deltas touching every row: ``per_row`` entries each, a share of them new keys."""
    parts: list[list[np.ndarray]] = [[] for _ in range(6)]
    for i in range(base.num_rows):
        row = base.row(i)
        pick = rng.choice(len(row), per_row, replace=False)
        seg, tc, tf = row.segment[pick].copy(), row.target_column[pick].copy(), row.target_feature[pick].copy()
        new = rng.random(per_row) < new_share
        tf[new] = rng.integers(1000, 2**63, int(new.sum()), dtype=np.uint64)
        for j, a in enumerate((np.full(per_row, base.row_column[i]), np.full(per_row, base.row_feature[i]),
                               seg, tc, tf, rng.random(per_row, dtype=np.float32))):
            parts[j].append(a)
    return RowBatch.from_entries(*(np.concatenate(p) for p in parts))


def bench_apply(quick: bool) -> None:
    rng = np.random.default_rng(0)
    out = []
    for entries_per_row, per_row in ((2000, 20), (20000, 50), (200, 50)):
        rows = 200 if quick else 500
        base = _base_batch(rng, rows, entries_per_row)
        for new_share in (0.0, 0.2):
            delta = _delta_for(base, rng, per_row, new_share)

            def store_apply() -> None:
                s = ColumnStore(BIG)
                s.apply(BatchId(1, 1), base, validate=False)
                t = time.perf_counter()
                s.apply(BatchId(1, 2), delta, validate=False)
                times.append(time.perf_counter() - t)

            def plain() -> None:
                rows_ = {k: r for k, r in base}
                t = time.perf_counter()
                for k, d in delta:
                    rows_[k] = merge_rows(rows_[k], d)
                times.append(time.perf_counter() - t)

            times: list[float] = []
            for _ in range(3):
                store_apply()
            t_store = min(times)
            times = []
            for _ in range(3):
                plain()
            t_plain = min(times)
            m = delta.num_entries
            out.append([
                f"{entries_per_row}", f"{per_row}", f"{new_share:.0%}",
                f"{m / t_store / 1e6:.2f}", f"{m / t_plain / 1e6:.2f}", f"{t_plain / t_store:.1f}x",
            ])
    print_table("apply: merge-add throughput (delta entries/s, M)",
           ["entries/row", "delta entries/row", "new keys", "store", "plain numpy", "speed-up"], out)


def _per_row_apply(rows: dict[tuple[int, int], Row], batch: RowBatch) -> None:
    """The previous store path, kept as a baseline: plan + merge one row at a time (row_merge's
    per-row functions), a fresh region for each growing row (without the store's bookkeeping)."""
    for key, delta in batch:
        base = rows.get(key)
        plan = plan_merge(base if base is not None else Row.empty(), delta)
        if base is not None and plan.in_place:
            add_in_place(base, delta, plan)
            continue
        n = (len(base) if base is not None else 0) + plan.new_count
        out = row_from_region(np.empty(ENTRY_BYTES * n, np.uint8))  # one region per row, as stored
        merge_into(base if base is not None else Row.empty(), delta, plan, out)
        rows[key] = out


def bench_apply_training(tmp: Path, sentences: int, window: int) -> None:
    """Apply the delta batches of real training (bundled corpus, ``window`` sentences per batch)."""
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.rowstore import RowStore
    from giaannd.model.tokens import load_bundled_corpus
    from giaannd.model.train import train_batch

    encoded = list(ColumnAssigner().encode_many(load_bundled_corpus(sentences)))
    batches = [train_batch(encoded[i : i + window]).rows for i in range(0, len(encoded), window)]
    # stream copies, so an in-place add never touches the batch arrays the next run reads
    def fresh() -> list[RowBatch]:
        return [RowBatch.from_buffers([b.copy() for b in batch.buffers()], validate=False) for batch in batches]

    def run(apply: Callable[[int, RowBatch], object], finish: Callable[[], object] = lambda: None) -> float:
        stream = fresh()
        t = time.perf_counter()
        for i, batch in enumerate(stream):
            apply(i + 1, batch)
        finish()
        return time.perf_counter() - t

    timings: dict[str, list[float]] = {}
    for rep in range(3):
        core = RowStore()
        timings.setdefault("core", []).append(run(lambda _i, b: core.apply(b)))
        store = ColumnStore(BIG)
        timings.setdefault("store", []).append(run(lambda i, b: store.apply(BatchId(1, i), b)))
        rows: dict[tuple[int, int], Row] = {}
        timings.setdefault("per_row", []).append(run(lambda _i, b: _per_row_apply(rows, b)))
        d = tmp / f"apply-train-{rep}"
        ds = DurableStore.open(d, BIG)

        def durable(i: int, b: RowBatch) -> None:
            ds.apply(BatchId(1, i), b)
            ds.sync()

        timings.setdefault("durable", []).append(run(durable))
        ds.close()
        shutil.rmtree(d)
    for row_key, row in core:  # same result, exact strengths: the comparison is like for like
        got = store.row(row_key)
        if got is None or not got.equals(row):
            raise AssertionError(f"store row {row_key} differs from the core's")
    t_core = min(timings["core"])
    entries = sum(b.num_entries for b in batches)
    out = []
    for label, key in (("core RowStore.apply (baseline)", "core"),
                       ("ColumnStore.apply", "store"),
                       ("DurableStore.apply + log fsync per batch, validated", "durable"),
                       ("per-row plan + merge (the previous algorithm, no store bookkeeping)", "per_row")):
        t = min(timings[key])
        out.append([label, f"{t:.3f}", f"{entries / t / 1e6:.2f}", f"{t / t_core:.2f}x"])
    print_table(f"apply: training stream ({len(encoded)} sentences of the bundled corpus, K={window}: "
           f"{len(batches)} batches, {sum(b.num_rows for b in batches):,} rows, {entries:,} entries; best of 3)",
           ["path", "s", "M entries/s", "time / core RowStore"], out)


def bench_log(tmp: Path, quick: bool) -> None:
    rng = np.random.default_rng(1)
    batch = _base_batch(rng, 16, 200)  # ~67 KB per record
    records = 200 if quick else 1000
    rows = []
    from giaannd.storage.engine.update_log import UpdateLog, encode_batch_payload

    record_bytes = 40 + sum(len(p) for p in encode_batch_payload(BatchId(1, 1), batch))
    for label, every in (("group commit, fsync / 32 records", 32), ("group commit, fsync / 4 records", 4),
                         ("fsync every record", 1)):
        d = tmp / f"log{every}"
        d.mkdir()
        log = UpdateLog(d, 1)
        t = time.perf_counter()
        for i in range(1, records + 1):
            log.append_batch(BatchId(1, i), batch)
            if i % every == 0:
                log.sync()
        log.sync()
        el = time.perf_counter() - t
        log.close()
        rows.append([label, f"{records / el:,.0f}", f"{records * record_bytes / el / 1e6:.0f}"])
    payload = os.urandom(record_bytes)
    fd = os.open(tmp / "raw", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    t = time.perf_counter()
    for _ in range(records):
        os.write(fd, payload)
    el = time.perf_counter() - t
    os.close(fd)
    rows.append(["raw os.write, same bytes, no fsync (baseline)", f"{records / el:,.0f}",
                 f"{records * record_bytes / el / 1e6:.0f}"])
    print_table(f"update log ({record_bytes / 1e3:.0f} KB records)", ["mode", "records/s", "MB/s"], rows)
    bench_append_after_sync(tmp, 500 if quick else 3000)


def bench_append_after_sync(tmp: Path, records: int, as_json: bool = False) -> None:
    """Latency of an append right after a sync, small records (one 40-entry row): the store's log,
    which drops what each sync made durable from the page cache, against a log that keeps it (the
    baseline, same run). An append writes into the segment's partial last page; if a drop took
    that page, the append reads it back from the disk first (update_log.py, ``drop_synced``)."""
    from giaannd.storage.engine.update_log import UpdateLog

    n = 40
    batch = RowBatch.from_entries(np.full(n, 5, np.uint64), np.full(n, 7, np.uint64), np.zeros(n, np.uint8),
                                  np.arange(1, n + 1, dtype=np.uint64), np.arange(n, dtype=np.uint64),
                                  np.ones(n, np.float32))
    rows, p50 = [], {}
    for label, drop in (("keeps its pages (baseline)", False), ("drops what it synced (the store's)", True)):
        d = tmp / f"after-sync-{int(drop)}"
        d.mkdir()
        log = UpdateLog(d, 1, drop_synced=drop)
        took = np.empty(records)
        for i in range(records):
            t = time.perf_counter()
            log.append_batch(BatchId(1, i + 1), batch)
            took[i] = time.perf_counter() - t
            log.sync()
        log.close()
        rows.append([label, f"{np.percentile(took, 50) * 1e6:.1f}", f"{np.percentile(took, 99) * 1e6:.1f}"])
        p50[drop] = float(np.percentile(took, 50))
        if as_json:
            for q in (50, 99):
                emit_figure(f"update log append right after a sync, p{q} µs, {label}", np.percentile(took, q) * 1e6)
    if as_json:
        emit_figure("update log append right after a sync, p50, the store's log / baseline", p50[True] / p50[False])
        return
    print_table(f"update log: an append right after a sync ({records} one-row records)",
                ["log", "p50 µs", "p99 µs"], rows)


def bench_restart(tmp: Path, rows_mb: int) -> None:
    rng = np.random.default_rng(2)
    d = tmp / "restart"
    ds = DurableStore.open(d, BIG)
    entries_per_row = 5000
    per_batch_rows = 200
    total_entries = rows_mb * (1 << 20) // ENTRY_BYTES
    nbatches = max(1, total_entries // (entries_per_row * per_batch_rows))
    for i in range(nbatches):
        ds.apply(BatchId(1, i + 1), _base_batch(rng, per_batch_rows, entries_per_row), validate=False)
    ds.sync()
    gb = ds.store.usage().num_entries * ENTRY_BYTES / 1e9
    ds.close()
    t = time.perf_counter()
    replayed = DurableStore.open(d, BIG)
    t_replay = time.perf_counter() - t
    t = time.perf_counter()
    replayed.snapshot()
    t_snap = time.perf_counter() - t
    replayed.close()
    t = time.perf_counter()
    DurableStore.open(d, BIG).close()
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    DurableStore.open(d, BIG, verify_rows=False).close()
    t_load_nv = time.perf_counter() - t
    size = sum(p.stat().st_size for p in d.iterdir()) / 1e9
    buf = np.empty(int(gb * 1e9), np.uint8)
    t_memcpy = _best(buf.copy, 2)
    del buf
    rows = [
        ["log replay (open with no snapshot)", f"{t_replay:.2f}", f"{t_replay / gb:.2f}"],
        ["snapshot write (fsync + rename)", f"{t_snap:.2f}", f"{t_snap / gb:.2f}"],
        ["open = snapshot load + row checks", f"{t_load:.2f}", f"{t_load / gb:.2f}"],
        ["open = snapshot load, checksum only", f"{t_load_nv:.2f}", f"{t_load_nv / gb:.2f}"],
        ["memcpy of the same bytes (baseline)", f"{t_memcpy:.2f}", f"{t_memcpy / gb:.2f}"],
    ]
    print_table(f"restart ({gb:.2f} GB of rows, {size:.2f} GB on disk)", ["step", "s", "s/GB"], rows)
    shutil.rmtree(d)


def bench_reads(quick: bool) -> None:
    rng = np.random.default_rng(3)
    base = _base_batch(rng, 2000, 2000)
    s = ColumnStore(BIG)
    s.apply(BatchId(1, 1), base, validate=False)
    rows = []
    for nrows in (1, 64, 1000):
        pick = rng.choice(base.num_rows, nrows, replace=False)
        rc, rf = base.row_column[pick], base.row_feature[pick]
        got = s.read_rows(rc, rf)
        nbytes = got.nbytes
        t_read = _best(lambda: s.read_rows(rc, rf), 5)
        src = np.empty(nbytes, np.uint8)
        t_copy = _best(lambda: src.copy(), 5)
        rows.append([f"{nrows}", f"{nbytes / 1e6:.1f}", f"{t_read * 1e6:.0f}", f"{nbytes / t_read / 1e9:.2f}",
                     f"{nbytes / t_copy / 1e9:.2f}", f"{t_read / t_copy:.1f}x"])
    print_table("row reads: read_rows (gather + copy) vs memcpy of the same bytes",
           ["rows", "MB", "read µs", "read GB/s", "memcpy GB/s", "read/memcpy time"], rows)


def bench_placement() -> None:
    rng = np.random.default_rng(4)
    rows = []
    for members in (3, 10, 50):
        p = Placement(tuple(Member(f"n{i}") for i in range(members)), 3)
        pw = Placement(tuple(Member(f"n{i}", float(i + 1)) for i in range(members)), 3, strategy="weighted")
        keys = rng.integers(0, 2**64, 10_000, dtype=np.uint64)
        t = _best(lambda: p.owner_indices(keys), 5)
        tw = _best(lambda: pw.owner_indices(keys), 5)
        t1 = _best(lambda: [p.owners(int(k)) for k in keys[:1000]], 1) / 1000
        rows.append([f"{members}", f"{t / len(keys) * 1e9:.0f}", f"{tw / len(keys) * 1e9:.0f}", f"{t1 * 1e9:.0f}"])
    print_table("placement: ns per key (10,000 keys per call, R=3)",
           ["members", "hash, vectorised", "weighted, vectorised", "scalar owners() loop"], rows)


def bench_service(tmp: Path, quick: bool) -> None:
    """Section 6 (module docstring). Lives in its own coroutine so the rest stays synchronous."""
    import asyncio

    asyncio.run(_bench_service(tmp, quick))


async def _bench_service(tmp: Path, quick: bool) -> None:
    import asyncio

    from giaannd.client.storage_client import StorageClient
    from giaannd.cluster.view import ClusterView, StorageNode
    from peers.transport import Reply, connect
    from tools.cluster_harness import Cluster

    rng = np.random.default_rng(6)
    base = _base_batch(rng, 200 if quick else 2000, 500)
    # three storage nodes in this process (the daemon's runtime + storage role), R=3 of 3
    cluster = await Cluster(tmp / "service", 3, scheme="tcp", replicas=3, capacity_bytes=BIG,
                            request_timeout_s=10.0).start()
    services = list(cluster.services.values())
    topo = ClusterView(replicas=1)  # reads: all from s0
    topo.set_members([StorageNode("s0", cluster.addresses["s0"])])
    client = StorageClient(topo, cluster.client.transports)
    await client.write(base)
    # the raw baseline: a handler that answers with 7 buffers of the same sizes, no decode, no gather
    raw_t = cluster.transport("bench-raw")
    canned: list[np.ndarray] = []
    async def raw_handler(_incoming: object) -> Reply:
        return Reply(b"\x90", canned)
    raw_listener = await raw_t.listen("tcp://127.0.0.1:0", raw_handler)
    raw_conn = await connect(raw_t, raw_listener.address, timeout_s=5)
    reps = 20 if quick else 100

    async def timed(fn: Callable[[], object]) -> float:
        await fn()  # type: ignore[misc]
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                await fn()  # type: ignore[misc]
            best = min(best, (time.perf_counter() - t) / reps)
        return best

    rows = []
    for nrows in (1, 64, 1000):
        pick = rng.choice(base.num_rows, min(nrows, base.num_rows), replace=False)
        rc, rf = base.row_column[pick], base.row_feature[pick]
        got = await client.read_rows(rc, rf)
        canned[:] = [b.copy() for b in got.buffers()]
        keys = [rc, rf]
        t_svc = await timed(lambda: client.read_rows(rc, rf))
        t_raw = await timed(lambda: raw_conn.request(b"\x90", keys, timeout_s=10))
        mb = got.nbytes / 1e6
        rows.append([f"{len(pick)}", f"{mb:.2f}", f"{t_svc * 1e6:.0f}", f"{mb / t_svc / 1e3:.2f}",
                     f"{t_raw * 1e6:.0f}", f"{mb / t_raw / 1e3:.2f}", f"{t_svc / t_raw:.2f}x"])
    print_table("storage service: row read over tcp (in-process) vs a raw transport request of the same bytes",
           ["rows", "MB", "service µs", "service GB/s", "raw µs", "raw GB/s", "service/raw time"], rows)

    # writes: R=3, W=2 over three services vs one local DurableStore apply + fsync
    client3 = cluster.client
    local = DurableStore.open(tmp / "local", BIG)
    wrows = []
    seq = iter(range(1, 10**9))  # one writer for the local store: a repeated id would be skipped
    for nrows, per in ((1, 100), (64, 100), (1000, 100)):
        batches = [_base_batch(rng, nrows, per) for _ in range(reps // 4 + 2)]
        it = iter(batches)

        async def quorum_write() -> None:
            await client3.write(next(it))

        def local_apply() -> None:
            local.apply(BatchId(9, next(seq)), next(it2), validate=True)
            local.sync()

        await quorum_write()
        t0 = time.perf_counter()
        n = len(batches) - 1
        for _ in range(n):
            await quorum_write()
        t_q = (time.perf_counter() - t0) / n
        await client3.flush()
        it2 = iter(batches)
        t0 = time.perf_counter()
        for _ in range(n):
            local_apply()
        t_l = (time.perf_counter() - t0) / n
        mb = batches[0].nbytes / 1e6
        wrows.append([f"{nrows}x{per}", f"{mb:.2f}", f"{t_q * 1e3:.2f}", f"{t_l * 1e3:.2f}",
                      f"{t_q / (3 * t_l):.2f}x"])
    # concurrency: many writes in flight share fsyncs (group commit)
    batches = [_base_batch(rng, 16, 50) for _ in range(200 if not quick else 50)]
    fs0 = sum(s.counters.fsync_batches for s in services)
    ap0 = sum(s.counters.applies for s in services)
    t0 = time.perf_counter()
    await asyncio.gather(*(client3.write(b) for b in batches))
    await client3.flush()
    t_c = time.perf_counter() - t0
    fs = sum(s.counters.fsync_batches for s in services) - fs0
    ap = sum(s.counters.applies for s in services) - ap0
    wrows.append([f"{len(batches)} concurrent 16x50", f"{batches[0].nbytes / 1e6:.2f}",
                  f"{t_c / len(batches) * 1e3:.2f} (amortised)", "-", f"{ap} applies / {fs} fsyncs"])
    print_table("storage service: quorum write R=3 W=2 over tcp, all three services in this process (one "
           "core does all three applies) vs one local DurableStore apply + fsync",
           ["batch rows x entries", "MB", "quorum write ms", "local apply+fsync ms",
            "quorum / (3 x local)"], wrows)
    local.close()
    await client.close()
    await raw_conn.close()
    await raw_listener.close()
    await cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-mb", type=int, default=256, help="size of the restart benchmark's rows (default 256)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--service-only", action="store_true", help="only section 6 (storage service)")
    ap.add_argument("--append-after-sync", action="store_true",
                    help="only section 2's append right after a sync (with --json: its figures as JSON)")
    ap.add_argument("--json", action="store_true",
                    help="with --append-after-sync, one JSON object per figure (the other sections print tables only)")
    ap.add_argument("--apply-only", action="store_true", help="only section 1 (apply)")
    ap.add_argument("--sentences", type=int, default=4000,
                    help="bundled-corpus sentences for the training-stream apply table (default 4000)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="giaannd-bench-", dir=args.dir))
    try:
        if args.append_after_sync:
            bench_append_after_sync(tmp, 500 if args.quick else 3000, args.json)
            return
        if args.service_only:
            bench_service(tmp, args.quick)
            return
        bench_apply(args.quick)
        bench_apply_training(tmp, 1000 if args.quick else args.sentences, 256)
        if args.apply_only:
            return
        bench_log(tmp, args.quick)
        bench_restart(tmp, 32 if args.quick else args.rows_mb)
        bench_reads(args.quick)
        bench_placement()
        bench_service(tmp, args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
