"""Repair across processes: the messages and the pure rules behind them (no I/O).

Theory of operation
-------------------
repair/plan.py decides *what* a node is missing from its peers' update logs and applied sets; in the
daemon those live in other processes, so the node asks for them (repair/remote.py is the glue).
Every request is self-contained (no server-side session), so a page can be re-asked after a
reconnect and a server keeps no state between pages:

- ``LoggedFor(node, placement, after_seq)`` + the asking node's applied set (bulk): one page of
  the batch records in the server's update log with log seq > ``after_seq``, each restricted to
  the rows in columns ``node`` owns under ``placement``, leaving out records ``node`` has applied
  and records of stream writers (copies, not writes: repair/plan.py). With ``applied_columns``
  (``AppliedColumns``: the columns ``node`` applied under each batch id of a tracked writer above
  its promised floor, applied_set.py "Which columns") an id ``node`` applied counts as applied only
  in those columns: its record is restricted to the columns ``node`` owns and lacks under it (a
  replica may hold part of a batch). The page also lists the ids of *every* logged record ``node``
  lacks, in whole or in part, touching its columns or not: plan_repair needs them to tell
  "applied there but left its log" (unrecoverable) from "logged, just not in my columns". The last
  page (``done``) carries the server's applied set, read on the event loop at the same instant as
  the log's last seq that bounds the page: every id in that set was appended to the log before
  it was applied, so it is either in the pages or truly gone from the log (snapshotted away).
- ``DigestsFor(node, placement, after, digest_version)``: one page of (row key, keys digest,
  strength digest) of the server's rows in columns both it and ``node`` own, in a repair digest
  version (row_digest.py: version 2 is computed for a page at once, version 1 per row, for peers
  from before versions); the reply names the version it used.
- ``RowsOf(keys)``: the server's rows of those keys, for the rows whose strength digests differ
  (replicas sum the same batches in different orders; strengths are compared within a tolerance).

Tags: requests 200..229, replies 230..255. The storage node's stream endpoint serves these next to
its stream messages (tags 1..63 / 64..127), so tags are append only and never reused
(``is_repair_request`` tells the two apart by the tag alone). Placement travels as its members,
weights, replicas, strategy and pins plus its epoch; the server rebuilds it and refuses a request
whose epoch does not match (the two would disagree on ownership).

Bulk layouts (all 1-d, little-endian numpy arrays):

=============  =========================================================================
LoggedFor      applied set: writers u64, floors u64, exception counts u64, exceptions u64
LoggedPage     7 RowBatch buffers of all records' rows concatenated (``pack_batches``),
               ids: writer u64, seq u64; the server's applied set (4 arrays, empty unless done)
DigestsPage    row_column u64, row_feature u64, keys digest u64, strength digest u64
RowsOf         row_column u64, row_feature u64
RowsPage       7 RowBatch buffers
=============  =========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, cast

import msgspec
import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.rowengine.run import range_positions
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.update_log import LogRecord
from giaannd.storage.repair.plan import lacking
from peers.placement import Member, Placement, Strategy
from peers.wire import DECODE_ERRORS

__all__ = [
    "DEFAULT_PAGE_BYTES",
    "MAX_APPLIED_COLUMNS_SENT",
    "MAX_DIVERGENT_LISTED",
    "MAX_PAGE_BYTES",
    "MAX_PAGE_RECORDS",
    "MAX_PAGE_ROWS",
    "REPAIR_TAG_MIN",
    "AppliedColumns",
    "DigestVerdict",
    "Divergence",
    "DigestsFor",
    "DigestsPage",
    "LogPage",
    "LoggedFor",
    "LoggedPage",
    "PlacementSpec",
    "RepairRefused",
    "RepairReply",
    "RepairRequest",
    "RowsOf",
    "RowsPage",
    "applied_arrays",
    "applied_columns_of",
    "applied_from_bulk",
    "compare_digests",
    "decode_repair",
    "decode_repair_reply",
    "is_repair_request",
    "owned_mask",
    "pack_batches",
    "placement_from_spec",
    "rows_differ",
    "select_log_page",
    "spec_of",
    "unpack_batches",
]

#: Smallest tag of this message family; everything below belongs to the stream endpoint.
REPAIR_TAG_MIN: Final = 200
#: Default and largest bytes of rows (+16 per listed id) in one LoggedPage / RowsPage: big enough
#: to amortise a round trip, small enough that a page is a fraction of the frame limits
#: (peers.framing.MAX_BULK_BYTES_PER_FRAME) and of a receiver's memory.
DEFAULT_PAGE_BYTES: Final = 8 * 2**20
MAX_PAGE_BYTES: Final = 256 * 2**20
#: Records listed in one LoggedPage header (the header is msgpack, bounded by MAX_BODY_BYTES).
MAX_PAGE_RECORDS: Final = 65_536
#: Rows per DigestsPage and keys per RowsOf (as protocol.MAX_DIGEST_ROWS).
MAX_PAGE_ROWS: Final = 65_536
#: Columns sent in one LoggedFor's ``applied_columns`` at most: msgpack, at most 9 bytes each, so
#: ~9 MiB under the header's peers.framing.MAX_BODY_BYTES (16 MiB). A node holding more (batches
#: in flight held back by outstanding hints) sends the ids whose columns fit; the others count as
#: applied whole there (as before ``applied_columns``), so a part missing of those is not shipped.
MAX_APPLIED_COLUMNS_SENT: Final = 1 << 20

_U64 = Annotated[int, msgspec.Meta(ge=0)]  # (msgpack uint64 at most)
_Bytes = Annotated[int, msgspec.Meta(ge=1)]


class PlacementSpec(msgspec.Struct, frozen=True):
    """A placement as data: enough to rebuild it exactly (``epoch`` checks that)."""

    members: list[tuple[str, float]]
    replicas: int
    strategy: str = "hash"
    pins: list[tuple[_U64, list[str]]] = []
    epoch: str = ""


class AppliedColumns(msgspec.Struct, frozen=True):
    """Which columns a node applied under each batch id of its tracked writers above their promised
    floors: ``AppliedSet.column_arrays`` as lists (tracked writers, their promised floors; per batch
    id writer, seq, column count; the columns concatenated, each id's sorted)."""

    tracked: list[_U64] = []
    promised: list[_U64] = []
    writers: list[_U64] = []
    seqs: list[_U64] = []
    counts: list[_U64] = []
    columns: list[_U64] = []


# -- requests (tags 200..229; append only) ---------------------------------------------------------
class LoggedFor(msgspec.Struct, frozen=True, tag=200):
    """Logged records ``node`` lacks, restricted to its columns. Bulk: its applied set (4 arrays).
    ``applied_columns`` (added Dec 1; a server from before ignores it and counts every id in the
    applied set as applied whole): the columns applied under its tracked writers' ids, so that the
    columns it lacks under an id it applied are sent too. Reply: ``LoggedPage``."""

    node: str
    placement: PlacementSpec
    after_seq: _U64 = 0
    max_bytes: _Bytes = DEFAULT_PAGE_BYTES
    stream_writers: list[_U64] = []  # the asking node's (excluded like the server's own)
    applied_columns: AppliedColumns | None = None


class DigestsFor(msgspec.Struct, frozen=True, tag=201):
    """Row digests in columns both ``node`` and the server own, keys > ``after`` (if given), in
    repair digest version ``digest_version`` (row_digest.py; a server that does not know it
    answers in the newest it knows below it, and says which: ``DigestsPage.digest_version``; a
    server from before versions ignores the field and answers in 1). Reply: ``DigestsPage``."""

    node: str
    placement: PlacementSpec
    after: tuple[_U64, _U64] | None = None
    max_rows: _Bytes = MAX_PAGE_ROWS
    digest_version: Annotated[int, msgspec.Meta(ge=1, le=255)] = 1


class RowsOf(msgspec.Struct, frozen=True, tag=202):
    """The rows of the keys in bulk (absent ones left out). Reply: ``RowsPage``."""

    max_bytes: _Bytes = DEFAULT_PAGE_BYTES


# -- replies (tags 230..255; append only) ----------------------------------------------------------
class LoggedPage(msgspec.Struct, frozen=True, tag=230):
    """``records``: (writer, seq, rows in the packed bulk) in log order. Resume after
    ``next_after_seq`` unless ``done``. ``by_column`` (added Dec 1; absent from a server from
    before: False): the page was selected by the request's ``applied_columns``, so it lists the
    ids the asker holds in part; without it, an id the asker applied is never listed, even if
    logged here."""

    server: str
    records: list[tuple[_U64, _U64, int]]
    next_after_seq: _U64
    done: bool
    stream_writers: list[_U64] = []
    by_column: bool = False


class RepairRefused(msgspec.Struct, frozen=True, tag=231):
    """The request was not served; nothing changed on the server."""

    reason: str


class DigestsPage(msgspec.Struct, frozen=True, tag=232):
    """``digest_version``: the repair digest version of the page's digests (absent from a server
    from before versions: 1)."""

    next_after: tuple[_U64, _U64] | None
    done: bool
    digest_version: int = 1


class RowsPage(msgspec.Struct, frozen=True, tag=233):
    """``served``: how many of the requested keys this page answers (ask again for the rest)."""

    served: int


RepairRequest = LoggedFor | DigestsFor | RowsOf
RepairReply = LoggedPage | RepairRefused | DigestsPage | RowsPage

_REQ: Final = msgspec.msgpack.Decoder(RepairRequest)
_REP: Final = msgspec.msgpack.Decoder(RepairReply)


class _Tag(msgspec.Struct):
    type: int = -1


_TAG: Final = msgspec.msgpack.Decoder(_Tag)


def is_repair_request(payload: bytes | memoryview) -> bool:
    """True if ``payload`` is a msgpack map whose tag is in this family (>= ``REPAIR_TAG_MIN``).

    The stream endpoint's dispatcher calls this first and hands such payloads to
    ``RepairServer.handle_incoming``; anything undecodable is left to the stream decoder.
    """
    try:
        return _TAG.decode(payload).type >= REPAIR_TAG_MIN
    except DECODE_ERRORS:
        return False


def decode_repair(payload: bytes | memoryview) -> RepairRequest:
    """Decode one request.

    Raises:
        ValueError: undecodable, unknown tag, or a field out of range (msgspec's ``$.path`` kept).
    """
    try:
        # (a typed name, not ``cast``: msgspec 0.23's stubs type the decoder's result, 0.22's do not)
        request: RepairRequest = _REQ.decode(payload)
        return request
    except DECODE_ERRORS as exc:
        raise ValueError(f"undecodable repair request: {exc}") from exc


def decode_repair_reply(payload: bytes | memoryview) -> RepairReply:
    """Decode one reply (ValueError as ``decode_repair``)."""
    try:
        reply: RepairReply = _REP.decode(payload)
        return reply
    except DECODE_ERRORS as exc:
        raise ValueError(f"undecodable repair reply: {exc}") from exc


# -- placement ---------------------------------------------------------------------------------------
def spec_of(placement: Placement) -> PlacementSpec:
    return PlacementSpec([(m.name, m.weight) for m in placement.members], placement.replicas,
                         placement.strategy, sorted((k, list(v)) for k, v in placement.pins.items()),
                         placement.epoch)


def placement_from_spec(spec: PlacementSpec) -> Placement:
    """Rebuild a placement.

    Raises:
        ValueError: invalid members/strategy, or the rebuilt epoch differs from ``spec.epoch``.
    """
    try:
        placement = Placement(tuple(Member(n, w) for n, w in spec.members), spec.replicas,
                              cast(Strategy, spec.strategy), {k: tuple(v) for k, v in spec.pins})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"bad placement: {exc}") from exc
    if spec.epoch and placement.epoch != spec.epoch:
        raise ValueError(f"placement epoch mismatch: sent {spec.epoch}, rebuilt {placement.epoch}")
    return placement


