"""Handoff planner: an ownership change → the column transfers that keep every row (ARCHITECTURE §6, §8).

Theory of operation
-------------------
Input: the placement before and after a topology change (join, decommission, removenode, replace),
the columns that exist, and which members are live. Output: a ``Plan`` — for every column and every
*new* owner that did not own it before, one source that holds a complete copy (a live old owner), and
the columns nobody live holds (data loss the operator must be told about, never silently skipped).

Rules, and why:

- **Only gained ownership moves data.** A member that stays an owner keeps its copy; a member that
  loses a column keeps it until the new owners are verified (``Plan.released``), so a read or a
  write under the old placement always finds a complete replica (ARCHITECTURE §6).
- **One source per (column, target).** Two sources for the same rows would need the rows merged,
  and rows are sums of batches: they cannot be merged by "max" (docs/topology.md).
- **The source is an old owner that loses the column, when one is live** (join: the owner the
  newcomer displaces; decommission: the leaving node): writes computed under the new placement never
  reach it for that column, so whatever it applies meanwhile is forwarded as is. Otherwise
  (removenode, replace: the losing owner is dead) any live old owner, and writes are told apart by
  their placement epoch. Among equals the source is chosen by a hash of (column, target), so a join
  streams from all old nodes in parallel. The choice is a pure function of the inputs, so every node computes the same
  plan from
  the same two placements and can find the transfers it must *send* without a coordinator.
- Members in ``avoid_sources`` (a node being decommissioned that should not be loaded, a suspect
  node) are used only when no other live old owner exists.

Pure: no I/O, no clock, no logging.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import xxhash
from numpy.typing import ArrayLike, NDArray

from peers.placement import Placement

__all__ = ["Plan", "Transfer", "TransferRule", "owns", "plan_transfers", "stranded"]

U64 = NDArray[np.uint64]


@dataclass(frozen=True, eq=False)
class Transfer:
    """Stream ``columns`` (sorted, unique) from ``source`` to ``target``."""

    source: str
    target: str
    columns: U64

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Transfer):
            return NotImplemented
        return (self.source, self.target) == (other.source, other.target) and np.array_equal(
            self.columns, other.columns)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Plan:
    """What a placement change needs.

    Attributes:
        transfers: one per (source, target) pair with work, sorted by (source, target).
        lost: columns with a new owner but no live old owner (no complete copy anywhere live).
        released: member -> columns it owned before and does not own after (kept until cutover).
        columns_total: number of distinct columns considered.
        columns_moved: columns with at least one new owner.
    """

    transfers: tuple[Transfer, ...]
    lost: U64
    released: dict[str, U64] = field(default_factory=dict)
    columns_total: int = 0
    columns_moved: int = 0

    @property
    def moved_fraction(self) -> float:
        return self.columns_moved / self.columns_total if self.columns_total else 0.0

    def sent_by(self, source: str) -> list[Transfer]:
        return [t for t in self.transfers if t.source == source]

    def received_by(self, target: str) -> list[Transfer]:
        return [t for t in self.transfers if t.target == target]


@dataclass(frozen=True)
class TransferRule:
    """The plan's rule as a predicate, for columns that did not exist when the plan was made (a
    write creates a column while its transfer runs: the stream that would have carried it must
    carry its writes)."""

    old: Placement
    new: Placement
    live: frozenset[str]
    avoid_sources: frozenset[str] = frozenset()

    def claims(self, source: str, target: str, columns: U64) -> NDArray[np.bool_]:
        """Per column: does the transfer ``source -> target`` carry it under this rule?"""
        out = np.zeros(columns.size, np.bool_)
        if columns.size == 0:
            return out
        moves = _moves(self.old, self.new, np.asarray(columns, np.uint64), self.live, self.avoid_sources)
        names = moves.names
        if source not in names or target not in names:
            return out
        hit = (moves.source == names.index(source)) & (moves.target == names.index(target))
        out[moves.row[hit]] = True
        return out

    def pairs(self) -> set[tuple[str, str]]:
        """Every (source, target) pair this rule can give some column, whether or not a column that
        exists now needs it: a column created while the operation runs goes to the pair the rule
        names, so each of these pairs needs a stream even with nothing to copy yet (before Dec 2,
        only pairs to members new to the ring had one: a column born during a replace, removenode or
        decommission whose pair the plan lacked reached its new owner through no stream, and its
        rows were never copied there).

        Sources are the live old members (``_moves``' tiers pick among a column's live old owners).
        Only members new to the ring gain columns when the change only adds members (a member's
        score for a key depends on nothing else, so a newcomer can only displace an old owner),
        and only the leavers are sources when it only removes live members that are not avoided
        (each moved column's first tier, its live owners that lose it, holds a leaver). Anything
        else (a member removed while down, weights, replicas, strategy or pins changed) may give
        a column to any member from any live old member."""
        old, new = self.old, self.new
        old_names, new_names = set(old.names), set(new.names)
        added, removed = new_names - old_names, old_names - new_names
        rest_same = (old.replicas == new.replicas and old.strategy == new.strategy
                     and dict(old.pins) == dict(new.pins)
                     and {m.name: m.weight for m in old.members if m.name in new_names}
                     == {m.name: m.weight for m in new.members if m.name in old_names})
        targets = added if rest_same and not removed else new_names
        sources = {s for s in old.names if s in self.live}
        if rest_same and removed and not added and removed <= self.live and not removed & self.avoid_sources:
            sources = removed
        return {(s, t) for s in sources for t in targets if s != t}


def owns(placement: Placement, member: str, columns: U64) -> NDArray[np.bool_]:
    """Per column: is ``member`` one of its owners under ``placement``?"""
    if member not in placement.names or columns.size == 0:
        return np.zeros(columns.size, np.bool_)
    me = placement.names.index(member)
    return np.asarray((placement.owner_indices(columns) == me).any(axis=1), np.bool_)


def plan_transfers(old: Placement, new: Placement, columns: ArrayLike, live: Collection[str],
                   avoid_sources: Collection[str] = ()) -> Plan:
    """Plan the transfers from ``old`` to ``new`` ownership of ``columns`` (module docstring).

    Args:
        old, new: placements before and after.
        columns: column ids that exist (any order, duplicates allowed).
        live: members believed up (sources must be live; targets need not be: their transfer waits).
        avoid_sources: members used as sources only when no other live old owner has the column.

    Returns:
        The plan. Columns whose owner lists are equal produce nothing.
    """
    cols = np.sort(np.asarray(columns, dtype=np.uint64).reshape(-1))
    if cols.size > 1:  # unique (a sort and a mask: numpy's ``unique`` hashes, 10x the sort here)
        cols = cols[np.append(True, cols[1:] != cols[:-1])]
    if cols.size == 0:
        return Plan((), np.zeros(0, np.uint64))
    m = _moves(old, new, cols, live, avoid_sources)
    names = m.names
    # (source, target) pairs in name order (``names`` is sorted), columns ascending within each
    order = np.lexsort((m.row, m.target, m.source))
    src, dst, rows = m.source[order], m.target[order], m.row[order]
    cuts = _runs((src[1:] != src[:-1]) | (dst[1:] != dst[:-1]), src.size)
    transfers = tuple(Transfer(names[int(src[a])], names[int(dst[a])], cols[rows[a:b]]) for a, b in cuts)
    rel_order = np.lexsort((m.released_row, m.released_member))
    rel_member, rel_row = m.released_member[rel_order], m.released_row[rel_order]
    released = {names[int(rel_member[a])]: cols[rel_row[a:b]]
                for a, b in _runs(rel_member[1:] != rel_member[:-1], rel_member.size)}
    return Plan(transfers, cols[m.lost_rows], released, int(cols.size), m.moved)


def stranded(old: Placement, new: Placement, columns: ArrayLike, live: Collection[str]) -> U64:
    """The columns (sorted, unique) that a live old owner gives up and that no live member owns
    under ``new``: the change would take their last live copy out of the placement (a
    decommission whose remaining owners are down). A column whose owners are all down before
    and stay owners is not one: nothing live loses it.

    Args:
        old, new: placements before and after.
        columns: column ids that exist (any order, duplicates allowed).
        live: members believed up, new members that will serve included.
    """
    cols = np.sort(np.asarray(columns, dtype=np.uint64).reshape(-1))
    if cols.size == 0 or all(n in live for n in new.names):  # (the common case: no table to build)
        return cols[:0]
    cols = cols[np.append(True, cols[1:] != cols[:-1])]
    names = sorted(set(old.names) | set(new.names))
    index = {n: i for i, n in enumerate(names)}
    before = np.array([index[n] for n in old.names], np.intp)[old.owner_indices(cols)]
    after = np.array([index[n] for n in new.names], np.intp)[new.owner_indices(cols)]
    live_of = np.zeros(len(names), np.bool_)
    live_of[[index[n] for n in live if n in index]] = True
    gives_up = (live_of[before] & ~(before[:, :, None] == after[:, None, :]).any(axis=2)).any(axis=1)
    out: U64 = cols[gives_up & ~live_of[after].any(axis=1)]
    return out


@dataclass(frozen=True)
class _Moves:
    """What an ownership change means for each column (``_moves``), as flat arrays over the
    members' ``names`` (sorted): a (column row, gained owner, source) triple per transfer, a
    (column row, member) pair per owner that loses the column, the rows with a gained owner but
    no live old owner (lost) and how many rows have a gained owner (moved)."""

    names: list[str]
    row: NDArray[np.intp]
    target: NDArray[np.intp]
    source: NDArray[np.intp]
    released_row: NDArray[np.intp]
    released_member: NDArray[np.intp]
    lost_rows: NDArray[np.intp]
    moved: int


def _moves(old: Placement, new: Placement, cols: U64, live: Collection[str], avoid: Collection[str]) -> _Moves:
    """The transfers the change from ``old`` to ``new`` asks for ``cols`` (module docstring's
    rules), in whole-array passes over the (column × replica) owner tables: per column, the owners
    gained and lost, the candidate sources and the source of each gained owner. The candidates are
    the first non-empty tier of: live old owners that lose the column and are not avoided (no
    write computed under the new placement reaches them for it, so whatever they apply for it is
    forwarded without knowing the writer's placement: streaming.sender.StreamRunner), live ones not
    avoided, live ones that lose it, live ones. Where a tier has several (a removenode or replace:
    any live old owner) the hash decides (``_highest_hash``); a join or a decommission names one
    source per column (the owner that loses it)."""
    names = sorted(set(old.names) | set(new.names))
    index = {n: i for i, n in enumerate(names)}
    # a row of owner indices names distinct members (Placement's contract, pins included)
    before = np.array([index[n] for n in old.names], np.intp)[old.owner_indices(cols)]
    after = np.array([index[n] for n in new.names], np.intp)[new.owner_indices(cols)]
    gained = ~(after[:, :, None] == before[:, None, :]).any(axis=2)
    lost_owner = ~(before[:, :, None] == after[:, None, :]).any(axis=2)
    live_of = np.zeros(len(names), np.bool_)
    live_of[[index[n] for n in live if n in index]] = True
    avoid_of = np.zeros(len(names), np.bool_)
    avoid_of[[index[n] for n in avoid if n in index]] = True
    holders = live_of[before]
    released = holders & lost_owner
    ok = holders & ~avoid_of[before]
    preferred = holders
    for tier in (released, ok, released & ok):  # the first non-empty of: released & ok, ok, released, holders
        preferred = np.where(tier.any(axis=1, keepdims=True), tier, preferred)
    moved_rows = gained.any(axis=1)
    has_source: NDArray[np.bool_] = np.asarray(preferred.any(axis=1))
    lost_rows = np.flatnonzero(moved_rows & ~has_source)
    rows, slots = np.nonzero(gained & has_source[:, None])
    targets = after[rows, slots]
    sources = before[rows, preferred[rows].argmax(axis=1)]  # right where the tier has one member
    several = np.flatnonzero(preferred[rows].sum(axis=1) > 1)
    if several.size:  # several candidates: the hash decides
        r = rows[several]
        sources[several] = _highest_hash(cols[r], targets[several], before[r], preferred[r], names)
    rel_rows, rel_slots = np.nonzero(lost_owner)
    return _Moves(names, rows, targets, sources, rel_rows, before[rel_rows, rel_slots], lost_rows,
                  int(moved_rows.sum()))


def _highest_hash(cols: U64, targets: NDArray[np.intp], owners: NDArray[np.intp], candidate: NDArray[np.bool_],
                  names: list[str]) -> NDArray[np.intp]:
    """The source of each (column, target) pair among several candidates (the ``owners`` where
    ``candidate`` is set), as member indices into ``names`` (sorted): the candidate with the
    highest xxh3-64 of the column (8 bytes, little-endian), the target's name, a zero byte and the
    candidate's name; among equal hashes the first in name order. Every node computes the same
    (the rule is part of the plan every node derives alone, across versions). The messages of one
    (target, candidate) pair have one length, so they are laid out as rows of one byte matrix,
    built in whole-array passes; the hashing itself is still one ``xxh3_64_intdigest`` call per
    (column, candidate) from a generator (xxhash has no call for many messages at once): the rest of
    a removenode's per-column cost (tools/bench/plan.py)."""
    n = cols.shape[0]
    best = np.full(n, -1, np.intp)
    best_hash = np.zeros(n, np.uint64)
    column_bytes = np.ascontiguousarray(cols, "<u8").view(np.uint8).reshape(n, 8)
    by_name = np.argsort(owners, axis=1, kind="stable")  # member indices ascend as names do
    every = np.arange(n)
    for k in range(owners.shape[1]):
        member = owners[every, by_name[:, k]]
        on = np.flatnonzero(candidate[every, by_name[:, k]])
        pair = targets[on] * len(names) + member[on]
        order = np.argsort(pair, kind="stable")
        on, pair = on[order], pair[order]
        for a, b in _runs(pair[1:] != pair[:-1], pair.size):  # one (target, candidate) pair each
            sel = on[a:b]
            t, c = divmod(int(pair[a]), len(names))
            tail = names[t].encode() + b"\x00" + names[c].encode()
            msg = np.empty((sel.size, 8 + len(tail)), np.uint8)
            msg[:, :8] = column_bytes[sel]
            msg[:, 8:] = np.frombuffer(tail, np.uint8)
            flat, width = msg.tobytes(), msg.shape[1]
            h = np.fromiter((xxhash.xxh3_64_intdigest(flat[i:i + width]) for i in range(0, len(flat), width)),
                            np.uint64, sel.size)
            better = (best[sel] < 0) | (h > best_hash[sel])
            best[sel[better]] = c
            best_hash[sel[better]] = h[better]
    return best


def _runs(changes: NDArray[np.bool_], n: int) -> list[tuple[int, int]]:
    """The (start, end) of each run of equal items in a sorted array of ``n`` items, given where
    item i + 1 differs from item i (``changes``); none when ``n`` is 0."""
    if n == 0:
        return []
    cuts = (np.flatnonzero(changes) + 1).tolist()
    return list(zip([0, *cuts], [*cuts, n]))
