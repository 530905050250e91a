"""Application messages of the data plane: storage reads, delta applies, digests, usage (ARCHITECTURE §7–§8).

Each message is one msgspec ``Struct`` carried as the *payload* of a ``peers.transport`` request or
reply. Bulk data (row batches, key arrays) never goes through msgpack: it travels as the transport's
bulk buffers, received in place, and this module only says *which* buffers a message carries:

=================  ==============================================  ====================================
request            bulk buffers                                    success reply (bulk)
=================  ==============================================  ====================================
``ReadRows``       ``row_column`` u64[K], ``row_feature`` u64[K]   ``RowsReply`` (the 7 RowBatch arrays)
``ReadRowPart``    none                                            ``RowPart`` (4 entry arrays, below)
``ApplyBatch``     the 7 ``RowBatch.buffers()``                    ``ApplyAck``
``RowDigests``     ``row_column`` u64[K], ``row_feature`` u64[K]   ``DigestsReply`` (4 arrays, below)
``GetUsage``       none                                            ``UsageReply``
``BatchesApplied`` none                                            ``AppliedMask``
``ScanRows``       none                                            ``ScanPage`` (the 7 RowBatch arrays)
``PutVocab``       none (entries in the payload: small strings)    ``VocabAck``
``GetVocab``       none                                            ``VocabReply``
``ColumnInfo``     none                                            ``ColumnInfoPage``
``RingGet``        none                                            ``RingState``
``RingPush``       none (entries in the payload)                   ``RingState`` (the merged ring)
``SetOverride``    none                                            ``OverrideSet``
``RegisterGet``    none                                            ``RegisterValue``
``RegisterPrepare`` none                                           ``RegisterValue`` (the accepted one)
``RegisterAccept`` none (the value in the payload: small)          ``RegisterAccepted``
``ComputeCall``    ``body`` u8[n] (the op's own encoding)          ``ComputeAnswer`` (``body`` u8[m])
``HeldHints``      none                                            ``HeldMask``
=================  ==============================================  ====================================

**Rows of any size** (docs/transport.md, "Chunked reads"): a ``ReadRows`` with ``chunked`` is
answered with at most the node's read chunk (``storage.read-chunk-bytes``) of rows, in key order;
a row larger than the chunk is not sent but listed in ``RowsReply.large`` with its size and
version, and ``more`` says the reply stopped early (keys after ``next_column``/``next_feature``
are to be asked again). A large row is then read with ``ReadRowPart`` requests, entries
``[offset, offset + limit)`` each, answered ``RowPart`` with the row's current size and version
(its applied-batch count and the store's drop count) and the four entry arrays of that slice. A
read is consistent when every part reports the version the read started from; otherwise the
row changed between parts and the client restarts it (giaannd/client/row_parts.py).

**Reads during a fold** (docs/storage.md, "Folds off the event loop"): while a storage node folds
its delta runs into its base (seconds at 10^8 entries), the requests that touch its rows wait for
the fold. A ``ReadRows`` with ``busy_ok`` does not: it is answered ``Unavailable`` (message starting
``"folding"``) at once, and the client reads those rows from the next replica
(giaannd/client/reads.py). An ``ApplyBatch`` is logged and acknowledged, and applied to the rows
when the fold ends; vocabulary and register requests do not touch the rows and are served. Any
other request, a ``ReadRowPart`` included, still waits (storage/replication/requests.py, "During a
fold").

``Register*`` are the acceptor side of replicated registers (small versioned rows with
compare-and-set, CASPaxos: giaannd/storage/engine/register_store.py has the rules,
giaannd/client/registers.py the proposer and what it guarantees); a refused prepare or accept is
answered ``RegisterConflict`` with the higher ballot.

``RingGet`` / ``RingPush`` / ``SetOverride`` / ``OperationGet`` are *runtime* requests (a separate union,
``RuntimeRequest``): every node with a data plane, storage or compute, answers them in
``giaannd.runtime.node`` before any role handler sees the request (``runtime_request`` peeks at the
tag). They carry the storage ring (giaannd/cluster/ring.py) and a topology operation's cutover override
with its lease, and ask a coordinator whether the operation a lease names still runs (docs/topology.md).

``ComputeCall`` (tag 17) is a *compute-to-compute* call: the runtime hands it to the handler the
compute role registered (``NodeRuntime.serve_compute``), never to the storage role; a node
without one answers ``Unavailable``. ``op`` names the call (``"eval.share"``: one node's share of
a spread evaluation, giaannd/compute/eval_wire.py) and the body travels as one ``uint8`` bulk
buffer, so a body is bounded by the frame's buffer limit (``MAX_COMPUTE_BODY_BYTES``), not by the
16 MiB control body; the op's own module decodes and checks it.

Any request may instead get one of the typed errors ``StoreFull``, ``NotOwner``, ``BadRequest``,
``Unavailable`` (and ``VocabConflict``, ``RegisterConflict`` for their requests): they are *replies*,
not transport errors, so the caller can tell "this node refuses this write" (route elsewhere,
surface to the user) from "the connection broke" (retry another replica).

Tags and field order are part of the protocol. **Append only**: never renumber a tag, never reorder or
remove a field; new fields go last with a default (memberlist's rule for its message types). Structs
do not forbid unknown fields, so a newer peer may add some (STYLE.md item 7).

Decoding is split from validation, h11-style: ``decode_request``/``decode_reply`` turn bytes into a
typed message or raise ``ProtocolViolation`` (the peer's fault); the ``check_*`` helpers check
the bulk buffers against the named limits *before* anything copies or allocates for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final, NamedTuple

import msgspec
import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.cluster.ring import MAX_RING_ENTRIES, WireEntry
from giaannd.errors import RemoteFault
from giaannd.model.rows import RowBatch
from peers import framing
from peers.placement import Placement
from peers.wire import DECODE_ERRORS

__all__ = [
    "COMPUTE_CALL_TAG",
    "MAX_BATCH_ENTRIES",
    "MAX_COMPUTE_BODY_BYTES",
    "MAX_COMPUTE_OP_CHARS",
    "MAX_BATCH_ROWS",
    "MAX_COLUMN_INFO_ROWS",
    "MAX_DIGEST_ROWS",
    "MAX_FLUSH_TIMEOUT_S",
    "MAX_INCREMENT",
    "MAX_LARGE_ROWS",
    "MAX_OVERRIDE_MEMBERS",
    "MAX_QUERY_SEQS",
    "MAX_READ_PART_ENTRIES",
    "MAX_READ_ROWS",
    "MAX_REGISTER_KEY_CHARS",
    "MAX_REGISTER_VALUE_BYTES",
    "MAX_SCAN_ENTRIES",
    "MAX_SCAN_EXAMINE",
    "MAX_SCAN_NODES",
    "MAX_ROW_SIZE_BINS",
    "MAX_SCAN_PAGE_BYTES",
    "SCAN_ENTRY_BYTES",
    "SCAN_ROW_BYTES",
    "MAX_SCAN_ROWS",
    "MAX_VOCAB_ENTRIES",
    "MAX_VOCAB_TEXT_CHARS",
    "ROW_DIGEST_VERSIONS",
    "ApplyAck",
    "ApplyBatch",
    "AppliedMask",
    "BatchId",
    "BadRequest",
    "BatchesApplied",
    "ColumnInfo",
    "ColumnInfoPage",
    "ComputeAnswer",
    "ComputeCall",
    "DigestsReply",
    "ErrorReply",
    "GetVocab",
    "GetUsage",
    "HeldHints",
    "HeldMask",
    "NotOwner",
    "OperationGet",
    "OperationState",
    "OverrideLease",
    "OverrideMember",
    "OverrideSet",
    "ProtocolViolation",
    "PutVocab",
    "LargeRow",
    "ReadRowPart",
    "ReadRows",
    "RegisterAccept",
    "RegisterAccepted",
    "RegisterConflict",
    "RegisterGet",
    "RegisterPrepare",
    "RegisterValue",
    "Reply",
    "Request",
    "RowDigests",
    "RingGet",
    "RingPush",
    "RingState",
    "RowPart",
    "RowsReply",
    "RuntimeRequest",
    "ScanPage",
    "ScanRows",
    "SetOverride",
    "StoreFull",
    "Unavailable",
    "UsageReply",
    "VocabAck",
    "VocabConflict",
    "VocabReply",
    "check_batch",
    "check_body",
    "check_increments",
    "compute_call",
    "check_keys",
    "check_part",
    "decode_reply",
    "decode_request",
    "encode",
    "register_key_id",
    "request_tag",
    "runtime_request",
    "scan_chain_mask",
    "scan_page_bytes",
]

class BatchId(NamedTuple):
    """Identity of a delta batch: the writer and its sequence number (both uint64, seq >= 1)."""

    writer: int
    seq: int


# -- named limits --------------------------------------------------------------------------------
#: Rows per ReadRows. An inference step reads a handful; a training worker prefetching a sentence's
#: subnetwork reads a few thousand. 64 Ki keys are 1 MiB of ids: bounded work per request, so one
#: reader cannot monopolise a storage node's event loop (the h11 / memberlist "every size has a limit").
MAX_READ_ROWS: Final = 65_536
#: Rows per RowDigests (repair scans in chunks of this many).
MAX_DIGEST_ROWS: Final = 65_536
#: Rows per ApplyBatch: a coalesced training delta for one owner (ARCHITECTURE §9, K sentences).
MAX_BATCH_ROWS: Final = 1_048_576
#: Entries per ApplyBatch: 8 Mi entries are 168 MiB on the wire (21 B each), which is also the most
#: one apply may hold in RAM twice (wire buffer + merged region) — far below a storage node's capacity.
MAX_BATCH_ENTRIES: Final = 8 * 1_048_576
#: Largest |strength| of one entry of an ApplyBatch (an increment). A stored strength is the float32
#: sum of every increment applied to its entry: two increments near the float32 maximum (3.4e38)
#: summed to inf, and a row holding inf is refused by every reader (``check_batch``: finite
#: strengths) and its snapshot by the restart. Under this bound it takes 2**64 increments to one
#: entry to get there; training's increments are small (about 1).
MAX_INCREMENT: Final = float(2**64)
#: Entries per RowPart (and so per chunked RowsReply, whose rows stay under the node's read chunk):
#: ``storage.read-chunk-bytes`` is at most 128 MiB (config.MAX_READ_CHUNK_BYTES), below this cap.
MAX_READ_PART_ENTRIES: Final = MAX_BATCH_ENTRIES
#: Rows one RowsReply may list as ``large``: each is at least a read chunk, so 4096 of them are
#: already 32 GiB at the default chunk; the rest of the request is asked again (``more``).
MAX_LARGE_ROWS: Final = 4096
#: Seqs per BatchesApplied or HeldHints query (the writer asks about its hinted batches in chunks).
MAX_QUERY_SEQS: Final = 65_536
#: The message of the ``NotOwner`` a register's owner answers for a key it sealed (a placement
#: change is handing the key to its new owners: storage/rebalance/register_handoff.py); proposers
#: tell that refusal apart by it (client/registers.py ``RegisterUnavailable.sealed``).
REGISTER_SEALED: Final = "register sealed: a placement change is handing it to its new owners"
#: Bound on free-text fields (error messages, node names) so a reply stays small.
MAX_TEXT_CHARS: Final = 4096
#: Rows per ScanPage. A page is built (copied) on the event loop, so it is bounded like a read.
MAX_SCAN_ROWS: Final = 65_536
#: Entries per ScanPage (21 B each: 16 MiB); a single larger row is still sent, alone.
MAX_SCAN_ENTRIES: Final = 800_000
#: Bytes of the arrays of one ScanPage when the client asks for a byte cap (``ScanRows.max_bytes``):
#: the page is built (copied) on the event loop and held once more by the client's k-way merge per
#: node, so it bounds the exporter's memory (compute.export-page-bytes). 16 MiB = MAX_SCAN_ENTRIES'.
MAX_SCAN_PAGE_BYTES: Final = 16 << 20
#: How ``ScanRows.max_bytes`` counts a page: the bytes of its seven arrays (``RowBatch.nbytes``),
#: 24 per row (key u64 x 2, offset i64), 21 per entry (u64 x 2, f32, u8) and the closing offset.
SCAN_ROW_BYTES: Final = 24
SCAN_ENTRY_BYTES: Final = 21


def scan_page_bytes(rows: int, entries: int) -> int:
    """The bytes a scan page of ``rows`` rows and ``entries`` entries counts against ``max_bytes``."""
    return SCAN_ROW_BYTES * rows + 8 + SCAN_ENTRY_BYTES * entries


#: Bins of ``UsageReply.row_size_log2``: a row's entry count is an int64, so floor(log2(n)) < 63.
MAX_ROW_SIZE_BINS: Final = 64
#: Row keys one ScanRows may look at (filtered out or not) before it answers, so a scan whose
#: filter rejects most rows still answers promptly; the cursor then moves with an empty page.
MAX_SCAN_EXAMINE: Final = 262_144
#: Node names in a ScanRows' ``skip`` / ``via`` (far above any cluster's storage member count).
MAX_SCAN_NODES: Final = 4096
#: Entries per PutVocab / ids per GetVocab (a training window adds at most a few thousand).
MAX_VOCAB_ENTRIES: Final = 65_536
#: Characters per vocabulary string (a lemma or a lower-cased surface word).
MAX_VOCAB_TEXT_CHARS: Final = 1024
#: Rows one ColumnInfo page looks at. Each row is hashed (its digest) on the event loop, so a page
#: is bounded like a scan page; a column with more features is answered in several pages.
MAX_COLUMN_INFO_ROWS: Final = 16_384
#: The per-row (repair) digest versions this code computes, oldest first (their definitions:
#: storage/engine/row_digest.py); ``ColumnInfo`` and repair's ``DigestsFor`` name the one wanted.
ROW_DIGEST_VERSIONS: Final = (1, 2)
#: Members in one SetOverride: a placement set, like the ring's entries (giaannd.cluster.ring
#: MAX_RING_ENTRIES bounds RingState / RingPush the same way).
MAX_OVERRIDE_MEMBERS: Final = MAX_RING_ENTRIES
#: Bound on SetOverride's flush wait (a cutover step waits for writes in flight, each bounded by
#: its own request timeout, so minutes would mean something is stuck).
MAX_FLUSH_TIMEOUT_S: Final = 600.0

#: Characters of a register key (``job/<id>/<stage>/<shard>``, compute/cluster_jobs/lease_table.py).
MAX_REGISTER_KEY_CHARS: Final = 256
#: Bytes of a register value. A lease shard costs ~30 B per lease, so 256 KiB holds thousands of
#: leases; every change copies the value to R acceptors and fsyncs it, so it stays small.
MAX_REGISTER_VALUE_BYTES: Final = 256 * 1024

#: Bytes of a ComputeCall's or ComputeAnswer's body (its one bulk buffer): the frame's own limit on
#: one buffer. What an op really accepts is its own, smaller policy (``compute.eval-share-max-bytes``).
MAX_COMPUTE_BODY_BYTES: Final = framing.MAX_BUFFER_BYTES
#: Characters of a ComputeCall's op name (``"eval.share"``).
MAX_COMPUTE_OP_CHARS: Final = 64

_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints are at most uint64
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]


class ProtocolViolation(RemoteFault, ValueError):
    """The peer sent something this protocol does not accept (undecodable, over a limit, wrong
    buffers). The service answers it with ``BadRequest`` and keeps serving; it never mutates state.
    Still a ``ValueError``, as broad ``except ValueError`` refusals (stream endpoint, sender) catch it."""

    reason = "protocol_violation"


# -- requests (tags 1..63) -----------------------------------------------------------------------
class ReadRows(msgspec.Struct, frozen=True, tag=1):
    """Read rows; keys in bulk (two u64 arrays). ``placement_epoch``: the caller's view, for NotOwner.
    ``chunked``: the caller reads large rows by parts (module docstring, "Rows of any size"); without
    it the reply holds every row whole (a client that predates chunked reads). ``busy_ok``: the
    caller has another live replica of every row asked for, so a node whose rows are being moved by
    a fold of its delta runs answers ``Unavailable`` at once instead of holding the read until the
    fold ends (module docstring, "Reads during a fold"); without it the read waits (a client that
    predates it, or a read of the last replica)."""

    placement_epoch: _Text = ""
    chunked: bool = False
    busy_ok: bool = False


class ApplyBatch(msgspec.Struct, frozen=True, tag=2):
    """Apply a delta batch (7 RowBatch buffers in bulk), idempotently by ``(writer, seq)``.

    ``writer_floor``: the writer promises never to send again any batch with seq <= it (compacts the
    applied set, applied_set.py). ``hint_for``: not for this node's store — keep it durably as a
    hinted handoff for that node and deliver it when it is back (hints.py).
    """

    writer: _U64
    seq: Annotated[int, msgspec.Meta(ge=1)]
    writer_floor: _U64 = 0
    placement_epoch: _Text = ""
    hint_for: _Text | None = None


class RowDigests(msgspec.Struct, frozen=True, tag=3):
    """Per-row digests (for repair and for tests comparing replicas); keys in bulk."""


class GetUsage(msgspec.Struct, frozen=True, tag=4):
    """Capacity and use of the node's store."""


