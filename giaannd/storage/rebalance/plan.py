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

__all__ = ["Plan", "Transfer", "TransferRule", "choose_source", "owns", "plan_transfers"]

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


def choose_source(column: int, target: str, candidates: Collection[str]) -> str:
    """The source for one (column, target): the candidate with the highest xxh3 of
    (column, target, candidate). Deterministic and independent of candidate order.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no candidate source")
    prefix = int(column).to_bytes(8, "little") + target.encode() + b"\x00"
    return max(sorted(candidates), key=lambda c: xxhash.xxh3_64_intdigest(prefix + c.encode()))


def _candidates(before: set[str], after: set[str], live: Collection[str], avoid: Collection[str]) -> set[str]:
    """Sources to choose from: live old owners, those *losing* the column first (no write computed
    under the new placement reaches them for it, so everything they apply for it is forwarded
    without needing to know the writer's placement: streaming.sender.StreamRunner), ``avoid`` last."""
    holders = before & set(live)
    released = holders - after
    ok = holders - set(avoid)
    return (released & ok) or ok or released or holders


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
        old_idx, new_idx = self.old.owner_indices(columns), self.new.owner_indices(columns)
        for i, col in enumerate(columns.tolist()):
            before = {self.old.names[j] for j in old_idx[i]}
            if target in before or target not in {self.new.names[j] for j in new_idx[i]}:
                continue
            after = {self.new.names[j] for j in new_idx[i]}
            preferred = _candidates(before, after, self.live, self.avoid_sources)
            out[i] = bool(preferred) and choose_source(col, target, preferred) == source
        return out


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
    cols = np.unique(np.asarray(columns, dtype=np.uint64))
    live_set, avoid = set(live), set(avoid_sources)
    if cols.size == 0:
        return Plan((), np.zeros(0, np.uint64))
    old_idx, new_idx = old.owner_indices(cols), new.owner_indices(cols)
    old_names, new_names = old.names, new.names
    work: dict[tuple[str, str], list[int]] = {}
    released: dict[str, list[int]] = {}
    lost: list[int] = []
    moved = 0
    for i, col in enumerate(cols.tolist()):
        before = {old_names[j] for j in old_idx[i]}
        after = {new_names[j] for j in new_idx[i]}
        gained = after - before
        for m in before - after:
            released.setdefault(m, []).append(col)
        if not gained:
            continue
        moved += 1
        preferred = _candidates(before, after, live_set, avoid)
        if not preferred:
            lost.append(col)
            continue
        for target in sorted(gained):
            work.setdefault((choose_source(col, target, preferred), target), []).append(col)
    transfers = tuple(Transfer(s, t, np.array(c, np.uint64)) for (s, t), c in sorted(work.items()))
    return Plan(transfers, np.array(lost, np.uint64),
                {m: np.array(c, np.uint64) for m, c in sorted(released.items())}, int(cols.size), moved)