Owned = Callable[[NDArray[np.uint64]], NDArray[np.bool_]]


def owned_mask(placement: Placement, *names: str) -> Owned:
    """Which columns every one of ``names`` owns (none, for a name not in the placement)."""
    idx = [placement.names.index(n) if n in placement.names else -1 for n in names]

    def owned(cols: NDArray[np.uint64]) -> NDArray[np.bool_]:
        if cols.size == 0 or -1 in idx:
            return np.zeros(cols.shape[0], np.bool_)
        owners = placement.owner_indices(cols)
        mask = np.ones(cols.shape[0], np.bool_)
        for i in idx:
            mask &= (owners == i).any(axis=1)
        return mask

    return owned


# -- applied sets and batches as bulk ------------------------------------------------------------------
def applied_arrays(applied: AppliedSet | None) -> list[NDArray[np.uint64]]:
    if applied is None:
        return [np.zeros(0, np.uint64) for _ in range(4)]
    return list(applied.to_arrays())


def _u64(arr: Any, what: str) -> NDArray[np.uint64]:
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.uint64:
        raise ValueError(f"{what}: expected a 1-d uint64 array")
    return arr


def applied_from_bulk(bulk: Sequence[Any], columns: AppliedColumns | None = None) -> AppliedSet:
    """The applied set in ``bulk``, with ``columns`` (the asker's, if sent) loaded into it.

    Raises:
        ValueError: ``bulk`` is not four consistent u64 arrays (AppliedSet.from_arrays), or
            ``columns`` does not fit the set (AppliedSet.load_column_arrays).
    """
    if len(bulk) != 4:
        raise ValueError(f"applied set: expected 4 arrays, got {len(bulk)}")
    w, f, c, e = (_u64(a, "applied set") for a in bulk)
    applied = AppliedSet.from_arrays(w, f, c, e)
    if columns is not None:
        if sum(columns.counts) != len(columns.columns):  # (exact: a u64 sum of the counts could wrap)
            raise ValueError("applied columns: column count does not match")
        applied.load_column_arrays(*(np.array(v, np.uint64) for v in (
            columns.tracked, columns.promised, columns.writers, columns.seqs, columns.counts, columns.columns)))
    return applied