class BatchesApplied(msgspec.Struct, frozen=True, tag=5):
    """Which of ``seqs`` of ``writer`` this node has applied (a writer confirming hint delivery)."""

    writer: _U64
    seqs: list[Annotated[int, msgspec.Meta(ge=1)]]


class ScanRows(msgspec.Struct, frozen=True, tag=6):
    """One page of this node's rows in key order after the cursor (docs/replication.md, "Scan").

    ``after_column``/``after_feature``: the cursor (exclusive); ``started`` False = from the first row.
    ``limit``: rows wanted (capped at MAX_SCAN_ROWS). ``owned``: when True, only rows of columns
    whose owner list, with the nodes in ``skip`` removed, starts with ``via`` followed by this node
    (so each column is read from exactly one node); ``placement_epoch`` must then equal the node's
    own, else ``NotOwner`` (a filter computed on another placement could miss or repeat rows).
    ``max_bytes`` > 0 (appended): the page's arrays stay under min(max_bytes, MAX_SCAN_PAGE_BYTES)
    and a row over that is cut into pieces; ``after_entry`` > 0 (appended) resumes inside the cursor
    row at that entry (``ScanPage.next_entry``). 0: whole rows, a big one alone (older clients).
    """

    after_column: _U64 = 0
    after_feature: _U64 = 0
    started: bool = False
    limit: Annotated[int, msgspec.Meta(ge=1)] = MAX_SCAN_ROWS
    owned: bool = False
    skip: Annotated[list[_Text], msgspec.Meta(max_length=MAX_SCAN_NODES)] = []
    via: Annotated[list[_Text], msgspec.Meta(max_length=MAX_SCAN_NODES)] = []
    placement_epoch: _Text = ""
    max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    after_entry: Annotated[int, msgspec.Meta(ge=0)] = 0


