"""Replicated reads of the StorageClient: replica choice, failover, ramp-up of returning members.

Theory of operation
-------------------
**Replica choice** (``replica_order``, pure): each row is read from one of its R owners, tried in
this order: live owners before owners believed down, the local node before remote ones, then the
row's preference-list position. A member that came up recently (back from down, or new in the
placement) is *ramping* (``read_ramp_s``, giaannd/ramp.py): for the rows whose pseudo-random draw
is at or above its current read weight it goes behind the other live replicas of the row, so it
keeps a growing fraction of the rows it would be first for and a cold node is not flooded with
reads the moment it returns. The local node is never demoted (reading it costs no network).

**Failover** (``read_replicated``): round k sends every row still unread to its k-th candidate,
grouped per node and chunked by ``MAX_READ_ROWS``, all nodes at once. A node that fails, times out
or answers NotOwner leaves its rows for the next round, i.e. the next owner; owners believed down
come last, as a last resort. After R rounds, rows no replica served raise ``ReadFailed`` (absent
rows are not failures: a node leaves out rows it does not hold).

**Around folds** (``around_folds``, on by default): a storage node folding its delta runs into its
base holds the reads of its rows until the fold ends (seconds at 10^8 entries per node). So round
k asks a node with ``busy_ok`` when every row sent to it has a live candidate after position k: a
folding node then answers ``Unavailable`` at once and those rows go to their next candidate in the
next round, like any failure. The last live candidate of a row is asked without it and waits for
the fold, as before (protocol.py, "Reads during a fold"); when members are down, a node's rows are
sent as two requests, those with a live candidate left and those without.

**Fewest nodes** (``fewest_nodes``, ``compute.read-fewest-nodes``, off by default): a small read
pays a fixed cost per request at both ends (tools/bench/readpath.py: ~80 us of transport CPU and
~30 us of handlers each), and spreading 16 rows over their first owners makes 3 requests where one
node holds them all (R = 3 of 3). With it on, round 0 sends each row to a live owner chosen by a
greedy cover (the node that is a live owner of most unassigned rows, ties to the one that is
first owner of most of them, so reads still spread by row hash; then the next...), which puts the
row's chosen node first and keeps the others in order for failover. Rows whose first
candidate is this node, and every read while a member is ramping, keep the plain order. The cost:
rows no longer go to their own first owner, so the read load of a client leans on the nodes that
own most of what it asks at once.

**Starting a ramp** (``ReadRampStarter``): on each topology change, members that went down stop
ramping; members that came up start, unless they are the first members this client hears of (a
client starting against a running cluster does not ramp everyone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from giaannd import protocol as p
from giaannd.client.errors import REQUEST_FAILURES, ReadFailed
from giaannd.client.row_parts import join_disjoint
from giaannd.cluster.view import ClusterView, ViewChange
from giaannd.model.rows import RowBatch
from giaannd.ramp import RampTracker, row_draws
from giaannd.rowengine.jit import kernel
from giaannd.unique import unique

__all__ = ["ReadFrom", "ReadRampStarter", "fewest_nodes", "read_replicated", "replica_order"]

# The storage client's parts log under the client's name (operators and tests filter on it).
log = logging.getLogger("giaannd.client.storage_client")

#: Rows from one node (``StorageClient.read_from``): node, row_column, row_feature, timeout_s, busy_ok.
ReadFrom = Callable[[str, NDArray[np.uint64], NDArray[np.uint64], float | None, bool], Awaitable[RowBatch]]


def replica_order(owners: NDArray[np.intp], down: NDArray[np.bool_], local: NDArray[np.bool_],
                  demote: NDArray[np.bool_] | None = None) -> NDArray[np.intp]:
    """Per row, its owners (member indices, placement order) in the order to try them.

    Args:
        owners: [rows, R] member indices of each row's owners.
        down: per member, believed down.
        local: per member, is this node.
        demote: [rows, R], owner ramping and this row's draw outside its weight (None: no ramp).
    """
    if demote is None and not down.any() and not local.any():
        return owners  # every rank is the preference position: the order is the placement's
    r = owners.shape[1]
    # candidate order per row: live before down, local before remote, then preference position
    rank = down[owners] * (4 * r) + (~local[owners]) * r + np.arange(r)[None, :]
    if demote is not None:  # a ramping member goes behind the other live replicas of a row
        rank += (demote & ~local[owners]) * (2 * r)
    return np.take_along_axis(owners, np.argsort(rank, axis=1, kind="stable"), axis=1)


@kernel("void(Array(int64, 2, 'C', readonly=True), Array(boolean, 1, 'C', readonly=True), "
        "Array(boolean, 1, 'C', readonly=True), int64[:, ::1])")
def _fewest(cand: NDArray[np.int64], down: NDArray[np.bool_], local: NDArray[np.bool_], out: NDArray[np.int64]) -> None:
    """``fewest_nodes`` into ``out`` (same shape as ``cand``): the greedy cover, one pass over the
    rows left per node chosen, then each row's chosen owner moved first, the rest in order."""
    rows, r = cand.shape
    n = down.shape[0]
    left = np.zeros(rows, np.bool_)
    first = np.empty(rows, np.int64)
    k = 0
    for i in range(rows):
        first[i] = cand[i, 0]
        if not local[cand[i, 0]]:
            for j in range(r):
                if not down[cand[i, j]]:
                    left[i] = True
                    k += 1
                    break
    counts = np.empty(n, np.int64)
    firsts = np.empty(n, np.int64)
    while k > 0:
        counts[:] = 0
        firsts[:] = 0
        lead = -1
        for i in range(rows):
            if left[i]:
                if lead < 0:
                    lead = cand[i, 0]
                firsts[cand[i, 0]] += 1
                for j in range(r):
                    if not down[cand[i, j]]:
                        counts[cand[i, j]] += 1
        # ties go to the first owner of most of those rows, then of the first of them: with R = N
        # every node owns every row, and a fixed tie-break would send every small read to one node
        best = 0
        best_score = -1
        for m in range(n):
            score = counts[m] * 2 * (k + 1) + firsts[m] * 2 + (1 if m == lead else 0)
            if score > best_score:
                best, best_score = m, score
        for i in range(rows):
            if left[i]:
                for j in range(r):
                    if cand[i, j] == best and not down[best]:
                        first[i] = best
                        left[i] = False
                        k -= 1
                        break
    for i in range(rows):  # the chosen one first, the others in their order (a stable partition)
        f = first[i]
        o = 0
        for j in range(r):
            if cand[i, j] == f:
                out[i, o] = f
                o += 1
        for j in range(r):
            if cand[i, j] != f:
                out[i, o] = cand[i, j]
                o += 1