def applied_columns_of(applied: AppliedSet, limit: int = MAX_APPLIED_COLUMNS_SENT) -> AppliedColumns:
    """``applied``'s columns per batch id as sent in ``LoggedFor``: the ids whose columns fit in
    ``limit`` columns in all (the first ones, by writer and seq; ``MAX_APPLIED_COLUMNS_SENT``)."""
    tracked, promised, writers, seqs, counts, columns = applied.column_arrays()
    fit = int(np.searchsorted(np.cumsum(counts), limit, "right"))
    sent = int(counts[:fit].sum())
    return AppliedColumns(tracked.tolist(), promised.tolist(), writers[:fit].tolist(), seqs[:fit].tolist(),
                          counts[:fit].tolist(), columns[:sent].tolist())


def pack_batches(batches: Sequence[RowBatch]) -> list[NDArray[Any]]:
    """Seven buffers holding every batch's rows back to back (offsets rebased; not canonical as a
    whole: split with ``unpack_batches`` and the per-batch row counts)."""
    if not batches:
        return RowBatch.empty().buffers()
    starts = np.cumsum([0] + [b.num_entries for b in batches[:-1]], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, np.int64)] + [b.offsets[1:] + s for b, s in zip(batches, starts)])
    cat = [np.concatenate([b.buffers()[i] for b in batches]) for i in (0, 1, 3, 4, 5, 6)]
    return [cat[0], cat[1], offsets, *cat[2:]]


