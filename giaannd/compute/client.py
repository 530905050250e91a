"""StorageClient: the compute side's (and hint delivery's) way to storage nodes (ARCHITECTURE §8–§9).

Theory of operation
-------------------
**Writes** (``write``): a RowBatch with a unique ``BatchId(writer, seq)`` is split by owner
(``placement.owner_indices`` on ``row_column``, vectorised) and each owner's share is sent as one
``ApplyBatch``. The call returns once every row has W *direct* durable acknowledgements (W defaults to
a majority of R). An owner that is down (topology), fails, or refuses (``Unavailable``/``NotOwner``)
gets its whole share as a **hint**: the same batch id, ``hint_for=<owner>``, sent to one other
live node, the one the rows' preference lists name first after their owners (Dynamo), or, in a
cluster with no node beyond the owners, another live owner, which keeps it in a separate hint log.
A share is never split across holders: idempotency is per batch id, so the target would keep only
the first part delivered. Hints do not count toward W (a strict quorum, unlike Dynamo's sloppy
one: W acknowledgements always come from real owners); they only bring the missing replica up to
date later. What is not done when W is reached (a slow owner, a hint) finishes in the background;
``flush()`` waits for it. Retrying a batch id is always safe: storage ignores a batch id it applied.

**Writer floors** (applied_set.py): each ApplyBatch carries ``writer_floor`` = (lowest seq of this
writer not yet *settled*) - 1. A seq is settled when every owner acknowledged it directly, or when a
hinted owner later reports it applied (``confirm_hints``, asking ``BatchesApplied``). One global
floor (not one per owner) so that a retry after a placement change can never land on a node whose
floor already passed it. A write that failed and is never retried holds the floor until ``abandon``.

**Reads** (``read_rows``): each row goes to its first live owner, the local node first when it is an
owner; on failure, timeout or NotOwner the rows are retried on the next owner, then on owners
believed down as a last resort. A member that came up recently (back from down, or new in the
placement) is *ramping* (``read_ramp_s``, ramp.py): it keeps a growing fraction of the rows it
would be first for, and the rest go first to the other live replicas, so a cold node is not
flooded with reads the moment it returns.

**Scan** (``scan_all``): every row of the cluster exactly once, as pages of ``ScanRows``. Each live
storage node is asked for the rows of the columns whose first live owner it is (the request names
the down nodes to skip and the placement epoch; the node filters with the same placement), so
replicas never duplicate a row. If a node fails mid-scan, its remaining share (after its cursor) is
asked of every other live node with ``via=[failed node]``: each returns the rows of those columns
whose next owner it is — again a partition. A change of placement during a scan raises
``ScanInterrupted`` (pages already yielded may then be inconsistent: start again).

**Vocabulary** (``put_vocab`` / ``get_vocab``): id → string entries are owned like columns (by
the id). A put goes to every live owner and succeeds once each entry has W durable acks (no
hints: a replica that missed an entry is covered by the lookup, which asks the next owner for any
id the first did not hold). Entries are content-checked by storage; a ``VocabConflict`` reply is a
real 64-bit hash collision and raises ``RemoteVocabConflict``.

**Backpressure**: at most ``max_inflight_bytes_per_owner`` of ApplyBatch bytes in flight per owner:
a slow owner makes ``write`` wait instead of queueing unbounded memory.

**Column info** (``column_info``): one column's owners (placement order, live or not) and, per
live owner, its rows, entries, bytes and order-free digests of that column (``ColumnInfo`` pages,
summed), so the caller can see whether the replicas agree.

**Unreachable peers** (ARCHITECTURE §5): when a call cannot reach a node at the connection level
(connect refused or timed out, connection lost mid-request) the client calls ``on_unreachable(node)``;
the daemon's runtime passes a rate-limited ``MembershipNode.report_unreachable``, so a data-plane
failure *starts* suspicion, which the node refutes if it is alive. Typed error replies (StoreFull,
NotOwner...), request deadlines (a slow node is not an unreachable one), a peer membership already
declared dead (``PeerDead``) and handshake rejections are not reported. The client imports nothing of
membership: the hook is a plain callback.

Connections are opened on first use per address and reused; a closed one is replaced on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.ramp import READ_RAMP_FLOOR, RampTracker, row_draws
from giaannd.storage.applied_set import BatchId
from giaannd.storage.requests import scan_chain_mask
from giaannd.topology import Topology, TopologyChange
from peers.errors import DeadlineExceeded, HandshakeRejected, PeerDead, PeersError, TransportClosed
from peers.transport import Connection, Identity, Transport, connect, make_transport, scheme_of

__all__ = [
    "ColumnReplicaInfo",
    "ColumnReport",
    "QuorumNotReached",
    "ReadFailed",
    "RemoteBadRequest",
    "RemoteNotOwner",
    "RemoteStoreFull",
    "RemoteUnavailable",
    "RemoteVocabConflict",
    "ScanInterrupted",
    "StorageClient",
    "StorageRequestError",
    "VocabWriteFailed",
    "WriteResult",
]

log = logging.getLogger(__name__)

#: Per-owner bytes of ApplyBatch in flight (backpressure); one coalesced delta batch is typically
#: a few MiB, so 64 MiB keeps a pipeline of them without letting one slow owner hoard RAM.
DEFAULT_MAX_INFLIGHT_BYTES_PER_OWNER: Final = 64 * 2**20
DEFAULT_REQUEST_TIMEOUT_S: Final = 10.0
DEFAULT_CONNECT_TIMEOUT_S: Final = 2.0
#: ``write`` starts a background ``confirm_hints`` at most this often while hinted seqs are pending,
#: so the writer floor recovers after an outage without anyone scheduling it.
CONFIRM_HINTS_INTERVAL_S: Final = 2.0
#: Rows asked per ScanRows page (storage caps it at MAX_SCAN_ROWS and by entries).
DEFAULT_SCAN_PAGE_ROWS: Final = 16_384
#: Pages one owner may answer for one ``column_info`` (MAX_COLUMN_INFO_ROWS rows each: 16 Mi
#: features, far beyond any column); a node still paging past it is reported as failed.
MAX_COLUMN_INFO_PAGES: Final = 1024


class StorageRequestError(Exception):
    """A storage node answered with a typed error, or a quorum/read could not be met."""

    def __init__(self, message: str, node: str = "") -> None:
        super().__init__(f"{node}: {message}" if node else message)
        self.node = node


class RemoteStoreFull(StorageRequestError):
    """The node's store is at capacity; nothing changed there."""

    def __init__(self, node: str, reply: p.StoreFull) -> None:
        super().__init__(f"store full ({reply.used_bytes} of {reply.capacity_bytes} bytes used, "
                         f"{reply.needed_bytes} more needed)", node)
        self.reply = reply


