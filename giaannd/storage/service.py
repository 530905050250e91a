"""The storage service: the durable column store served on the peer transport (ARCHITECTURE §8).

Asyncio glue only. What it serves (giaannd/protocol.py): ``ReadRows``, ``ApplyBatch`` (acknowledged
only once the batch is in the synced update log: group commit, group_commit.py), hinted
``ApplyBatch`` (kept in the hint log, hints.py, delivered when the target is back), ``RowDigests``,
``GetUsage``, ``BatchesApplied``. Everything a peer sends is decoded, then checked against the named
limits, then validated as a canonical RowBatch, and only then handed to the store; any failure is a
typed error *reply* (``BadRequest``, ``StoreFull``, ``NotOwner``, ``Unavailable``) and the service
keeps serving.

Lifecycle: ``open()`` recovers the store and hints and binds the listeners (tests call it directly);
``start(ctx)`` does the same under the daemon and adds metrics and the background loops (snapshot
timer, hint retry); ``stop(graceful=True)`` stops accepting, lets in-flight applies finish, snapshots
and closes. ``stop(graceful=False)`` closes listeners and files at once (the log is already durable
for everything acknowledged).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from giaannd import protocol as p
from giaannd.compute.client import StorageClient, StorageRequestError
from giaannd.model.rows import RowBatch
from giaannd.storage.applied_set import BatchId
from giaannd.storage.errors import StoreFullError
from giaannd.storage.group_commit import GroupCommit
from giaannd.storage.hints import DEFAULT_MAX_HINT_BYTES, HintSpaceFull, HintStore
from giaannd.storage.recovery import DurableStore
from giaannd.topology import Topology, TopologyChange
from peers.errors import PeersError
from peers.transport import Identity, Incoming, Listener, Reply, Transport, make_transport, scheme_of

if TYPE_CHECKING:
    from giaannd.config import Config
    from giaannd.daemon import ServiceContext

__all__ = ["HINT_RETRY_S", "StorageCounters", "StorageService", "create_service"]

log = logging.getLogger(__name__)

#: How often undelivered hints are retried even without a topology event (a target that came back
#: before its failure was noticed produces no "came up" event).
HINT_RETRY_S: Final = 5.0
#: Budget of one hint delivery request.
HINT_DELIVERY_TIMEOUT_S: Final = 10.0
STORE_DIR: Final = "store"
HINTS_DIR: Final = "hints"


@dataclass
class StorageCounters:
    """Counters for /metrics and tests (``applies / fsync_batches`` is the group-commit ratio)."""

    reads: int = 0
    rows_read: int = 0
    bytes_read: int = 0
    applies: int = 0
    applies_duplicate: int = 0
    bytes_applied: int = 0
    fsync_batches: int = 0
    hints_received: int = 0
    hints_delivered: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def _reply(msg: p.Reply, bulk: Sequence[Any] = ()) -> Reply:
    return Reply(p.encode(msg), list(bulk))


def _owned(batch: RowBatch) -> RowBatch:
    """A copy that no longer references the transport's pooled receive buffers."""
    return RowBatch(*[np.array(b, copy=True) for b in batch.buffers()])


