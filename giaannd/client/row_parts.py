"""Chunked reads: rows of any size from one storage node (protocol "Rows of any size").

Theory of operation
-------------------
**Replies are bounded.** ``read_chunked`` sends ``ReadRows(chunked=True)``. The node answers with
rows up to its read chunk (``storage.read-chunk-bytes``) in key order; rows larger than the chunk
are not in the reply but listed in ``RowsReply.large`` with their size and version; ``more`` says
the node stopped early, and the keys after ``(next_column, next_feature)`` are asked again. So no
reply, and no copy a node makes for one, is larger than a chunk, whatever the rows.

**Large rows by parts.** ``read_large_row`` allocates the row's four entry arrays once and fills
them with ``ReadRowPart`` requests of one chunk each, ``READ_PARTS_IN_FLIGHT`` at a time on the
node's connection (a loopback round trip per part would otherwise cap the rate). Each part is
checked on arrival (while the others are on the wire), the entries across part edges at the end,
and received straight into its place (the transport's ``recv_into``: no copy on this side); a reply
that does not fit (an error reply, a node whose read chunk is smaller than ours) is asked for again
into fresh buffers and copied into place. The row is validated as canonical (sorted, unique
targets, finite strengths) before it is returned, each part by one compiled pass
(giaannd/rowengine/canon.py). The first touch of fresh memory (the kernel maps and zeroes each
page) costs as much as the transfer on a loaded host (0.5-0.9 GB/s measured here, against 1-1.6
GB/s for a loopback socket), so a thread maps the row's pages ahead of the receives without
writing them (``Prefault``, giaannd/prefault.py): no part waits for it.

**No torn rows.** Every part reports the row's version: its entry count, ``touches`` (batches
applied to it) and the store's ``drops`` (column drops); each only grows, and every change of a
row's entries changes one of them (a merge-add ``touches``, a growth ``entries`` too, a drop and
re-write ``drops``). The node serves parts as views of the row's region (no copy), so a part's
bytes may be changed while they wait in its socket queue; hence the rule: **a row is accepted only
if every part and one version check sent after the last part arrived (an empty ``ReadRowPart``
at the row's end) report the version the read started from.** A change that reached bytes of a
part before they were handed to the kernel happened before that check was served, so the check
sees it. Otherwise the read starts again from the version the part or check saw. A row that
vanished (``entries`` 0) is absent. After ``MAX_READ_RESTARTS`` restarts the read gives up with
``ReadFailed`` (a row written faster than it can be read; the replica loop then tries the next
owner).

**Joining.** Rows from several replies (and nodes) are disjoint; ``join_disjoint`` puts them in
key order with one copy per field, slicing whole runs of rows (never per-entry work on a large
row), and returns a single part as it is: reading one large row copies it once in all.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd import protocol as p
from giaannd.client.errors import ReadFailed, RemoteBadRequest
from giaannd.client.node_call import NodeCall
from giaannd.client.row_memory import RowMemory
from giaannd.model.rows import NUM_SEGMENTS, RowBatch
from giaannd.prefault import Prefault
from giaannd.rowengine.canon import first_non_canonical
from giaannd.rowengine.jit import kernel
from peers.errors import LocalProtocolError

__all__ = ["MAX_READ_RESTARTS", "READ_PARTS_IN_FLIGHT", "check_canonical_row", "find_keys", "join_disjoint",
           "read_chunked",
           "read_large_row"]

#: Part requests of one large row in flight at once. One part at a time pays a round trip plus the
#: node's copy per chunk with the socket idle; four keep the connection busy (tools/bench/bigrow.py)
#: while the node holds at most four chunks of copies for this reader.
READ_PARTS_IN_FLIGHT: Final = 4
#: Restarts of a large-row read whose row changed between parts before the read fails
#: (module docstring, "No torn rows").
MAX_READ_RESTARTS: Final = 8
#: Runs of consecutive rows ``join_disjoint`` slices one by one; more (rows of many replies
#: interleaved key by key: small rows) go through one vectorised gather instead.
MAX_JOIN_RUNS: Final = 256
#: Entries up to which ``join_disjoint`` always gathers by one vectorised permutation (two copies
#: per field, no per-run Python): a small read's rows come from several nodes interleaved key by
#: key, and slicing them run by run cost 130 us for 16 rows from 3 nodes against ~25 us
#: (tools/bench/readpath.py). 64 Ki entries (1.3 MiB) keep the second copy cheaper than the slicing.
JOIN_GATHER_ENTRIES: Final = 65_536

_Version = tuple[int, int, int]  # entries, touches, drops
#: Where a read given no ``RowMemory`` takes a row's arrays: fresh memory each time.
_FRESH: Final = RowMemory(0)


async def read_chunked(call: NodeCall, node: str, cols: NDArray[np.uint64], feats: NDArray[np.uint64], *,
                       chunk_entries: int, epoch: str, timeout_s: float | None = None,
                       in_flight: int = READ_PARTS_IN_FLIGHT, memory: RowMemory | None = None,
                       busy_ok: bool = False) -> RowBatch:
    """The rows ``(cols, feats)`` that ``node`` holds (absent ones left out), any size, as one
    canonical batch (module docstring). ``busy_ok``: the caller can read them elsewhere, so a node
    whose fold is moving them may refuse at once (``ReadRows.busy_ok``: ``RemoteUnavailable``).

    Raises:
        ProtocolViolation: a malformed reply or part.
        ReadFailed: a large row kept changing while it was read.
        StorageRequestError / PeersError / OSError: the node refused or could not be reached.
    """
    parts: list[RowBatch] = []
    while cols.size:
        reply, bulk = await call(node, p.ReadRows(epoch, chunked=True, busy_ok=busy_ok), [cols, feats], timeout_s)
        if not isinstance(reply, p.RowsReply):
            raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ReadRows", node)
        batch = p.check_batch(bulk)
        _check_reply_keys(reply, batch, cols, feats)
        parts.append(batch)
        if reply.large:
            for row in reply.large:
                big = await read_large_row(call, node, row, chunk_entries=chunk_entries, epoch=epoch,
                                           timeout_s=timeout_s, in_flight=in_flight, memory=memory)
                if big is not None:
                    parts.append(big)
        if not reply.more:
            break
        nc, nf = np.uint64(reply.next_column), np.uint64(reply.next_feature)
        later = (cols > nc) | ((cols == nc) & (feats > nf))
        if int(later.sum()) == cols.size:
            raise p.ProtocolViolation("ReadRows reply says 'more' but its cursor is before every key")
        cols, feats = cols[later], feats[later]
    return join_disjoint(parts)


def _check_reply_keys(reply: p.RowsReply, batch: RowBatch, cols: NDArray[np.uint64],
                      feats: NDArray[np.uint64]) -> None:
    """The rows of a chunked ``ReadRows`` reply, whole (``batch``, canonical) and listed ``large``,
    are keys asked for (``cols``, ``feats``), each once, and at or before the reply's cursor when
    it says ``more``: else the row would be returned though not asked for, or twice (the next page
    asks again for the keys after the cursor) and ``join_disjoint`` would refuse the read with a
    bare ``ValueError`` instead of booking the node's failure.

    Raises:
        ProtocolViolation: a row that breaks one of those.
    """
    rc, rf = np.ascontiguousarray(batch.row_column), np.ascontiguousarray(batch.row_feature)
    if rc.shape[0]:
        where = np.empty(cols.shape[0], np.int64)  # each key asked: its row in the batch, or -1
        find_keys(rc, rf, np.ascontiguousarray(cols), np.ascontiguousarray(feats), where)
        hit = np.zeros(rc.shape[0], np.bool_)
        hit[where[where >= 0]] = True
        if not bool(hit.all()):
            i = int(np.argmin(hit))
            raise p.ProtocolViolation(f"ReadRows reply holds row ({int(rc[i])}, {int(rf[i])}), not asked for")
    cursor = (reply.next_column, reply.next_feature)
    if reply.more and rc.shape[0] and (int(rc[-1]), int(rf[-1])) > cursor:
        raise p.ProtocolViolation(f"ReadRows reply holds row ({int(rc[-1])}, {int(rf[-1])}) after its cursor")
    if not reply.large:
        return
    asked = set(zip(cols.tolist(), feats.tolist()))
    listed = [(row[0], row[1]) for row in reply.large]
    for key in listed:
        if key not in asked:
            raise p.ProtocolViolation(f"large row {key} was not asked for")
        if reply.more and key > cursor:
            raise p.ProtocolViolation(f"large row {key} listed after the reply's cursor")
    if len(set(listed)) != len(listed):
        raise p.ProtocolViolation("ReadRows reply lists a large row twice")
    where = np.empty(len(listed), np.int64)
    find_keys(rc, rf, np.array([k[0] for k in listed], np.uint64), np.array([k[1] for k in listed], np.uint64),
               where)
    if bool((where >= 0).any()):
        raise p.ProtocolViolation(f"large row {listed[int(np.argmax(where >= 0))]} is both in the reply and "
                                  "listed to read by parts")


_RO_U64 = "Array(uint64, 1, 'C', readonly=True)"


@kernel(f"void({_RO_U64}, {_RO_U64}, {_RO_U64}, {_RO_U64}, int64[::1])")
def find_keys(rc: NDArray[np.uint64], rf: NDArray[np.uint64], qc: NDArray[np.uint64], qf: NDArray[np.uint64],
               out: NDArray[np.int64]) -> None:
    """Per query key ``(qc[i], qf[i])`` its index among the keys ``(rc, rf)`` (sorted and unique,
    as a canonical batch's rows), or -1: a binary search each (numpy has none over key pairs)."""
    n = rc.shape[0]
    for i in range(qc.shape[0]):
        c, f = qc[i], qf[i]
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if rc[mid] < c or (rc[mid] == c and rf[mid] < f):
                lo = mid + 1
            else:
                hi = mid
        out[i] = lo if lo < n and rc[lo] == c and rf[lo] == f else -1


async def read_large_row(call: NodeCall, node: str, row: p.LargeRow, *, chunk_entries: int, epoch: str,
                         timeout_s: float | None = None, in_flight: int = READ_PARTS_IN_FLIGHT,
                         memory: RowMemory | None = None) -> RowBatch | None:
    """One row listed in ``RowsReply.large``, read by parts into one allocation (module docstring;
    from ``memory`` when given: row_memory.py); None when it vanished meanwhile.

    Raises:
        ReadFailed: it changed during each of ``MAX_READ_RESTARTS + 1`` reads.
        ProtocolViolation: a malformed part, or a row that is not canonical.
    """
    column, feature, entries, touches, drops = row
    version: _Version = (entries, touches, drops)
    for _ in range(MAX_READ_RESTARTS + 1):
        if version[0] == 0:
            return None
        got = await _read_parts(call, node, column, feature, version, max(1, chunk_entries), max(1, in_flight),
                                epoch, timeout_s, memory or _FRESH)
        if isinstance(got, RowBatch):
            return got
        version = got  # changed: read again, at the version the part saw
    raise ReadFailed(f"row ({column}, {feature}) changed during each of {MAX_READ_RESTARTS + 1} reads", node)


async def _read_parts(call: NodeCall, node: str, column: int, feature: int, version: _Version, chunk: int,
                      in_flight: int, epoch: str, timeout_s: float | None, memory: RowMemory
                      ) -> RowBatch | _Version:
    """One attempt: the whole row at ``version``, or the version a part saw instead."""
    n = version[0]
    out, fresh = memory.fields(n)
    starts = iter(range(0, n, chunk))
    edges: list[int] = []  # where each received part starts
    what = f"row ({column}, {feature}) read by parts"
    changed: list[_Version] = []

    pre = Prefault(out, chunk) if fresh else None  # kept memory is mapped already

    async def worker() -> None:
        for a in starts:  # the shared iterator hands each chunk to one worker
            b = min(a + chunk, n)
            while a < b:
                if changed:
                    return
                msg = p.ReadRowPart(column, feature, a, b - a, epoch)
                try:  # the part's bytes straight into place (the transport's recv_into)
                    reply, bulk = await call(node, msg, (), timeout_s, recv_into=[o[a:b] for o in out])
                    in_place = True
                except LocalProtocolError:  # not 4 buffers of that size (an error, a node's smaller
                    reply, bulk = await call(node, msg, (), timeout_s)  # chunk): ask again, then copy
                    in_place = False
                if not isinstance(reply, p.RowPart):
                    raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ReadRowPart", node)
                seen = (int(reply.entries), int(reply.touches), int(reply.drops))
                if seen != version:
                    changed.append(seen)
                    return
                got = p.check_part(reply, bulk, a, b - a)
                k = int(got[0].shape[0])
                if not in_place:
                    for dst, src in zip(out, got):
                        dst[a : a + k] = src
                # checked on arrival, while other parts are on the wire; the pairs across part
                # edges once all are in (``_check_edges``)
                check_canonical_row(out[0][a : a + k], out[1][a : a + k], out[2][a : a + k], out[3][a : a + k], what)
                edges.append(a)
                a += k

    try:
        async with asyncio.TaskGroup() as tg:  # one failing part cancels the others
            for _ in range(min(in_flight, -(-n // chunk))):
                tg.create_task(worker())
    except* Exception as group:  # the first failure, as itself: callers sort errors by type
        raise group.exceptions[0] from None
    finally:
        if pre is not None:
            pre.stop()
    if changed:
        return changed[0]
    # the version check after every part arrived (module docstring, "No torn rows")
    reply, bulk = await call(node, p.ReadRowPart(column, feature, n, 1, epoch), (), timeout_s)
    if not isinstance(reply, p.RowPart):
        raise RemoteBadRequest(f"unexpected reply {type(reply).__name__} to ReadRowPart", node)
    seen = (int(reply.entries), int(reply.touches), int(reply.drops))
    if seen != version:
        return seen
    _check_edges(out, edges, what)
    return RowBatch(np.array([column], np.uint64), np.array([feature], np.uint64), np.array([0, n], np.int64),
                    out[0], out[1], out[2], out[3])


def _check_edges(out: list[NDArray[Any]], edges: list[int], what: str) -> None:
    """The entry pairs across part edges (each part was checked alone) are in canonical order."""
    at = np.array(sorted(e for e in edges if e > 0), np.int64)
    if at.size:
        pairs = np.stack((at - 1, at), axis=1).reshape(-1)  # (last of one part, first of the next)
        seg, tc, tf, st = (o[pairs] for o in out)
        for i in range(0, pairs.shape[0], 2):
            check_canonical_row(seg[i : i + 2], tc[i : i + 2], tf[i : i + 2], st[i : i + 2], what)


def check_canonical_row(seg: NDArray[np.uint8], tc: NDArray[np.uint64], tf: NDArray[np.uint64],
                        strength: NDArray[np.float32], what: str) -> None:
    """What ``RowBatch.validate`` checks of one row's entries (segments in range, finite strengths,
    targets strictly ascending by (segment, column, feature)), in one compiled pass
    (giaannd/rowengine/canon.py): numpy's whole-array passes, even in cache-sized blocks, cost
    more CPU on the receiving thread than the transfer left it (measured in docs/storage.md).

    Raises:
        ProtocolViolation: the row is not canonical.
    """
    i = first_non_canonical(np.ascontiguousarray(seg), np.ascontiguousarray(tc), np.ascontiguousarray(tf),
                            np.ascontiguousarray(strength), NUM_SEGMENTS)
    if i < 0:
        return
    if int(seg[i]) >= NUM_SEGMENTS:
        raise p.ProtocolViolation(f"{what}: segment out of range ({int(seg[i])} at entry {i})")
    if not np.isfinite(strength[i]):
        raise p.ProtocolViolation(f"{what}: non-finite strength (entry {i})")
    raise p.ProtocolViolation(f"{what}: entries not sorted and unique (near entry {i})")


def _rows_slice(b: RowBatch, r0: int, r1: int) -> RowBatch:
    """Rows ``[r0, r1)`` of ``b`` as views."""
    e0, e1 = int(b.offsets[r0]), int(b.offsets[r1])
    return RowBatch(b.row_column[r0:r1], b.row_feature[r0:r1], b.offsets[r0 : r1 + 1] - e0, b.segment[e0:e1],
                    b.target_column[e0:e1], b.target_feature[e0:e1], b.strength[e0:e1])


def _concat_in_order(pieces: list[RowBatch]) -> RowBatch:
    """Batches already in ascending, disjoint key order, as one batch: one copy per field."""
    lengths = np.concatenate([np.diff(b.offsets) for b in pieces])
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cat: Any = np.concatenate
    return RowBatch(cat([b.row_column for b in pieces]), cat([b.row_feature for b in pieces]), offsets,
                    cat([b.segment for b in pieces]), cat([b.target_column for b in pieces]),
                    cat([b.target_feature for b in pieces]), cat([b.strength for b in pieces]))


def join_disjoint(parts: list[RowBatch]) -> RowBatch:
    """Canonical batches holding disjoint rows, as one canonical batch (module docstring, "Joining").

    Raises:
        ValueError: two parts hold the same row.
    """
    parts = [b for b in parts if b.num_rows]
    if not parts:
        return RowBatch.empty()
    if len(parts) == 1:
        return parts[0]
    rc = np.concatenate([b.row_column for b in parts])
    rf = np.concatenate([b.row_feature for b in parts])
    order = np.lexsort((rf, rc))
    rc, rf = rc[order], rf[order]
    if bool(((rc[1:] == rc[:-1]) & (rf[1:] == rf[:-1])).any()):
        raise ValueError("join_disjoint: a row is in two parts")
    lengths = np.concatenate([np.diff(b.offsets) for b in parts])
    if int(lengths.sum()) <= JOIN_GATHER_ENTRIES:
        return _gather_in_order(parts, order, rc, rf, lengths)
    src = np.repeat(np.arange(len(parts)), [b.num_rows for b in parts])[order]
    idx = np.concatenate([np.arange(b.num_rows) for b in parts])[order]
    cut = np.flatnonzero((src[1:] != src[:-1]) | (idx[1:] != idx[:-1] + 1)) + 1
    if cut.shape[0] + 1 > MAX_JOIN_RUNS:  # many short runs: one vectorised gather
        return _gather_in_order(parts, order, rc, rf, lengths)
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), int(src.shape[0])]
    return _concat_in_order([_rows_slice(parts[int(src[a])], int(idx[a]), int(idx[e - 1]) + 1)
                             for a, e in zip(starts, ends)])


def _gather_in_order(parts: list[RowBatch], order: NDArray[np.intp], rc: NDArray[np.uint64],
                     rf: NDArray[np.uint64], lengths: NDArray[np.int64]) -> RowBatch:
    """``parts`` (disjoint) as one batch, rows taken in ``order`` (of the parts' rows one after the
    other; ``rc``/``rf`` already in that order): per field one concatenation and one gather by an
    entry permutation built with whole-array passes."""
    starts = np.zeros(lengths.shape[0], np.int64)  # where each row's entries begin in the concatenation
    np.cumsum(lengths[:-1], out=starts[1:])
    taken = lengths[order]
    offsets = np.zeros(taken.shape[0] + 1, np.int64)
    np.cumsum(taken, out=offsets[1:])
    perm = np.arange(int(offsets[-1]), dtype=np.int64) + np.repeat(starts[order] - offsets[:-1], taken)
    cat: Any = np.concatenate
    return RowBatch(rc, rf, offsets, cat([b.segment for b in parts])[perm],
                    cat([b.target_column for b in parts])[perm], cat([b.target_feature for b in parts])[perm],
                    cat([b.strength for b in parts])[perm])