def unpack_batches(buffers: Sequence[Any], row_counts: Sequence[int]) -> list[RowBatch]:
    """Inverse of ``pack_batches``; every batch is validated (peer input).

    Raises:
        ValueError: wrong buffers, counts that do not add up, or a non-canonical batch.
    """
    whole = RowBatch.from_buffers(list(buffers), validate=False)
    if any(n < 0 for n in row_counts) or sum(row_counts) != whole.num_rows:
        raise ValueError("packed batches: row counts do not add up")
    off = whole.offsets
    if off.shape[0] != whole.num_rows + 1 or off[0] != 0 or off[-1] != whole.num_entries or np.any(np.diff(off) < 0):
        raise ValueError("packed batches: bad offsets")
    out, r0 = [], 0
    for n in row_counts:
        e0, e1 = int(off[r0]), int(off[r0 + n])
        b = RowBatch(whole.row_column[r0 : r0 + n], whole.row_feature[r0 : r0 + n], off[r0 : r0 + n + 1] - e0,
                     whole.segment[e0:e1], whole.target_column[e0:e1], whole.target_feature[e0:e1],
                     whole.strength[e0:e1])
        b.validate()
        out.append(b)
        r0 += n
    return out


# -- the server's page of its log (pure over the records it is given) ------------------------------
@dataclass
class LogPage:
    """One page of a log for ``node``: restricted records, ids ``node`` lacks, and the cursor."""

    records: list[tuple[BatchId, RowBatch]] = field(default_factory=list)
    ids: list[BatchId] = field(default_factory=list)
    next_after_seq: int = 0
    reached_end: bool = False