class StorageService:
    """Serve one ``DurableStore`` (module docstring).

    Args:
        data_dir: holds ``store/`` (update log + snapshots) and ``hints/``.
        capacity_bytes: the store's capacity (writes past it get ``StoreFull``).
        listen: data-plane URLs to bind (``tcp://127.0.0.1:0``, ``mem://n1``...).
        transports: scheme -> transport to listen and dial with (built from ``identity`` if absent).
        identity: data-plane identity (needed only when ``transports`` lacks a scheme).
        topology: the cluster view (ownership checks, hint delivery); None: a standalone node that
            owns everything and delivers no hints.
        node_name: this node's member name (as in the topology).
        group_commit_window_s: see GroupCommit.
        snapshot_interval_s: snapshot timer period (daemon mode / ``run_snapshots``).
    """

    name = "storage"

    def __init__(
        self,
        data_dir: Path | str,
        capacity_bytes: int,
        listen: Sequence[str],
        *,
        transports: Mapping[str, Transport] | None = None,
        identity: Identity | None = None,
        topology: Topology | None = None,
        node_name: str = "",
        group_commit_window_s: float = 0.0,
        snapshot_interval_s: float = 300.0,
        hint_max_bytes: int = DEFAULT_MAX_HINT_BYTES,
        hint_retry_s: float = HINT_RETRY_S,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.capacity_bytes = capacity_bytes
        self.listen_urls = list(listen)
        self.transports: dict[str, Transport] = dict(transports or {})
        self.identity = identity
        self.topology = topology
        self.node_name = node_name
        self.window_s = group_commit_window_s
        self.snapshot_interval_s = snapshot_interval_s
        self.hint_max_bytes = hint_max_bytes
        self.hint_retry_s = hint_retry_s
        self.counters = StorageCounters()
        self.store: DurableStore | None = None
        self.hints: HintStore | None = None
        self.listeners: list[Listener] = []
        self._commit: GroupCommit | None = None
        self._snapshot_lock = asyncio.Lock()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._client: StorageClient | None = None
        self._delivering: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._prom: dict[str, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        """The bound data-plane addresses (ports resolved)."""
        return [lst.address for lst in self.listeners]

    async def open(self) -> None:
        """Recover the store and hints, then bind the listeners.

        Raises:
            CorruptLogError, CorruptSnapshotError: damaged files (start-up stops).
            OSError: a listener could not bind.
        """
        self.store = await asyncio.to_thread(DurableStore.open, self.data_dir / STORE_DIR, self.capacity_bytes)
        self.hints = await asyncio.to_thread(HintStore.open, self.data_dir / HINTS_DIR, self.hint_max_bytes)
        self._commit = GroupCommit(self.store.sync, self.store.log.durable_seq, self.window_s)
        rec = self.store.recovery
        log.info("storage recovered dir=%s snapshot_seq=%d replayed=%d torn_bytes=%d hints=%d",
                 self.data_dir, rec.snapshot_seq, rec.records_replayed, rec.torn_tail_bytes, self.hints.held)
        for url in self.listen_urls:
            transport = self._transport(scheme_of(url))
            self.listeners.append(await transport.listen(url, self.handle))
        if self.topology is not None:
            self._client = StorageClient(self.topology, self.transports, identity=self.identity)
            self.topology.on_change(self._on_topology)

    def _transport(self, scheme: str) -> Transport:
        if scheme not in self.transports:
            if self.identity is None:
                raise ValueError(f"no {scheme}:// transport and no identity to build one")
            self.transports[scheme] = make_transport(scheme, self.identity)
        return self.transports[scheme]

    async def start(self, ctx: ServiceContext) -> None:
        """Daemon entry: open, register metrics, start the snapshot and hint-retry loops."""
        if self.identity is None:
            self.identity = _identity_from_config(ctx.config, str(ctx.node_id))
        if not self.node_name:
            self.node_name = ctx.node_name
        await self.open()
        m = ctx.metrics
        for key in ("reads", "rows_read", "bytes_read", "applies", "applies_duplicate", "bytes_applied",
                    "fsync_batches", "hints_received", "hints_delivered"):
            self._prom[key] = m.counter(f"giaannd_storage_{key}_total", f"storage service: {key}")
        self._prom["errors"] = m.counter("giaannd_storage_errors_total", "storage service error replies", ["kind"])
        ctx.spawn(self.run_snapshots(ctx.stopping), "snapshots")
        ctx.spawn(self.run_hint_retry(ctx.stopping), "hint-retry")

    async def stop(self, graceful: bool) -> None:
        """Graceful: stop accepting, finish in-flight applies, snapshot, close. Else close now."""
        self._stopping = True
        for lst in self.listeners:
            with contextlib.suppress(Exception):
                await lst.close()
        self.listeners = []
        for task in list(self._tasks):
            task.cancel()
        if graceful:
            await self._idle.wait()
            if self._commit is not None:
                await self._commit.drain()
            if self.store is not None:
                async with self._snapshot_lock:
                    await asyncio.to_thread(self.store.snapshot)
        if self._client is not None:
            await self._client.close()
        if self.store is not None:
            self.store.close()
        if self.hints is not None:
            self.hints.close()

    def health(self) -> Mapping[str, Any]:
        out: dict[str, Any] = {"addresses": self.addresses}
        if self.store is not None:
            u = self.store.store.usage()
            out.update(used_bytes=u.used_bytes, capacity_bytes=u.capacity_bytes, rows=u.num_rows,
                       is_full=u.is_full)
        if self.hints is not None:
            out["hints_held"] = self.hints.held
        out["counters"] = asdict(self.counters)
        return out

    # -- background loops ---------------------------------------------------------------------------
    async def run_snapshots(self, stopping: asyncio.Event) -> None:
        """Snapshot every ``snapshot_interval_s`` (truncates the log, bounds replay time)."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.snapshot_interval_s)
                return
            await self.snapshot()

    async def snapshot(self) -> Path:
        """Write a snapshot now; applies wait while it runs (DurableStore.snapshot's contract)."""
        assert self.store is not None
        async with self._snapshot_lock:
            start = time.perf_counter()
            path = await asyncio.to_thread(self.store.snapshot)
        log.info("snapshot written path=%s seconds=%.3f", path, time.perf_counter() - start)
        return path

    async def run_hint_retry(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.hint_retry_s)
                return
            await self.deliver_hints()

    def _on_topology(self, change: TopologyChange) -> None:
        if self.hints is None or self._stopping:
            return
        for target in change.came_up & set(self.hints.targets()):
            self._spawn(self.deliver_hints_to(target))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def deliver_hints(self) -> int:
        """Try every target that is live now; returns hints delivered."""
        if self.hints is None or self.topology is None:
            return 0
        done = 0
        for target in self.hints.targets():
            if self.topology.is_live(target):
                done += await self.deliver_hints_to(target)
        return done

    async def deliver_hints_to(self, target: str) -> int:
        """Deliver the target's hints in order; stop at the first failure (retried later)."""
        if self.hints is None or self._client is None or target in self._delivering:
            return 0
        self._delivering.add(target)
        done = 0
        try:
            for hint in self.hints.pending(target):
                try:
                    await self._client.apply_to(target, hint.batch_id, hint.batch,
                                                timeout_s=HINT_DELIVERY_TIMEOUT_S)
                except (StorageRequestError, PeersError, OSError, KeyError, LookupError) as exc:
                    log.info("hint delivery paused target=%s held=%d: %s", target,
                             len(self.hints.pending(target)), exc)
                    break
                self.hints.delivered(target, hint.batch_id)
                self._count("hints_delivered")
                done += 1
        finally:
            self._delivering.discard(target)
        if done:
            log.info("hints delivered target=%s count=%d", target, done)
        return done

    # -- request handling ---------------------------------------------------------------------------
    async def handle(self, incoming: Incoming) -> Reply:
        """The transport handler: decode, check, serve; every failure is a typed reply."""
        try:
            msg = p.decode_request(incoming.payload)
            if isinstance(msg, p.ReadRows):
                return self._read(incoming.bulk)
            if isinstance(msg, p.ApplyBatch):
                return await self._apply(msg, incoming.bulk)
            if isinstance(msg, p.RowDigests):
                return self._digests(incoming.bulk)
            if isinstance(msg, p.GetUsage):
                return self._usage()
            return self._batches_applied(msg)
        except p.ProtocolViolation as exc:
            log.debug("bad request peer=%s: %s", incoming.peer, exc)
            return self._error(p.BadRequest(str(exc)[: p.MAX_TEXT_CHARS]))

    def _error(self, msg: p.ErrorReply) -> Reply:
        kind = type(msg).__name__
        self.counters.error(kind)
        if "errors" in self._prom:
            self._prom["errors"].labels(kind).inc()
        return _reply(msg)

    def _count(self, key: str, n: int = 1) -> None:
        setattr(self.counters, key, getattr(self.counters, key) + n)
        if key in self._prom:
            self._prom[key].inc(n)

    def _not_owner(self, row_column: np.ndarray) -> p.NotOwner | None:
        """NotOwner unless this node owns every row's column under its placement (standalone: owns all)."""
        topo = self.topology
        if topo is None or not self.node_name or self.node_name not in topo or row_column.size == 0:
            return None
        placement = topo.placement
        me = placement.names.index(self.node_name)
        owned = (placement.owner_indices(row_column) == me).any(axis=1)
        if bool(owned.all()):
            return None
        return p.NotOwner(placement.epoch, f"{int((~owned).sum())} of {owned.size} rows not owned here")

    def _read(self, bulk: Sequence[np.ndarray]) -> Reply:
        assert self.store is not None
        cols, feats = p.check_keys(bulk, p.MAX_READ_ROWS)
        if (err := self._not_owner(cols)) is not None:
            return self._error(err)
        batch = self.store.store.read_rows(cols, feats)
        self._count("reads")
        self._count("rows_read", batch.num_rows)
        self._count("bytes_read", batch.nbytes)
        return _reply(p.RowsReply(), batch.buffers())

    def _digests(self, bulk: Sequence[np.ndarray]) -> Reply:
        assert self.store is not None
        cols, feats = p.check_keys(bulk, p.MAX_DIGEST_ROWS)
        n = cols.shape[0]
        present = np.zeros(n, np.uint8)
        keys, strength, batches = (np.zeros(n, np.uint64) for _ in range(3))
        for i, key in enumerate(zip(cols.tolist(), feats.tolist())):
            d = self.store.store.digest(key)
            if d is not None:
                present[i], keys[i], strength[i], batches[i] = 1, d.keys, d.strength, d.batches
        return _reply(p.DigestsReply(), [present, keys, strength, batches])

    def _usage(self) -> Reply:
        assert self.store is not None and self.hints is not None
        u = self.store.store.usage()
        return _reply(p.UsageReply(u.capacity_bytes, u.used_bytes, u.num_rows, u.num_entries, u.is_full,
                                   self.hints.held))

    def _batches_applied(self, msg: p.BatchesApplied) -> Reply:
        assert self.store is not None
        if len(msg.seqs) > p.MAX_QUERY_SEQS:
            raise p.ProtocolViolation(f"{len(msg.seqs)} seqs in one query; the limit is {p.MAX_QUERY_SEQS}")
        applied = self.store.store.applied
        return _reply(p.AppliedMask([BatchId(msg.writer, s) in applied for s in msg.seqs]))

    async def _apply(self, msg: p.ApplyBatch, bulk: Sequence[np.ndarray]) -> Reply:
        assert self.store is not None and self._commit is not None
        if self._stopping:
            return self._error(p.Unavailable("storage service is stopping"))
        batch = p.check_batch(bulk)
        batch_id = BatchId(msg.writer, msg.seq)
        if msg.hint_for is not None and msg.hint_for != self.node_name:
            return await self._hold_hint(msg.hint_for, batch_id, batch)
        if (err := self._not_owner(batch.row_column)) is not None:
            return self._error(err)
        self._in_flight += 1
        self._idle.clear()
        try:
            async with self._snapshot_lock:
                try:
                    result = self.store.apply(batch_id, batch, validate=False)  # check_batch validated
                    seq = result.seq
                    if msg.writer_floor > self.store.store.applied.floor(msg.writer):
                        seq = max(seq, self.store.advance_floor(msg.writer, msg.writer_floor))
                except StoreFullError as exc:
                    return self._error(p.StoreFull(exc.needed_bytes, exc.used_bytes, exc.capacity_bytes))
                except ValueError as exc:
                    return self._error(p.BadRequest(str(exc)[: p.MAX_TEXT_CHARS]))
                except OSError as exc:
                    log.error("update log write failed: %s", exc)
                    return self._error(p.Unavailable(f"update log write failed: {exc}"[: p.MAX_TEXT_CHARS]))
            try:
                await self._commit.wait_durable(seq)
            except OSError as exc:
                log.error("update log fsync failed: %s", exc)
                return self._error(p.Unavailable(f"update log fsync failed: {exc}"[: p.MAX_TEXT_CHARS]))
            self.counters.fsync_batches = self._commit.syncs
            if result.applied:
                self._count("applies")
                self._count("bytes_applied", batch.nbytes)
            else:
                self._count("applies_duplicate")
            return _reply(p.ApplyAck(durable=True, applied=result.applied))
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _hold_hint(self, target: str, batch_id: BatchId, batch: RowBatch) -> Reply:
        assert self.hints is not None
        try:
            added = self.hints.add(target, batch_id, _owned(batch))
            await asyncio.to_thread(self.hints.sync, target)
        except HintSpaceFull as exc:
            return self._error(p.Unavailable(str(exc)))
        except ValueError as exc:
            return self._error(p.BadRequest(str(exc)))
        except OSError as exc:
            return self._error(p.Unavailable(f"hint log write failed: {exc}"[: p.MAX_TEXT_CHARS]))
        if added:
            self._count("hints_received")
        if self.topology is not None and self.topology.is_live(target) and not self._stopping:
            self._spawn(self.deliver_hints_to(target))
        return _reply(p.ApplyAck(durable=True, applied=added, hinted=True))


def _identity_from_config(config: Config, node_id: str) -> Identity:
    """The data-plane identity: the cluster keyring if configured, else a key derived from the
    cluster name (no secret: config says an empty key file is acceptable on loopback only)."""
    if config.cluster.key_file:
        from peers.keyring import Keyring

        keys = list(Keyring.load(config.cluster.key_file).keys)
    else:
        keys = [hashlib.sha256(f"giaannd-unkeyed:{config.cluster.name}".encode()).digest()]
    return Identity(node_id, config.cluster.name, keys)


def create_service(config: Config) -> StorageService:
    """The daemon's factory (giaannd.daemon.ROLE_FACTORIES)."""
    s = config.storage
    return StorageService(
        config.data_path("storage"), s.capacity_bytes, config.transport.bind,
        group_commit_window_s=s.fsync_group_commit_ms / 1000.0,
        snapshot_interval_s=s.snapshot_interval_s,
    )


async def _main(argv: Sequence[str] | None = None) -> None:
    """``python -m giaannd.storage.service``: one storage node without the daemon (real-process
    tests and benchmarks). With ``--member`` it knows its peers (static topology, no membership):
    ownership checks and hint delivery then work across processes."""
    ap = argparse.ArgumentParser(prog="python -m giaannd.storage.service",
                                 description="Run one storage service (no daemon, no membership).")
    ap.add_argument("--listen", required=True, help="data-plane URL, e.g. tcp://127.0.0.1:0")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--capacity-bytes", type=int, default=1 << 30)
    ap.add_argument("--cluster", default="giaann")
    ap.add_argument("--key-hex", default="", help="cluster key (hex); default: derived from --cluster")
    ap.add_argument("--name", default="", help="this node's member name (with --member)")
    ap.add_argument("--member", action="append", default=[], metavar="NAME=URL",
                    help="a storage member (repeat; include this node)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--hint-retry-s", type=float, default=HINT_RETRY_S)
    ap.add_argument("--snapshot-interval-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    key = bytes.fromhex(args.key_hex) if args.key_hex else \
        hashlib.sha256(f"giaannd-unkeyed:{args.cluster}".encode()).digest()
    topology = None
    if args.member:
        from giaannd.topology import StorageNode

        topology = Topology(local=args.name or None, replicas=args.replicas)
        topology.set_members([StorageNode(*m.split("=", 1)) for m in args.member])
    service = StorageService(args.data_dir, args.capacity_bytes, [args.listen],
                             identity=Identity(args.name or f"storage-{args.listen}", args.cluster, [key]),
                             topology=topology, node_name=args.name, hint_retry_s=args.hint_retry_s,
                             snapshot_interval_s=args.snapshot_interval_s)
    await service.open()
    print(f"LISTENING {service.addresses[0]}", flush=True)
    stop = asyncio.Event()
    import signal

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loops = [loop.create_task(service.run_hint_retry(stop)), loop.create_task(service.run_snapshots(stop))]
    await stop.wait()
    await asyncio.gather(*loops)
    await service.stop(graceful=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(_main())
