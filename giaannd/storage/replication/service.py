"""The storage service: the durable column store served on the peer transport (ARCHITECTURE §8).

Asyncio glue only. What a request does is decided by the sans-IO core, ``requests.StorageRequests``
(decode → limits → canonical RowBatch → ownership → store; typed error replies). This module owns
what needs a clock or threads: the group commit (``group_commit.py``: an ``ApplyBatch`` is
acknowledged only once the update log is synced, one fsync shared by every apply waiting), hint logs
synced in a worker thread and delivered to their targets when they come back (``hints.py``), the
snapshot timer, metrics, and the lifecycle. A full disk (disk_full.py) makes the node refuse writes
and keep serving reads until space returns; a failed snapshot is retried with backoff, never fatal.


One way to build it: from the ``storage`` config section and the node runtime
(``giaannd.runtime.node.NodeRuntime``), as ``ComputeService`` is built from ``compute``. The runtime
owns the node's identity, transports, listeners and cluster view; the service serves on them
(the storage role registers ``handle`` with the runtime, giaannd/services/roles.py) and sends hints
over them, so a node has one data plane and one view of the cluster.

Lifecycle: ``start(ctx)`` recovers the store, hints and vocabulary, registers metrics and starts the
background loops (snapshot timer, hint retry). ``stop(graceful=True)`` refuses new writes, lets
in-flight applies reach their durable ack, snapshots and closes (a final snapshot that fails is
raised after everything is closed, so the daemon's exit status says so); ``stop(graceful=False)``
closes at once (everything acknowledged is already in the synced log). Protocol and replication:
docs/replication.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from giaannd import protocol as p
from giaannd.client.registers import RegisterClient
from giaannd.client.storage_client import StorageClient
from giaannd.cluster.view import ClusterView, ViewChange
from giaannd.cpus import usable_cpus
from giaannd.metrics import SNAPSHOT_BUCKETS_S, STORAGE_LATENCY_BUCKETS_S, STORAGE_WRITE_BUCKETS_S
from giaannd.storage.engine.column_store import ColumnStore, StoreUsage
from giaannd.storage.engine.disk_usage import DiskUsage, disk_usage
from giaannd.storage.engine.recovery import DurableStore, fix_mmap_threshold, return_freed_heap
from giaannd.storage.engine.register_store import RegisterStore
from giaannd.storage.engine.snapshot import WriteMode
from giaannd.storage.engine.sorted_keys import Keys, TailSource, extended_tail, merge_runs, sorted_rows
from giaannd.storage.engine.vocab_store import VocabStore
from giaannd.storage.replication.background_fold import BackgroundFold, fold_scales, thread_result
from giaannd.storage.replication.disk_full import DiskWatch
from giaannd.storage.replication.group_commit import GroupCommit
from giaannd.storage.replication.hint_delivery import HintDelivery
from giaannd.storage.replication.hints import DEFAULT_MAX_HINT_BYTES, HintStore
from giaannd.storage.replication.requests import (
    Answer,
    Step,
    StorageCounters,
    StorageRequests,
    WaitDurable,
    WaitHintSynced,
    WaitRegistersSynced,
    WaitVocabSynced,
)
from giaannd.storage.replication.snapshot_timer import snapshot_due, snapshot_waits
from peers.transport import Incoming, Reply

if TYPE_CHECKING:
    from giaannd.cluster.ring import Ring
    from giaannd.config import StorageConfig
    from giaannd.runtime.node import NodeRuntime
    from giaannd.service import ServiceContext

__all__ = ["DISK_COUNTERS", "STORAGE_COUNTERS", "StorageCounters", "StorageService"]

log = logging.getLogger(__name__)

STORE_DIR: Final = "store"
HINTS_DIR: Final = "hints"
VOCAB_DIR: Final = "vocab"
REGISTERS_DIR: Final = "registers"

#: ``StorageCounters`` field (requests.py counts them) -> (metric, HELP).
STORAGE_COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "reads": ("giaannd_storage_reads_total",
              "Read requests served: ReadRows, and each ScanRows or ColumnInfo page."),
    "reads_redirected": ("giaannd_storage_reads_redirected_total",
                         "ReadRows answered Unavailable at once because a fold of the delta runs was moving "
                         "this node's rows and the caller had another replica to read them from (busy_ok)."),
    "rows_read": ("giaannd_storage_rows_read_total", "Rows returned by ReadRows and ScanRows requests."),
    "bytes_read": ("giaannd_storage_read_bytes_total",
                   "Bytes of the row batches returned by ReadRows and ScanRows (array buffers)."),
    "applies": ("giaannd_storage_applies_total",
                "Batches applied to this node's store (counted at apply, before their fsync)."),
    "applies_deferred": ("giaannd_storage_applies_deferred_total",
                         "Of the batches applied, those logged and acknowledged while a fold of the delta runs "
                         "moved the rows, and applied to them when it ended."),
    "applies_duplicate": ("giaannd_storage_applies_duplicate_total",
                          "ApplyBatch requests for a batch already applied here (a retry: acknowledged, "
                          "not reapplied)."),
    "bytes_applied": ("giaannd_storage_applied_bytes_total",
                      "Bytes of the row batches applied to this node's store (array buffers)."),
    "hints_received": ("giaannd_storage_hints_received_total",
                       "Batches held here as hints for an owner that could not take them."),
    "hints_delivered": ("giaannd_storage_hints_delivered_total",
                        "Hinted batches delivered to their owner once it was back."),
    "vocab_added": ("giaannd_storage_vocab_entries_added_total",
                    "Vocabulary entries (id -> string) new to this node, from PutVocab requests."),
    "register_changes": ("giaannd_storage_register_changes_total",
                         "Register promises and accepts written here (RegisterPrepare / RegisterAccept)."),
}
#: Counts of the disk-full state (disk_full.py counts them through ``on_count``) -> (metric, HELP).
DISK_COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "snapshot_failures": ("giaannd_storage_snapshot_failures_total",
                          "Snapshots that failed (disk full or another write error); each is retried "
                          "after a capped, jittered backoff."),
    "disk_full_refusals": ("giaannd_storage_disk_full_refusals_total",
                           "Writes (batches, hints, vocabulary) refused because the disk is full."),
}
#: Requests whose latency is observed (``handle``) -> the ``_prom`` key of their histogram.
_TIMED: Final[Mapping[type, str]] = {p.ReadRows: "read_seconds", p.ApplyBatch: "apply_seconds"}


def _reply(msg: p.Reply, bulk: Sequence[Any] = ()) -> Reply:
    return Reply(p.encode(msg), list(bulk))


class StorageService:
    """Serve one ``DurableStore`` (module docstring).

    Args:
        settings: the ``storage`` config section (capacity, group commit, snapshot interval,
            hint retry and delivery ramp).
        data_dir: holds ``store/`` (update log + snapshots), ``hints/`` and ``vocab/``.
        runtime: the node runtime; ``start`` takes the node's name, identity, transports and
            cluster view from it (ownership checks, hint delivery) and reports peers it could
            not reach to it (``report_unreachable``: suspicion through membership).
    """

    name = "storage"

    def __init__(self, settings: StorageConfig, data_dir: Path | str, runtime: NodeRuntime) -> None:
        self.settings = settings
        self.data_dir = Path(data_dir)
        self.capacity_bytes = settings.capacity_bytes
        self.runtime = runtime
        #: the node's name and cluster view, from the runtime at ``start``
        self.node_name = ""
        self.topology: ClusterView | None = None
        self.delivery: HintDelivery | None = None
        self.core: StorageRequests | None = None
        self.store: DurableStore | None = None
        self.hints: HintStore | None = None
        self.vocab: VocabStore | None = None
        self.registers: RegisterStore | None = None
        self._commit: GroupCommit | None = None
        #: the store's folds, in a worker thread (background_fold.py): made at ``start``
        self.folds: BackgroundFold | None = None
        #: held by every write to the store, and by a snapshot only while it freezes the store
        self._snapshot_lock = asyncio.Lock()
        #: held for a whole snapshot: one at a time
        self._snapshot_running = asyncio.Lock()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        #: when ``start`` attached hint delivery (``removed_for_good`` waits a retry interval after it)
        self._delivery_since: float | None = None
        self._client: StorageClient | None = None
        self._delivering: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: the key order's work in worker threads under way, by kind ("merge": ``merge_key_order``,
        #: "tail": ``take_keys_in``)
        self._key_tasks: dict[str, asyncio.Task[bool]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # (the one the service runs on: ``_recover``)
        self._prom: dict[str, Any] = {}
        #: disk-full state, snapshot retries, rate-limited write errors (limits from ``settings``)
        self.disk = DiskWatch(self.data_dir / STORE_DIR, settings)

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def counters(self) -> StorageCounters:
        return self.core.counters if self.core is not None else StorageCounters()

    async def start(self, ctx: ServiceContext) -> None:
        """Recover the store, hints and vocabulary; attach hint delivery to the runtime's view;
        register metrics; start the snapshot and hint-retry loops.

        Raises:
            RuntimeError: the runtime has not started (no identity yet).
            CorruptLogError, CorruptSnapshotError: damaged files (start-up stops).
        """
        rt = self.runtime
        if rt.identity is None:
            raise RuntimeError("the node runtime starts before the storage service")
        self.node_name, self.topology = rt.node_name, rt.topology
        await self._recover()
        self._attach_delivery(rt.topology)
        self._delivery_since = time.monotonic()
        rt.ring_listeners.append(self._on_ring_change)
        self._register_metrics(ctx)
        ctx.spawn(self.run_snapshots(ctx.stopping), "snapshots")
        ctx.spawn(self.run_hint_retry(ctx.stopping), "hint-retry")
        ctx.spawn(self.sort_key_order(), "key-order")
        if self.settings.heap_trim_interval_s > 0:
            ctx.spawn(self.run_heap_trim(ctx.stopping), "heap-trim")

    async def _recover(self) -> None:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        if s.malloc_mmap_threshold_bytes:  # before the replay's temporaries (recovery.py says why)
            fix_mmap_threshold(s.malloc_mmap_threshold_bytes)
        self.store = await asyncio.to_thread(DurableStore.open, self.data_dir / STORE_DIR, s.capacity_bytes,
                                             map_snapshot=s.snapshot_load_map,
                                             replay_threads=s.replay_threads or usable_cpus(),
                                             read_ahead_bytes=s.restart_read_ahead_bytes)
        # Whatever start-up left (the rows are numpy arrays now, but config, rings, hints...) leaves
        # the cyclic GC's generations, so full collections later do not walk it again.
        gc.freeze()
        # from now on a commit leaves a due fold to a worker thread, off the event loop (the replay
        # above folded inline, in the thread that opened the store)
        self.store.deferred.max_bytes = s.fold_defer_bytes  # writes during a fold (deferred_applies.py)
        scales = fold_scales(self.node_name, s.fold_jitter)
        columns = self.store.store
        columns.fold_scale = next(scales)

        def next_fold_point() -> None:  # each fold's point its own (background_fold.py)
            columns.fold_scale = next(scales)

        self.folds = BackgroundFold(self.store, self._snapshot_lock, next_fold_point)
        columns.on_fold_due = self.folds.due
        columns.merge_key_order_apart(self._key_merge_due)
        columns.take_keys_in_apart(self._keys_behind)
        self.hints = await asyncio.to_thread(HintStore.open, self.data_dir / HINTS_DIR, DEFAULT_MAX_HINT_BYTES)
        store = self.store
        self._commit = GroupCommit(self._sync_log, store.log.durable_seq, s.fsync_group_commit_ms / 1000.0,
                                   appended=lambda: store.log.last_seq)
        self.core = StorageRequests(self.store, self.hints, self.node_name, lambda: self.topology, self._on_count,
                                    disk=self._disk_usage, read_chunk_bytes=s.read_chunk_bytes,
                                    removed_for_good=self.removed_for_good)
        self.vocab = await asyncio.to_thread(VocabStore.open, self.data_dir / VOCAB_DIR)
        self.core.vocab = self.vocab
        self.core.guard = self.disk
        self.disk.on_count = self._on_count
        self.registers = await asyncio.to_thread(
            RegisterStore.open, self.data_dir / REGISTERS_DIR, s.register_ram_bytes,
            spill_bytes=s.register_spill_bytes, max_disk_bytes=s.register_disk_bytes)
        self.core.registers = self.registers
        rec = self.store.recovery
        log.info("storage recovered dir=%s snapshot_seq=%d replayed=%d torn_bytes=%d hints=%d snapshot_bytes=%d "
                 "snapshot_load_s=%.3f snapshot_load_cpu_s=%.3f log_bytes=%d replay_s=%.3f replay_cpu_s=%.3f",
                 self.data_dir, rec.snapshot_seq, rec.records_replayed, rec.torn_tail_bytes, self.hints.held,
                 rec.snapshot_bytes, rec.snapshot_load_s, rec.snapshot_load_cpu_s, rec.log_bytes, rec.replay_s,
                 rec.replay_cpu_s)

    def _attach_delivery(self, topology: ClusterView) -> None:
        """The client hint delivery sends with, and the topology subscription that drives it."""
        assert self.hints is not None
        rt = self.runtime
        self._client = StorageClient(topology, rt.transports, identity=rt.identity,
                                     on_unreachable=rt.report_unreachable)
        self.delivery = HintDelivery(self.hints, self._client, topology, ramp_s=self.settings.ramp_up_s,
                                     start_bytes_per_s=self.settings.hint_ramp_start_bytes_per_s,
                                     on_delivered=self._count_delivered)
        topology.on_change(self._on_topology)

    def _count_delivered(self) -> None:
        if self.core is not None:
            self.core.count("hints_delivered")

    def _register_metrics(self, ctx: ServiceContext) -> None:
        m = ctx.metrics
        for key, (name, doc) in {**STORAGE_COUNTERS, **DISK_COUNTERS}.items():
            self._prom[key] = m.counter(name, doc)
        self._prom["errors"] = m.counter(
            "giaannd_storage_errors_total",
            "Error replies to storage requests, by reply type (NotOwner, StoreFull, Unavailable...).",
            ["error"])
        self._prom["read_seconds"] = m.histogram(
            "giaannd_storage_read_duration_seconds",
            "ReadRows requests, from decoded to reply ready (or cancelled).", buckets=STORAGE_LATENCY_BUCKETS_S)
        self._prom["apply_seconds"] = m.histogram(
            "giaannd_storage_apply_duration_seconds",
            "ApplyBatch requests (hinted ones too), from decoded to durable acknowledgement or error reply "
            "(group-commit wait and fsync included).", buckets=STORAGE_WRITE_BUCKETS_S)
        self._prom["snapshot_seconds"] = m.histogram(
            "giaannd_storage_snapshot_duration_seconds",
            "Snapshots written (timer and final), from the freeze to the old files' removal; failed ones "
            "are not counted here (giaannd_storage_snapshot_failures_total).", buckets=SNAPSHOT_BUCKETS_S)
        m.gauge("giaannd_storage_snapshot_running",
                "1 while a snapshot is being written (applies go on beside it), else 0.").set_function(
            lambda: float(self._snapshot_running.locked()))
        self._prom["heap_trim_seconds"] = m.histogram(
            "giaannd_storage_heap_trim_duration_seconds",
            "Returns of the C heap's free pages to the kernel (storage.heap-trim-interval-s).",
            buckets=STORAGE_LATENCY_BUCKETS_S)
        self._prom["fsync_seconds"] = m.histogram(
            "giaannd_storage_fsync_duration_seconds",
            "Update-log fsyncs: one per group commit, whatever the batches it covers (failed ones too).",
            buckets=STORAGE_WRITE_BUCKETS_S)
        fold_seconds = m.histogram(
            "giaannd_storage_fold_duration_seconds",
            "Folds of the delta runs into the base (and tier merges too large for a commit), in a worker "
            "thread: the time the rows were held, the writes logged meanwhile applied; reads went to other "
            "replicas and writes were logged and acknowledged.", buckets=SNAPSHOT_BUCKETS_S)
        if self.folds is not None:
            self.folds.observe = fold_seconds.observe
        m.gauge("giaannd_storage_fold_running",
                "1 while a fold (or a large tier merge) holds the rows, else 0.").set_function(
            lambda: float(self.folds is not None and self.folds.running))
        m.gauge("giaannd_storage_fold_held_write_bytes",
                "Bytes of batches logged and acknowledged during the fold under way, not applied to the rows "
                "yet (storage.fold-defer-bytes bounds it).").set_function(
            lambda: float(self.store.deferred.held_bytes if self.store is not None else 0))
        m.gauge("giaannd_storage_log_since_snapshot_bytes",
                "Bytes of update-log records after the newest snapshot: what a restart would replay now "
                "(storage.snapshot-min-log-ratio compares it with used_bytes).").set_function(
            lambda: float(self.store.logged_since_snapshot if self.store is not None else 0))
        m.gauge("giaannd_storage_snapshot_held_disk_bytes",
                "Disk a deleted snapshot file still takes because the store's rows are mapped from it "
                "(storage.snapshot-load-map) until a fold copies them; counted in the node's disk use.").set_function(
            lambda: float(self.store.held_disk_bytes() if self.store is not None else 0))
        m.gauge("giaannd_storage_used_bytes",
                "Bytes the column store accounts for now (rows, entries, index).").set_function(
            lambda: float(self.usage().used_bytes))
        m.gauge("giaannd_storage_capacity_bytes",
                "Configured store capacity (storage.capacity-bytes); writes past it get StoreFull.").set_function(
            lambda: float(self.capacity_bytes))
        m.gauge("giaannd_storage_hints_held", "Hinted batches held here for other nodes, not yet delivered.") \
            .set_function(lambda: float(self.hints.held if self.hints is not None else 0))
        m.gauge("giaannd_storage_vocab_entries", "Vocabulary entries (id -> string) this node holds now.") \
            .set_function(lambda: float(len(self.vocab) if self.vocab is not None else 0))
        m.gauge("giaannd_storage_disk_full", "1 while writes are refused because the disk is full, else 0.") \
            .set_function(lambda: float(self.disk.full))
        m.gauge("giaannd_storage_full",
                "1 while writes are refused because the store is at capacity or the disk is full, else 0.") \
            .set_function(lambda: float(self.is_full))
        m.gauge("giaannd_storage_torn_tail_bytes",
                "Bytes recovery cut off a torn update-log tail at this start (0: the log ended cleanly).") \
            .set_function(lambda: float(self.store.recovery.torn_tail_bytes if self.store is not None else 0))
        for name, doc, (load, replay) in (
                ("giaannd_storage_recovery_duration_seconds",
                 "Wall seconds this start's recovery took, by phase: reading the snapshot (snapshot_load) and "
                 "replaying the update log after it (log_replay).", ("snapshot_load_s", "replay_s")),
                ("giaannd_storage_recovery_cpu_seconds",
                 "CPU seconds (user and system) of the thread that ran this start's recovery, by phase "
                 "(snapshot_load, log_replay): against the wall seconds, the time spent waiting for the disk "
                 "or for a busy core.", ("snapshot_load_cpu_s", "replay_cpu_s")),
                ("giaannd_storage_recovery_bytes",
                 "Bytes this start's recovery read, by phase: the snapshot file (snapshot_load) and the "
                 "update-log segments replayed after it (log_replay).", ("snapshot_bytes", "log_bytes"))):
            gauge = m.gauge(name, doc, ["phase"])
            for phase, field in (("snapshot_load", load), ("log_replay", replay)):
                gauge.labels(phase=phase).set_function(self._recovery_figure(field))

    def _recovery_figure(self, field: str) -> Callable[[], float]:
        """A gauge's reading of this start's ``RecoveryReport.<field>`` (0 before the store opens)."""
        return lambda: float(getattr(self.store.recovery, field)) if self.store is not None else 0.0

    def _sync_log(self) -> int:
        """``DurableStore.sync``, timed (GroupCommit runs it in a worker thread: one observation
        per group commit, not per batch)."""
        assert self.store is not None
        started = time.perf_counter()
        try:
            return self.store.sync()
        finally:
            if (hist := self._prom.get("fsync_seconds")) is not None:
                hist.observe(time.perf_counter() - started)

    async def stop(self, graceful: bool) -> None:
        """Graceful: refuse new applies (``Unavailable``: writers go to other replicas or hint),
        let in-flight applies reach their durable ack, then snapshot and close.
        Not graceful: close everything now (every acknowledged batch is already in the synced log)."""
        self._stopping = True
        with contextlib.suppress(ValueError):  # (not there when start did not get that far)
            self.runtime.ring_listeners.remove(self._on_ring_change)
        if self.core is not None:
            self.core.refuse_writes = True
        for task in list(self._tasks):
            task.cancel()
        if self.folds is not None:  # a fold under way ends first: nothing below sees its runs mid-move
            await self.folds.close()
        if graceful:
            await self._idle.wait()
            if self._commit is not None:
                await self._commit.drain()
        self.disk.close()
        final_snapshot_error: OSError | None = None
        if graceful and self.store is not None:
            try:
                async with self._snapshot_running, self._snapshot_lock:  # no writes any more: one step
                    await asyncio.to_thread(self.store.snapshot)
            except OSError as exc:
                final_snapshot_error = exc
                log.error("final snapshot failed: %r; every acknowledged write is in the synced update log and "
                          "is replayed at the next start", exc)
        if self._client is not None:
            await self._client.close()
        if self.store is not None:
            self.store.close()
        if self.hints is not None:
            self.hints.close()
        if self.vocab is not None:
            self.vocab.close()
        if self.registers is not None:
            self.registers.close()
        if final_snapshot_error is not None:
            raise final_snapshot_error

    @property
    def register_client(self) -> RegisterClient | None:
        """The proposer side of the replicated registers over this node's client (None before
        ``start``): what the topology-operation lock uses (rebalance/cluster_lock.py)."""
        return None if self._client is None else self._client.registers

    @property
    def is_full(self) -> bool:
        """Writes are refused: the store is at capacity, or the disk is full."""
        return self.disk.full or (self.store is not None and self.store.store.usage().is_full)

    def usage(self) -> StoreUsage:
        """Capacity and use of the column store (``is_full`` adds a full disk to ``usage().is_full``)."""
        if self.store is None:
            return StoreUsage(0, self.capacity_bytes, 0, 0, 0)
        return self.store.store.usage()

    def health(self) -> Mapping[str, Any]:
        out: dict[str, Any] = {}
        if self.store is not None:
            u = self.store.store.usage()
            full = u.is_full or self.disk.full
            out.update(used_bytes=u.used_bytes, capacity_bytes=u.capacity_bytes, rows=u.num_rows,
                       is_full=full, full=full, torn_tail_bytes=self.store.recovery.torn_tail_bytes)
        out.update(self.disk.health())
        if self.hints is not None:
            out["hints_held"] = self.hints.held
        if self.vocab is not None:
            out["vocab_entries"] = len(self.vocab)
        if self.folds is not None and self.store is not None:
            out.update(folding=self.folds.running, folds=self.folds.folds,
                       fold_held_write_bytes=self.store.deferred.held_bytes)
        out["counters"] = asdict(self.counters)
        return out

    # -- background loops ---------------------------------------------------------------------------
    async def run_snapshots(self, stopping: asyncio.Event) -> None:
        """Snapshot about every ``storage.snapshot-interval-s`` (truncates the log, bounds replay
        time), with a phase and jitter from the node's name (snapshot_timer.py) so replicas do not
        snapshot together. A failed snapshot (a full disk) is retried after the backoff
        (disk_full.py), never fatal."""
        waits = snapshot_waits(self.node_name, self.settings.snapshot_interval_s, self.settings.snapshot_jitter)
        wait_s = next(waits)
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), wait_s)
                return
            wait_s = next(waits)
            if self.snapshot_due():  # (else too little logged since the last one: next turn)
                try:
                    await self.snapshot()
                except OSError as exc:
                    wait_s = self.disk.snapshot_failed(exc)

    def snapshot_due(self) -> bool:
        """Whether the timer's turn writes a snapshot now (snapshot_timer.snapshot_due)."""
        store = self.store
        if store is not None and store.log.sync_failed:  # writes wait for a snapshot (update_log.py)
            return True
        return store is not None and snapshot_due(store.log.last_seq > store.snapshot_seq, store.logged_since_snapshot,
                                                  store.store.used_bytes, self.settings.snapshot_min_log_ratio)

    async def snapshot(self) -> Path:
        """Write a snapshot now, without stopping writes: applies wait only while it begins (a
        log rotation and a frozen view, recovery.py), then go on while a worker thread writes it.

        Cancelled (the service stopping), it still waits for its thread — a thread cannot be
        stopped — and keeps ``_snapshot_running`` until then, so the final snapshot at ``stop``
        never runs beside it; a frozen view it got is released.

        Raises:
            OSError: it failed (its temporary is deleted; the log is intact).
        """
        assert self.store is not None
        store = self.store
        loop = asyncio.get_running_loop()
        async with self._snapshot_running:  # one at a time (the timer, the final one at stop)
            start = time.perf_counter()
            # the strengths' buffer, its pages touched while writes go on, not while they wait
            room = await loop.run_in_executor(None, store.freeze_room)
            # the log made durable so far, while writes go on: the rotation under the writes' lock
            # then syncs only what came since (else an fsync of up to a group-commit window's
            # appends, the most of what a lazy freeze waits for: docs/storage.md). A sync that
            # fails leaves the log waiting for this very snapshot (update_log.py): go on
            with contextlib.suppress(OSError):
                await loop.run_in_executor(None, self._sync_log)
            async with self._snapshot_lock:  # the writes' lock: held for the freeze only
                beginning = loop.run_in_executor(None, store.begin_snapshot, room)
                try:
                    job = await thread_result(beginning)
                except asyncio.CancelledError:
                    if not beginning.cancelled() and beginning.exception() is None:
                        beginning.result().view.release()
                    raise
            mode: WriteMode = ("direct" if self.settings.snapshot_direct_io
                               else "dropped" if self.settings.snapshot_drop_cache else "cached")
            writing = loop.run_in_executor(None, job.write, self.settings.snapshot_busy_share, mode)
            try:
                await thread_result(writing)
            except asyncio.CancelledError:
                if not writing.cancelled():
                    writing.exception()  # (retrieved: a failure here is the stop's to report, not the loop's)
                raise
            # (unlinks and a directory fsync: off the event loop; safe beside appends, recovery.py)
            path = await asyncio.to_thread(store.finish_snapshot, job)
        seconds = time.perf_counter() - start
        self.disk.snapshot_written(path, seconds)
        if "snapshot_seconds" in self._prom:
            self._prom["snapshot_seconds"].observe(seconds)
        return path

    async def run_hint_retry(self, stopping: asyncio.Event) -> None:
        """Retry undelivered hints every ``storage.hint-retry-s`` (a target that came back before
        its failure was noticed produces no "came up" event)."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.settings.hint_retry_s)
                return
            await self.deliver_hints()

    async def run_heap_trim(self, stopping: asyncio.Event) -> None:
        """Give the C heap's free pages back every ``storage.heap-trim-interval-s``, in a worker
        thread (its description says why and what it costs); timed in
        ``giaannd_storage_heap_trim_duration_seconds``. Before the trim, an idle node folds its
        delta runs into the base (``fold_when_idle``)."""
        seen = -1
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.settings.heap_trim_interval_s)
                return
            seen = await self.fold_when_idle(seen)
            start = time.perf_counter()
            if not await asyncio.to_thread(return_freed_heap):
                return  # a C library without malloc_trim: nothing to do, ever
            self._prom["heap_trim_seconds"].observe(time.perf_counter() - start)

    def _disk_usage(self) -> DiskUsage:
        """The data directory's ``disk_usage``, with the disk a deleted snapshot file still takes
        while the store's base is mapped from it (``DurableStore.held_disk_bytes``)."""
        return disk_usage(self.data_dir, held_bytes=self.store.held_disk_bytes() if self.store is not None else 0)

    async def sort_key_order(self) -> bool:
        """Sort every row key once after the start, in a worker thread (sorted_keys.py): a store
        opens with no key order, and the first scan page, column listing or stream after a start
        sorted every key on the event loop (0.66-0.76 s at 2.6·10^6 rows here; minutes at the
        10^9 rows a node is meant to hold, gossip's acks waiting). Returns whether the order sorted
        here was taken (not when a listing built it first, or a drop came meanwhile)."""
        store, folds = self.store, self.folds
        if store is None or folds is None:
            return False
        try:
            await folds.ready()  # (the key order is not touched while a drop or a listing holds the gate)
            source = store.store.key_order_source()
            if source is None:
                return False
            a, b, rows, drops = source
            main = await asyncio.to_thread(sorted_rows, a, b, rows)
            await folds.ready()  # no await from here to the install
            return store.store.install_key_order(main, rows, drops)
        except Exception as exc:  # (a failure leaves the sort to the first listing, as before)
            log.error("sorting the key order after the start failed (the first listing sorts it): %r", exc)
            return False

    def _key_merge_due(self) -> None:
        """A listing found a large merge of the key order due (sorted_keys.py): do it in a worker
        thread, unless one is under way."""
        self._key_task("merge", self.merge_key_order)

    def _keys_behind(self) -> None:
        """Rows created since the key order last took rows in wait (``KEYS_BEHIND_APART_ROWS`` of
        them at least): sort them in in a worker thread, unless that is under way."""
        self._key_task("tail", self.take_keys_in)

    def _key_task(self, kind: str, run: Callable[[], Coroutine[Any, Any, bool]]) -> None:
        """Start ``run()`` on the event loop unless a task of ``kind`` is under way. The caller may
        be a worker thread (a drop's or a repair's listing behind the fold gate, a commit of writes
        held during a fold): then this is handed to the event loop."""
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(self._key_task, kind, run)
            return
        task = self._key_tasks.get(kind)
        if task is None or task.done():
            task = self._key_tasks[kind] = self._spawn(run())
            task.add_done_callback(_log_key_task_failure)

    async def take_keys_in(self) -> bool:
        """Sort the rows created since the key order last took rows in, in a worker thread, and
        install them as its tail on the event loop (sorted_keys.py ``extended_tail``); returns
        whether they were taken (not when a listing took them in itself, or a merge or a drop
        replaced the runs meanwhile: the next commit asks again while enough rows wait)."""
        def extend(source: tuple[Any, Any, TailSource]) -> Keys:
            keys_a, keys_b, (tail, first, num_rows, _) = source
            return extended_tail(keys_a, keys_b, tail, first, num_rows)

        return await self._key_order_apart(lambda store: store.key_tail_source(), extend,
                                           lambda store, tail, source: store.install_key_tail(tail, source[2]))

    async def merge_key_order(self) -> bool:
        """The due merge of the key order's tail into its main run, in a worker thread (O(store):
        ~24 bytes per row), installed on the event loop; returns whether it was taken (not when a
        drop or a full listing changed the main run meanwhile)."""
        return await self._key_order_apart(
            lambda store: store.key_merge_source(),
            lambda source: merge_runs(source[0], source[1]),
            lambda store, merged, source: store.install_key_merge(merged, source))

    async def _key_order_apart(self, source: Callable[[ColumnStore], Any], work: Callable[[Any], Any],
                               install: Callable[[ColumnStore, Any, Any], bool]) -> bool:
        """``work(source(store))`` in a worker thread, then ``install`` of its result on the event
        loop; False when there is no store yet or ``source`` finds nothing to do. The source is
        taken and the result installed while no drop or listing holds the fold gate (they change
        the key order in a worker thread)."""
        store, folds = self.store, self.folds
        if store is None or folds is None:
            return False
        await folds.ready()
        taken = source(store.store)
        if taken is None:
            return False
        result = await asyncio.to_thread(work, taken)
        await folds.ready()  # no await from here to the install
        return install(store.store, result, taken)

    async def fold_when_idle(self, seen: int) -> int:
        """Fold the store's delta runs into its base when nothing was logged since the last call
        (``seen``: the log's last seq then; returns it now) and no snapshot is running (its frozen
        view holds the runs: the fold would copy them). A delta entry costs 16-32 B more than a base
        entry (its base position, the run's position index, the room of its buffers), 1.4-4.5 B per
        stored entry on a settled cluster node, which an idle node does not need (docs/storage.md
        "Known gaps", Live RSS). In a worker thread, like the folds applies make due
        (background_fold.py); it moves the base's entries once (in place when its buffers have
        room). (No await between the check and taking the writes' lock, which is free: a snapshot
        cannot begin in between.)"""
        if self.store is None or self.folds is None:
            return seen
        last = self.store.log.last_seq
        if last == seen and not self._snapshot_running.locked() and not self._snapshot_lock.locked():
            await self.folds.fold()
        return last

    def _on_topology(self, change: ViewChange) -> None:
        if self.hints is None or self._stopping:
            return
        if self.delivery is not None:  # pacing ramps (hint_delivery.py)
            for name in change.went_down:
                self.delivery.went_down(name)
            for name in change.came_up:
                self.delivery.came_up(name)
        for target in change.came_up & set(self.hints.targets()):
            self._spawn(self.deliver_hints_to(target))

    def _on_ring_change(self, ring: Ring) -> None:
        """A committed ring change: drop the hints held for members it marks removed (below)."""
        if not self._stopping:
            self.drop_hints_for_removed(ring)

    def drop_hints_for_removed(self, ring: Ring | None = None) -> int:
        """Forget the hints held for members ``ring`` (default: the node's) marks removed and that
        are not live: the cutover that removed them dropped those held by the nodes it reached,
        and nobody delivers them (hint_delivery.py, "A target removed for good"). Returns how many."""
        if self.delivery is None:
            return 0
        return self.delivery.drop_removed(lambda name: self.removed_for_good(name, ring))

    def removed_for_good(self, target: str, ring: Ring | None = None) -> bool:
        """Whether the hints for ``target`` are dropped here (``drop_hints_for_removed``): ``ring``
        (default: the node's) marks it removed and it is not live. Never before delivery is
        attached, nor within a hint retry interval of that (hint_delivery.py: "not while the
        service starts"). The request core asks it too, to answer such a hint held without writing it
        (requests.py, ``hold_hint``)."""
        if self.delivery is None or self.topology is None or self._delivery_since is None:
            return False
        if time.monotonic() - self._delivery_since < self.settings.hint_retry_s:
            # (right after a start, membership may not have heard yet of a removed member that
            # still runs as a standby: it would look down, and its hints must reach it)
            return False
        entry = (ring if ring is not None else self.runtime.ring).get(target)
        return entry is not None and entry.state == "removed" and not self.topology.is_live(target)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def deliver_hints(self) -> int:
        """Try every target that is live now, after dropping the hints of targets removed for good
        (``drop_hints_for_removed``: the periodic round also does it after a restart, and for a
        hint that came after the ring change); returns hints delivered."""
        if self.hints is None or self.topology is None:
            return 0
        self.drop_hints_for_removed()
        done = 0
        for target in self.hints.targets():
            if self.topology.is_live(target):
                done += await self.deliver_hints_to(target)
        return done

    async def deliver_hints_to(self, target: str) -> int:
        """Deliver the target's hints in order, paced while it ramps up, re-split by the current
        placement if it no longer owns them; stop at the first failure (retried later).
        hint_delivery.py has the rules."""
        if self.delivery is None or target in self._delivering:
            return 0
        self._delivering.add(target)
        done = 0
        try:
            done = await self.delivery.deliver_to(target)
        finally:
            self._delivering.discard(target)
        if done:
            log.info("hints delivered target=%s count=%d", target, done)
        return done

    # -- request handling ---------------------------------------------------------------------------
    async def handle(self, incoming: Incoming) -> Reply:
        """The transport handler: the core decides (requests.py), this waits for durability."""
        core = self.core
        if core is None:
            return _reply(p.Unavailable("storage service is not open"))
        msg = core.parse(incoming.payload)
        if isinstance(msg, Answer):
            return _reply(msg.reply, msg.bulk)
        hist = self._prom.get(_TIMED.get(type(msg), ""))
        if hist is None:
            return await self._serve(core, msg, incoming)
        started = time.perf_counter()
        try:
            return await self._serve(core, msg, incoming)
        finally:
            hist.observe(time.perf_counter() - started)

    async def _serve(self, core: StorageRequests, msg: p.Request, incoming: Incoming) -> Reply:
        folds = self.folds
        step: Step | None = None
        if folds is not None and folds.running:  # what may go on while a fold moves the rows (requests.py)
            step = core.serve_during_fold(msg, incoming.bulk)
            if step is None:
                await folds.ready()  # no await after this before the store is touched
        if step is None and isinstance(msg, p.ApplyBatch) and msg.hint_for in (None, self.node_name):
            async with self._snapshot_lock:  # not while a snapshot freezes the store (snapshot())
                step = core.serve(msg, incoming.bulk)
        elif step is None:
            step = core.serve(msg, incoming.bulk)
        if isinstance(step, Answer):
            if isinstance(step.reply, p.AppliedMask) and any(step.reply.applied):
                return await self._applied_durable(step)
            return _reply(step.reply, step.bulk)
        if isinstance(step, WaitHintSynced):
            return await self._hint_synced(step)
        if isinstance(step, WaitVocabSynced):
            return await self._vocab_synced(step)
        if isinstance(step, WaitRegistersSynced):
            return await self._registers_synced(step)
        return await self._durable(step)

    async def _registers_synced(self, step: WaitRegistersSynced) -> Reply:
        """Answer a register promise or accept once the register log is synced through it
        (register_store.py: an acceptor must not forget what it answered)."""
        assert self.registers is not None and self.core is not None
        self._in_flight += 1
        self._idle.clear()
        try:
            if self.registers.durable_seq < step.seq:
                await asyncio.to_thread(self.registers.sync)
        except OSError as exc:
            log.error("register log fsync failed: %s", exc)
            return _reply(self.core.error(p.Unavailable(f"register log fsync failed: {exc}"[: p.MAX_TEXT_CHARS])).reply)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        return _reply(step.reply)

    async def _vocab_synced(self, step: WaitVocabSynced) -> Reply:
        """Ack a PutVocab once the vocab log is synced through its record (vocab_store.py)."""
        assert self.vocab is not None and self.core is not None
        self._in_flight += 1
        self._idle.clear()
        try:
            if self.vocab.durable_offset < step.offset:  # (also for "known" entries still syncing)
                await asyncio.to_thread(self.vocab.sync)
        except OSError as exc:
            self.disk.write_failed("vocab_log_sync", exc)
            return _reply(self.core.error(p.Unavailable(f"vocab log fsync failed: {exc}"[: p.MAX_TEXT_CHARS])).reply)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        return _reply(step.ack)

    async def _log_durable(self, seq: int) -> Reply | None:
        """Wait until the update log is durable through ``seq`` (counted in flight, for a drain);
        the ``Unavailable`` reply to send when its sync failed, None once durable."""
        assert self._commit is not None and self.core is not None
        self._in_flight += 1
        self._idle.clear()
        try:
            await self._commit.wait_durable(seq)
        except OSError as exc:
            self.disk.write_failed("update_log_sync", exc)
            return _reply(self.core.error(p.Unavailable(f"update log fsync failed: {exc}"[: p.MAX_TEXT_CHARS])).reply)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        return None

    async def _durable(self, step: WaitDurable) -> Reply:
        assert self._commit is not None
        failed = await self._log_durable(step.seq)
        if failed is not None:
            return failed
        self.counters.fsync_batches = self._commit.syncs
        return _reply(step.ack)

    async def _applied_durable(self, step: Answer) -> Reply:
        """A ``BatchesApplied`` yes, sent once the update log is durable through every record
        logged when it was answered: a yes settles the seq in the writer's floor as a durable ack
        does (docs/replication.md, "Writer floors"), and the batch may still be waiting for its
        group commit's sync."""
        assert self.store is not None
        failed = await self._log_durable(self.store.log.last_seq)
        return failed if failed is not None else _reply(step.reply, step.bulk)

    async def _hint_synced(self, step: WaitHintSynced) -> Reply:
        assert self.hints is not None and self.core is not None
        try:
            await asyncio.to_thread(self.hints.sync, step.target)
        except OSError as exc:
            self.disk.write_failed("hint_log_sync", exc)
            return _reply(self.core.error(p.Unavailable(f"hint log sync failed: {exc}"[: p.MAX_TEXT_CHARS])).reply)
        if self.topology is not None and self.topology.is_live(step.target) and not self._stopping:
            self._spawn(self.deliver_hints_to(step.target))
        return _reply(step.ack)

    def _on_count(self, key: str, n: int) -> None:
        if key.startswith("error:"):
            if "errors" in self._prom:
                self._prom["errors"].labels(key[6:]).inc(n)
        elif key in self._prom:
            self._prom[key].inc(n)


def _log_key_task_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("work on the key order in a worker thread failed (listings do it themselves): %r", exc)