def select_log_page(records: Iterable[LogRecord], after_seq: int, upto_seq: int, owned: Owned,
                    node_applied: AppliedSet, excluded_writers: set[int], max_bytes: int,
                    max_records: int = MAX_PAGE_RECORDS) -> LogPage:
    """Walk ``records`` (log order) with ``after_seq < seq <= upto_seq`` until the page is full.

    A record the node lacks, in whole or in part (``node_applied.columns``: an id of a tracked
    writer counts as applied only in the columns applied under it, when known), is listed in
    ``ids`` (16 bytes) and, when it has rows in columns the node owns and lacks under its id, in
    ``records`` restricted to them. The page always makes progress (at least one record
    past ``after_seq`` is consumed when one exists). ``reached_end``: nothing up to ``upto_seq`` is
    left, so the caller may attach its applied set read at ``upto_seq``.
    """
    page = LogPage(next_after_seq=after_seq)
    used = 0
    for rec in records:
        if rec.seq <= after_seq:
            continue
        if rec.seq > upto_seq:
            break
        bid, batch = rec.batch_id, rec.batch
        # the columns the node applied under the id (None: applied whole, or not a writer's batch)
        done = node_applied.columns(bid) if bid is not None and bid.writer not in excluded_writers else None
        if bid is not None and batch is not None and done is not None:
            mask = lacking(owned, done)(batch.row_column)
            share = batch.select_rows(mask) if mask.any() else None
            cost = 16 + (share.nbytes if share is not None else 0)
            if page.ids and (used + cost > max_bytes or len(page.records) >= max_records):
                return page
            used += cost
            page.ids.append(bid)
            if share is not None:
                page.records.append((bid, share))
        page.next_after_seq = rec.seq
    page.reached_end = True
    return page


# -- replica comparison ------------------------------------------------------------------------------
#: Divergent rows described one by one in a repair's report at most (``Divergence``); all are counted.
MAX_DIVERGENT_LISTED: Final = 1000


