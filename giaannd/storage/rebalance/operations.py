"""Topology operations: join, decommission, removenode, replace, repair (ARCHITECTURE §6, §8; issue 8).

Theory of operation
-------------------
Every membership change is the same operation, ``Rebalance(new_members)``:

1. **plan** (rebalance/plan.py): old placement = the current one, new = over ``new_members``; for every
   column with a new owner, one live old owner streams it. Columns no live node holds are *lost*:
   the operation refuses to start (``DataLossError``) unless told ``allow_loss``.
2. **stream** (streaming/stream.py / streaming/sender.py), all transfers in parallel, one stream per (source,
   target): chunks of the rows, then the writes the source keeps applying (deltas). Meanwhile the
   old placement stays in force everywhere: old owners serve reads and take writes.
3. **verify**: each stream, once every chunk is applied, compares the receiver's row digests
   (keys and strengths, bit for bit) with the source's at one consistent instant.
4. **cutover**, in this order, each step waiting for the previous:
   0. hints held for the sources are delivered while every view is still the old one (a holder
      delivers under its own view's placement epoch, which the sources' forwarding reads);
   a. the *targets* switch to the new placement (they now accept direct writes for their new columns;
      nobody sends them any yet);
   b. the *writers* switch, and writes already computed under the old placement finish (they still
      reach the old owners, which apply them and forward them through the open streams);
   c. hints held for the sources are delivered (they may carry rows of moved columns; after (e) a
      source would refuse them as a non-owner);
   d. the streams close: no more deltas; each finishes when its receiver acknowledged everything;
   e. every storage node switches; released columns stay on disk but are no longer served.
   Only then is the new placement epoch in force: "a new owner serves a column only after its copy
   is complete and verified" (ARCHITECTURE §6).
   Before (a), the **registers** of keys whose owner set changes are handed to their new owners
   (rebalance/register_handoff.py: leavers seal them, the joiners merge the old owners' states);
   after (e), or when the operation fails, the seals are dropped.

The cluster side effects (switching views, draining writers) go through a ``ClusterControl``: the
in-process implementation drives ``ClusterView`` objects directly (tests, bench); the daemon's
implementation changes what the node advertises in membership (wiring: docs/topology.md).

Sources: a stream whose source is served by this process (``control.service(name)``) runs a local
``StreamRunner``; any other source is driven through its stream endpoint by a
``RemoteStreamRunner`` (source_control.py, rebalance/remote_source.py), and planning lists remote old
owners' columns with ``ListColumns``. A live old owner that does not answer is treated as dead for
planning (its columns are copied from other replicas, or the operation refuses as data loss).

Properties: **idempotent** (re-running a verb whose placement is already in force plans nothing and
returns ``done``; re-issuing it while it runs returns the same operation via ``OperationRegistry``),
**progress** (bytes, rate, ETA per stream and in total), **abort / resume** (``pause()`` stops
sending, the streams keep their state and keep collecting deltas; ``resume()`` continues from the
receivers' durable positions), **bounded** (every wait has a timeout and a clear error).

**Cleans up when abandoned**: an operation that fails or is cancelled before its targets switched
(cutover step a) asks each receiver to discard the streams it opened (``DiscardStream``,
rebalance/stream_discard.py): the old placement stays in force, so the partial rows they brought are
dropped, and the receivers can take those columns again in a later operation without a wiped data
directory. After step (a) the targets may have served and taken writes of their new columns:
nothing is discarded then. A receiver that cannot be reached keeps its rows (a later stream of
those columns refuses it, saying so); ``progress()`` reports ``discarded_rows`` and
``discard_errors``. ``after_discard`` runs once every stream is discarded (the daemon's join then
takes new stream ids: rebalance/daemon.py). While that clean-up runs the state is ``failing`` or
``cancelling``; ``failed`` and ``cancelled`` are published only once it ended, since whoever
polls for a terminal state (giaannctl ``--wait``, sdk/follow.py) may start the next operation then,
and receivers still holding the rows would refuse its streams ("already holds ... rows").

**One operation in the cluster at a time**: an operation holds the cluster's topology lock
(cluster_lock.py) from before its plan until it ended; ``OperationRegistry.begin`` takes it before
a verb answers, ``run`` takes it otherwise. It is released before the end is published (above).

**Clears a dead member's streams**: an operation that removes a member that is not live (removenode,
replace) first asks every live receiver to discard the open streams that member sent
(``DiscardStreamsFrom``, rebalance/stream_discard.py): a decommissioning node killed mid-stream for good
left them, with their rows, and they would refuse this operation's streams of the same columns
until their idle-stream sweep. A receiver that refuses (it sees the member live) or cannot be
reached keeps them, as before. A member that is only down, and not removed, keeps its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd import failpoints
from giaannd.cluster.view import ClusterView, StorageNode
from giaannd.errors import Refused
from giaannd.storage.engine.register_store import RegisterState
from giaannd.storage.rebalance import register_handoff as rh
from giaannd.storage.rebalance.cluster_lock import LOCK_KEY, OperationLockSealed, OperationLockUnavailable
from giaannd.storage.rebalance.plan import Plan, Transfer, TransferRule, owns, plan_transfers, stranded
from giaannd.storage.rebalance.remote_source import RemoteStreamRunner
from giaannd.storage.rebalance.source_control import (
    SourceControlError,
    SourceStart,
    discard_stream,
    discard_streams_from,
    list_columns,
    register_call,
)
from giaannd.storage.replication.hint_delivery import HINT_DRAIN_RETRY
from giaannd.storage.replication.service import StorageService
from giaannd.storage.streaming.sender import StreamRunner, Throttle
from giaannd.unique import unique
from peers.errors import PeersError
from peers.placement import Member, Placement
from peers.retry import attempts
from peers.transport import Transport

__all__ = [
    "ClusterControl",
    "DataLossError",
    "OperationRegistry",
    "Rebalance",
    "Runner",
    "TopologyOpError",
    "members_after",
]

log = logging.getLogger(__name__)

#: Bound on each cutover wait (writers draining, hints delivered, streams acknowledged).
CUTOVER_TIMEOUT_S: Final = 60.0
#: Bound on the streaming phase as a whole unless the caller sets one.
DEFAULT_STREAM_TIMEOUT_S: Final = 3600.0
#: Bound on listing a remote old owner's columns while planning (it counts as unreachable after).
LIST_COLUMNS_TIMEOUT_S: Final = 30.0
#: Remote old owners asked for their columns at once while planning (each reply holds a node's
#: column ids: 8 MB for 10^6 columns, so not every member of a large cluster at the same time).
LIST_COLUMNS_CONCURRENCY: Final = 16

#: A stream as the operation sees it: sent from this process, or driven on a remote source.
Runner = StreamRunner | RemoteStreamRunner

#: An abandoned operation's state while its clean-up runs -> its state once that ended (module
#: docstring): not ended yet for the registry, the daemon or a client's wait.
_ENDING: Final = {"failing": "failed", "cancelling": "cancelled"}


class TopologyOpError(Refused):
    """The operation cannot proceed; nothing moved to the new placement."""

    reason = "topology_op_refused"


class DataLossError(TopologyOpError):
    """Some columns have new owners but no live node holds a copy."""

    reason = "data_loss"

    def __init__(self, columns: NDArray[np.uint64], message: str = "") -> None:
        shown = ", ".join(f"{c:#x}" for c in columns[:8].tolist())
        super().__init__(message or f"{columns.size} columns have no live replica to copy from ({shown}...)")
        self.columns = columns


class ClusterControl(Protocol):
    """What an operation needs from the cluster. Sources need not be local: a member this process
    does not serve is reached through its stream endpoint (``stream_address``)."""

    transport: Transport

    def view(self) -> ClusterView:
        """The current cluster view (placement set + live set)."""

    def service(self, name: str) -> StorageService | None:
        """The local service of a member, if this process runs it (else the member is remote)."""

    def stream_address(self, name: str) -> str:
        """The member's StreamEndpoint address (stream items and source control)."""

    async def switch(self, names: Sequence[str], members: Sequence[StorageNode]) -> None:
        """Set the placement set of these storage nodes' views to ``members``."""

    async def switch_writers(self, members: Sequence[StorageNode]) -> None:
        """Writers use ``members`` from now on; returns once writes computed before have finished."""

    async def hints_held_for(self, names: Sequence[str]) -> int:
        """Hints held anywhere (every live storage node) for these members."""

    async def deliver_hints(self) -> None:
        """Push hint delivery now (it is also periodic)."""

    async def drop_hints_for(self, name: str) -> int:
        """Forget hints held for a member that left the placement (returns how many)."""

    async def after_cutover(self, new_members: Sequence[StorageNode]) -> None:
        """Every node switched to ``new_members``: make it durable (the daemon commits its ring)."""

    async def lock(self, op_id: str, kind: str) -> int | None:
        """Take the cluster's topology-operation lock (cluster_lock.py); its token, or None where
        the control has no lock to take. Raises OperationLockBusy, OperationLockUnavailable."""

    async def unlock(self, token: int) -> None:
        """Release ``lock``'s token (retried in the background when it cannot be now)."""

    async def abandon(self) -> None:
        """The operation failed or was cancelled: undo partial switches (the old placement stays)."""