def fewest_nodes(cand: NDArray[np.intp], down: NDArray[np.bool_], local: NDArray[np.bool_]) -> NDArray[np.intp]:
    """``cand`` (per row, its owners in the order to try them) with each row's first owner chosen
    so that the rows go to as few live nodes as a greedy cover finds (module docstring, "Fewest
    nodes"); the other owners keep their order. A row whose first candidate is local, or with no
    live owner, is left as it is. One compiled pass per chosen node (``_fewest``): the numpy
    passes before it (a dozen per node chosen, two argsorts) were ~35 µs of a small read.

    Raises:
        ValueError: a member index outside ``down``/``local`` (the kernel indexes unchecked)."""
    c = np.ascontiguousarray
    cand64 = c(cand, np.int64)
    down, local = c(down, np.bool_), c(local, np.bool_)
    if down.shape != local.shape or (cand64.size and not 0 <= int(cand64.min()) <= int(cand64.max()) < down.shape[0]):
        raise ValueError("fewest_nodes: candidates must be member indices of down/local")
    out = np.empty_like(cand64)
    _fewest(cand64, down, local, out)
    return out.astype(cand.dtype, copy=False)


async def read_replicated(topology: ClusterView, read_from: ReadFrom, ramp: RampTracker, clock: Callable[[], float],
                          row_column: Any, row_feature: Any, timeout_s: float | None = None, *,
                          fewest: bool = False, around_folds: bool = True) -> RowBatch:
    """``StorageClient.read_rows`` (its docstring): rows from the first candidate replica, failing
    over round by round (module docstring). ``fewest``: choose the first candidates so that the
    rows go to as few nodes as possible ("Fewest nodes"). ``around_folds``: a node folding its
    delta runs may send rows that have another live candidate on to it ("Around folds")."""
    cols = np.ascontiguousarray(row_column, np.uint64).reshape(-1)
    feats = np.ascontiguousarray(row_feature, np.uint64).reshape(-1)
    if cols.shape != feats.shape:
        raise ValueError("row_column and row_feature differ in length")
    if cols.size == 0:
        return RowBatch.empty()
    if cols.size > p.MAX_READ_ROWS:  # a node's rows may be cut into several requests: a key asked
        cols, feats = _unique_keys(cols, feats)  # twice must not be in two (its row would come twice)
    placement = topology.placement
    names = placement.names
    owners = placement.owner_indices(cols)
    r = owners.shape[1]
    down, local = topology.masks()
    weights = ramp.weights(names, clock())
    demote = None if weights is None else row_draws(cols, feats)[:, None] >= weights[owners]
    cand = replica_order(owners, down, local, demote)
    if fewest and demote is None and cols.size > 1:
        cand = fewest_nodes(cand, down, local)
    spare = _live_spares(cand, down) if around_folds and r > 1 else None
    todo = np.ones(cols.size, bool)
    parts: list[RowBatch] = []
    errors: dict[str, str] = {}
    for k in range(r):
        if not todo.any():
            break
        jobs = []
        for m in unique(cand[todo, k]):
            node_mask = todo & (cand[:, k] == m)
            for mask, busy_ok in _by_spare(node_mask, spare, k):
                for start in range(0, int(mask.sum()), p.MAX_READ_ROWS):
                    rows = np.flatnonzero(mask)[start : start + p.MAX_READ_ROWS]
                    jobs.append((names[int(m)], rows, busy_ok))
        outcomes = await _read_all(read_from, jobs, cols, feats, timeout_s)
        for (node, rows, _), out in zip(jobs, outcomes):
            if isinstance(out, RowBatch):
                parts.append(out)
                todo[rows] = False
            elif isinstance(out, REQUEST_FAILURES):
                errors[node] = str(out) or type(out).__name__
            elif isinstance(out, BaseException):
                raise out
    if todo.any():
        detail = "; ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
        raise ReadFailed(f"{int(todo.sum())} rows unreadable on every replica ({detail})")
    return join_disjoint(parts)  # each row came from one node: disjoint (a lone part is not copied)