_VocabText = Annotated[str, msgspec.Meta(max_length=MAX_VOCAB_TEXT_CHARS)]
#: A vocabulary entry: (kind, id, text); kind 0 = column (noun lemma), 1 = feature (lower-cased word).
VocabEntry = tuple[Annotated[int, msgspec.Meta(ge=0, le=1)], _U64, _VocabText]


class PutVocab(msgspec.Struct, frozen=True, tag=7):
    """Add id → string entries (grow-only, idempotent; each text must hash to its id)."""

    entries: Annotated[list[VocabEntry], msgspec.Meta(max_length=MAX_VOCAB_ENTRIES)]


class GetVocab(msgspec.Struct, frozen=True, tag=8):
    """Look up ids; ``kinds[i]`` (0 column, 1 feature) goes with ``ids[i]``."""

    kinds: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1)]], msgspec.Meta(max_length=MAX_VOCAB_ENTRIES)]
    ids: Annotated[list[_U64], msgspec.Meta(max_length=MAX_VOCAB_ENTRIES)]


class ColumnInfo(msgspec.Struct, frozen=True, tag=9):
    """Size and digest of this node's rows of one column, a page at a time (docs/replication.md,
    "Column info"). ``after_feature``: the cursor (exclusive) when ``started``; ``limit``: rows to
    look at (capped at MAX_COLUMN_INFO_ROWS). Answered from whatever the node holds, owner or not:
    the caller picks the nodes to ask (the column's owners)."""

    column: _U64
    after_feature: _U64 = 0
    started: bool = False
    limit: Annotated[int, msgspec.Meta(ge=1)] = MAX_COLUMN_INFO_ROWS
    #: the repair digest version of the digests wanted (storage/engine/row_digest.py); a node that
    #: does not know it answers in the newest it knows below it and says which
    #: (``ColumnInfoPage.digest_version``); a node from before versions answers in 1
    digest_version: Annotated[int, msgspec.Meta(ge=1, le=255)] = 1


_RegisterKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REGISTER_KEY_CHARS)]
_RegisterValue = Annotated[bytes, msgspec.Meta(max_length=MAX_REGISTER_VALUE_BYTES)]


class RegisterGet(msgspec.Struct, frozen=True, tag=13):
    """This node's accepted state of register ``key``, promising nothing (one vote of a quorum read)."""

    key: _RegisterKey
    placement_epoch: _Text = ""


class RegisterPrepare(msgspec.Struct, frozen=True, tag=14):
    """CASPaxos phase 1: promise to accept nothing below ballot ``(round, proposer)``; answered with
    the accepted state (``RegisterValue``) once the promise is durable."""

    key: _RegisterKey
    round: _U64
    proposer: _U64
    placement_epoch: _Text = ""


class RegisterAccept(msgspec.Struct, frozen=True, tag=15):
    """CASPaxos phase 2: accept ``value`` under ballot ``(round, proposer)`` unless a higher ballot
    was promised or accepted; ``RegisterAccepted`` once durable. Its version is ``(version,
    origin_round, origin_proposer)``: a counter and the ballot that first proposed the value, so
    two different values never share a version (a value written back keeps its version)."""

    key: _RegisterKey
    round: _U64
    proposer: _U64
    version: _U64
    origin_round: _U64
    origin_proposer: _U64
    value: _RegisterValue = b""
    placement_epoch: _Text = ""