class RemoteNotOwner(StorageRequestError):
    def __init__(self, node: str, reply: p.NotOwner) -> None:
        super().__init__(f"not an owner under placement epoch {reply.epoch}: {reply.message}", node)
        self.epoch = reply.epoch


class RemoteBadRequest(StorageRequestError):
    """The node rejected the request as malformed (a bug on our side)."""


class RemoteUnavailable(StorageRequestError):
    """The node cannot serve now (stopping, disk error, hint space full)."""


class QuorumNotReached(StorageRequestError):
    """Some row got fewer than W durable acknowledgements. Retry with the same batch id."""

    def __init__(self, batch_id: BatchId, min_acks: int, quorum: int, failures: Mapping[str, str]) -> None:
        detail = "; ".join(f"{n}: {e}" for n, e in sorted(failures.items()))
        super().__init__(f"batch {tuple(batch_id)}: {min_acks} of {quorum} acks for some rows ({detail})")
        self.batch_id, self.min_acks, self.quorum, self.failures = batch_id, min_acks, quorum, dict(failures)
        # a StoreFull among the failures is what the caller most needs to see
        self.store_full = any("store full" in e for e in failures.values())


class ReadFailed(StorageRequestError):
    """Every replica of some rows failed."""


class ScanInterrupted(StorageRequestError):
    """The placement changed during a scan (or a node scans under another placement): the pages
    yielded so far may miss or repeat rows. Start the scan again."""


class RemoteVocabConflict(StorageRequestError):
    """A vocabulary id is held with another string: a real 64-bit hash collision (nothing changed)."""

    def __init__(self, node: str, reply: p.VocabConflict) -> None:
        kind = "column" if reply.kind == 0 else "feature"
        super().__init__(f"{kind} id {reply.id:#018x} is held as {reply.held!r}, offered {reply.offered!r} "
                         "(64-bit hash collision)", node)
        self.reply = reply


class VocabWriteFailed(StorageRequestError):
    """Some vocabulary entries got fewer than W durable acks (retrying is always safe)."""


@dataclass(frozen=True)
class WriteResult:
    """``acked``: owners that acknowledged before the call returned; ``hinted``: target -> holder of
    hints made so far (more may follow in the background)."""

    batch_id: BatchId
    quorum: int
    acked: tuple[str, ...]
    hinted: Mapping[str, tuple[str, ...]]


@dataclass(eq=False)
class _Unsettled:
    """Owners of one seq that have not acknowledged it directly (writer floors)."""

    pending: set[str]