def _unique_keys(cols: NDArray[np.uint64], feats: NDArray[np.uint64]) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """The keys ``(cols, feats)`` each once, in key order."""
    order = np.lexsort((feats, cols))
    c, f = cols[order], feats[order]
    first = np.ones(c.shape[0], bool)
    first[1:] = (c[1:] != c[:-1]) | (f[1:] != f[:-1])
    return c[first], f[first]


def _live_spares(cand: NDArray[np.intp], down: NDArray[np.bool_]) -> list[bool] | NDArray[np.bool_]:
    """Whether each row has a live candidate after position k ("Around folds"): [rows, R] bools, or,
    when no member is believed down, one flag per position for every row (no per-row arrays)."""
    r = cand.shape[1]
    if not down.any():
        return [k < r - 1 for k in range(r)]
    live = ~down[cand]
    spare = np.zeros_like(live)
    spare[:, :-1] = np.logical_or.accumulate(live[:, ::-1], axis=1)[:, ::-1][:, 1:]
    return spare


def _by_spare(mask: NDArray[np.bool_], spare: list[bool] | NDArray[np.bool_] | None,
              k: int) -> list[tuple[NDArray[np.bool_], bool]]:
    """The rows ``mask`` sends to one node in round k, split by whether each has a live candidate
    after it (``_live_spares``): those may be refused by a folding node, the others may not."""
    if spare is None or isinstance(spare, list):
        return [(mask, spare is not None and spare[k])]
    with_spare = mask & spare[:, k]
    return [(m, flag) for m, flag in ((with_spare, True), (mask & ~spare[:, k], False)) if m.any()]


async def _read_all(read_from: ReadFrom, jobs: list[tuple[str, NDArray[np.intp], bool]], cols: NDArray[np.uint64],
                    feats: NDArray[np.uint64], timeout_s: float | None) -> list[RowBatch | BaseException]:
    """Each job's batch or exception, all jobs at once (``asyncio.gather``, ``return_exceptions``).
    A lone job (a small read: every row's candidate is one node) is awaited here: no task and no
    gather future for it (tools/bench/readpath.py)."""
    if len(jobs) == 1:
        node, rows, busy_ok = jobs[0]
        try:
            return [await read_from(node, cols[rows], feats[rows], timeout_s, busy_ok)]
        except Exception as exc:  # as gather's return_exceptions (cancellation still propagates)
            return [exc]
    return await asyncio.gather(*(read_from(node, cols[rows], feats[rows], timeout_s, busy_ok)
                                  for node, rows, busy_ok in jobs), return_exceptions=True)


class ReadRampStarter:
    """Starts and stops read ramps on topology changes (module docstring, "Starting a ramp").

    Args:
        topology: the cluster view; the members it holds now count as already known.
        ramp: the tracker whose ramps this starts (the client's ``read_ramp``).
        clock: monotonic seconds.
    """

    def __init__(self, topology: ClusterView, ramp: RampTracker, clock: Callable[[], float]) -> None:
        self.topology, self.ramp, self.clock = topology, ramp, clock
        self._known: set[str] = set()  # members this client has seen (a came_up of one: a return)
        with contextlib.suppress(LookupError):
            self._known.update(topology.placement.names)

    def on_topology_change(self, change: ViewChange) -> None:
        """Start the read ramp of members that came up: back from down, or new in the placement
        once this client knew some members (the first members it hears of are not ramped)."""
        now = self.clock()
        for name in change.went_down:
            self.ramp.forget(name)
            if name not in self.topology:
                self._known.discard(name)
        had_members = bool(self._known)
        for name in sorted(change.came_up):
            if name in self._known or had_members:
                self.ramp.start(name, now)
                log.info("read ramp started member=%s ramp_s=%.1f", name, self.ramp.ramp_s)
            self._known.add(name)