class ReadRowPart(msgspec.Struct, frozen=True, tag=16):
    """Entries ``[offset, offset + limit)`` of row ``(column, feature)`` (module docstring, "Rows of
    any size"); the node serves at most its read chunk, so the reply may hold fewer."""

    column: _U64
    feature: _U64
    offset: _U64
    limit: Annotated[int, msgspec.Meta(ge=1)]
    placement_epoch: _Text = ""


class ComputeCall(msgspec.Struct, frozen=True, tag=17):
    """A compute-to-compute call (module docstring): ``op`` names it; its body is one u8 bulk
    buffer. Answered ``ComputeAnswer`` or a typed error (``BadRequest``: the body or op is bad;
    ``Unavailable``: no compute role here, or it cannot serve the op now)."""

    op: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_COMPUTE_OP_CHARS)]


#: The tag of ``ComputeCall`` (the runtime routes it by a tag peek, ``request_tag``).
COMPUTE_CALL_TAG: Final = 17


class HeldHints(msgspec.Struct, frozen=True, tag=18):
    """Which of ``seqs`` of ``writer`` this node still holds as hints for ``target`` (a writer
    whose hinted target left the placement: docs/replication.md, "Writer floors"). Appended
    Dec 1; a node that predates it answers ``BadRequest``, which settles nothing."""

    target: _Text
    writer: _U64
    seqs: list[Annotated[int, msgspec.Meta(ge=1)]]


Request = (ReadRows | ApplyBatch | RowDigests | GetUsage | BatchesApplied | ScanRows | PutVocab | GetVocab
           | ColumnInfo | RegisterGet | RegisterPrepare | RegisterAccept | ReadRowPart | HeldHints)


# -- runtime requests (tags 10..): answered by every node with a data plane, before the roles -----
class RingGet(msgspec.Struct, frozen=True, tag=10):
    """This node's storage ring (giaannd/cluster/ring.py)."""


class RingPush(msgspec.Struct, frozen=True, tag=11):
    """Merge ``entries`` (``Ring.to_wire()``) into this node's ring, durably; the reply is the
    merged ring."""

    entries: Annotated[list[WireEntry], msgspec.Meta(max_length=MAX_RING_ENTRIES)]


#: One member of a SetOverride: (name, data-plane address, weight).
OverrideMember = tuple[
    Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)], _Text,
    Annotated[float, msgspec.Meta(gt=0)]]


class OverrideLease(msgspec.Struct, frozen=True):
    """Whose a placement override is: the member coordinating the operation, and its id."""

    coordinator: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)]
    op_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)]


class SetOverride(msgspec.Struct, frozen=True, tag=12):
    """Set (``members``) or clear (None) this node's placement override (a topology operation's
    cutover, docs/topology.md). With ``flush``, the reply waits (at most ``flush_timeout_s``)
    until every storage client of the node finished the writes it had in flight: writes computed
    under the previous placement are done when ``OverrideSet`` arrives. A flush that times out is
    answered ``Unavailable`` (the override stays set)."""

    members: Annotated[list[OverrideMember], msgspec.Meta(max_length=MAX_OVERRIDE_MEMBERS)] | None = None
    flush: bool = False
    flush_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_FLUSH_TIMEOUT_S)] = 30.0
    #: the operation the override belongs to (appended Dec 2): the node drops the override once
    #: that operation is known to have ended without clearing it (docs/topology.md, "Override
    #: leases"); None (a coordinator that predates it): the override stays until cleared
    lease: OverrideLease | None = None


class OperationGet(msgspec.Struct, frozen=True, tag=19):
    """The state of topology operation ``op_id`` on the node that coordinates it (an override's
    lease, docs/topology.md). Appended Dec 2; a node that predates it answers ``BadRequest``."""

    op_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)]


RuntimeRequest = RingGet | RingPush | SetOverride | OperationGet


# -- success replies (tags 64..127) ---------------------------------------------------------------
#: A row a chunked ReadRows left out for being larger than the read chunk:
#: (column, feature, entries, touches, drops); the last three as in ``RowPart``.
LargeRow = tuple[_U64, _U64, _U64, _U64, _U64]


class RowsReply(msgspec.Struct, frozen=True, tag=64):
    """The rows found (7 RowBatch buffers in bulk); absent rows are left out. For a ``chunked``
    request: ``large`` lists the rows to read by parts, and ``more`` says keys after
    ``(next_column, next_feature)`` were not looked at (ask for them again)."""

    more: bool = False
    next_column: _U64 = 0
    next_feature: _U64 = 0
    large: Annotated[list[LargeRow], msgspec.Meta(max_length=MAX_LARGE_ROWS)] = []


class ApplyAck(msgspec.Struct, frozen=True, tag=65):
    """The batch is in the update log and synced (or was applied before: ``applied`` False).
    For a hint, ``durable`` means the hint log holds it."""

    durable: bool = True
    applied: bool = True
    hinted: bool = False


class DigestsReply(msgspec.Struct, frozen=True, tag=66):
    """Bulk: ``present`` u8[K], ``keys`` u64[K], ``strength`` u64[K], ``batches`` u64[K]."""


