"""QuorumWriter: the StorageClient's replicated writes and hints (ARCHITECTURE §8).

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
date later. An owner that refused with ``BadRequest`` or ``StoreFull`` gets no hint: the hint
would be refused the same way when delivered. What is not done when W is reached (a slow owner, a
hint) finishes in the background; ``flush()`` waits for it. Retrying a batch id is always safe:
storage ignores a batch id it applied.

**Writer floors** (writer_floor.py): a seq settles when every owner acknowledged it directly, or
when a hinted owner later reports it applied. ``write`` starts a background ``confirm_hints`` (ask
each live hinted owner ``BatchesApplied``) at most every ``CONFIRM_HINTS_INTERVAL_S`` while hinted
seqs are pending, so the floor recovers after an outage without anyone scheduling it.

**Which hinted seqs settle** (hint_confirm.py): those a live hinted owner reports applied, and
those whose hint no holder holds any more (``HeldHints``), asked only for an owner that left the
placement (a removenode while it was down). A hint leaves its holder only once its rows are
durable where they are served, so that is safe; a seq no node acknowledged holding (a stranded
share) is not settled that way, nor one a live owner reports not applied (hint_confirm.py says
why, and what that leaves open).

**Stranded shares**: a share no owner acknowledged and no node holds (the owner refused it with
``StoreFull`` or ``BadRequest``, which are not hinted, or no live node would hold its hint) cannot
simply settle: the floor is the writer's promise never to send the seq again, and an owner whose
floor passed a seq counts it as applied, so neither a late send nor a repair (which looks for ids
the node has not applied, repair/plan.py) would ever give that owner the rows. Nor may it stay
unsettled with nothing under way, which held the floor back for the client's lifetime. So the
writer keeps the share (at most ``MAX_STRANDED_BYTES``; past that only the seq is tracked) and
counts the seq as hinted for its owner: each ``confirm_hints`` round first sends the owner's
stranded shares again, to the owner itself when it is live (else, or when it refuses with
``Unavailable``/``NotOwner`` or fails, as a hint), stopping at the first that fails, and then asks
``BatchesApplied`` as for any hinted seq. The seq settles only once the owner reports the batch
applied; a write that did not reach W is settled this way too or ``abandon``-ed, as before.

**Backpressure**: each owner's share reserves its bytes in that owner's ``ByteBudget`` *before* it
is sent, in the write loop: a slow owner's full budget blocks the write there, even when the other
owners would make the quorum.

All I/O goes through callables the client passes in (its per-owner budgets, its ApplyBatch sender,
its ``_call``); this module holds the policy and the background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
from numpy.typing import NDArray

from giaannd import protocol as p
from giaannd.client.byte_budget import ByteBudget
from giaannd.client.errors import (
    REQUEST_FAILURES,
    QuorumNotReached,
    RemoteBadRequest,
    RemoteStoreFull,
)
from giaannd.client.hint_confirm import confirm_target
from giaannd.client.node_call import NodeCall
from giaannd.client.writer_floor import Unsettled, WriterFloor
from giaannd.cluster.view import ClusterView
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.unique import unique

__all__ = ["CONFIRM_HINTS_INTERVAL_S", "MAX_STRANDED_BYTES", "QuorumWriter", "WriteResult", "hint_holders",
           "write_quorum"]

# The storage client's parts log under the client's name (operators and tests filter on it).
log = logging.getLogger("giaannd.client.storage_client")

#: ``write`` starts a background ``confirm_hints`` at most this often while hinted seqs are pending,
#: so the writer floor recovers after an outage without anyone scheduling it.
CONFIRM_HINTS_INTERVAL_S: Final = 2.0
#: Bytes of stranded shares (module docstring) a writer keeps to send again: the per-owner
#: in-flight budget's default, so a full or unreachable owner costs at most about what it could
#: have had in flight. Past it a stranded seq is still tracked (it settles when its owner gets the
#: batch another way: a repair) but its rows are not kept.
MAX_STRANDED_BYTES: Final = 64 * 2**20


@dataclass(frozen=True)
class WriteResult:
    """``acked``: owners that acknowledged before the call returned; ``hinted``: target -> holder of
    hints made so far (more may follow in the background)."""

    batch_id: BatchId
    quorum: int
    acked: tuple[str, ...]
    hinted: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class _Stranded:
    """A share of ours that no node holds (module docstring, "Stranded shares")."""

    bid: BatchId
    share: RowBatch
    epoch: str


class SendReserved(Protocol):
    """Send one ApplyBatch whose bytes are already held in the node's budget; releases them."""

    async def __call__(self, node: str, batch_id: BatchId, batch: RowBatch, writer_floor: int,
                       hint_for: str | None, timeout_s: float | None,
                       epoch: str | None = None) -> p.ApplyAck: ...


class ApplyTo(Protocol):
    """Reserve the bytes in the node's budget, then send (``StorageClient.apply_to``)."""

    async def __call__(self, node: str, batch_id: BatchId, batch: RowBatch, *, writer_floor: int = 0,
                       hint_for: str | None = None, timeout_s: float | None = None,
                       epoch: str | None = None) -> p.ApplyAck: ...


