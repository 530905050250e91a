"""Repair across processes: ``RepairServer`` answers a peer's questions about this node's update log
and rows; ``repair_self`` repairs the local node from its live peers (the daemon's ``giaannctl
node repair``, one storage process each).

Glue only: the messages and their rules are in repair/wire.py, what to apply is repair/plan.py's
``plan_repair`` (the same decisions as repair.local.repair, which needs every service in one process):

1. Hints are pushed by the caller before this runs (they close most gaps).
2. For every live peer, all ``LoggedFor`` pages: the records it still logs that this node lacks,
   restricted to this node's columns (and, for an id of a tracked writer this node applied, to
   the columns it lacks under it: ``LoggedFor.applied_columns``), every id it logs that this node
   lacks (in whole or in part), its applied set and its stream writers. If any peer fails to
   answer completely, nothing is applied (a share built without that peer's rows could be
   incomplete, and once applied under its id it could never be completed) and the peer is
   reported in ``peers_failed``.
3. ``plan_repair``; each share is applied through ``apply_local`` under its original batch id. By
   column only if every peer answered by column (``LoggedPage.by_column``: a peer from before
   lists no id this node applied, so one held in part would look lost to that peer's log).
4. Every peer's ``DigestsFor`` pages against this node's rows in the columns both own; rows whose
   strength digests differ are fetched (``RowsOf``) and compared within ``tolerance``.

A batch applied by a peer *after* that peer's last page was read is not seen by this run (a write
still in flight reaches this node by itself); this is the same window repair_ops has.

Serving: the storage node's stream endpoint hands every payload for which
``repair.wire.is_repair_request(payload)`` is true (tag >= 200) to
``RepairServer.handle_incoming(incoming)`` and returns its ``Reply`` (``with_repair`` builds that
dispatching handler around another one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
from numpy.typing import NDArray

from giaannd.errors import RemoteFault
from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ENTRY_BYTES
from giaannd.storage.engine.errors import CorruptLogError
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.row_digest import ROW_DIGEST_VERSIONS, row_digests
from giaannd.storage.engine.update_log import LogRecord, list_segments, scan_segment
from giaannd.storage.repair.plan import add_record, plan_repair
from giaannd.storage.repair.wire import (
    DEFAULT_PAGE_BYTES,
    MAX_PAGE_BYTES,
    MAX_PAGE_ROWS,
    DigestsFor,
    DigestsPage,
    Divergence,
    LoggedFor,
    LoggedPage,
    RepairRefused,
    RepairRequest,
    RowsOf,
    RowsPage,
    applied_arrays,
    applied_columns_of,
    applied_from_bulk,
    compare_digests,
    decode_repair,
    decode_repair_reply,
    is_repair_request,
    owned_mask,
    pack_batches,
    placement_from_spec,
    rows_differ,
    select_log_page,
    spec_of,
    unpack_batches,
)
from giaannd.storage.replication.background_fold import BackgroundFold
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.column_sets import member
from giaannd.storage.streaming.sender import apply_local
from giaannd.storage.streaming.writers import stream_columns_of, stream_writers_of
from peers.errors import PeersError
from peers.placement import Placement
from peers.transport import Connection, Handler, Incoming, Reply, Transport, connect

__all__ = ["RepairFailed", "RepairServer", "repair_self", "with_repair"]

log = logging.getLogger(__name__)

_ENC: Final = msgspec.msgpack.Encoder()
#: Entries copied per DigestsFor page at most (the scan gathers the rows it looks at).
_DIGEST_PAGE_ENTRIES: Final = 1 << 20
#: Keys looked at per DigestsFor page (filtered out or not), as protocol.MAX_SCAN_EXAMINE.
_DIGEST_PAGE_EXAMINE: Final = 262_144
REQUEST_TIMEOUT_S: Final = 30.0
CONNECT_TIMEOUT_S: Final = 5.0


class RepairFailed(RemoteFault):
    """A peer refused a repair request or answered something else than the protocol says."""

    reason = "repair_failed"


def _reply(msg: msgspec.Struct, bulk: Sequence[Any] = ()) -> Reply:
    return Reply(_ENC.encode(msg), list(bulk))


def _u64(values: Sequence[int]) -> NDArray[np.uint64]:
    return np.array(values, np.uint64) if len(values) else np.zeros(0, np.uint64)


# -- server -------------------------------------------------------------------------------------------
def _records_after(directory: Path, after_seq: int) -> Iterator[LogRecord]:
    """The log's records with seq > ``after_seq``, segment by segment (skipping earlier segments;
    a segment dropped by a snapshot meanwhile is skipped: its records left the log)."""
    segments = list_segments(directory)
    for i, (first, path) in enumerate(segments):
        if i + 1 < len(segments) and segments[i + 1][0] - 1 <= after_seq:
            continue
        try:
            scan = scan_segment(path, first, is_last=i == len(segments) - 1)
        except FileNotFoundError:
            continue
        yield from scan.records


class RepairServer:
    """Answers repair requests (repair/wire.py) about one local storage service."""

    def __init__(self, service: StorageService) -> None:
        self.service = service

    def _store(self) -> DurableStore:
        if self.service.store is None:
            raise RuntimeError("storage service is not open")
        return self.service.store

    async def handle_incoming(self, incoming: Incoming) -> Reply:
        """Decode and serve one request; bad input gets a ``RepairRefused`` reply."""
        try:
            msg = decode_repair(incoming.payload)
        except ValueError as exc:
            return _reply(RepairRefused(str(exc)[:400]))
        return await self.handle(msg, incoming.bulk)

    async def handle(self, msg: RepairRequest, bulk: Sequence[Any]) -> Reply:
        """Serve one decoded request (``RepairRefused`` for anything it cannot serve; never raises
        for peer input, never changes this node's state)."""
        try:
            if isinstance(msg, LoggedFor):
                return await self._logged(msg, bulk)
            if (folds := self.service.folds) is not None:  # not while a fold moves the rows (the
                await folds.ready()  # engine's lock would block the event loop); no await after
            if isinstance(msg, DigestsFor):
                return self._digests(msg, bulk)
            return self._rows(msg, bulk)
        except (ValueError, RuntimeError, CorruptLogError, OSError) as exc:
            log.warning("repair request refused: %s: %s", type(exc).__name__, exc)
            return _reply(RepairRefused(f"{type(msg).__name__}: {type(exc).__name__}: {exc}"[:400]))

    def _placement_with(self, spec: Any, node: str) -> Placement:
        placement = placement_from_spec(spec)
        if node not in placement.names:
            raise ValueError(f"node {node!r} is not a member of the placement")
        return placement

    async def _logged(self, msg: LoggedFor, bulk: Sequence[Any]) -> Reply:
        store = self._store()
        placement = self._placement_with(msg.placement, msg.node)
        node_applied = applied_from_bulk(bulk, msg.applied_columns)
        mine = stream_writers_of(self.service)
        excluded = mine | set(msg.stream_writers)
        # One instant on the event loop (no await between): every id in ``applied`` was appended
        # to the log at a seq <= upto before it was applied (DurableStore.apply).
        upto, applied = store.log.last_seq, applied_arrays(store.store.applied)
        page = await asyncio.to_thread(
            lambda: select_log_page(_records_after(store.directory, msg.after_seq), msg.after_seq, upto,
                                    owned_mask(placement, msg.node), node_applied, excluded,
                                    min(msg.max_bytes, MAX_PAGE_BYTES)))
        reply = LoggedPage(self.service.node_name, [(b.writer, b.seq, r.num_rows) for b, r in page.records],
                           page.next_after_seq, page.reached_end, sorted(mine), msg.applied_columns is not None)
        ids = [_u64([b.writer for b in page.ids]), _u64([b.seq for b in page.ids])]
        return _reply(reply, [*pack_batches([r for _, r in page.records]), *ids,
                              *(applied if page.reached_end else applied_arrays(None))])

    def _digests(self, msg: DigestsFor, bulk: Sequence[Any]) -> Reply:
        if bulk:
            raise ValueError("DigestsFor takes no bulk")
        # a newer asker's version: the newest this node knows (the reply says which)
        version = min(msg.digest_version, ROW_DIGEST_VERSIONS[-1])
        rows = self._store().store
        placement = self._placement_with(msg.placement, msg.node)
        owned = owned_mask(placement, msg.node, self.service.node_name)
        res = rows.scan(msg.after, min(msg.max_rows, MAX_PAGE_ROWS), _DIGEST_PAGE_ENTRIES, _DIGEST_PAGE_EXAMINE,
                        keep=owned)
        b = res.batch
        kd, sd = row_digests(b.offsets, Row(b.segment, b.target_column, b.target_feature, b.strength), version)
        return _reply(DigestsPage(res.next_key, res.done, version), [b.row_column, b.row_feature, kd, sd])

    def _rows(self, msg: RowsOf, bulk: Sequence[Any]) -> Reply:
        if len(bulk) != 2 or any(not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.uint64
                                 for a in bulk) or bulk[0].shape != bulk[1].shape:
            raise ValueError("RowsOf: expected two equal-length 1-d uint64 key arrays")
        if bulk[0].size > MAX_PAGE_ROWS:
            raise ValueError(f"RowsOf: at most {MAX_PAGE_ROWS} keys per request")
        rows = self._store().store
        cols, feats = bulk
        # the keys served: as many as fit the page's bytes (16 + the entries of each), one at least
        used = np.cumsum(16 + ENTRY_BYTES * rows.row_lengths(cols, feats))
        served = max(1, int(np.searchsorted(used, min(msg.max_bytes, MAX_PAGE_BYTES), "right"))) if cols.size else 0
        batch = rows.read_rows(cols[:served], feats[:served])
        return _reply(RowsPage(served), batch.buffers())


def with_repair(server: RepairServer, other: Handler) -> Handler:
    """A listener handler serving repair requests (tag >= 200) with ``server`` and everything else
    with ``other`` (e.g. ``StreamEndpoint.handle``)."""

    async def handle(incoming: Incoming) -> Reply:
        if is_repair_request(incoming.payload):
            return await server.handle_incoming(incoming)
        return await other(incoming)

    return handle


# -- client ---------------------------------------------------------------------------------------------
async def _at_once() -> None:
    """A ``rows_ready`` with nothing to wait for."""


class _Peer:
    """One connection to a peer's repair server, with the paging loops."""

    def __init__(self, name: str, conn: Connection, me: str, placement: Placement) -> None:
        self.name, self.conn, self.me = name, conn, me
        self.spec = spec_of(placement)

    async def _ask(self, msg: msgspec.Struct, bulk: Sequence[Any], want: type[Any]) -> tuple[Any, list[Any]]:
        res = await self.conn.request(_ENC.encode(msg), list(bulk), timeout_s=REQUEST_TIMEOUT_S)
        try:
            reply = decode_repair_reply(res.payload)
        except ValueError as exc:
            raise RepairFailed(f"{self.name}: {exc}") from exc
        if isinstance(reply, RepairRefused):
            raise RepairFailed(f"{self.name} refused: {reply.reason}")
        if not isinstance(reply, want):
            raise RepairFailed(f"{self.name}: unexpected {type(reply).__name__} to {type(msg).__name__}")
        return reply, res.bulk

    async def logged(self, my_applied: AppliedSet, my_writers: set[int], page_bytes: int
                     ) -> tuple[dict[BatchId, RowBatch], AppliedSet, set[int], bool]:
        """Every page: (records by id, ids without rows mapped to empty batches), applied, writers,
        and whether every page was selected by column (``LoggedPage.by_column``)."""
        out: dict[BatchId, RowBatch] = {}
        by_column = True
        # (the columns too: a tracked writer's id may be held for some of this node's columns only)
        after, arrays, columns = 0, applied_arrays(my_applied), applied_columns_of(my_applied)
        while True:
            req = LoggedFor(self.me, self.spec, after, page_bytes, sorted(my_writers), columns)
            page, bulk = await self._ask(req, arrays, LoggedPage)
            by_column &= page.by_column
            if len(bulk) != 13:
                raise RepairFailed(f"{self.name}: LoggedPage with {len(bulk)} buffers, expected 13")
            try:
                batches = unpack_batches(bulk[:7], [n for _, _, n in page.records])
                if any(a.dtype != np.uint64 or a.ndim != 1 for a in bulk[7:9]) or bulk[7].shape != bulk[8].shape:
                    raise ValueError("ids: expected two equal-length 1-d uint64 arrays")
                for w, s in zip(bulk[7].tolist(), bulk[8].tolist()):
                    out.setdefault(BatchId(w, s), RowBatch.empty())
                for (w, s, _), batch in zip(page.records, batches):
                    add_record(out, BatchId(w, s), batch)  # (one record per share of an id)
                if page.done:
                    return out, applied_from_bulk(bulk[9:13]), set(page.stream_writers), by_column
            except ValueError as exc:
                raise RepairFailed(f"{self.name}: bad LoggedPage: {exc}") from exc
            if page.next_after_seq <= after:
                raise RepairFailed(f"{self.name}: LoggedPage made no progress")
            after = page.next_after_seq

    async def compare(self, store: DurableStore, shared: tuple[NDArray[np.uint64], NDArray[np.uint64]],
                      tolerance: float, out: Divergence, extra: KeyIndex,
                      rows_ready: Callable[[], Awaitable[None]] = _at_once,
                      digest_version: int = ROW_DIGEST_VERSIONS[-1]) -> None:
        """This node's rows ``shared`` (sorted keys of the rows in columns both own) against the
        peer's: the divergent rows go to ``out``; the peer's rows this node lacks to ``extra``
        too (to count the rows compared). ``rows_ready``: awaited before each look at this node's
        rows (no await between it and the look): a fold under way ends first
        (background_fold.py). Arrays throughout: no Python per row (version 2 digests; a peer
        from before versions answers version 1, hashed here per row as it is there)."""
        after: tuple[int, int] | None = None
        reported = np.zeros(shared[0].shape[0], bool)  # shared rows the peer listed
        index = KeyIndex.from_keys(np.array(shared[0]), np.array(shared[1]))
        recheck: list[tuple[NDArray[np.uint64], NDArray[np.uint64]]] = []
        while True:
            page, bulk = await self._ask(DigestsFor(self.me, self.spec, after, digest_version=digest_version),
                                         (), DigestsPage)
            cols, feats, keys_there, strength_there = self._digest_arrays(page, bulk)
            await rows_ready()
            present, keys_here, strength_here = store.store.row_digests(cols, feats, page.digest_version)
            verdict = compare_digests(present, keys_here, strength_here, keys_there, strength_there)
            out.add(cols[verdict.missing], feats[verdict.missing], f"missing on {self.me}, present on {self.name}")
            out.add(cols[verdict.differ], feats[verdict.differ], f"{self.name} differs from {self.me} (targets)")
            extra.lookup_or_add(cols[verdict.missing], feats[verdict.missing])
            recheck.append((cols[verdict.recheck], feats[verdict.recheck]))
            at = index.lookup(cols, feats)
            reported[at[at >= 0]] = True
            if page.done or page.next_after is None:
                break
            if after is not None and tuple(page.next_after) <= after:
                raise RepairFailed(f"{self.name}: DigestsPage made no progress")
            after = tuple(page.next_after)
        out.add(shared[0][~reported], shared[1][~reported], f"missing on {self.name}, present on {self.me}")
        if recheck:
            await self._recheck(store, np.concatenate([c for c, _ in recheck]), np.concatenate([f for _, f in recheck]),
                                tolerance, out, rows_ready)

    def _digest_arrays(self, page: DigestsPage, bulk: Sequence[Any]) -> list[NDArray[np.uint64]]:
        """A DigestsPage's four arrays (keys, features, keys digests, strength digests), checked."""
        if page.digest_version not in ROW_DIGEST_VERSIONS:
            raise RepairFailed(f"{self.name}: DigestsPage in unknown digest version {page.digest_version}")
        if len(bulk) != 4:
            raise RepairFailed(f"{self.name}: DigestsPage with {len(bulk)} buffers, expected 4")
        if any(not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.uint64 or a.shape != bulk[0].shape
               for a in bulk):
            raise RepairFailed(f"{self.name}: DigestsPage buffers are not four equal-length 1-d uint64 arrays")
        return list(bulk)

    async def _recheck(self, store: DurableStore, cols: NDArray[np.uint64], feats: NDArray[np.uint64],
                       tolerance: float, out: Divergence, rows_ready: Callable[[], Awaitable[None]]) -> None:
        """The rows whose strength digests differ: fetched from the peer page by page and compared
        with this node's within ``tolerance`` (``rows_differ``: vectorised)."""
        while cols.shape[0]:
            c, f = cols[:MAX_PAGE_ROWS], feats[:MAX_PAGE_ROWS]
            page, bulk = await self._ask(RowsOf(DEFAULT_PAGE_BYTES), [c, f], RowsPage)
            if not 1 <= page.served <= c.shape[0]:
                raise RepairFailed(f"{self.name}: RowsPage served {page.served} of {c.shape[0]} keys")
            try:
                theirs = RowBatch.from_buffers(bulk, validate=True)
            except ValueError as exc:
                raise RepairFailed(f"{self.name}: bad RowsPage: {exc}") from exc
            c, f = c[: page.served], f[: page.served]
            await rows_ready()
            differ = rows_differ(c, f, store.store.read_rows(c, f), theirs, tolerance)
            out.add(c[differ], f[differ], f"{self.name} differs from {self.me}")
            cols, feats = cols[page.served :], feats[page.served :]


async def _open_peers(transport: Transport, peer_addresses: dict[str, str], me: str, placement: Placement,
                      failed: dict[str, str]) -> list[_Peer]:
    peers: list[_Peer] = []
    for name, address in sorted(peer_addresses.items()):
        if name == me:
            continue
        try:
            conn = await connect(transport, address, timeout_s=CONNECT_TIMEOUT_S)
        except (PeersError, OSError) as exc:
            failed[name] = f"connect: {type(exc).__name__}: {exc}"
            continue
        peers.append(_Peer(name, conn, me, placement))
    return peers


def _keys_by_peer(store: DurableStore, placement: Placement, me: str, peers: Sequence[str]
                  ) -> tuple[int, dict[str, tuple[NDArray[np.uint64], NDArray[np.uint64]]]]:
    """How many rows this node holds in columns it owns, and of those, the keys (sorted, as two
    arrays) of the ones each peer also owns. Owners are computed once per column, not per row."""
    cols, feats = store.store.key_arrays()
    none = (cols[:0], feats[:0])
    if me not in placement.names or not cols.shape[0]:
        return 0, {p: none for p in peers}
    first = np.ones(cols.shape[0], bool)
    first[1:] = cols[1:] != cols[:-1]
    starts = np.flatnonzero(first)
    owners = placement.owner_indices(cols[starts])  # one row of owner indices per column
    per_row = np.diff(np.append(starts, cols.shape[0]))

    def rows_owned_with(name: str) -> NDArray[np.bool_]:
        if name not in placement.names:
            return np.zeros(cols.shape[0], bool)
        return np.repeat((owners == placement.names.index(name)).any(axis=1), per_row)

    mine = rows_owned_with(me)
    out: dict[str, tuple[NDArray[np.uint64], NDArray[np.uint64]]] = {}
    for p in peers:
        both = mine & rows_owned_with(p)
        out[p] = (cols[both], feats[both])
    return int(mine.sum()), out


async def repair_self(service: StorageService, transport: Transport, peer_addresses: dict[str, str],
                      placement: Placement, tolerance: float = 1e-5, *,
                      page_bytes: int = DEFAULT_PAGE_BYTES,
                      digest_version: int = ROW_DIGEST_VERSIONS[-1]) -> dict[str, Any]:
    """Repair this node from its live peers (module docstring). Hints must have been pushed first.

    Args:
        service: the local, open storage service (its ``node_name`` is the repaired node).
        transport: used to connect to the peers' repair servers.
        peer_addresses: live peer name -> address of the listener serving its ``RepairServer``.
        placement: the placement in force (every peer is asked under it).
        tolerance: relative tolerance of the strength comparison.
        page_bytes: bytes per LoggedFor page (smaller: more round trips, less memory per page).
        digest_version: the repair digest version asked of the peers (row_digest.py; the newest
            by default: 1 is what nodes from before versions compute, per row, for comparisons).

    Returns:
        ``{"batches_shipped", "rows_shipped", "unrecoverable": {node: [...]}, "unlogged": {node:
        {peer: count}}, "rows_compared", "rows_divergent": [...], "rows_divergent_count",
        "peers_failed": {peer: reason}}`` (repair.local.repair's shape for one node;
        "unrecoverable"/"unlogged" empty when nothing; "rows_divergent" describes at most
        ``wire.MAX_DIVERGENT_LISTED`` rows, "rows_divergent_count" counts them all).
    """
    store = service.store
    if store is None:
        raise RuntimeError("storage service is not open")
    me = service.node_name
    failed: dict[str, str] = {}
    report: dict[str, Any] = {"batches_shipped": 0, "rows_shipped": 0, "unrecoverable": {}, "unlogged": {},
                              "rows_compared": 0, "rows_divergent": [], "rows_divergent_count": 0,
                              "peers_failed": failed}
    peers = await _open_peers(transport, peer_addresses, me, placement, failed)
    try:
        await _rebuild(service, store, peers, placement, page_bytes, report)
        await _compare(store, me, peers, placement, tolerance, report, service.folds, digest_version)
    finally:
        for p in peers:
            with contextlib.suppress(Exception):
                await p.conn.close()
    return report


async def _rebuild(service: StorageService, store: DurableStore, peers: list[_Peer], placement: Placement,
                   page_bytes: int, report: dict[str, Any]) -> None:
    me, failed = service.node_name, report["peers_failed"]
    mine = stream_writers_of(service)
    logs: dict[str, dict[BatchId, RowBatch]] = {}
    applied: dict[str, AppliedSet] = {}
    excluded = set(mine)
    by_column = True  # every peer answered by column (``plan_repair``'s ``by_column``)
    for p in peers:
        try:
            logs[p.name], applied[p.name], writers, answered = await p.logged(store.store.applied, mine, page_bytes)
            excluded |= writers
            by_column &= answered
        except (RepairFailed, PeersError, OSError) as exc:
            failed[p.name] = f"logged: {exc}"
    if failed:
        log.warning("repair node=%s: applying nothing, peers did not answer: %s", me, failed)
        return
    streamed = stream_columns_of(service)
    plan = plan_repair(store.store.applied, owned_mask(placement, me), logs, applied, excluded,
                       lambda cols: member(cols, streamed), by_column=by_column)
    for bid, share in plan.shares.items():
        if await apply_local(service, bid, share):
            report["batches_shipped"] += 1
            report["rows_shipped"] += share.num_rows
    if plan.unlogged:
        report["unlogged"][me] = plan.unlogged
    if plan.unrecoverable:
        report["unrecoverable"][me] = [f"{b.writer:#x}/{b.seq}: {why}" for b, why in plan.unrecoverable.items()]


async def _compare(store: DurableStore, me: str, peers: list[_Peer], placement: Placement, tolerance: float,
                   report: dict[str, Any], folds: BackgroundFold | None = None,
                   digest_version: int = ROW_DIGEST_VERSIONS[-1]) -> None:
    names = [p.name for p in peers]
    if folds is None:
        held, shared = _keys_by_peer(store, placement, me, names)
    else:  # O(rows): in a worker thread behind the fold gate, not on the event loop (background_fold.py)
        held, shared = await folds.whole_store(_keys_by_peer, store, placement, me, names)
    divergent, extra = Divergence(), KeyIndex()  # (extra: rows peers hold that this node lacks)
    for p in peers:
        if p.name in report["peers_failed"]:
            continue
        try:
            await p.compare(store, shared[p.name], tolerance, divergent, extra,
                            _at_once if folds is None else folds.ready, digest_version)
        except (RepairFailed, PeersError, OSError) as exc:
            report["peers_failed"][p.name] = f"compare: {exc}"
    report["rows_compared"] = held + len(extra)
    report["rows_divergent"] = divergent.listed
    report["rows_divergent_count"] = divergent.count