class UsageReply(msgspec.Struct, frozen=True, tag=67):
    """``used_bytes`` of ``capacity_bytes`` is RAM; the ``disk_*`` fields (0 from a node that
    predates them) are the bytes of the node's storage files and its file system's free and total
    bytes. ``row_size_log2`` (appended; None from a node that predates it): element k is the number
    of rows whose entry count n has floor(log2(n)) == k, trailing zeros trimmed (``[]``: no rows)."""

    capacity_bytes: int
    used_bytes: int
    num_rows: int
    num_entries: int
    is_full: bool
    hints_held: int = 0
    disk_bytes: int = 0
    disk_free_bytes: int = 0
    disk_total_bytes: int = 0
    row_size_log2: Annotated[list[_U64], msgspec.Meta(max_length=MAX_ROW_SIZE_BINS)] | None = None


class AppliedMask(msgspec.Struct, frozen=True, tag=68):
    applied: list[bool]


class ScanPage(msgspec.Struct, frozen=True, tag=69):
    """Rows of one scan page (7 RowBatch buffers in bulk). ``next_column``/``next_feature``: the cursor
    for the next request (the last key looked at, even when filtered out); ``done``: no rows after it.
    ``next_entry`` > 0 (appended): the page ended inside the row ``next_*``; ask again with it as
    ``ScanRows.after_entry`` for the rest (only when the request set ``max_bytes``)."""

    next_column: int = 0
    next_feature: int = 0
    done: bool = True
    examined: int = 0
    next_entry: int = 0


class VocabAck(msgspec.Struct, frozen=True, tag=70):
    """The entries are durable (the vocab log is synced). ``added``: new here; ``known``: held already."""

    added: int = 0
    known: int = 0


class VocabReply(msgspec.Struct, frozen=True, tag=71):
    """The entries found (ids this node does not hold are left out)."""

    entries: list[VocabEntry] = []


class ColumnInfoPage(msgspec.Struct, frozen=True, tag=72):
    """One page of a column's rows on one node. Counts and digests cover this page only; the caller
    adds them up (digests: sum mod 2**64 of per-row hashes, ``requests.fold_row_digest`` in
    version 1, ``row_digest.fold_row_digests_v2`` in version 2, so the total does not depend on
    where pages end). ``bytes``: the store's accounting (regions plus the per-row overhead).
    ``next_feature``: the cursor for the next page; ``done``: no row of the column after it;
    ``digest_version``: the version of the digests (absent from a node from before versions: 1)."""

    rows: int = 0
    entries: int = 0
    bytes: int = 0
    keys_digest: int = 0
    strength_digest: int = 0
    batches: int = 0
    next_feature: int = 0
    done: bool = True
    digest_version: int = 1


class RingState(msgspec.Struct, frozen=True, tag=73):
    """A node's ring (``Ring.to_wire()``: ``[(name, stamp, state, weight), ...]``)."""

    entries: Annotated[list[WireEntry], msgspec.Meta(max_length=MAX_RING_ENTRIES)] = []


class OverrideSet(msgspec.Struct, frozen=True, tag=74):
    """The override is in force (or cleared): ``epoch`` is the placement epoch now in force on
    the node ("" when it knows no storage member); ``override`` whether one is set (False also
    when the members equal the ring's active set, which ends an override by itself)."""

    epoch: _Text = ""
    override: bool = False


class OperationState(msgspec.Struct, frozen=True, tag=80):
    """The answer of ``OperationGet``: the operation's state on its coordinator (``streaming``,
    ``cutover``, ``done``, ``failed``, ...), "" when the node runs no operation of that id (it
    never did, or it restarted since)."""

    state: _Text = ""


class RegisterValue(msgspec.Struct, frozen=True, tag=75):
    """A node's accepted state of a register: ballot ``(round, proposer)``, version ``(version,
    origin_round, origin_proposer)`` and value; all zero / empty when it never accepted one."""

    round: int = 0
    proposer: int = 0
    version: int = 0
    origin_round: int = 0
    origin_proposer: int = 0
    value: bytes = b""


class RegisterAccepted(msgspec.Struct, frozen=True, tag=76):
    """The accept is durable."""


class RowPart(msgspec.Struct, frozen=True, tag=77):
    """Entries from ``offset`` of one row (bulk: ``segment`` u8[k], ``target_column`` u64[k],
    ``target_feature`` u64[k], ``strength`` f32[k]). The row's version now: ``entries`` (0: absent),
    ``touches`` (batches applied to it) and ``drops`` (the store's count of column drops, so a row
    deleted and written again is not mistaken for the old one)."""

    entries: _U64
    touches: _U64
    drops: _U64
    offset: _U64


class ComputeAnswer(msgspec.Struct, frozen=True, tag=78):
    """The answer of a ``ComputeCall``: its body is one u8 bulk buffer (the op's own encoding)."""


class HeldMask(msgspec.Struct, frozen=True, tag=79):
    """The answer of ``HeldHints``: per seq, whether a hint of it for the target is still held."""

    held: list[bool]


# -- error replies (tags 128..) -------------------------------------------------------------------
class StoreFull(msgspec.Struct, frozen=True, tag=128):
    """The write would take the store past its capacity; nothing changed."""

    needed_bytes: int
    used_bytes: int
    capacity_bytes: int


class NotOwner(msgspec.Struct, frozen=True, tag=129):
    """This node does not own (some of) the rows under its placement ``epoch``."""

    epoch: _Text
    message: _Text = ""


class BadRequest(msgspec.Struct, frozen=True, tag=130):
    """The request broke the protocol (undecodable, over a limit, bad buffers); nothing changed."""

    message: _Text


class Unavailable(msgspec.Struct, frozen=True, tag=131):
    """The node cannot serve now (stopping, log write failed, hint space full); try another."""

    message: _Text