@dataclass
class Rebalance:
    """Move the cluster to ``new_members`` without losing an acknowledged update (module docstring).

    Args:
        control: the cluster.
        kind: "join", "decommission", "removenode", "replace" (labels only: the plan decides).
        new_members: the placement set after the operation.
        avoid_sources: members to stream from only as a last resort.
        allow_loss: start even if some columns have no live copy (they stay lost).
        rate_bytes_s: throttle on the bytes all of its streams send together (change at run time
            with ``set_rate``; None: unthrottled).
        chunk_bytes: stream chunk size (default streaming.DEFAULT_CHUNK_BYTES).
    """

    control: ClusterControl
    kind: str
    new_members: list[StorageNode]
    avoid_sources: tuple[str, ...] = ()
    allow_loss: bool = False
    rate_bytes_s: float | None = None
    chunk_bytes: int | None = None
    stream_timeout_s: float = DEFAULT_STREAM_TIMEOUT_S
    #: None: random per operation object (only it can resume its streams). A fixed value makes
    #: the stream ids a function of the operation, so a coordinator that restarted (a joining
    #: node coordinates its own join) resumes the streams its sources still run; a source that
    #: restarted is told apart by ``StreamHello.first`` and refused.
    stream_nonce: int | None = None
    #: Called once the streams of an operation abandoned before its cutover are all discarded.
    after_discard: Callable[[], object] | None = None
    state: str = "new"
    error: str | None = None
    plan: Plan | None = None
    runners: list[Runner] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _started: float = field(default_factory=time.monotonic)
    _resumed: asyncio.Event = field(default_factory=asyncio.Event)

    #: the cluster lock (cluster_lock.py): "none" (not taken yet, or a control without one),
    #: "held", "released" (once held), or "unavailable: ..." (run without it; stays so)
    lock_state: str = "none"
    _lock_token: int | None = None
    _lock_taken: bool = False

    def __post_init__(self) -> None:
        # Stream ids are unique to this operation object: only it holds the senders' state (the
        # queue of forwarded writes is in RAM), so only it can resume them (streaming/stream.py).
        self._nonce = secrets.randbits(64) if self.stream_nonce is None else self.stream_nonce
        self._throttle = Throttle(self.rate_bytes_s)
        self._resumed.set()
        self._unreachable: set[str] = set()  # live old owners that did not answer ListColumns
        self.registers_moved = 0  # register states handed to joiners (register_handoff.py)
        self.registers_lost = 0  # keys fewer than a majority of their old owners answered for
        self._sealed: list[str] = []  # members that may hold seals of this operation
        self._streams: list[tuple[int, str]] = []  # (stream id, target) of every stream started
        self._pairs: list[tuple[str, str]] = []  # (source, target) of every stream (_start_streams)
        self._switched = False  # a target switched to the new placement (cutover step a began)
        self._planned_epoch: str | None = None  # the placement the plan was made from
        self._stranded = np.zeros(0, np.uint64)  # columns the change leaves with no live owner
        self.discarded_rows = 0  # rows the receivers dropped when the operation was abandoned
        self.discard_errors: list[str] = []  # receivers that could not discard a stream
        self._op_id: str | None = None  # (op_id)

    # -- planning ---------------------------------------------------------------------------------
    def _placements(self) -> tuple[Placement, Placement]:
        view = self.control.view()
        old = view.placement
        new = Placement(tuple(Member(n.name, n.weight) for n in self.new_members), view.replicas, view.strategy)
        return old, new

    async def _columns(self, old: Placement) -> NDArray[np.uint64]:
        """Every column held by a live old owner: local ones read their store, remote ones answer
        ``ListColumns``, all asked at once (at most LIST_COLUMNS_CONCURRENCY at a time); one that
        does not answer is recorded as unreachable (not a source). Asked one after the other, a
        plan waited the round trips (and a first listing's key sort on each source) in turn, and
        LIST_COLUMNS_TIMEOUT_S for each member that did not answer."""
        view = self.control.view()
        parts = []
        remote = []
        for name in old.names:
            if not view.is_live(name):
                continue
            svc = self.control.service(name)
            if svc is not None:
                if svc.store is not None:
                    parts.append(svc.store.store.held_columns())
                continue
            remote.append(name)
        gate = asyncio.Semaphore(LIST_COLUMNS_CONCURRENCY)

        async def listed(name: str) -> NDArray[np.uint64] | None:
            async with gate:
                try:
                    return await asyncio.wait_for(list_columns(
                        self.control.transport, self.control.stream_address(name)), LIST_COLUMNS_TIMEOUT_S)
                except (PeersError, OSError, TimeoutError, SourceControlError, TopologyOpError, KeyError) as exc:
                    log.warning("planning: %s did not list its columns (%s); treated as down", name, exc)
                    self._unreachable.add(name)
                    return None

        for columns in await asyncio.gather(*map(listed, remote)):
            if columns is not None:
                parts.append(columns)
        return unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)

    def _live(self) -> list[str]:
        return [n for n in self.control.view().live() if n not in self._unreachable]

    async def make_plan(self) -> Plan:
        old, new = self._placements()
        self._planned_epoch = old.epoch
        columns = await self._columns(old)
        live = self._live()
        # newcomers are outside the old view's liveness; they take the streams
        self._stranded = stranded(old, new, columns, {*live, *(n for n in new.names if n not in old.names)})
        return plan_transfers(old, new, columns, live, self.avoid_sources)

    def check_dead_owners(self) -> None:
        """Columns whose every replica is on dead members cannot even be listed (only their
        owners knew them): refuse when that can happen (dead members >= R), unless allow_loss.

        Raises:
            DataLossError: as many old owners are down (or did not answer) as R.
        """
        old, _ = self._placements()
        view = self.control.view()
        dead = [n for n in old.names if not view.is_live(n) or n in self._unreachable]
        if len(dead) >= old.effective_replicas and not self.allow_loss:
            raise DataLossError(np.zeros(0, np.uint64), (
                f"{', '.join(dead)} {'is' if len(dead) == 1 else 'are'} not reachable and R = "
                f"{old.effective_replicas}: columns held only there are lost and cannot even be listed; "
                "bring a replica back, or pass allow_loss"))

    @property
    def op_id(self) -> str:
        """``kind:old->new`` placement epochs, fixed at its first use (the lock, before any
        planning): the view's placement moves during the cutover, and the id must not (an
        override's lease names it: giaannd/services/override_lease.py). A coordinator restarted
        into the same operation makes the same id."""
        if self._op_id is None:
            old, new = self._placements()
            self._op_id = f"{self.kind}:{old.epoch[:12]}->{new.epoch[:12]}"
        return self._op_id

    # -- the cluster's operation lock ------------------------------------------------------------
    async def take_lock(self) -> None:
        """Take the cluster's topology-operation lock before planning (cluster_lock.py); once.
        A register that cannot be reached runs the operation without it, and says so.

        Raises:
            OperationLockBusy: another operation holds it.
        """
        if self._lock_taken:
            return
        try:
            self._lock_token = await self.control.lock(self.op_id, self.kind)
        except OperationLockSealed as exc:  # refused: a write of it in doubt is released all the same
            if exc.token is not None:
                _spawn_unlock(self.control, exc.token)
            raise
        except OperationLockUnavailable as exc:
            log.warning("%s runs without the cluster's topology lock: %s", self.kind, exc)
            self.lock_state = f"unavailable: {exc}"
            self._lock_token = exc.token  # a write in doubt: released at the end all the same
        else:
            self.lock_state = "held" if self._lock_token is not None else "none"
        self._lock_taken = True

    async def release_lock(self) -> None:
        """Release the lock if this operation holds it (before its end is published: whoever polls
        for it may start the next operation at once)."""
        token, self._lock_token = self._lock_token, None
        if token is not None:
            # its own task, and only waited for here: a release cancelled midway would leave the
            # token held, and the lock refused to every node until this one restarts
            unlock = _spawn_unlock(self.control, token)
            with contextlib.suppress(Exception):  # (the control retries a failed release itself)
                await asyncio.wait_for(asyncio.shield(unlock), CUTOVER_TIMEOUT_S)
            if self.lock_state == "held":
                self.lock_state = "released"

    # -- running ----------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Plan, stream, verify, cut over. Returns the final progress.

        Raises:
            DataLossError: columns without a live copy (and not ``allow_loss``).
            TopologyOpError: a stream failed, or a cutover wait timed out; the old placement stays.
        """
        try:
            await self.take_lock()  # (taken already when started through OperationRegistry.begin)
            if self.plan is None:
                self.check_dead_owners()
                plan = await self.make_plan()
                self.check_dead_owners()  # again: an old owner may not have answered
                self.plan = plan
                if self.plan.lost.size and not self.allow_loss:
                    raise DataLossError(self.plan.lost)
                if self._stranded.size and not self.allow_loss:
                    raise DataLossError(self._stranded, (
                        f"{self._stranded.size} columns would have no live owner after the {self.kind} "
                        "(their other owners are down): bring them back first, or pass allow_loss"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._discard_dead_sources(), CUTOVER_TIMEOUT_S)
                if self.state == "cancelling":  # while the plan waited for a remote old owner
                    raise TopologyOpError("operation cancelled before any stream started")
                self._start_streams(self.plan)
            self.state = "streaming"
            deadline = time.monotonic() + self.stream_timeout_s
            await self._wait_caught_up(deadline)
            while self.state == "paused":
                # paused at the instant the last stream caught up, before this task ran again: the
                # pause stopped the streams' tasks, and a cutover would close streams nothing runs
                # (their last acknowledgements never come). The pause wins: wait for the resume.
                await self._wait_resumed(deadline)
                await self._wait_caught_up(deadline)
            if self.state != "streaming":  # cancelled at that instant
                raise TopologyOpError(f"operation {_ENDING.get(self.state, self.state)} before the cutover")
            await self._cutover()
            await self.release_lock()
            self.state = "done"
            return self.progress()
        except BaseException as exc:
            # (paused too: a stream that fails while paused, or a pause past the stream timeout,
            # fails the operation; it used to stay "paused" with nothing left to resume)
            if self.state != "cancelling":
                self.state = "failing"
                self.error = f"{type(exc).__name__}: {exc}"
                for task in self._tasks:  # stop the other streams too (no forwarding forever)
                    task.cancel()
                for r in self.runners:
                    r.abort(f"operation failed: {self.error}")
            try:
                await self._clean_up()
            finally:  # ended: only now (module docstring)
                await self.release_lock()
                self.state = _ENDING.get(self.state, self.state)
            raise

    async def _clean_up(self) -> None:
        """An abandoned operation's clean-up (module docstring), each step bounded."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.control.abandon(), CUTOVER_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._unseal(), CUTOVER_TIMEOUT_S)
        if not self._switched and self._streams:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._discard_streams(), CUTOVER_TIMEOUT_S)

    async def _discard_streams(self) -> None:
        """Ask each receiver to discard the streams this operation opened to it (module docstring)."""
        for stream_id, target in self._streams:
            try:
                done = await discard_stream(self.control.transport, self.control.stream_address(target), stream_id)
            except (PeersError, OSError, TimeoutError, SourceControlError, KeyError) as exc:
                self.discard_errors.append(f"{target}: {type(exc).__name__}: {exc}")
                log.warning("abandoned %s: %s did not discard stream %#x (%s); it keeps the rows it received",
                            self.kind, target, stream_id, exc)
                continue
            self.discarded_rows += done.rows
        if not self.discard_errors:
            log.info("abandoned %s: %d streams discarded, %d rows dropped on their receivers", self.kind,
                     len(self._streams), self.discarded_rows)
            if self.after_discard is not None:
                try:
                    self.after_discard()
                except (OSError, ValueError) as exc:  # the next try meets the discarded ids, fails, tries again
                    log.warning("abandoned %s: after the discard: %s", self.kind, exc)

    async def _discard_dead_sources(self) -> None:
        """Ask every live receiver to discard the open streams of each member this operation
        removes that is not live (module docstring). Failures are logged: the new streams then
        meet the old rows and are refused, as before."""
        old, new = self._placements()
        view = self.control.view()
        dead = [n for n in old.names if n not in new.names and not view.is_live(n)]
        if not dead:
            return
        receivers = sorted({n for n in old.names if n not in dead and view.is_live(n)}
                           | {n for n in new.names if n not in old.names})
        for gone in dead:
            for name in receivers:
                try:
                    done = await discard_streams_from(self.control.transport, self.control.stream_address(name), gone)
                except (PeersError, OSError, TimeoutError, SourceControlError, TopologyOpError, KeyError) as exc:
                    log.warning("%s: %s did not discard the open streams of removed member=%s (%s)", self.kind,
                                name, gone, exc)
                    continue
                if done.streams:
                    log.info("%s: %s discarded %d open streams of removed member=%s (%d rows)", self.kind, name,
                             done.streams, gone, done.rows)

    def _stream_id(self, source: str, target: str) -> int:
        key = f"{self.op_id}|{source}|{target}|{self._nonce}".encode()
        return xxhash.xxh3_64_intdigest(key)

    def _start_streams(self, plan: Plan) -> None:
        old, new = self._placements()
        if self._planned_epoch is None:  # (a plan given by the caller)
            self._planned_epoch = old.epoch
        live = self._live()
        rule = TransferRule(old, new, frozenset(live), frozenset(self.avoid_sources))
        # every pair the rule can give a column, not only the plan's: a column created while the
        # operation runs goes to its rule's pair, which must have a stream (TransferRule.pairs).
        # Not to a member that is down: a stream to it waits for it, and a removenode while another
        # member is down would wait for that one (docs/topology.md, "Known gaps")
        reachable = set(live) | (set(new.names) - set(old.names))
        idle = {(s, t) for s, t in rule.pairs() if t in reachable}
        self._pairs = sorted({(t.source, t.target) for t in plan.transfers} | idle)
        for src, dst in self._pairs:
            t = next((t for t in plan.transfers if (t.source, t.target) == (src, dst)),
                     Transfer(src, dst, np.zeros(0, np.uint64)))
            source = self.control.service(t.source)
            label = f"{t.source}->{t.target}"
            runner: Runner
            if source is not None:
                runner = StreamRunner(source, self.control.transport, self.control.stream_address(t.target),
                                      t.columns, self._stream_id(t.source, t.target), chunk_bytes=self.chunk_bytes,
                                      throttle=self._throttle, label=label, direct_epoch=new.epoch,
                                      claims=functools.partial(rule.claims, t.source, t.target),
                                      source_keeps=functools.partial(owns, new, t.source),
                                      locate_target=functools.partial(self._locate, t.target))
            else:
                start = SourceStart(
                    self._stream_id(t.source, t.target), self.control.stream_address(t.target), t.source, t.target,
                    [(m.name, m.weight) for m in old.members], [(m.name, m.weight) for m in new.members],
                    old.replicas, old.strategy, sorted(live), sorted(self.avoid_sources), self.chunk_bytes,
                    None, label)
                runner = RemoteStreamRunner(self.control.transport, self.control.stream_address(t.source),
                                            start, t.columns, locate_source=functools.partial(self._locate, t.source))
            self.runners.append(runner)
            self._streams.append((self._stream_id(t.source, t.target), t.target))
        self._share_rate(self.rate_bytes_s)
        self._spawn_runners()

    def _locate(self, name: str) -> str | None:
        """A member's stream endpoint address now (None: not known live): a node that restarted
        mid-stream is found there (runners ask when it is unreachable)."""
        try:
            return self.control.stream_address(name)
        except (TopologyOpError, KeyError):
            return None

    def _share_rate(self, rate_bytes_s: float | None) -> None:
        """One budget for all the streams: local streams share one throttle; each remote stream
        gets an equal share at its source (rate / number of streams)."""
        n = len(self.runners)
        remote = [r for r in self.runners if isinstance(r, RemoteStreamRunner)]
        share = None if not rate_bytes_s or rate_bytes_s <= 0 or n == 0 else rate_bytes_s / n
        self._throttle.set(None if share is None else share * (n - len(remote)))
        for r in remote:
            r.set_rate(share)

    def _spawn_runners(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(r.run()) for r in self.runners if r.state not in ("done", "failed")]

    async def _wait_caught_up(self, deadline: float) -> None:
        """Until every stream caught up; a stream that fails (its ``caught_up`` is set too) fails
        the operation at once. Before, the streams were awaited in turn and the failures checked
        after all of them: a source that restarted early in a long join was only reported once the
        other streams had caught up, which they did for nothing."""
        waits = {asyncio.ensure_future(r.caught_up.wait()): r for r in self.runners}
        try:
            while waits:
                done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    r = next(iter(waits.values()))
                    raise TopologyOpError(f"{r.label}: not caught up within {self.stream_timeout_s}s")
                for fut in done:
                    del waits[fut]
                failed = [r for r in self.runners if r.state == "failed"]
                if failed:
                    raise TopologyOpError("; ".join(f"{r.label}: {r.error}" for r in failed))
        finally:
            for fut in waits:
                fut.cancel()

    async def _wait_resumed(self, deadline: float) -> None:
        try:
            await asyncio.wait_for(self._resumed.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TopologyOpError(f"still paused after the stream timeout ({self.stream_timeout_s}s)") from None

    async def _cutover(self) -> None:
        assert self.plan is not None
        self.state = "cutover"
        control = self.control
        view = control.view()
        old_names = set(view.names)  # (the view object itself switches below)
        targets = sorted({dst for _, dst in self._pairs})  # (every stream's, those of no column yet too)
        sources = sorted({src for src, _ in self._pairs})
        self._check_placement()
        # Hints for the sources are delivered before anyone switches (a holder delivers under its
        # own view's epoch, and the sources forward by epoch), and again after the writers drained.
        await self._wait_hints(sources)
        await asyncio.wait_for(self._hand_off_registers(), CUTOVER_TIMEOUT_S)
        if self.state != "cutover":  # cancelled meanwhile: nothing switched yet, the receivers discard
            raise TopologyOpError(f"operation {_ENDING.get(self.state, self.state)} before any node switched")
        self._check_placement()  # (again: the waits above may have let another cutover commit)
        self._switched = True  # from here on the targets may serve their new columns: no discard
        await control.switch(targets, self.new_members)
        await failpoints.hit("cutover.after-targets")
        await asyncio.wait_for(control.switch_writers(self.new_members), CUTOVER_TIMEOUT_S)
        await failpoints.hit("cutover.after-writers")
        await self._wait_hints(sources)
        for r in self.runners:
            r.close()
        for r in self.runners:
            try:
                await asyncio.wait_for(r.finished.wait(), CUTOVER_TIMEOUT_S)
            except TimeoutError:
                raise TopologyOpError(f"{r.label}: last deltas not acknowledged in time") from None
            if r.state == "failed":
                raise TopologyOpError(f"{r.label}: {r.error}")
        everyone = sorted(old_names | {m.name for m in self.new_members})
        await control.switch(everyone, self.new_members)
        await asyncio.wait_for(control.after_cutover(self.new_members), CUTOVER_TIMEOUT_S)
        try:
            await asyncio.wait_for(self._unseal(), CUTOVER_TIMEOUT_S)
        except (PeersError, OSError, TimeoutError, SourceControlError, RuntimeError) as exc:
            # harmless: a seal is scoped to the old epoch, which no node is in any more
            log.warning("could not drop register seals: %s", exc)
        # Hints for a removed member are redundant now: its rows were copied from replicas that
        # had every acknowledged batch (W direct acks among the old owners) or got it by hint.
        for gone in old_names - {m.name for m in self.new_members}:
            try:
                dropped = await control.drop_hints_for(gone)
            except (PeersError, OSError, TimeoutError, SourceControlError) as exc:
                log.warning("could not drop hints for removed member=%s: %s", gone, exc)
                continue
            if dropped:
                log.info("dropped hints for removed member=%s count=%d", gone, dropped)

    def _check_placement(self) -> None:
        """Refuse to cut over from a placement that is no longer in force: another coordinator's
        operation committed meanwhile (each node's registry runs one at a time, not the cluster).
        Switching anyway would move every node to this operation's members, and its ring commit
        would undo the other change (a member it added tombstoned, one it removed back).

        Raises:
            TopologyOpError: the view's placement epoch is not the one the plan was made from.
        """
        epoch = self.control.view().placement.epoch
        if self._planned_epoch is not None and epoch != self._planned_epoch:
            raise TopologyOpError(
                f"the placement changed while the operation ran (epoch {self._planned_epoch[:12]} -> "
                f"{epoch[:12]}: another operation completed first); nothing switched, run the verb again")

    # -- registers (register_handoff.py) -----------------------------------------------------------
    async def _register_call(self, name: str, msg: rh.HandoffRequest) -> rh.RegisterStates | rh.RegisterCount:
        svc = self.control.service(name)
        if svc is not None:
            return await rh.serve(svc, msg)
        return await register_call(self.control.transport, self.control.stream_address(name), msg)

    async def _hand_off_registers(self) -> None:
        """Seal and export at every live old member, merge, import at the joiners (module docstring
        of register_handoff.py). Before any node switches.

        Raises:
            TopologyOpError: a live old member did not answer (it may not be sealed), an import
                failed, or (without ``allow_loss``) keys fewer than a majority of old owners answered for.
        """
        old, new = self._placements()
        if old.epoch == new.epoch:
            return
        members = [n for n in old.names if n in self._live()]
        self._sealed = members
        spec = ([(m.name, m.weight) for m in old.members], [(m.name, m.weight) for m in new.members],
                old.replicas, old.strategy)
        answers: dict[str, dict[str, RegisterState]] = {}
        for name in members:
            got: dict[str, RegisterState] = {}
            after = ""
            try:
                while True:
                    page = await self._register_call(name, rh.RegisterExport(*spec, after=after))
                    if not isinstance(page, rh.RegisterStates):
                        raise SourceControlError(f"unexpected reply {type(page).__name__} to RegisterExport")
                    got.update(rh.from_wire(w) for w in page.states)
                    if page.done:
                        break
                    after = page.next_after
            except (PeersError, OSError, SourceControlError, RuntimeError) as exc:
                raise TopologyOpError(f"register handoff: {name} did not export its registers "
                                      f"(its copies could not be sealed): {exc}") from None
            answers[name] = got
        # newcomers are outside the old view's liveness; they took the streams (an import to one that
        # is down fails the operation)
        live = set(self._live()) | {n for n in new.names if n not in old.names}
        plan = rh.plan_handoff(old, new, answers, live)
        self.registers_lost = len(plan.lost)
        # the topology lock is this operation's own and carries no data: its register is not
        # worth failing a removal of dead members for (the release writes it empty over whatever
        # the new owners hold: cluster_lock.py)
        lost = [key for key in plan.lost if key != LOCK_KEY]
        if len(lost) < len(plan.lost):
            log.warning("register handoff: the topology lock's register %r cannot be handed on (too few old "
                        "owners reachable); it is released on its new owners after the cutover", LOCK_KEY)
        if lost and not self.allow_loss:
            raise TopologyOpError(
                f"register handoff: {len(lost)} registers (e.g. {lost[0]!r}) have fewer than a majority "
                "of their old owners reachable, or a new owner down: their latest value cannot be handed on; "
                "bring the members back, or pass allow_loss")
        for joiner, states in sorted(plan.imports.items()):
            for page_states in rh.pages(states):
                try:
                    await self._register_call(joiner, rh.RegisterImport(page_states))
                except (PeersError, OSError, SourceControlError, RuntimeError) as exc:
                    raise TopologyOpError(f"register handoff: import into {joiner} failed: {exc}") from None
                self.registers_moved += len(page_states)
        if plan.keys:
            log.info("registers handed off op=%s keys=%d states=%d lost=%d", self.op_id, plan.keys,
                     self.registers_moved, len(plan.lost))

    async def _unseal(self) -> None:
        for name in self._sealed:
            if name in self._live():
                await self._register_call(name, rh.RegisterUnseal())
        self._sealed = []

    async def _wait_hints(self, sources: Sequence[str]) -> None:
        """Until no hint is held for ``sources`` (bounded). A cancel meanwhile ends the wait: it
        comes only before any node switched (``cancel``), and hints held for a source that is down
        would keep it for the whole bound (a decommissioning node killed mid-stream: the operator
        cancelled, then waited a minute)."""
        deadline = asyncio.get_running_loop().time() + CUTOVER_TIMEOUT_S
        async for _ in attempts(HINT_DRAIN_RETRY, deadline=deadline):
            if self.state == "cancelling":
                raise TopologyOpError("operation cancelled before any node switched")
            if not await self.control.hints_held_for(sources):
                return
            await self.control.deliver_hints()
        if await self.control.hints_held_for(sources):
            raise TopologyOpError(f"hints for {', '.join(sources)} not delivered in {CUTOVER_TIMEOUT_S}s")

    # -- control ------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop sending (streams keep their state and keep collecting the sources' writes). Only
        while streaming: a cutover under way is bounded and goes on (its streams must finish), and
        an operation that ended stays as it ended."""
        if self.state != "streaming":
            return
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self.state = "paused"
        self._resumed.clear()

    def resume(self) -> None:
        """Continue a paused operation from the receivers' durable positions (call ``run`` again)."""
        if self.state == "paused":
            self.state = "streaming"
            self._spawn_runners()
            self._resumed.set()

    def cancel(self) -> None:
        """Give up: stop sending and stop collecting deltas. The old placement stays in force; before
        the cutover the receivers then drop the partial rows they got (``run``'s clean-up: module
        docstring). An operation that ended stays as it ended, and so does one whose cutover
        switched a node: the targets may have taken direct writes of their new columns, so the
        cutover (bounded) goes on; aborting its streams there failed it half-switched. The state is
        "cancelling" until ``run`` has cleaned up."""
        if self.state in ("done", "failed", "cancelled", *_ENDING) or self._switched:
            return
        self.pause()
        self.state = "cancelling"
        for r in self.runners:
            r.abort("operation cancelled")
        self._resumed.set()  # (a run waiting for the resume meets the aborted streams)

    def set_rate(self, rate_bytes_s: float | None) -> None:
        """Change the budget of all the streams together (bytes/s; None: unthrottled)."""
        self.rate_bytes_s = rate_bytes_s
        if self.runners:
            self._share_rate(rate_bytes_s)
        else:
            self._throttle.set(rate_bytes_s)

    def progress(self) -> dict[str, Any]:
        streams = [r.progress() for r in self.runners]
        total = sum(s["bytes_total_estimate"] for s in streams)
        done = sum(min(s["bytes_done"], s["bytes_total_estimate"]) for s in streams)
        elapsed = max(1e-9, time.monotonic() - self._started)
        rate = done / elapsed
        plan = self.plan
        return {
            "op": self.kind, "state": self.state, "error": self.error,
            "columns_total": plan.columns_total if plan else 0,
            "columns_moved": plan.columns_moved if plan else 0,
            "lost_columns": int(plan.lost.size) if plan else 0,
            "bytes_total": total, "bytes_done": done, "rate_bytes_s": rate,
            "eta_s": (total - done) / rate if rate > 0 else None,
            "streams": streams,
            "registers_moved": self.registers_moved, "registers_lost": self.registers_lost,
            "discarded_rows": self.discarded_rows, "discard_errors": list(self.discard_errors),
            "cluster_lock": self.lock_state,
        }


class OperationRegistry:
    """At most one topology operation per cluster view at a time; re-issuing the same verb returns
    the running one (idempotent verbs)."""

    def __init__(self) -> None:
        self.current: Rebalance | None = None
        self._task: asyncio.Task[dict[str, Any]] | None = None
        #: set once the node's topology service stopped (daemon.py): nothing starts after, not
        #: even a ``begin`` that was taking the lock then (its operation would run against a
        #: closed stream endpoint, holding the lock)
        self.closed = False

    def start(self, op: Rebalance) -> Rebalance:
        """Start ``op`` in the background unless an operation is running.

        Raises:
            TopologyOpError: a different operation is running, the last one is cleaning up, or
                the registry is closed.
        """
        if self.closed:
            raise TopologyOpError("this node's topology service stopped")
        cur = self.current
        if cur is not None and cur.state in _ENDING:  # (not the same verb re-issued: it ended)
            raise TopologyOpError(f"the last topology operation is still cleaning up: {cur.kind} ({cur.state}); "
                                  "run the verb again once it ended")
        if cur is not None and cur.state not in ("done", "failed", "cancelled"):
            if cur.kind == op.kind and [m.name for m in cur.new_members] == [m.name for m in op.new_members]:
                if cur.state == "paused":
                    cur.resume()
                return cur
            raise TopologyOpError(f"another topology operation is running: {cur.kind} ({cur.state})")
        self.current = op
        self._task = asyncio.get_running_loop().create_task(op.run())
        self._task.add_done_callback(_log_result)
        return op

    async def begin(self, op: Rebalance) -> Rebalance:
        """``start``, having taken the cluster's topology-operation lock for a new operation first
        (cluster_lock.py): a verb refused there answers at once instead of failing later.

        Raises:
            TopologyOpError: as ``start`` (closed meanwhile included: the lock is released).
            OperationLockBusy: another operation in the cluster holds the lock.
        """
        cur = self.current
        if cur is not None and cur.state not in ("done", "failed", "cancelled"):
            return self.start(op)  # the same verb again (the running one), or refused as before
        await op.take_lock()
        try:
            started = self.start(op)
        except BaseException:
            await op.release_lock()  # another start won the registry meanwhile, or it closed
            raise
        if started is not op:  # the same verb, started meanwhile: it answers, and holds its own
            await op.release_lock()
        return started

    async def wait(self, timeout_s: float) -> dict[str, Any]:
        """The current operation's progress once it ended or ``timeout_s`` passed (its failure is
        in the progress: ``state``, ``error``; it is not raised here)."""
        assert self._task is not None and self.current is not None
        await asyncio.wait({self._task}, timeout=timeout_s)  # (neither raises its outcome nor cancels it)
        return self.current.progress()


#: Lock releases under way (``Rebalance.release_lock``): the loop keeps only weak references to tasks.
_UNLOCKS: set[asyncio.Future[None]] = set()


def _spawn_unlock(control: ClusterControl, token: int) -> asyncio.Future[None]:
    """``control.unlock(token)`` in its own task (``Rebalance.release_lock``)."""
    unlock = asyncio.ensure_future(control.unlock(token))
    _UNLOCKS.add(unlock)
    unlock.add_done_callback(_unlock_done)
    return unlock


def _unlock_done(task: asyncio.Future[None]) -> None:
    _UNLOCKS.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("topology lock: release failed: %s", task.exception())


def _log_result(task: asyncio.Task[dict[str, Any]]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warning("topology operation failed: %s", exc)


def members_after(view: ClusterView, *, add: Sequence[StorageNode] = (), remove: Sequence[str] = ()
                  ) -> list[StorageNode]:
    """The placement set after adding / removing members."""
    gone = set(remove) | {n.name for n in add}
    kept = [StorageNode(m.name, view.address(m.name), m.weight) for m in view.placement.members
            if m.name not in gone]
    return kept + list(add)
