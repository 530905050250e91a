"""Replica repair: find the batches a replica is missing and rebuild its share of each (pure).

Theory of operation
-------------------
Rows are sums of batches, so two replicas of a row cannot be reconciled by comparing values ("take
the max" would drop one side's increments, "add the difference" is inexact in floating point and
wrong when both sides miss something). What can be compared exactly is *which batches* each node
applied: its applied set (applied_set.py). Repair therefore works on batches:

1. Hints first. A replica that was down gets its missed batches by hinted handoff (hints.py); repair
   pushes delivery to completion before comparing anything, since most gaps close there.
2. Candidates. Every batch record still in a peer's update log whose rows touch a column the
   repaired node ``dst`` owns, and whose id ``dst`` has not applied, is a candidate. For a tracked
   (training) writer the unit is (batch id, column) (applied_set.py, "Which columns"): ``dst`` may
   hold an id for some of its columns only (one share applied, the one with the rest lost), so an
   id it applied is still a candidate in the columns it lacks under that id (``lacking``).
3. Share assembly. ``dst``'s share of batch ``b`` is ``b``'s rows in the columns ``dst`` owns
   (and lacks under ``b``: the columns applied already are never shipped; the store would ignore
   them anyway, ``ColumnStore.prepare``). Each
   peer logged ``b``'s rows in the columns *it* owns, so the union over the peers that logged ``b``,
   restricted to ``dst``'s columns, is ``dst``'s share — provided no peer that applied ``b`` has lost
   its record of it (snapshotted the log away): then a row only that peer knew might be missing,
   and marking ``b`` applied at ``dst`` would make ``dst`` ignore that row forever. Such a batch is
   reported as *unrecoverable from logs*, never half-applied. Rows logged by two peers must be
   identical (they are the same writer's rows); a conflict is reported.
4. Apply. The share is applied at ``dst`` under the original id ``b``, atomically with its applied-set
   entry (and its columns), so a late hint or writer retry of ``b`` is ignored as a duplicate (its
   share is the same).
5. Verify. Row digests of the replicas: keys exactly, strengths within a tolerance (replicas apply
   batches in different orders; float addition is not associative), applied-batch counts ignored
   (stream copies apply one batch per chunk).

Batches a node applied as *stream items* (streaming/stream.py: copies, not writes) are not writer batches:
their writer ids are listed by the receiving node and excluded from candidates.

**Columns a stream copied to the node** (``copied``: a join's newcomer holds nothing else) hold every
batch the stream's source had applied, under the stream's ids, not the batches' own: the node's
applied set lacks those ids although their rows are there, and shipping them again counted them
twice. Whether such a batch came before the stream's cut or after (a write the node missed) cannot
be told from ids, so a candidate with rows in those columns is reported *unrecoverable*, never
applied; the row comparison still reports what differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.applied_set import AppliedSet

__all__ = ["RepairPlan", "add_record", "assemble_share", "lacking", "plan_repair"]

Owned = Callable[[NDArray[np.uint64]], NDArray[np.bool_]]


@dataclass
class RepairPlan:
    """What to apply at one node.

    Attributes:
        shares: batch id -> the node's assembled share (apply under that id).
        unrecoverable: batch id -> why it cannot be rebuilt from the peers' logs.
        unlogged: per peer, how many ids it applied that the node has not and that no peer has a
            log record of. They may not touch the node's columns at all (one writer's batches go
            to many owner sets): only the row comparison can tell; a non-zero count with
            divergent rows means updates lost beyond what the logs retain.
    """

    shares: dict[BatchId, RowBatch] = field(default_factory=dict)
    unrecoverable: dict[BatchId, str] = field(default_factory=dict)
    unlogged: dict[str, int] = field(default_factory=dict)


def assemble_share(parts: Iterable[RowBatch], owned: Owned) -> RowBatch:
    """The union of ``parts``' rows in owned columns, each row once, sorted by row key.

    Whole-array work only (a coalesced training batch has up to 10^6 rows; the dict of rows this
    replaced cost seconds of Python per repaired batch): the owned rows of every part are stacked,
    stably sorted by key, and each later copy of a key is compared with its first copy at once.

    Raises:
        ValueError: two parts disagree on a row (they must be copies of the same writer's row);
            the row named is the first, in parts order, whose copy differs from its first copy.
    """
    rows = _stack([part.select_rows(owned(part.row_column)) for part in parts])
    if not rows.num_rows:
        return RowBatch.empty()
    order = np.lexsort((rows.row_feature, rows.row_column))  # stable: first copies lead their key
    col, feat = rows.row_column[order], rows.row_feature[order]
    starts = np.ones(order.shape[0], dtype=bool)
    starts[1:] = (col[1:] != col[:-1]) | (feat[1:] != feat[:-1])
    first = order[starts]  # per key, in key order: the position of its first copy
    copy_of = np.empty_like(order)
    copy_of[order] = first[np.cumsum(starts) - 1]  # per row: the position of its key's first copy
    bad = _differing(rows, np.flatnonzero(copy_of != np.arange(order.shape[0])), copy_of)
    if bad.shape[0]:
        at = int(bad.min())
        raise ValueError(f"peers logged different contents for row {rows.key(at)}")
    return _take(rows, first)


def _stack(batches: list[RowBatch]) -> RowBatch:
    """The rows of ``batches`` one after another, as they are: a key may repeat (not canonical,
    unlike ``RowBatch.concat``, which would add the copies up)."""
    batches = [b for b in batches if b.num_rows]
    if not batches:
        return RowBatch.empty()
    lengths = np.concatenate([np.diff(b.offsets) for b in batches])
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def cat(field: str) -> NDArray[np.generic]:
        return np.concatenate([getattr(b, field) for b in batches])

    return RowBatch(cat("row_column"), cat("row_feature"), offsets, cat("segment"),  # type: ignore[arg-type]
                    cat("target_column"), cat("target_feature"), cat("strength"))  # type: ignore[arg-type]


def _entries(offsets: NDArray[np.int64], idx: NDArray[np.intp]) -> NDArray[np.int64]:
    """The entry positions of rows ``idx`` (in that order), concatenated."""
    lengths = offsets[idx + 1] - offsets[idx]
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(offsets[idx] - out_starts, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _differing(rows: RowBatch, dup: NDArray[np.intp], copy_of: NDArray[np.intp]) -> NDArray[np.intp]:
    """Which rows of ``dup`` differ from their first copy ``copy_of[dup]``, by ``Row.equals``'s
    rule: same length and every entry field equal (``==``: a NaN strength never equals, -0.0
    equals 0.0)."""
    lengths = np.diff(rows.offsets)
    same_len = lengths[dup] == lengths[copy_of[dup]]
    check = dup[same_len]
    mine, theirs = _entries(rows.offsets, check), _entries(rows.offsets, copy_of[check])
    fields = (rows.segment, rows.target_column, rows.target_feature, rows.strength)
    differs = np.zeros(mine.shape[0], dtype=bool)
    for f in fields:
        differs |= f[mine] != f[theirs]
    row_of_entry = np.repeat(np.arange(check.shape[0]), lengths[check])
    bad = np.zeros(check.shape[0], dtype=bool)
    bad[row_of_entry[differs]] = True
    return np.concatenate([dup[~same_len], check[bad]])


def _take(rows: RowBatch, idx: NDArray[np.intp]) -> RowBatch:
    """Rows ``idx`` of ``rows``, in that order, as a batch of its own (``select_rows`` by index)."""
    lengths = rows.offsets[idx + 1] - rows.offsets[idx]
    offsets = np.zeros(idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    e = _entries(rows.offsets, idx)
    return RowBatch(
        rows.row_column[idx].astype(np.uint64, copy=False), rows.row_feature[idx].astype(np.uint64, copy=False),
        offsets, rows.segment[e].astype(np.uint8, copy=False), rows.target_column[e].astype(np.uint64, copy=False),
        rows.target_feature[e].astype(np.uint64, copy=False), rows.strength[e].astype(np.float32, copy=False),
    )


def add_record(records: dict[BatchId, RowBatch], batch_id: BatchId, batch: RowBatch) -> None:
    """One more log record of ``batch_id`` into ``records``. A store logs one record per share of
    an id it applied (a training writer's ids are idempotent per column: a later share brings only
    the columns the earlier ones lacked), so the rows of every record of an id are kept, not the
    last record's only."""
    had = records.get(batch_id)
    records[batch_id] = batch if had is None else RowBatch.concat([had, batch])


def lacking(owned: Owned, done: NDArray[np.uint64]) -> Owned:
    """Which row columns a node owns and has not applied under one batch id: ``owned`` less
    ``done`` (``AppliedSet.columns``: the columns applied under it; empty when none)."""
    if not done.shape[0]:
        return owned

    def mask(cols: NDArray[np.uint64]) -> NDArray[np.bool_]:
        return owned(cols) & ~np.isin(cols, done)

    return mask


def plan_repair(dst_applied: AppliedSet, owned: Owned, peer_logs: Mapping[str, Mapping[BatchId, RowBatch]],
                peer_applied: Mapping[str, AppliedSet], excluded_writers: set[int],
                copied: Owned | None = None, *, by_column: bool = True) -> RepairPlan:
    """Plan the repair of one node (module docstring, steps 2–3).

    Args:
        dst_applied: the repaired node's applied set.
        owned: which row columns the repaired node owns (current placement).
        peer_logs: per peer, the batch records still in its update log.
        peer_applied: per peer, its applied set (to detect records lost to a snapshot).
        excluded_writers: stream writer ids (copies, never candidates).
        copied: which row columns streams copied to the repaired node (module docstring: a
            candidate with rows there is unrecoverable); None: none.
        by_column: False: every id the repaired node applied counts as applied whole (the step 2
            rule before (batch id, column)): for peer logs from a server from before
            ``LoggedPage.by_column``, which lists no id the node applied, so one it logs and the
            node holds in part would look lost to its log (a false "unrecoverable").
    """
    plan = RepairPlan()
    for bid, (want, parts) in _candidates(dst_applied, owned, peer_logs, excluded_writers, by_column).items():
        lost = [p for p, applied in peer_applied.items() if bid in applied and bid not in peer_logs.get(p, {})]
        if lost:
            plan.unrecoverable[bid] = f"applied on {', '.join(sorted(lost))} but no longer in its log"
            continue
        try:
            share = assemble_share(parts, want)
        except ValueError as exc:
            plan.unrecoverable[bid] = str(exc)
            continue
        if copied is not None and share.num_rows and copied(share.row_column).any():
            plan.unrecoverable[bid] = "rows in columns a stream copied here, whose copy may hold them already"
            continue
        if share.num_rows:
            plan.shares[bid] = share
    logged = set().union(*(set(r) for r in peer_logs.values())) if peer_logs else set()
    for peer, applied in peer_applied.items():
        n = count_missing(applied, dst_applied, logged | excluded_ids(applied, excluded_writers))
        if n:
            plan.unlogged[peer] = n
    return plan


def _candidates(dst_applied: AppliedSet, owned: Owned, peer_logs: Mapping[str, Mapping[BatchId, RowBatch]],
                excluded_writers: set[int], by_column: bool) -> dict[BatchId, tuple[Owned, list[RowBatch]]]:
    """Step 2: per candidate id, which row columns ``dst`` wants of it (owned, not applied under
    the id) and the peers' records of it with rows there."""
    out: dict[BatchId, tuple[Owned, list[RowBatch]]] = {}
    wanted: dict[BatchId, Owned | None] = {}  # per id seen: what dst wants of it (None: nothing)
    for records in peer_logs.values():
        for bid, batch in records.items():
            if bid.writer in excluded_writers:
                continue
            if bid not in wanted:
                # None: applied whole (untracked, promised, no columns known, or not by column)
                done = dst_applied.columns(bid) if by_column or bid not in dst_applied else None
                wanted[bid] = None if done is None else lacking(owned, done)
            want = wanted[bid]
            if want is not None and want(batch.row_column).any():
                out.setdefault(bid, (want, []))[1].append(batch)
    return out


def excluded_ids(applied: AppliedSet, writers: set[int]) -> set[BatchId]:
    """Placeholder set semantics for ``count_missing``: every id of an excluded writer."""
    return {BatchId(w, 0) for w in writers if w in set(applied.writers())}


def count_missing(have: AppliedSet, other: AppliedSet, skip: set[BatchId]) -> int:
    """How many ids ``have`` covers (floor ranges + exceptions) that ``other`` lacks, not counting
    ``skip`` (ids with seq 0 in ``skip`` mean "the whole writer")."""
    writers, floors, counts, exceptions = have.to_arrays()
    total, pos = 0, 0
    for w, f, c in zip(writers.tolist(), floors.tolist(), counts.tolist()):
        exc = exceptions[pos : pos + c].tolist()
        pos += c
        if BatchId(w, 0) in skip:
            continue
        of = other.floor(w)
        seqs = list(range(of + 1, f + 1)) + [s for s in exc if s > of]
        total += sum(1 for s in seqs if BatchId(w, s) not in other and BatchId(w, s) not in skip)
    return total