class VocabConflict(msgspec.Struct, frozen=True, tag=132):
    """A PutVocab entry names an id held with a different string: a real 64-bit hash collision
    (texts are checked against their ids first). The whole PutVocab is refused; nothing changed."""

    kind: int
    id: int
    held: _Text
    offered: _Text


class RegisterConflict(msgspec.Struct, frozen=True, tag=133):
    """A ``RegisterPrepare`` / ``RegisterAccept`` refused: this node promised or accepted the higher
    ballot ``(round, proposer)``. Nothing changed; the proposer retries above it."""

    round: int
    proposer: int


ErrorReply = StoreFull | NotOwner | BadRequest | Unavailable | VocabConflict | RegisterConflict
Reply = (RowsReply | ApplyAck | DigestsReply | UsageReply | AppliedMask | ScanPage | VocabAck | VocabReply
         | ColumnInfoPage | RingState | OverrideSet | RegisterValue | RegisterAccepted | RowPart | ComputeAnswer
         | HeldMask | OperationState | ErrorReply)


def register_key_id(key: str) -> int:
    """The 64-bit placement key of a register (its owners are ``placement.owners`` of it, like a
    column's). Namespaced so it is not the id of any column or feature."""
    return xxhash.xxh3_64_intdigest(b"register\0" + key.encode())


class _Head(msgspec.Struct):
    """Just the tag of a request (msgspec writes it first, as ``type``); other keys are skipped."""

    type: int = -1


_RUNTIME_TAGS: Final = frozenset({10, 11, 12, 19})

_REQUEST_DECODER: Final[msgspec.msgpack.Decoder[Request]] = msgspec.msgpack.Decoder(Request)
_REPLY_DECODER: Final[msgspec.msgpack.Decoder[Reply]] = msgspec.msgpack.Decoder(Reply)
_RUNTIME_DECODER: Final[msgspec.msgpack.Decoder[RuntimeRequest]] = msgspec.msgpack.Decoder(RuntimeRequest)
_COMPUTE_DECODER: Final = msgspec.msgpack.Decoder(ComputeCall)
_HEAD_DECODER: Final = msgspec.msgpack.Decoder(_Head)
_ENCODER: Final = msgspec.msgpack.Encoder()
#: everything decoding a peer's bytes may raise (peers/wire.py says why each)
_DECODE_ERRORS: Final = DECODE_ERRORS


def encode(msg: Request | RuntimeRequest | ComputeCall | Reply) -> bytes:
    return _ENCODER.encode(msg)


def decode_request(payload: bytes | memoryview) -> Request:
    """Decode a request payload.

    Raises:
        ProtocolViolation: not a known request (keeps msgspec's ``$.path`` in the message).
    """
    try:
        return _REQUEST_DECODER.decode(payload)
    except _DECODE_ERRORS as exc:
        raise ProtocolViolation(f"undecodable request: {exc}") from None


def request_tag(payload: bytes | memoryview) -> int:
    """The tag of a request payload, -1 when it has none (garbage: the role handler answers
    that). Peeks at the tag only (~0.1 µs), so the data path pays almost nothing for routing."""
    try:
        return _HEAD_DECODER.decode(payload).type
    except _DECODE_ERRORS:
        return -1


def runtime_request(payload: bytes | memoryview, tag: int | None = None) -> RuntimeRequest | None:
    """The runtime request in ``payload``, or None when it is not one (a role's request, or
    garbage: the role handler answers that). ``tag``: the payload's ``request_tag`` when the
    caller peeked already.

    Raises:
        ProtocolViolation: a runtime tag with a bad body.
    """
    if (request_tag(payload) if tag is None else tag) not in _RUNTIME_TAGS:
        return None
    try:
        return _RUNTIME_DECODER.decode(payload)
    except _DECODE_ERRORS as exc:
        raise ProtocolViolation(f"undecodable request: {exc}") from None


def compute_call(payload: bytes | memoryview) -> ComputeCall:
    """Decode a ``ComputeCall`` payload (the caller peeked ``COMPUTE_CALL_TAG``).

    Raises:
        ProtocolViolation: a bad body.
    """
    try:
        return _COMPUTE_DECODER.decode(payload)
    except _DECODE_ERRORS as exc:
        raise ProtocolViolation(f"undecodable request: {exc}") from None


def check_body(bulk: Sequence[np.ndarray], limit: int) -> memoryview:
    """The one u8 body buffer of a ``ComputeCall`` / ``ComputeAnswer``, checked (count, dtype,
    shape, at most ``limit`` bytes) before anything decodes it.

    Raises:
        ProtocolViolation: anything else.
    """
    if len(bulk) != 1:
        raise ProtocolViolation(f"a compute body is 1 buffer, got {len(bulk)}")
    body = bulk[0]
    if body.dtype != np.uint8 or body.ndim != 1:
        raise ProtocolViolation(f"compute body: expected 1-d uint8, got {body.ndim}-d {body.dtype}")
    if body.shape[0] > limit:
        raise ProtocolViolation(f"compute body of {body.shape[0]} bytes; the limit is {limit}")
    return body.data


def decode_reply(payload: bytes | memoryview) -> Reply:
    """Decode a reply payload.

    Raises:
        ProtocolViolation: not a known reply.
    """
    try:
        return _REPLY_DECODER.decode(payload)
    except _DECODE_ERRORS as exc:
        raise ProtocolViolation(f"undecodable reply: {exc}") from None