def write_quorum(configured: int | None, replicas: int) -> int:
    """W: the configured quorum, else a majority of the effective R; never more than R."""
    return min(configured or replicas // 2 + 1, replicas)


def hint_holders(topology: ClusterView, target: str, rows: NDArray[np.uint64],
                 exclude: set[str]) -> NDArray[np.intp]:
    """Per row, the index of the node that should hold ``target``'s hint (-1: none live): the
    first live node of the row's preference list beyond its owners (Dynamo), else a live owner."""
    placement = topology.placement
    names = placement.names
    pref = topology.preference(rows)
    down, _ = topology.masks()  # (kept by the view: no Python per member per batch)
    usable = ~down
    for name in {target, *exclude}:
        if name in names:
            usable[names.index(name)] = False
    cand = usable[pref]
    beyond = cand.copy()
    beyond[:, : placement.effective_replicas] = False  # prefer nodes that are not owners (Dynamo)
    pick = np.where(beyond.any(axis=1), beyond.argmax(axis=1), cand.argmax(axis=1))
    chosen = pref[np.arange(pref.shape[0]), pick]
    return np.where(cand.any(axis=1), chosen, -1)


class QuorumWriter:
    """Quorum writes and hints of one writer (module docstring).

    Args:
        topology: the cluster view (placement, liveness, preference lists).
        floors: the writer's batch ids and floor.
        budget: node -> its in-flight byte budget.
        send_reserved: sends one ApplyBatch whose bytes are reserved (releases them).
        apply_to: reserves, then sends (hint holders).
        call: one request to one node (``BatchesApplied`` for hint confirmation).
    """

    def __init__(self, topology: ClusterView, floors: WriterFloor, *, budget: Callable[[str], ByteBudget],
                 send_reserved: SendReserved, apply_to: ApplyTo, call: NodeCall) -> None:
        self.topology = topology
        self.floors = floors
        self._budget = budget
        self._send_reserved = send_reserved
        self._apply_to = apply_to
        self._call = call
        self._background: set[asyncio.Task[Any]] = set()
        self._last_confirm = float("-inf")
        #: target -> seq -> its stranded share (module docstring)
        self._stranded: dict[str, dict[int, _Stranded]] = {}
        self._stranded_bytes = 0

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def flush(self) -> None:
        """Wait until background work (late acks, hints, hint confirmation) is done."""
        while self._background:
            await asyncio.wait(set(self._background))

    async def write(self, batch: RowBatch, batch_id: BatchId | None, quorum_setting: int | None) -> WriteResult:
        """``StorageClient.write`` (its docstring); ``quorum_setting``: the configured W or None."""
        placement = self.topology.placement  # (raises LookupError before an id is taken)
        floors = self.floors
        bid = batch_id if batch_id is not None else floors.next_batch_id()
        self._maybe_confirm_hints()
        if batch.num_rows == 0:
            floors.abandon(bid)  # nothing to send anywhere: settled
            return WriteResult(bid, 0, (), {})
        quorum = write_quorum(quorum_setting, placement.effective_replicas)
        owner_idx = placement.owner_indices(batch.row_column)
        names = placement.names
        shares = {names[int(m)]: (owner_idx == m).any(axis=1) for m in unique(owner_idx)}
        state = floors.track(bid, shares)
        # a floor speaks for our own writer only: for a foreign id (hint replay, tools) send none
        floor = floors.floor if floors.is_ours(bid) else 0
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
                tasks[self._spawn(self._send_reserved(node, bid, sub, floor, None, None,
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

    def _settle_direct(self, task: asyncio.Task[p.ApplyAck], node: str, bid: BatchId, state: Unsettled,
                       batch: RowBatch, shares: Mapping[str, NDArray[np.bool_]], floor: int,
                       hinted: dict[str, list[str]], failures: dict[str, str], epoch: str) -> bool:
        """Book one owner's outcome; on failure start its hint (``epoch``: the split's placement).
        True if it acknowledged."""
        if task.cancelled():
            return False
        exc = task.exception()
        if exc is None:
            self.floors.owner_done(bid, state, node)
            return True
        if not isinstance(exc, REQUEST_FAILURES):
            raise exc
        failures[node] = str(exc) or type(exc).__name__
        share = batch.select_rows(shares[node])
        if isinstance(exc, (RemoteBadRequest, RemoteStoreFull)):
            # a hint would be refused the same way when delivered: the writer sends it again
            self._strand(node, bid, share, epoch)
            return False
        self._spawn(self._hint(node, bid, share, floor, hinted, epoch))
        return False

    async def _finish_late(self, task: asyncio.Task[p.ApplyAck], node: str, *args: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait({task})
        self._settle_direct(task, node, *args)

    async def _hint(self, target: str, bid: BatchId, share: RowBatch, floor: int,
                    hinted: dict[str, list[str]], epoch: str) -> bool:
        """Hand ``target``'s whole share to one other live node (hint_for=target), with the
        ``epoch`` of the placement the share was split with (the holder keeps and delivers it).

        The share is never split between holders: an untracked writer's ids are applied whole
        (applied_set.py), so two parts delivered separately under one id would make the target drop
        the second part (a tracked writer's are applied per column).
        The holder is the node that the rows' preference lists name most often; on refusal, the
        next one. When no node is left the share is stranded (module docstring): False.
        """
        exclude: set[str] = set()
        while True:
            holders = hint_holders(self.topology, target, share.row_column, exclude)
            # the names of the placement hint_holders just indexed (it may have changed while the
            # previous holder was asked: a stale list named the wrong node, or none)
            names = self.topology.placement.names
            holders = holders[holders >= 0]
            if holders.size == 0:
                log.warning("no node can hold a hint target=%s batch=%s rows=%d", target, tuple(bid),
                            share.num_rows)
                self._strand(target, bid, share, epoch)
                return False
            holder = names[int(np.bincount(holders).argmax())]
            try:
                await self._apply_to(holder, bid, share, writer_floor=floor, hint_for=target, epoch=epoch)
            except REQUEST_FAILURES as exc:
                log.info("hint refused holder=%s target=%s: %s", holder, target, exc)
                exclude.add(holder)
                continue
            hinted.setdefault(target, []).append(holder)
            self.floors.hinted_for(target, bid, holder)
            return True

    def _strand(self, target: str, bid: BatchId, share: RowBatch, epoch: str) -> None:
        """Keep ``target``'s share of ``bid`` that no node holds, to send it again; its seq settles
        only once ``target`` reports it applied (module docstring, "Stranded shares")."""
        if not self.floors.is_ours(bid):
            return  # (a foreign id settles nothing here)
        self.floors.hinted_for(target, bid)
        held = self._stranded.setdefault(target, {})
        old = held.pop(bid.seq, None)  # (a retry's share replaces an earlier attempt's)
        if old is not None:
            self._stranded_bytes -= old.share.nbytes
        if self._stranded_bytes + share.nbytes > MAX_STRANDED_BYTES:
            log.warning("stranded share not kept (over %d bytes) target=%s batch=%s rows=%d",
                        MAX_STRANDED_BYTES, target, tuple(bid), share.num_rows)
            return
        held[bid.seq] = _Stranded(bid, share, epoch)
        self._stranded_bytes += share.nbytes

    async def _resend_stranded(self, target: str) -> None:
        """Send ``target``'s stranded shares again, in seq order, until one fails (it is kept):
        to ``target`` when it is live, else (or when it fails but for a refusal that a hint would
        meet too) as a hint. A share taken by either is no longer kept here."""
        held = self._stranded.get(target, {})
        for seq in sorted(held):
            s = held.pop(seq, None)  # (a concurrent round does not send it too)
            if s is None:
                continue
            self._stranded_bytes -= s.share.nbytes
            if seq not in self.floors.hinted.get(target, ()):
                continue  # settled meanwhile, or abandoned
            floor = self.floors.floor
            if self.topology.is_live(target):
                try:
                    await self._apply_to(target, s.bid, s.share, writer_floor=floor, epoch=s.epoch)
                    continue
                except (RemoteBadRequest, RemoteStoreFull) as exc:
                    log.info("stranded share refused again target=%s batch=%s: %s", target, tuple(s.bid), exc)
                    self._strand(target, s.bid, s.share, s.epoch)
                    break
                except REQUEST_FAILURES:
                    pass
            if not await self._hint(target, s.bid, s.share, floor, {}, s.epoch):
                break  # (stranded again by _hint)
        if not held and self._stranded.get(target) is held:
            del self._stranded[target]

    def _maybe_confirm_hints(self) -> None:
        now = asyncio.get_running_loop().time()
        if self.floors.hinted and now - self._last_confirm >= CONFIRM_HINTS_INTERVAL_S:
            self._last_confirm = now
            self._spawn(self.confirm_hints())

    def abandon(self, bid: BatchId) -> None:
        """``StorageClient.abandon``: the floor may pass ``bid``; its stranded shares are dropped."""
        self.floors.abandon(bid)
        for target, held in list(self._stranded.items()):
            s = held.pop(bid.seq, None) if self.floors.is_ours(bid) else None
            if s is not None:
                self._stranded_bytes -= s.share.nbytes
            if not held:
                del self._stranded[target]

    async def confirm_hints(self) -> int:
        """Send stranded shares again, then settle the hinted seqs that reached their owners: ask
        live hinted owners, and the holders of the hints for an owner that left the placement or
        reports a seq not applied (hint_confirm.py). Returns the number of (owner, seq) pairs
        confirmed."""
        floors = self.floors
        confirmed = 0
        for target in list(floors.hinted):
            if target in self._stranded:
                await self._resend_stranded(target)
            confirmed += await confirm_target(self.topology, floors, self._call, target, self._stranded)
            if target in floors.hinted and not floors.hinted[target]:
                del floors.hinted[target]
        return confirmed