class Divergence:
    """The divergent rows a repair found: every one counted (``count``), the first ``limit``
    described (``listed``: "row (column, feature): what"). A node that lost a column to a disk
    failure diverges in every row of it; the report stays small whatever that number is."""

    def __init__(self, limit: int = MAX_DIVERGENT_LISTED) -> None:
        self.limit = limit
        self.count = 0
        self.listed: list[str] = []

    def add(self, cols: NDArray[np.uint64], feats: NDArray[np.uint64], what: str) -> None:
        """Rows ``(cols[i], feats[i])``, each described as ``f"row {key}: {what}"``."""
        room = self.limit - len(self.listed)
        if room > 0:
            self.listed += [f"row {(c, f)}: {what}" for c, f in zip(cols[:room].tolist(), feats[:room].tolist())]
        self.count += int(cols.shape[0])


@dataclass(frozen=True)
class DigestVerdict:
    """Rows of one digest page, as masks over its rows: ``missing`` on this node, ``differ`` (the
    key digests differ: other targets or segments), ``recheck`` (key digests agree, strength
    digests differ: compare the strengths within the tolerance)."""

    missing: NDArray[np.bool_]
    differ: NDArray[np.bool_]
    recheck: NDArray[np.bool_]


def compare_digests(present: NDArray[np.bool_], keys_here: NDArray[np.uint64], strength_here: NDArray[np.uint64],
                    keys_there: NDArray[np.uint64], strength_there: NDArray[np.uint64]) -> DigestVerdict:
    """Classify a peer's page of rows against this node's digests of the same rows (one version;
    ``ColumnStore.row_digests``). Keys must match exactly (same targets, segments); equal strength
    digests mean bit-identical strengths; anything else is left to ``recheck``. Rows the peer
    lacks are found by the caller (the keys it did not report)."""
    differ = present & (keys_here != keys_there)
    return DigestVerdict(~present, differ, present & ~differ & (strength_here != strength_there))


def rows_differ(cols: NDArray[np.uint64], feats: NDArray[np.uint64], here: RowBatch, there: RowBatch,
                rtol: float) -> NDArray[np.bool_]:
    """For each key ``(cols[i], feats[i])`` (unique): whether its rows in ``here`` and ``there``
    differ: absent from either, other keys or segments, or strengths not within ``rtol`` of each
    other (``Row.equals``: ``|a - b| <= rtol * |b|``, b the peer's). Vectorised: the rows are
    aligned by a key index and compared entry by entry, one pass."""
    n = int(cols.shape[0])
    index = KeyIndex.from_keys(np.array(cols, np.uint64), np.array(feats, np.uint64))
    at_here, at_there = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    for batch, at in ((here, at_here), (there, at_there)):
        pos = index.lookup(batch.row_column, batch.row_feature)
        found = pos >= 0
        at[pos[found]] = np.flatnonzero(found)
    differ = (at_here < 0) | (at_there < 0)
    both = np.flatnonzero(~differ)
    len_here = np.diff(here.offsets)[at_here[both]]
    len_there = np.diff(there.offsets)[at_there[both]]
    differ[both[len_here != len_there]] = True
    both, lengths = both[len_here == len_there], len_here[len_here == len_there]
    if not int(lengths.sum()):
        return differ
    h = range_positions(here.offsets[at_here[both]], lengths)
    t = range_positions(there.offsets[at_there[both]], lengths)
    same = ((here.segment[h] == there.segment[t]) & (here.target_column[h] == there.target_column[t])
            & (here.target_feature[h] == there.target_feature[t]))
    a, b = here.strength[h], there.strength[t]
    same &= (a == b) if rtol == 0.0 else np.isclose(a, b, rtol=rtol, atol=0.0)
    starts = np.zeros(both.shape[0], np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    nonempty = lengths > 0
    row_same = np.ones(both.shape[0], bool)
    row_same[nonempty] = np.logical_and.reduceat(same, starts[nonempty])
    differ[both[~row_same]] = True
    return differ