def check_keys(bulk: Sequence[np.ndarray], limit: int) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """The two key arrays of a ReadRows / RowDigests, checked (count, dtype, shape, limit).

    Raises:
        ProtocolViolation: anything else.
    """
    if len(bulk) != 2:
        raise ProtocolViolation(f"expected 2 key buffers, got {len(bulk)}")
    cols, feats = bulk
    for name, arr in (("row_column", cols), ("row_feature", feats)):
        if arr.dtype != np.uint64 or arr.ndim != 1:
            raise ProtocolViolation(f"{name}: expected 1-d uint64, got {arr.ndim}-d {arr.dtype}")
    if cols.shape != feats.shape:
        raise ProtocolViolation("row_column and row_feature differ in length")
    if cols.shape[0] > limit:
        raise ProtocolViolation(f"{cols.shape[0]} keys in one request; the limit is {limit}")
    return cols, feats


def check_batch(bulk: Sequence[np.ndarray]) -> RowBatch:
    """The RowBatch of an ApplyBatch (or RowsReply), checked against the limits, then for canonical
    form (``RowBatch.validate``). Sizes come first: nothing is copied or sorted before they pass.

    Raises:
        ProtocolViolation: wrong buffers, over a limit, or not canonical.
    """
    if len(bulk) != 7:
        raise ProtocolViolation(f"a row batch has 7 buffers, got {len(bulk)}")
    rows, entries = int(bulk[0].size), int(bulk[6].size)
    if rows > MAX_BATCH_ROWS or entries > MAX_BATCH_ENTRIES:
        raise ProtocolViolation(
            f"batch of {rows} rows / {entries} entries is over the limit "
            f"({MAX_BATCH_ROWS} rows / {MAX_BATCH_ENTRIES} entries)")
    try:
        return RowBatch.from_buffers(list(bulk), validate=True)
    except ValueError as exc:
        raise ProtocolViolation(str(exc)) from None


def check_increments(batch: RowBatch) -> None:
    """An ApplyBatch's strengths are increments within ``MAX_INCREMENT`` (checked after
    ``check_batch``: they are finite). Not for replies: a stored row's sums may be larger.

    Raises:
        ProtocolViolation: an increment over the bound.
    """
    st = batch.strength
    if st.size and (float(st.max()) > MAX_INCREMENT or float(st.min()) < -MAX_INCREMENT):
        raise ProtocolViolation(f"a strength increment beyond ±{MAX_INCREMENT:.3g} (sums of such overflow float32)")


_PART_DTYPES: Final = (("segment", np.uint8), ("target_column", np.uint64), ("target_feature", np.uint64),
                       ("strength", np.float32))


def check_part(reply: RowPart, bulk: Sequence[np.ndarray], offset: int, limit: int
               ) -> tuple[NDArray[np.uint8], NDArray[np.uint64], NDArray[np.uint64], NDArray[np.float32]]:
    """The four entry arrays of a ``RowPart`` answering a ``ReadRowPart(offset, limit)``, checked:
    buffer count, dtypes, equal lengths, the offset asked for, and a length that fits both the
    request and the row (a part of a row that still exists holds at least one entry).

    Raises:
        ProtocolViolation: anything else.
    """
    if len(bulk) != 4:
        raise ProtocolViolation(f"a row part has 4 buffers, got {len(bulk)}")
    for (name, dt), arr in zip(_PART_DTYPES, bulk):
        if arr.dtype != dt or arr.ndim != 1:
            raise ProtocolViolation(f"row part {name}: expected 1-d {np.dtype(dt)}, got {arr.ndim}-d {arr.dtype}")
    k = int(bulk[0].shape[0])
    if any(int(arr.shape[0]) != k for arr in bulk):
        raise ProtocolViolation("row part buffers differ in length")
    if reply.offset != offset:
        raise ProtocolViolation(f"row part at offset {reply.offset}, asked for {offset}")
    if k > min(limit, MAX_READ_PART_ENTRIES):
        raise ProtocolViolation(f"row part of {k} entries; asked for at most {limit}")
    left = max(0, reply.entries - offset)  # entries of the row at and after the offset
    if k > left or (k == 0 and left > 0):
        raise ProtocolViolation(f"row part of {k} entries at {offset} of a {reply.entries}-entry row")
    seg, tc, tf, st = bulk
    return seg, tc, tf, st


def scan_chain_mask(placement: Placement, cols: NDArray[np.uint64], skip: NDArray[np.bool_],
                    chain: Sequence[int]) -> NDArray[np.bool_]:
    """Which columns an owned scan of ``chain[-1]`` returns: those whose owner list (preference
    order), with the members where ``skip`` is True removed, starts with ``chain`` (member
    indices). Pure; the node filters with it and the client re-checks every page with it.

    The owners are computed once per distinct column: a scan's keys come sorted, many rows to a
    column, so this is a fraction of the rows (the hashing was most of a scan page's filter cost).
    """
    if cols.shape[0] > 1:
        change = np.flatnonzero(cols[1:] != cols[:-1]) + 1
        if change.shape[0] + 1 < cols.shape[0] and bool(np.all(cols[change] > cols[change - 1])):
            starts = np.concatenate([[0], change])
            per_column = scan_chain_mask(placement, cols[starts], skip, chain)
            return np.repeat(per_column, np.diff(np.append(starts, cols.shape[0])))
    owners = placement.owner_indices(cols)  # (K, R)
    live = ~skip[owners]
    rank = np.cumsum(live, axis=1) - 1  # position of each owner among the non-skipped ones
    ok = np.ones(cols.shape[0], bool)
    for want_rank, member in enumerate(chain):
        ok &= (live & (owners == member) & (rank == want_rank)).any(axis=1)
    return ok
