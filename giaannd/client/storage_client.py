"""StorageClient: the compute side's (and hint delivery's) way to storage nodes (ARCHITECTURE §8–§9).

Theory of operation
-------------------
``StorageClient`` is a facade: it owns the connections, the per-owner byte budgets, the writer
state and the read ramp, and hands each replicated operation to the module that implements it
(each opens with its own theory of operation):

- ``write``, ``confirm_hints`` → writes.py: split by owner, W direct durable acks (a strict
  quorum), hints for owners that are down or fail, the rest finished in the background (``flush``);
- ``next_batch_id``, ``writer_floor``, ``abandon`` → writer_floor.py: batch ids and the floor sent
  with every write;
- ``read_rows`` → reads.py: replica order (live, local, preference; ramping members demoted),
  failover owner by owner, the read ramp of members that came up (``read_ramp_s``);
- ``scan_all`` → scan.py: every row of the cluster exactly once, failover ``via`` a failed node;
- ``put_vocab`` / ``get_vocab`` → remote_vocab.py: id → string entries, owned like columns;
- ``column_info`` → column_info.py: one column on each of its owners, digests compared;
- ``read_column`` → column_rows.py: one column's rows from one live owner, paged, with failover;
- ``read_register`` / ``cas_register`` → registers.py: small versioned rows with compare-and-set
  (CASPaxos over the key's owners; what it guarantees is written there);
- the error types and reply checking → client/errors.py.

What stays here is the plumbing the parts share and the single-node requests (``apply_to``,
``usage``, ``batches_applied``, ``digests``, ``read_from``):

**Calls** (``_call``, passed to the parts as their ``NodeCall``, node_call.py): one request to one
named node. Connections are opened on first use per address (a transport is built from
``identity`` for a scheme not given) and reused; a closed one is replaced on the next call. Typed
error replies become exceptions.

**Unreachable peers** (ARCHITECTURE §5): when a call cannot reach a node at the connection level
(connect refused or timed out, connection lost mid-request) the client calls ``on_unreachable(node)``;
the daemon's runtime passes a rate-limited ``MembershipNode.report_unreachable``, so a data-plane
failure *starts* suspicion, which the node refutes if it is alive. Typed error replies (StoreFull,
NotOwner...), request deadlines (a slow node is not an unreachable one), a peer membership already
declared dead (``PeerDead``) and handshake rejections are not reported (client/errors.py
``is_unreachable``). The client imports nothing of membership: the hook is a plain callback, and a
hook that raises is logged without changing the request's outcome.

**Backpressure**: at most ``max_inflight_bytes_per_owner`` of ApplyBatch bytes in flight per owner
(byte_budget.py), shared by ``write`` and ``apply_to``: a slow owner makes ``write`` wait instead of
queueing unbounded memory.

Every name this module exported before it was split (the error types, ``WriteResult``,
``ColumnReport``, ``ByteBudget``, the constants) is still importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd import protocol as p
from giaannd.client.byte_budget import ByteBudget as ByteBudget  # re-exported (train.py, tests)
from giaannd.client.column_info import MAX_COLUMN_INFO_PAGES as MAX_COLUMN_INFO_PAGES
from giaannd.client.column_info import ColumnReplicaInfo, ColumnReport, column_report
from giaannd.client.column_rows import ColumnRead, read_column
from giaannd.client.errors import (
    QuorumNotReached,
    ReadFailed,
    RemoteBadRequest,
    RemoteNotOwner,
    RemoteStoreFull,
    RemoteUnavailable,
    RemoteVocabConflict,
    ScanInterrupted,
    StorageRequestError,
    VocabWriteFailed,
    raise_for_reply,
)
from giaannd.client.errors import is_unreachable as _unreachable
from giaannd.client.reads import ReadRampStarter, read_replicated
from giaannd.client.registers import CasOutcome, RegisterClient, RegisterRead, Version
from giaannd.client.remote_vocab import get_vocab, put_vocab
from giaannd.client.row_memory import DEFAULT_KEEP_ROW_BYTES, RowMemory
from giaannd.client.row_parts import READ_PARTS_IN_FLIGHT, read_chunked
from giaannd.client.scan import DEFAULT_SCAN_PAGE_BYTES, DEFAULT_SCAN_PAGE_ROWS, scan_cluster
from giaannd.client.writer_floor import WriterFloor
from giaannd.client.writes import CONFIRM_HINTS_INTERVAL_S as CONFIRM_HINTS_INTERVAL_S
from giaannd.client.writes import QuorumWriter, WriteResult, hint_holders
from giaannd.cluster.view import ClusterView
from giaannd.config import DEFAULT_READ_CHUNK_BYTES
from giaannd.model.gpu.rows import DeviceRows, PinnedStager
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.ramp import READ_RAMP_FLOOR, RampTracker
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
#: Bytes per row entry on the wire (u64 + u64 + f32 + u8), to turn the read chunk into entries.
_ENTRY_BYTES: Final = 21


class _Dial:
    """The connect lock of one address and the callers holding or awaiting it: dropped with the
    last of them, so a client does not keep a lock for every address it ever dialled (a node
    restarted at a new address, again and again)."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock, self.users = asyncio.Lock(), 0


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
        read_chunk_bytes: bytes of one read part (``storage.read-chunk-bytes``): rows larger than
            a storage node's read chunk are read in parts of this size (client/row_parts.py).
        read_parts_in_flight: part requests of one large row in flight at once.
        read_fewest_nodes: send a read's rows to as few live owners as possible instead of each
            row's first owner (``compute.read-fewest-nodes``; reads.py, "Fewest nodes").
        keep_row_bytes: memory of large rows (read by parts) the caller dropped, kept idle up to
            this many bytes and received into again (client/row_memory.py); 0 keeps none.
        read_around_folds: a storage node folding its delta runs sends the rows of a read that
            have another live replica on to it at once instead of holding the read until the fold
            ends (reads.py, "Around folds"); False: every read waits for the node it asks.
    """

    def __init__(
        self,
        topology: ClusterView,
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
        read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES,
        read_parts_in_flight: int = READ_PARTS_IN_FLIGHT,
        read_fewest_nodes: bool = False,
        keep_row_bytes: int = DEFAULT_KEEP_ROW_BYTES,
        read_around_folds: bool = True,
    ) -> None:
        self.topology = topology
        self.transports: dict[str, Transport] = dict(transports or {})
        self.identity = identity
        self.write_quorum = write_quorum
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_inflight = max_inflight_bytes_per_owner
        self._conns: dict[str, Connection] = {}
        self._conn_locks: dict[str, _Dial] = {}
        self._budgets: dict[str, ByteBudget] = {}
        self._floors = WriterFloor(secrets.randbits(64) if writer_id is None else writer_id)
        self._writes = QuorumWriter(topology, self._floors, budget=self._budget,
                                    send_reserved=self._apply_reserved, apply_to=self.apply_to, call=self._call)
        self.on_unreachable = on_unreachable
        self.clock = clock
        #: entries per ReadRowPart (21 bytes each), capped by the protocol's part limit
        self.read_chunk_entries = max(1, min(read_chunk_bytes // _ENTRY_BYTES, p.MAX_READ_PART_ENTRIES))
        self.read_parts_in_flight = max(1, read_parts_in_flight)
        #: large rows' memory, kept when dropped and used again (client/row_memory.py)
        self.row_memory = RowMemory(keep_row_bytes)
        self.read_fewest_nodes = read_fewest_nodes
        self.read_around_folds = read_around_folds
        self.read_ramp = RampTracker(read_ramp_s, read_ramp_floor)
        self.registers = RegisterClient(topology, self._call)
        self._ramp_starter = ReadRampStarter(topology, self.read_ramp, clock)
        if read_ramp_s > 0:
            topology.on_change(self._ramp_starter.on_topology_change)

    @property
    def writer_id(self) -> int:
        """The 64-bit writer id of this client's batch ids."""
        return self._floors.writer_id

    # -- plumbing -------------------------------------------------------------------------------------
    async def _connection(self, node: str) -> Connection:
        address = self.topology.address(node)
        conn = self._conns.get(address)
        if conn is not None and not conn.is_closed:
            return conn
        dial = self._conn_locks.setdefault(address, _Dial())
        dial.users += 1
        try:
            async with dial.lock:
                conn = self._conns.get(address)
                if conn is None or conn.is_closed:
                    scheme = scheme_of(address)
                    if scheme not in self.transports:
                        if self.identity is None:
                            raise KeyError(f"no {scheme}:// transport to reach {node}")
                        self.transports[scheme] = make_transport(scheme, self.identity)
                    conn = await connect(self.transports[scheme], address, timeout_s=self.connect_timeout_s)
                    self._drop_closed()
                    self._conns[address] = conn
                return conn
        finally:
            dial.users -= 1
            if not dial.users:
                del self._conn_locks[address]

    def _drop_closed(self) -> None:
        """Forget the connections that closed: one is kept per address ever dialled otherwise (a
        node restarted at a new address leaves its old one behind, closed, for good)."""
        for address in [a for a, c in self._conns.items() if c.is_closed]:
            del self._conns[address]

    async def _call(self, node: str, msg: p.Request, bulk: Sequence[Any] = (), timeout_s: float | None = None,
                    *, recv_into: Sequence[Any] | None = None) -> tuple[p.Reply, list[np.ndarray]]:
        """One request; typed error replies become exceptions; connection-level failures are
        reported to ``on_unreachable`` before they propagate."""
        connecting = True
        try:
            conn = await self._connection(node)
            connecting = False
            result = await conn.request(p.encode(msg), bulk, recv_into=recv_into,
                                        timeout_s=timeout_s or self.request_timeout_s)
        except Exception as exc:
            if self.on_unreachable is not None and _unreachable(exc, connecting):
                try:
                    self.on_unreachable(node)
                except Exception:  # a broken hook must not turn into a failed request
                    log.exception("on_unreachable hook failed node=%s", node)
            raise
        reply = p.decode_reply(result.payload)
        raise_for_reply(node, reply)
        return reply, result.bulk

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
                        timeout_s: float | None = None, busy_ok: bool = False) -> RowBatch:
        """Rows from one node (absent rows left out), any size, checked as a canonical batch: replies
        bounded by the node's read chunk, larger rows read in parts (client/row_parts.py).
        ``busy_ok``: the node may refuse at once while a fold moves its rows (``RemoteUnavailable``;
        the caller reads another replica: reads.py, "Failover")."""
        cols = np.ascontiguousarray(row_column, np.uint64).reshape(-1)
        feats = np.ascontiguousarray(row_feature, np.uint64).reshape(-1)
        return await read_chunked(self._call, node, cols, feats, chunk_entries=self.read_chunk_entries,
                                  epoch=self.topology.epoch, timeout_s=timeout_s,
                                  in_flight=self.read_parts_in_flight, memory=self.row_memory, busy_ok=busy_ok)

    # -- replicated writes (writes.py, writer_floor.py) -----------------------------------------------------
    def next_batch_id(self) -> BatchId:
        """A fresh id of this writer. It counts as unsettled from now on (the floor cannot pass it
        while the caller prepares the write), until written everywhere or ``abandon``-ed."""
        return self._floors.next_batch_id()

    @property
    def writer_floor(self) -> int:
        """Every seq of this writer <= this is settled (writer_floor.py)."""
        return self._floors.floor

    @property
    def _next_seq(self) -> int:
        """The seq ``next_batch_id`` hands out next (tests wait for ``writer_floor`` to reach it - 1)."""
        return self._floors.next_seq

    async def write(self, batch: RowBatch, batch_id: BatchId | None = None) -> WriteResult:
        """Write ``batch`` to all R owners of each row; return once every row has W durable acks.

        Args:
            batch: canonical delta rows.
            batch_id: to retry an earlier write (same id); a new one is allocated when None.

        Raises:
            QuorumNotReached: some row got fewer than W direct acks (retry with the same id).
            LookupError: no storage members known.
        """
        return await self._writes.write(batch, batch_id, self.write_quorum)

    def _hint_holders(self, target: str, rows: NDArray[np.uint64], exclude: set[str]) -> NDArray[np.intp]:
        """Per row, the index of the node that should hold ``target``'s hint (-1: none live)."""
        return hint_holders(self.topology, target, rows, exclude)

    async def confirm_hints(self) -> int:
        """Ask live hinted owners whether our hinted batches reached them; settle those that did.
        Returns the number of (owner, seq) pairs confirmed."""
        return await self._writes.confirm_hints()

    def abandon(self, batch_id: BatchId) -> None:
        """Give up on a failed write of ours: it will never be sent again (lets the floor move)."""
        self._writes.abandon(batch_id)

    # -- replicated reads (reads.py) ------------------------------------------------------------------------
    async def read_rows(self, row_column: Any, row_feature: Any, timeout_s: float | None = None, *,
                        fewest: bool | None = None) -> RowBatch:
        """Rows from the nearest live replica, failing over to the others (absent rows left out).

        ``fewest``: group this read's rows on as few live owners as possible (reads.py, "Fewest
        nodes"); None: the client's ``read_fewest_nodes``. Inference's row fetcher asks for it
        per call (``compute.infer-read-fewest-nodes``).

        Raises:
            ReadFailed: every owner of some rows failed.
            LookupError: no storage members known.
        """
        return await read_replicated(self.topology, self.read_from, self.read_ramp, self.clock,
                                     row_column, row_feature, timeout_s,
                                     fewest=self.read_fewest_nodes if fewest is None else fewest,
                                     around_folds=self.read_around_folds)

    async def read_rows_to_device(self, row_column: Any, row_feature: Any, stager: PinnedStager,
                                  timeout_s: float | None = None) -> DeviceRows:
        """``read_rows``, the batch then moved to ``stager``'s device in one copy through its pooled
        pinned buffer (giaannd/model/gpu/rows.py: validated on the host first, on tcp and ucx alike).

        Raises:
            as ``read_rows``.
        """
        return stager.stage(await self.read_rows(row_column, row_feature, timeout_s))

    # -- cluster-wide scan (scan.py) ------------------------------------------------------------------------
    def scan_all(self, page_rows: int = DEFAULT_SCAN_PAGE_ROWS, timeout_s: float | None = None,
                 page_bytes: int = DEFAULT_SCAN_PAGE_BYTES) -> AsyncIterator[RowBatch]:
        """Every row of the cluster exactly once, as canonical pages in key order (scan.py: every
        node's pages merged k-way). A row over ``page_bytes`` comes in pieces, one per page, so
        consecutive pages may share a key (``RowBatch.concat`` adds the pieces back up).

        Raises (while iterating):
            ScanInterrupted: the placement changed during the scan (start again).
            ReadFailed: a node failed and no other live owner is left for some of its columns.
            LookupError: no storage members known.
        """
        return scan_cluster(self.topology, self._call, page_rows, timeout_s, page_bytes)

    # -- vocabulary (remote_vocab.py) -----------------------------------------------------------------------
    async def put_vocab(self, entries: Sequence[tuple[int, int, str]]) -> int:
        """Store id → string entries on the R owners of each id; returns once each has W durable acks.
        Returns the number of entries sent.

        Raises:
            RemoteVocabConflict: a real hash collision (not retryable).
            VocabWriteFailed: some entry got fewer than W acks (retry: puts are idempotent).
            LookupError: no storage members known.
        """
        return await put_vocab(self.topology, self._call, self.write_quorum, entries)

    async def get_vocab(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """Look up ``(kind, id)`` keys (kind 0 column, 1 feature) on their owners: the first live
        owner, then the next ones for whatever it did not hold. Ids no owner holds are left out.

        Raises:
            ReadFailed: every owner of some ids failed (none answered).
            LookupError: no storage members known.
        """
        return await get_vocab(self.topology, self._call, keys)

    # -- registers (registers.py) ---------------------------------------------------------------------------
    async def read_register(self, key: str, timeout_s: float | None = None) -> RegisterRead:
        """Quorum read of register ``key`` (registers.py: what it guarantees).

        Raises:
            RegisterUnavailable: fewer than a majority of its owners answered.
            LookupError: no storage members known.
        """
        return await self.registers.read(key, timeout_s)

    async def read_write_once_register(self, key: str, timeout_s: float | None = None) -> RegisterRead:
        """Read a *write-once* register (registers.py "Write-once reads": every write of it
        proposes the same bytes, or empties it) from one owner; a quorum read where that owner holds
        nothing. Raises: as ``read_register``."""
        got = await self.registers.read_one(key, timeout_s)
        return got if got is not None else await self.registers.read(key, timeout_s)

    async def cas_register(self, key: str, expect: Version | None, value: bytes = b"",
                           timeout_s: float | None = None) -> CasOutcome:
        """Set register ``key`` to ``value`` if it is at version ``expect`` (``registers.ABSENT``:
        never written); else refused with its current version and value. ``expect`` None: a
        linearizable read.

        Raises:
            RegisterUnavailable: no majority answered, or contention outlasted the rounds (the
                write may or may not have taken effect).
            LookupError: no storage members known.
        """
        return await self.registers.cas(key, expect, value, timeout_s)

    # -- column info (column_info.py) -----------------------------------------------------------------------
    async def column_info(self, column: int, page_rows: int = p.MAX_COLUMN_INFO_ROWS,
                          timeout_s: float | None = None) -> ColumnReport:
        """The column's owners (live or not) and, per live owner, its counts and digests, asked
        of all live owners at once; an owner that fails is reported with ``error``, not raised.

        Raises:
            LookupError: no storage members known (no placement).
        """
        return await column_report(self.topology, self._call, column, page_rows, timeout_s)

    # -- one column's rows (column_rows.py) ----------------------------------------------------------------
    async def read_column(self, column: int, max_entries: int, page_bytes: int = DEFAULT_SCAN_PAGE_BYTES,
                          timeout_s: float | None = None) -> ColumnRead:
        """The rows of ``column`` from one live owner (the next one if it fails: any one replica's
        copy), in key order, cut at ``max_entries`` entries (``truncated``; ``total_entries``
        counts them all). A column no owner holds reads as no rows.

        Raises:
            ReadFailed: no owner is live, or every live one failed.
            LookupError: no storage members known.
        """
        return await read_column(self.topology, self._call, column, max_entries, page_bytes, timeout_s)

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def flush(self) -> None:
        """Wait until background work (late acks, hints) is done."""
        await self._writes.flush()

    async def close(self) -> None:
        """Finish background work (each step is bounded by its request timeout), close connections."""
        await self.flush()
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.close()