class ByteBudget:
    """At most ``limit`` bytes in flight; one oversized request may go alone (never deadlocks).

    Shared by the client (per-owner in-flight writes) and training jobs (unacknowledged batches).
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


def _raise_for(node: str, reply: p.Reply) -> None:
    if isinstance(reply, p.StoreFull):
        raise RemoteStoreFull(node, reply)
    if isinstance(reply, p.NotOwner):
        raise RemoteNotOwner(node, reply)
    if isinstance(reply, p.BadRequest):
        raise RemoteBadRequest(reply.message, node)
    if isinstance(reply, p.Unavailable):
        raise RemoteUnavailable(reply.message, node)
    if isinstance(reply, p.VocabConflict):
        raise RemoteVocabConflict(node, reply)


_FAILURES: Final = (StorageRequestError, PeersError, OSError, p.ProtocolViolation, KeyError)


def _unreachable(exc: BaseException, connecting: bool) -> bool:
    """Whether ``exc`` says the peer could not be reached (module docstring, "Unreachable peers").

    While connecting: refused, reset, timed out (``DeadlineExceeded``) all count. On an open
    connection only its loss counts; a request deadline (``TimeoutError``, an ``OSError`` too) does
    not: the peer may just be slow."""
    if isinstance(exc, PeerDead | HandshakeRejected):
        return False
    if connecting:
        return isinstance(exc, OSError | DeadlineExceeded)
    return isinstance(exc, TransportClosed | ConnectionError) and not isinstance(exc, TimeoutError)


@dataclass(frozen=True)
class ColumnReplicaInfo:
    """One owner's view of a column (``StorageClient.column_info``). The counts are None when the
    owner is believed down (not asked) or its answer failed (``error``)."""

    node: str
    live: bool
    rows: int | None = None
    entries: int | None = None
    bytes: int | None = None
    keys_digest: int | None = None
    strength_digest: int | None = None
    batches: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class ColumnReport:
    """A column's owners under ``epoch`` (placement order) with what each live one holds.

    ``keys_agree``: every answering owner holds the same rows with the same entry keys;
    ``strength_agree``: also bit-identical strengths (replicas that applied the same batches in
    another order may differ in the last bit of a float sum, so this one can be False on a healthy
    cluster); both None when fewer than two owners answered."""

    column: int
    epoch: str
    replicas: list[ColumnReplicaInfo]

    @property
    def answered(self) -> list[ColumnReplicaInfo]:
        return [r for r in self.replicas if r.rows is not None]

    @property
    def keys_agree(self) -> bool | None:
        got = self.answered
        return None if len(got) < 2 else len({(r.rows, r.entries, r.keys_digest) for r in got}) == 1

    @property
    def strength_agree(self) -> bool | None:
        got = self.answered
        return None if len(got) < 2 else len({(r.keys_digest, r.strength_digest) for r in got}) == 1


class StorageClient:
    """Reads, quorum writes, hints and digests against the storage members of ``topology``.

    Args:
        topology: the cluster view (owners, addresses, liveness).
        transports: scheme -> transport to dial with; built from ``identity`` when missing.
        identity: data-plane identity (only needed to build transports).
        writer_id: 64-bit writer id for batch ids (random by default: unique per client lifetime).
        write_quorum: W; default majority of the effective R.
        request_timeout_s / connect_timeout_s: per request / per connection attempt series.
        max_inflight_bytes_per_owner: backpressure bound.
        on_unreachable: told ``node`` when a call could not reach it (module docstring).
        read_ramp_s: a member that came up is ramped into reads over this many seconds (0: off).
        read_ramp_floor: its read weight when it comes up (ramp.py).
        clock: monotonic seconds (the read ramp's clock; tests inject one).
    """

    def __init__(
        self,
        topology: Topology,
        transports: Mapping[str, Transport] | None = None,
        *,
        identity: Identity | None = None,
        writer_id: int | None = None,
        write_quorum: int | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_inflight_bytes_per_owner: int = DEFAULT_MAX_INFLIGHT_BYTES_PER_OWNER,
        on_unreachable: Callable[[str], object] | None = None,
        read_ramp_s: float = 0.0,
        read_ramp_floor: float = READ_RAMP_FLOOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topology = topology
        self.transports: dict[str, Transport] = dict(transports or {})
        self.identity = identity
        self.writer_id = secrets.randbits(64) if writer_id is None else writer_id
        self.write_quorum = write_quorum
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_inflight = max_inflight_bytes_per_owner
        self._next_seq = 1
        self._unsettled: dict[int, _Unsettled] = {}
        self._hinted: dict[str, set[int]] = {}
        self._conns: dict[str, Connection] = {}
        self._conn_locks: dict[str, asyncio.Lock] = {}
        self._budgets: dict[str, ByteBudget] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._last_confirm = float("-inf")
        self.on_unreachable = on_unreachable
        self.clock = clock
        self.read_ramp = RampTracker(read_ramp_s, read_ramp_floor)
        self._known: set[str] = set()  # members this client has seen (a came_up of one: a return)
        with contextlib.suppress(LookupError):
            self._known.update(topology.placement.names)
        if read_ramp_s > 0:
            topology.on_change(self._on_topology_change)

    def _on_topology_change(self, change: TopologyChange) -> None:
        """Start the read ramp of members that came up: back from down, or new in the placement
        once this client knew some members (the first members it hears of are not ramped)."""
        now = self.clock()
        for name in change.went_down:
            self.read_ramp.forget(name)
            if name not in self.topology:
                self._known.discard(name)
        had_members = bool(self._known)
        for name in sorted(change.came_up):
            if name in self._known or had_members:
                self.read_ramp.start(name, now)
                log.info("read ramp started member=%s ramp_s=%.1f", name, self.read_ramp.ramp_s)
            self._known.add(name)

    # -- plumbing -------------------------------------------------------------------------------------
    async def _connection(self, node: str) -> Connection:
        address = self.topology.address(node)
        conn = self._conns.get(address)
        if conn is not None and not conn.is_closed:
            return conn
        lock = self._conn_locks.setdefault(address, asyncio.Lock())
        async with lock:
            conn = self._conns.get(address)
            if conn is None or conn.is_closed:
                scheme = scheme_of(address)
                if scheme not in self.transports:
                    if self.identity is None:
                        raise KeyError(f"no {scheme}:// transport to reach {node}")
                    self.transports[scheme] = make_transport(scheme, self.identity)
                conn = await connect(self.transports[scheme], address, timeout_s=self.connect_timeout_s)
                self._conns[address] = conn
            return conn

    async def _call(self, node: str, msg: p.Request, bulk: Sequence[Any] = (),
                    timeout_s: float | None = None) -> tuple[p.Reply, list[np.ndarray]]:
        """One request; typed error replies become exceptions; connection-level failures are
        reported to ``on_unreachable`` before they propagate."""
        connecting = True
        try:
            conn = await self._connection(node)
            connecting = False
            result = await conn.request(p.encode(msg), bulk, timeout_s=timeout_s or self.request_timeout_s)
        except Exception as exc:
            if self.on_unreachable is not None and _unreachable(exc, connecting):
                try:
                    self.on_unreachable(node)
                except Exception:  # a broken hook must not turn into a failed request
                    log.exception("on_unreachable hook failed node=%s", node)
            raise
        reply = p.decode_reply(result.payload)
        _raise_for(node, reply)
        return reply, result.bulk

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- single-node operations -------------------------------------------------------------------------
    async def apply_to(self, node: str, batch_id: BatchId, batch: RowBatch, *, writer_floor: int = 0,
                       hint_for: str | None = None, timeout_s: float | None = None,
                       epoch: str | None = None) -> p.ApplyAck:
        """Send one ApplyBatch to ``node`` and wait for its durable ack (backpressured per node).

        ``epoch``: the ``placement_epoch`` to send (the placement the batch was split with; a hint
        delivery sends the one its writer used). None: this client's current epoch.

        Raises:
            RemoteStoreFull, RemoteNotOwner, RemoteUnavailable, RemoteBadRequest: typed refusals.
            PeersError / OSError: the transport failed (connection, deadline).
        """
        budget = self._budget(node)
        await budget.acquire(batch.nbytes)
        return await self._apply_reserved(node, batch_id, batch, writer_floor, hint_for, timeout_s, epoch)

    def _budget(self, node: str) -> ByteBudget:
        return self._budgets.setdefault(node, ByteBudget(self.max_inflight))

    async def _apply_reserved(self, node: str, batch_id: BatchId, batch: RowBatch, writer_floor: int,
                              hint_for: str | None, timeout_s: float | None,
                              epoch: str | None = None) -> p.ApplyAck:
        """``apply_to`` once ``batch.nbytes`` of the node's budget is held; releases it.

        ``epoch``: the placement the batch was split with (default: the current one). Sources of a
        topology change forward writes by it (docs/topology.md), so it must be the epoch of the
        split, not the one in force when the task gets to send.
        """
        epoch = self.topology.epoch if epoch is None else epoch
        msg = p.ApplyBatch(batch_id.writer, batch_id.seq, writer_floor, epoch, hint_for)
        try:
            reply, _ = await self._call(node, msg, batch.buffers(), timeout_s)
        finally:
            await self._budget(node).release(batch.nbytes)
        if not isinstance(reply, p.ApplyAck) or not reply.durable:
            raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ApplyBatch", node)
        return reply

    async def usage(self, node: str) -> p.UsageReply:
        reply, _ = await self._call(node, p.GetUsage())
        if not isinstance(reply, p.UsageReply):
            raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to GetUsage", node)
        return reply

    async def batches_applied(self, node: str, writer: int, seqs: Sequence[int]) -> list[bool]:
        """Which of ``writer``'s ``seqs`` (at most ``MAX_QUERY_SEQS``) ``node`` has applied."""
        reply, _ = await self._call(node, p.BatchesApplied(writer, list(seqs)))
        if not isinstance(reply, p.AppliedMask) or len(reply.applied) != len(seqs):
            raise RemoteBadRequest("unexpected reply to BatchesApplied", node)
        return list(reply.applied)

    async def digests(self, node: str, row_column: NDArray[np.uint64], row_feature: NDArray[np.uint64]
                      ) -> list[tuple[int, int, int] | None]:
        """Per-row (keys, strength, batches) digests from one node; None for an absent row."""
        cols = np.ascontiguousarray(row_column, np.uint64)
        feats = np.ascontiguousarray(row_feature, np.uint64)
        reply, bulk = await self._call(node, p.RowDigests(), [cols, feats])
        if not isinstance(reply, p.DigestsReply) or len(bulk) != 4:
            raise RemoteBadRequest("unexpected reply to RowDigests", node)
        present, keys, strength, batches = bulk
        return [(int(k), int(s), int(b)) if ok else None
                for ok, k, s, b in zip(present.tolist(), keys.tolist(), strength.tolist(), batches.tolist())]

    async def read_from(self, node: str, row_column: NDArray[np.uint64], row_feature: NDArray[np.uint64],
                        timeout_s: float | None = None) -> RowBatch:
        """Rows from one node (absent rows left out), checked as a canonical batch."""
        reply, bulk = await self._call(node, p.ReadRows(self.topology.epoch), [row_column, row_feature], timeout_s)
        if not isinstance(reply, p.RowsReply):
            raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ReadRows", node)
        return p.check_batch(bulk)

    # -- replicated writes --------------------------------------------------------------------------------
    def next_batch_id(self) -> BatchId:
        """A fresh id of this writer. It counts as unsettled from now on (the floor cannot pass it
        while the caller prepares the write), until written everywhere or ``abandon``-ed."""
        bid = BatchId(self.writer_id, self._next_seq)
        self._next_seq += 1
        self._unsettled[bid.seq] = _Unsettled(set())
        return bid

    @property
    def writer_floor(self) -> int:
        """Every seq of this writer <= this is settled (module docstring)."""
        return min(self._unsettled, default=self._next_seq) - 1

    async def write(self, batch: RowBatch, batch_id: BatchId | None = None) -> WriteResult:
        """Write ``batch`` to all R owners of each row; return once every row has W durable acks.

        Args:
            batch: canonical delta rows.
            batch_id: to retry an earlier write (same id); a new one is allocated when None.

        Raises:
            QuorumNotReached: some row got fewer than W direct acks (retry with the same id).
            LookupError: no storage members known.
        """
        placement = self.topology.placement  # (raises LookupError before an id is taken)
        bid = batch_id if batch_id is not None else self.next_batch_id()
        self._maybe_confirm_hints()
        if batch.num_rows == 0:
            self.abandon(bid)  # nothing to send anywhere: settled
            return WriteResult(bid, 0, (), {})
        r = placement.effective_replicas
        quorum = min(self.write_quorum or r // 2 + 1, r)
        owner_idx = placement.owner_indices(batch.row_column)
        names = placement.names
        shares = {names[int(m)]: (owner_idx == m).any(axis=1) for m in np.unique(owner_idx)}
        state = _Unsettled(set(shares))
        if bid.writer == self.writer_id:
            self._unsettled[bid.seq] = state
        # a floor speaks for our own writer only: for a foreign id (hint replay, tools) send none
        floor = self.writer_floor if bid.writer == self.writer_id else 0
        acks = np.zeros(batch.num_rows, np.int64)
        acked: list[str] = []
        hinted: dict[str, list[str]] = {}
        failures: dict[str, str] = {}
        tasks: dict[asyncio.Task[p.ApplyAck], str] = {}
        for node, mask in shares.items():
            sub = batch.select_rows(mask)
            if self.topology.is_live(node):
                # Reserve before sending: a slow owner's full budget blocks this write here, even
                # when the other owners would make the quorum (backpressure, module docstring).
                await self._budget(node).acquire(sub.nbytes)
                tasks[self._spawn(self._apply_reserved(node, bid, sub, floor, None, None,
                                                       placement.epoch))] = node
            else:
                failures[node] = "down"
                self._spawn(self._hint(node, bid, sub, floor, hinted, placement.epoch))
        pending = set(tasks)
        while pending and int(acks.min()) < quorum:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                node = tasks[task]
                if self._settle_direct(task, node, bid, state, batch, shares, floor, hinted, failures,
                                       placement.epoch):
                    acks[shares[node]] += 1
                    acked.append(node)
        for task in pending:  # W reached: the rest finish (or hint) in the background
            node = tasks[task]
            self._spawn(self._finish_late(task, node, bid, state, batch, shares, floor, hinted, failures,
                                          placement.epoch))
        if int(acks.min()) < quorum:
            raise QuorumNotReached(bid, int(acks.min()), quorum, failures)
        return WriteResult(bid, quorum, tuple(acked), {t: tuple(h) for t, h in hinted.items()})

    def _settle_direct(self, task: asyncio.Task[p.ApplyAck], node: str, bid: BatchId, state: _Unsettled,
                       batch: RowBatch, shares: Mapping[str, NDArray[np.bool_]], floor: int,
                       hinted: dict[str, list[str]], failures: dict[str, str], epoch: str) -> bool:
        """Book one owner's outcome; on failure start its hint (``epoch``: the split's placement).
        True if it acknowledged."""
        if task.cancelled():
            return False
        exc = task.exception()
        if exc is None:
            self._owner_done(bid, state, node)
            return True
        if not isinstance(exc, _FAILURES):
            raise exc
        failures[node] = str(exc) or type(exc).__name__
        if isinstance(exc, (RemoteBadRequest, RemoteStoreFull)):
            return False  # a hint would be refused the same way when delivered
        self._spawn(self._hint(node, bid, batch.select_rows(shares[node]), floor, hinted, epoch))
        return False

    async def _finish_late(self, task: asyncio.Task[p.ApplyAck], node: str, *args: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait({task})
        self._settle_direct(task, node, *args)

    def _owner_done(self, bid: BatchId, state: _Unsettled, node: str) -> None:
        state.pending.discard(node)
        if not state.pending and bid.writer == self.writer_id and self._unsettled.get(bid.seq) is state:
            del self._unsettled[bid.seq]

    def _hint_holders(self, target: str, rows: NDArray[np.uint64], exclude: set[str]) -> NDArray[np.intp]:
        """Per row, the index of the node that should hold ``target``'s hint (-1: none live)."""
        placement = self.topology.placement
        names = placement.names
        pref = self.topology.preference(rows)
        usable = np.array([self.topology.is_live(n) and n != target and n not in exclude for n in names])
        cand = usable[pref]
        beyond = cand.copy()
        beyond[:, : placement.effective_replicas] = False  # prefer nodes that are not owners (Dynamo)
        pick = np.where(beyond.any(axis=1), beyond.argmax(axis=1), cand.argmax(axis=1))
        chosen = pref[np.arange(pref.shape[0]), pick]
        return np.where(cand.any(axis=1), chosen, -1)

    async def _hint(self, target: str, bid: BatchId, share: RowBatch, floor: int,
                    hinted: dict[str, list[str]], epoch: str) -> None:
        """Hand ``target``'s whole share to one other live node (hint_for=target), with the
        ``epoch`` of the placement the share was split with (the holder keeps and delivers it).

        The share is never split between holders: storage idempotency is per batch id, so two
        parts delivered separately under one id would make the target drop the second part.
        The holder is the node that the rows' preference lists name most often; on refusal, the
        next one. Gives up (logged; the seq stays unsettled) when no node is left.
        """
        names = self.topology.placement.names
        exclude: set[str] = set()
        while True:
            holders = self._hint_holders(target, share.row_column, exclude)
            holders = holders[holders >= 0]
            if holders.size == 0:
                log.warning("no node can hold a hint target=%s batch=%s rows=%d", target, tuple(bid),
                            share.num_rows)
                return
            holder = names[int(np.bincount(holders).argmax())]
            try:
                await self.apply_to(holder, bid, share, writer_floor=floor, hint_for=target, epoch=epoch)
            except _FAILURES as exc:
                log.info("hint refused holder=%s target=%s: %s", holder, target, exc)
                exclude.add(holder)
                continue
            hinted.setdefault(target, []).append(holder)
            if bid.writer == self.writer_id:
                self._hinted.setdefault(target, set()).add(bid.seq)
            return

    def _maybe_confirm_hints(self) -> None:
        now = asyncio.get_running_loop().time()
        if self._hinted and now - self._last_confirm >= CONFIRM_HINTS_INTERVAL_S:
            self._last_confirm = now
            self._spawn(self.confirm_hints())

    async def confirm_hints(self) -> int:
        """Ask live hinted owners whether our hinted batches reached them; settle those that did.
        Returns the number of (owner, seq) pairs confirmed."""
        confirmed = 0
        for target in list(self._hinted):
            if not self.topology.is_live(target):
                continue
            seqs = sorted(self._hinted[target])
            for i in range(0, len(seqs), p.MAX_QUERY_SEQS):
                chunk = seqs[i : i + p.MAX_QUERY_SEQS]
                try:
                    reply, _ = await self._call(target, p.BatchesApplied(self.writer_id, chunk))
                except _FAILURES:
                    break
                if not isinstance(reply, p.AppliedMask) or len(reply.applied) != len(chunk):
                    break
                for seq, ok in zip(chunk, reply.applied):
                    if ok:
                        self._hinted[target].discard(seq)
                        state = self._unsettled.get(seq)
                        if state is not None:
                            self._owner_done(BatchId(self.writer_id, seq), state, target)
                        confirmed += 1
            if not self._hinted[target]:
                del self._hinted[target]
        return confirmed

    def abandon(self, batch_id: BatchId) -> None:
        """Give up on a failed write of ours: it will never be sent again (lets the floor move)."""
        if batch_id.writer == self.writer_id:
            self._unsettled.pop(batch_id.seq, None)
            for seqs in self._hinted.values():
                seqs.discard(batch_id.seq)

    # -- replicated reads ---------------------------------------------------------------------------------
    async def read_rows(self, row_column: Any, row_feature: Any, timeout_s: float | None = None) -> RowBatch:
        """Rows from the nearest live replica, failing over to the others (absent rows left out).

        Raises:
            ReadFailed: every owner of some rows failed.
            LookupError: no storage members known.
        """
        cols = np.ascontiguousarray(row_column, np.uint64).reshape(-1)
        feats = np.ascontiguousarray(row_feature, np.uint64).reshape(-1)
        if cols.shape != feats.shape:
            raise ValueError("row_column and row_feature differ in length")
        if cols.size == 0:
            return RowBatch.empty()
        placement = self.topology.placement
        names = placement.names
        owners = placement.owner_indices(cols)
        r = owners.shape[1]
        down = np.array([not self.topology.is_live(n) for n in names])
        local = np.array([n == self.topology.local for n in names])
        # candidate order per row: live before down, local before remote, then preference position
        rank = down[owners] * (4 * r) + (~local[owners]) * r + np.arange(r)[None, :]
        weights = self.read_ramp.weights(names, self.clock())
        if weights is not None:  # a ramping member goes behind the other live replicas of a row
            demote = row_draws(cols, feats)[:, None] >= weights[owners]  # ... unless its draw is in
            rank += (demote & ~local[owners]) * (2 * r)
        cand = np.take_along_axis(owners, np.argsort(rank, axis=1, kind="stable"), axis=1)
        todo = np.ones(cols.size, bool)
        parts: list[RowBatch] = []
        errors: dict[str, str] = {}
        for k in range(r):
            if not todo.any():
                break
            jobs = []
            for m in np.unique(cand[todo, k]):
                mask = todo & (cand[:, k] == m)
                for start in range(0, int(mask.sum()), p.MAX_READ_ROWS):
                    rows = np.flatnonzero(mask)[start : start + p.MAX_READ_ROWS]
                    jobs.append((names[int(m)], rows))
            outcomes = await asyncio.gather(
                *(self.read_from(node, cols[rows], feats[rows], timeout_s) for node, rows in jobs),
                return_exceptions=True)
            for (node, rows), out in zip(jobs, outcomes):
                if isinstance(out, RowBatch):
                    parts.append(out)
                    todo[rows] = False
                elif isinstance(out, _FAILURES):
                    errors[node] = str(out) or type(out).__name__
                elif isinstance(out, BaseException):
                    raise out
        if todo.any():
            detail = "; ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            raise ReadFailed(f"{int(todo.sum())} rows unreadable on every replica ({detail})")
        return parts[0] if len(parts) == 1 else RowBatch.concat(parts)

    # -- cluster-wide scan --------------------------------------------------------------------------------
    async def scan_all(self, page_rows: int = DEFAULT_SCAN_PAGE_ROWS,
                       timeout_s: float | None = None) -> AsyncIterator[RowBatch]:
        """Every row of the cluster exactly once, as canonical pages (module docstring). Pages of
        one node come in key order; pages of different nodes are not merged.

        Raises:
            ScanInterrupted: the placement changed during the scan (start again).
            ReadFailed: a node failed and no other live owner is left for some of its columns.
            LookupError: no storage members known.
        """
        placement = self.topology.placement
        epoch, names, r = placement.epoch, placement.names, placement.effective_replicas
        skip = [n for n in names if not self.topology.is_live(n)]
        skip_mask = np.array([n in skip for n in names])
        todo: deque[tuple[str, tuple[str, ...], tuple[int, int] | None]] = deque(
            (n, (), None) for n in names if n not in skip)
        if not todo:
            raise ReadFailed("no live storage node to scan")
        while todo:
            node, via, after = todo.popleft()
            while True:
                if self.topology.placement.epoch != epoch:
                    raise ScanInterrupted(f"placement changed from {epoch} during the scan")
                msg = p.ScanRows(after[0] if after else 0, after[1] if after else 0, after is not None,
                                 page_rows, True, skip, list(via), epoch)
                try:
                    reply, bulk = await self._call(node, msg, timeout_s=timeout_s)
                    if not isinstance(reply, p.ScanPage):
                        raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ScanRows", node)
                    batch = p.check_batch(bulk)
                except RemoteNotOwner as exc:
                    raise ScanInterrupted(f"{node} scans under another placement ({exc})") from None
                except _FAILURES as exc:
                    chain = (*via, node)
                    others = [n for n in names if n not in skip and n not in chain]
                    if len(chain) >= r or not others:
                        raise ReadFailed(f"scan: {node} failed ({exc}) and no other live owner is left "
                                         f"for its columns") from None
                    log.info("scan failover node=%s after=%s to=%s: %s", node, after, others, exc)
                    todo.extend((o, chain, after) for o in others)
                    break
                if batch.num_rows:
                    # the node filtered with our placement; re-check (a node that ignores the
                    # filter, e.g. one running without a topology, must not duplicate rows)
                    ok = scan_chain_mask(placement, batch.row_column, skip_mask,
                                         [names.index(n) for n in (*via, node)])
                    if not bool(ok.all()):
                        log.warning("scan: %s returned %d rows outside its share; dropped", node,
                                    int((~ok).sum()))
                        batch = batch.select_rows(ok)
                if batch.num_rows:
                    yield batch
                if reply.done:
                    break
                after = (reply.next_column, reply.next_feature)

    # -- vocabulary -----------------------------------------------------------------------------------------
    async def put_vocab(self, entries: Sequence[tuple[int, int, str]]) -> int:
        """Store id → string entries on the R owners of each id; returns once each has W durable acks.
        Returns the number of entries sent.

        Raises:
            RemoteVocabConflict: a real hash collision (not retryable).
            VocabWriteFailed: some entry got fewer than W acks (retry: puts are idempotent).
            LookupError: no storage members known.
        """
        if not entries:
            return 0
        placement = self.topology.placement
        names, r = placement.names, placement.effective_replicas
        quorum = min(self.write_quorum or r // 2 + 1, r)
        ids = np.fromiter((e[1] for e in entries), np.uint64, len(entries))
        owners = placement.owner_indices(ids)
        jobs: list[tuple[str, NDArray[np.intp]]] = []
        failures: dict[str, str] = {}
        for m in np.unique(owners):
            node = names[int(m)]
            idx = np.flatnonzero((owners == m).any(axis=1))
            if not self.topology.is_live(node):
                failures[node] = "down"
                continue
            for start in range(0, idx.size, p.MAX_VOCAB_ENTRIES):
                jobs.append((node, idx[start : start + p.MAX_VOCAB_ENTRIES]))
        outcomes = await asyncio.gather(
            *(self._call(node, p.PutVocab([entries[i] for i in idx.tolist()])) for node, idx in jobs),
            return_exceptions=True)
        acks = np.zeros(len(entries), np.int64)
        for (node, idx), out in zip(jobs, outcomes):
            if isinstance(out, RemoteVocabConflict):
                raise out
            if isinstance(out, tuple) and isinstance(out[0], p.VocabAck):
                acks[idx] += 1
            elif isinstance(out, _FAILURES) or isinstance(out, tuple):
                failures[node] = str(out) or type(out).__name__
            elif isinstance(out, BaseException):
                raise out
        if int(acks.min()) < quorum:
            detail = "; ".join(f"{n}: {e}" for n, e in sorted(failures.items()))
            raise VocabWriteFailed(f"{int((acks < quorum).sum())} vocabulary entries got fewer than "
                                   f"{quorum} acks ({detail})")
        return len(entries)

    async def get_vocab(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """Look up ``(kind, id)`` keys (kind 0 column, 1 feature) on their owners: the first live
        owner, then the next ones for whatever it did not hold. Ids no owner holds are left out.

        Raises:
            ReadFailed: every owner of some ids failed (none answered).
            LookupError: no storage members known.
        """
        if not keys:
            return {}
        placement = self.topology.placement
        names = placement.names
        kinds = [int(k) for k, _ in keys]
        ids = np.fromiter((i for _, i in keys), np.uint64, len(keys))
        owners = placement.owner_indices(ids)
        r = owners.shape[1]
        down = np.array([not self.topology.is_live(n) for n in names])
        rank = down[owners] * r + np.arange(r)[None, :]
        cand = np.take_along_axis(owners, np.argsort(rank, axis=1, kind="stable"), axis=1)
        todo = np.ones(len(keys), bool)
        answered = np.zeros(len(keys), bool)
        found: dict[tuple[int, int], str] = {}
        errors: dict[str, str] = {}
        for k in range(r):
            if not todo.any():
                break
            jobs: list[tuple[str, NDArray[np.intp]]] = []
            for m in np.unique(cand[todo, k]):
                idx = np.flatnonzero(todo & (cand[:, k] == m))
                for start in range(0, idx.size, p.MAX_VOCAB_ENTRIES):
                    jobs.append((names[int(m)], idx[start : start + p.MAX_VOCAB_ENTRIES]))
            outcomes = await asyncio.gather(
                *(self._call(node, p.GetVocab([kinds[i] for i in idx.tolist()],
                                              [int(ids[i]) for i in idx.tolist()])) for node, idx in jobs),
                return_exceptions=True)
            for (node, idx), out in zip(jobs, outcomes):
                if isinstance(out, tuple) and isinstance(out[0], p.VocabReply):
                    answered[idx] = True
                    for kind, ident, text in out[0].entries:
                        found[(kind, ident)] = text
                elif isinstance(out, _FAILURES) or isinstance(out, tuple):
                    errors[node] = str(out) or type(out).__name__
                elif isinstance(out, BaseException):
                    raise out
            todo &= np.array([(kd, int(i)) not in found for kd, i in zip(kinds, ids.tolist())])
        if (todo & ~answered).any():
            detail = "; ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            raise ReadFailed(f"{int((todo & ~answered).sum())} vocabulary ids unreadable on every owner ({detail})")
        return found

    # -- column info ---------------------------------------------------------------------------------------
    async def column_info(self, column: int, page_rows: int = p.MAX_COLUMN_INFO_ROWS,
                          timeout_s: float | None = None) -> ColumnReport:
        """The column's owners (live or not) and, per live owner, its counts and digests, asked
        of all live owners at once; an owner that fails is reported with ``error``, not raised.

        Raises:
            LookupError: no storage members known (no placement).
        """
        placement = self.topology.placement
        owners = [placement.names[int(i)]
                  for i in placement.owner_indices(np.array([column], np.uint64))[0]]
        live = [self.topology.is_live(n) for n in owners]
        results = await asyncio.gather(
            *(self._column_info_of(n, column, page_rows, timeout_s) for n, ok in zip(owners, live) if ok),
            return_exceptions=True)
        it = iter(results)
        replicas = []
        for name, ok in zip(owners, live):
            if not ok:
                replicas.append(ColumnReplicaInfo(name, False))
                continue
            got = next(it)
            if isinstance(got, ColumnReplicaInfo):
                replicas.append(got)
            elif isinstance(got, _FAILURES):
                replicas.append(ColumnReplicaInfo(name, True, error=f"{type(got).__name__}: {got}"))
            else:
                raise got
        return ColumnReport(column, placement.epoch, replicas)

    async def _column_info_of(self, node: str, column: int, page_rows: int,
                              timeout_s: float | None) -> ColumnReplicaInfo:
        mask = (1 << 64) - 1
        rows = entries = nbytes = keys = strength = batches = 0
        msg = p.ColumnInfo(column, limit=page_rows)
        for _ in range(MAX_COLUMN_INFO_PAGES):
            reply, _ = await self._call(node, msg, (), timeout_s)
            if not isinstance(reply, p.ColumnInfoPage):
                raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ColumnInfo", node)
            rows, entries, nbytes = rows + reply.rows, entries + reply.entries, nbytes + reply.bytes
            keys, strength = (keys + reply.keys_digest) & mask, (strength + reply.strength_digest) & mask
            batches += reply.batches
            if reply.done:
                return ColumnReplicaInfo(node, True, rows, entries, nbytes, keys, strength, batches)
            if reply.next_feature <= msg.after_feature and msg.started:
                raise RemoteBadRequest("ColumnInfo cursor did not advance", node)
            msg = p.ColumnInfo(column, reply.next_feature, True, page_rows)
        raise RemoteBadRequest(f"column {column} not done after {MAX_COLUMN_INFO_PAGES} pages", node)

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def flush(self) -> None:
        """Wait until background work (late acks, hints) is done."""
        while self._background:
            await asyncio.wait(set(self._background))

    async def close(self) -> None:
        """Finish background work (each step is bounded by its request timeout), close connections."""
        await self.flush()
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.close()
