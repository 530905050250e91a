"""The storage role's share of topology operations inside the daemon.

What a storage daemon runs for issue 8, started by ``StorageRole`` once its service is open:

- its **stream endpoint** (rebalance/endpoint.py) on ``storage.stream-bind`` (default: the host of
  the first ``tcp://`` bind, port 0; ``mem://NAME-stream`` on a mem-only node), advertised as
  ``NodeMeta.transports["stream"]``. The same endpoint receives streams (join targets) and takes
  source-control requests (sources driven by a coordinator elsewhere);
- the **admin routes** of the topology verbs (rebalance.routes.register_admin_routes, bound by operation
  id) over a
  ``DaemonClusterControl`` (daemon_control.py), with one ``OperationRegistry`` per node;
- the **auto-join**: a node that starts outside the ring with ``storage.join-mode = "auto"`` and
  finds an active ring runs the streaming join itself (``runtime.on_join_needed``). Its stream ids
  are fixed by the join and the node's *join generation* (join_generation.py), so a node
  restarted mid-join resumes its streams; a join abandoned before its cutover discards them
  (operations.py), and the generation then goes up, durably, so the next join opens new ones;
- the **release** of columns this node stopped owning: when a committed ring change takes
  columns away from this node (and it is still in the ring), their rows are deleted after
  ``storage.release-delay-s`` (release.py) — if by then no topology operation is running here (no stream sent or
  received, no placement override) and the ring is still the same. The delay leaves time for
  writes computed under the old placement to drain; the guard keeps a later operation's rows;
- the **idle-stream sweep**: every ``IDLE_SWEEP_S`` the endpoint discards the streams that sent
  it nothing for ``endpoint.IDLE_STREAM_DISCARD_S`` (their operation ended without discarding
  them: its coordinator died), dropping the partial rows they brought; the join generation then
  goes up, since one of them may have been this node's own join;
- the answer to ``OperationGet`` (``operation_state``): whether the operation an override's
  lease names still runs here (giaannd/services/override_lease.py);
- the **cluster's topology lock** (cluster_lock.py): the auto-join waits while another operation
  holds it; at start the node releases a lock an earlier life of it left;
- the **automatic repair** (auto_repair.py) when recovery cut a torn update-log tail: the same
  repair as ``giaannctl node repair``, started by the node itself once it is active in the ring
  and sees a live peer, and shown in status (``auto_repair``) and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from giaannd.cluster.view import StorageNode
from giaannd.runtime.ring import no_operation
from giaannd.storage.rebalance.auto_repair import AUTO_REPAIR_STATES, AutoRepair
from giaannd.storage.rebalance.cluster_lock import OperationLockBusy, OperationLockUnavailable
from giaannd.storage.rebalance.daemon_control import STREAM_SCHEME, DaemonClusterControl
from giaannd.storage.rebalance.endpoint import IDLE_STREAM_DISCARD_S, StreamEndpoint
from giaannd.storage.rebalance.join_generation import JoinGeneration
from giaannd.storage.rebalance.operations import OperationRegistry, Rebalance, TopologyOpError, members_after
from giaannd.storage.rebalance.release import release_unowned
from giaannd.storage.rebalance.routes import register_admin_routes
from giaannd.storage.repair.remote import repair_self
from giaannd.storage.replication.hint_delivery import HINT_DRAIN_RETRY
from peers.retry import attempts

if TYPE_CHECKING:
    from giaannd.cluster.ring import Ring
    from giaannd.config import Config
    from giaannd.runtime.node import NodeRuntime
    from giaannd.service import ServiceContext
    from giaannd.storage.replication.service import StorageService

__all__ = ["StorageTopology", "stream_bind_of"]

log = logging.getLogger(__name__)

#: Bound on pushing hinted handoff to completion before a repair compares replicas.
REPAIR_HINT_WAIT_S: Final = 60.0
#: How long a stopping node waits for its cancelled topology operation to clean up (operations.py,
#: "Cleans up when abandoned"), out of the daemon's drain budget (node.drain-timeout-s).
STOP_CLEANUP_WAIT_S: Final = 10.0
#: How often the stream endpoint looks for idle streams to discard (module docstring).
IDLE_SWEEP_S: Final = IDLE_STREAM_DISCARD_S / 8
#: The auto-join's wait for the cluster's topology lock: a try this often, a log line this often.
JOIN_LOCK_RETRY_S: Final = 10.0
JOIN_LOCK_LOG_S: Final = 600.0
#: At start, releasing a lock an earlier life of this node left: a try this often, this many times.
STALE_LOCK_RETRY_S: Final = 5.0
STALE_LOCK_ATTEMPTS: Final = 120


def stream_bind_of(config: Config) -> str:
    """``storage.stream-bind``, else the first tcp bind's host with port 0; on a node bound to
    ``mem://`` only (an in-process cluster), the first mem bind's name plus ``-stream``."""
    if config.storage.stream_bind:
        return config.storage.stream_bind
    for url in config.transport.bind:
        if url.startswith("tcp://"):
            host = url[len("tcp://"):].rpartition(":")[0]
            return f"tcp://{host}:0"
    for url in config.transport.bind:
        if url.startswith("mem://"):
            return f"{url}-stream"
    return "tcp://127.0.0.1:0"


class StorageTopology:
    """Stream endpoint, topology admin routes, auto-join and release for one storage daemon."""

    def __init__(self, config: Config, runtime: NodeRuntime, service: StorageService) -> None:
        self.config, self.runtime, self.service = config, runtime, service
        self.endpoint: StreamEndpoint | None = None
        self.control: DaemonClusterControl | None = None
        self.registry = OperationRegistry()
        self.generation = JoinGeneration(service.data_dir)
        self._release_task: asyncio.Task[None] | None = None
        self.released_rows = 0
        self._ring_seen = 0
        #: the repair started because recovery cut a torn log tail (None: nothing was cut)
        self.auto_repair: AutoRepair | None = None
        self._auto_repair_task: asyncio.Task[Any] | None = None
        self._idle_sweep_task: asyncio.Task[None] | None = None
        self._stale_lock_task: asyncio.Task[None] | None = None
        self._stopped = False  # (the auto-join's wait for the lock ends: ``join``)

    async def start(self, ctx: ServiceContext) -> None:
        rt = self.runtime
        self.control = DaemonClusterControl(rt, self.service)
        self.endpoint = await StreamEndpoint(self.service, self.control.transport,
                                             stream_bind_of(self.config)).open()
        rt.extra_transports[STREAM_SCHEME] = self.endpoint.address
        rt.refresh_meta()
        register_admin_routes(ctx.admin, self.control, self.registry, local_node=self.local_node,
                              repair_fn=self.repair, generation=self.generation)
        rt.on_join_needed = self.join
        rt.rings.operation_state = self.operation_state
        self._idle_sweep_task = ctx.spawn(self._sweep_idle_streams(), "idle-stream-sweep")
        self._stale_lock_task = ctx.spawn(self._release_stale_lock(), "topology-lock-stale")
        self._ring_seen = rt.ring.digest()
        rt.ring_listeners.append(self._on_ring_change)
        log.info("stream endpoint listening address=%s", self.endpoint.address)
        self._start_auto_repair(ctx)

    def _start_auto_repair(self, ctx: ServiceContext) -> None:
        state = ctx.metrics.gauge("giaannd_storage_auto_repair",
                                  "1 for the state the automatic repair after a torn log tail is in", ["state"])
        for name in AUTO_REPAIR_STATES:
            state.labels(name).set_function(self._auto_repair_is(name))
        store = self.service.store
        torn = store.recovery.torn_tail_bytes if store is not None else 0
        if not torn:
            return
        if not self.config.storage.auto_repair:
            log.warning("update log lost %d bytes at recovery and storage.auto-repair is off: run giaannctl "
                        "node repair", torn)
            return
        self.auto_repair = AutoRepair(torn, self.config.storage)
        self._auto_repair_task = ctx.spawn(self.auto_repair.run(self.repair, self._repair_blocked), "auto-repair")

    def _auto_repair_is(self, state: str) -> Callable[[], float]:
        return lambda: float(self.auto_repair is not None and self.auto_repair.state == state)

    def _repair_blocked(self) -> str | None:
        """Why a repair of this node cannot start now (None: it can)."""
        rt = self.runtime
        if not rt.ring.is_active(rt.node_name):
            return "this node is not active in the storage ring"
        peers = [n for n in rt.topology.live() if n != rt.node_name]
        if not peers:
            return "no live storage peer"
        assert self.control is not None
        try:
            for name in peers:
                self.control.stream_address(name)
        except TopologyOpError as exc:
            return str(exc)
        return None

    async def stop(self) -> None:
        self._stopped = True
        self.registry.closed = True  # (a ``begin`` taking the lock now does not start: operations.py)
        self.runtime.on_join_needed = None
        self.runtime.rings.operation_state = no_operation  # (stopped: no operation runs here)
        if self._auto_repair_task is not None:  # before the service it repairs closes
            self._auto_repair_task.cancel()
            with contextlib.suppress(BaseException):
                await self._auto_repair_task
        with contextlib.suppress(ValueError):
            self.runtime.ring_listeners.remove(self._on_ring_change)
        for task in (self._release_task, self._idle_sweep_task, self._stale_lock_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        op = self.registry.current
        if op is not None and op.state not in ("done", "failed", "cancelled"):
            op.cancel()
            # let it clean up (its streams discarded on their receivers, this node's own endpoint
            # among them for a join) before the endpoint closes: a node stopped mid-join then joins
            # afresh at its next start instead of meeting streams its sources gave up
            await self.registry.wait(STOP_CLEANUP_WAIT_S)
        if self.endpoint is not None:
            await self.endpoint.close()
            self.endpoint = None

    async def _release_stale_lock(self) -> None:
        """Release the cluster's topology lock if an earlier life of this node left it held
        (cluster_lock.py): this process runs no operation yet. Tried until the lock's register
        answers (membership may still be forming), a bounded number of times."""
        assert self.control is not None
        for _ in range(STALE_LOCK_ATTEMPTS):
            try:
                if await self.control.cluster_lock().release_own_stale():
                    return
            except OperationLockUnavailable as exc:
                log.info("topology lock: %s", exc)
            await asyncio.sleep(STALE_LOCK_RETRY_S)

    async def _sweep_idle_streams(self, every_s: float = IDLE_SWEEP_S) -> None:
        while True:
            await asyncio.sleep(every_s)
            endpoint = self.endpoint
            if endpoint is None:
                continue
            try:
                if await endpoint.discard_idle():
                    op = self.registry.current
                    if op is None or op.state in ("done", "failed", "cancelled"):
                        self.generation.advance()
            except (OSError, ValueError) as exc:  # a full disk, a damaged join-generation file: next turn
                log.warning("idle-stream sweep: %s", exc)

    def operation_state(self, op_id: str) -> str:
        """The state of the operation ``op_id`` this node coordinates, "" when it runs none of that
        id (``OperationGet``: an override's lease, giaannd/services/override_lease.py)."""
        op = self.registry.current
        return op.state if op is not None and op.op_id == op_id else ""

    # -- join -----------------------------------------------------------------------------------
    def local_node(self) -> StorageNode:
        rt = self.runtime
        address = next(iter(rt.advertised.values()), "")
        return StorageNode(rt.node_name, address, self.config.storage.placement_weight)

    def join_operation(self) -> Rebalance:
        """The streaming join of this node (it becomes active in the ring when it completes)."""
        assert self.control is not None
        view = self.runtime.topology
        # Fixed stream ids: if this node restarts mid-join, its next join resumes the streams the
        # sources still run (from this node's durable positions) instead of starting over; a join
        # abandoned before its cutover discarded them, and the next one takes new ids.
        return Rebalance(self.control, "join", members_after(view, add=[self.local_node()]),
                         stream_nonce=self.generation.current(), after_discard=self.generation.advance)

    async def join(self) -> dict[str, Any]:
        """Run (or return the running) streaming join of this node: the auto-join. While another
        topology operation holds the cluster's lock (cluster_lock.py) it waits for it, trying
        again every ``JOIN_LOCK_RETRY_S`` (nodes started together join one at a time), until this
        service stops: its task (ring_sync.py) lives until the end of the daemon's shutdown, and a
        join started then would run against a closed endpoint, holding the lock."""
        waited = 0.0
        while not self._stopped:
            try:
                op = await self.registry.begin(self.join_operation())
                return op.progress()
            except OperationLockBusy as exc:
                if waited % JOIN_LOCK_LOG_S < JOIN_LOCK_RETRY_S:
                    log.info("join waits for the cluster's topology lock: %s", exc)
            except TopologyOpError:
                if not self._stopped:
                    raise
                break  # stopped while it took the lock: the registry refused it
            if self.runtime.ring.get(self.runtime.node_name) is not None:
                return {"state": "done", "note": "the ring has this node now"}
            await asyncio.sleep(JOIN_LOCK_RETRY_S)
            waited += JOIN_LOCK_RETRY_S
        return {"state": "cancelled", "note": "the node stops"}

    # -- repair -------------------------------------------------------------------------------
    async def repair(self) -> dict[str, Any]:
        """``giaannctl node repair`` here: push hints everywhere until none are held (bounded),
        then rebuild this node's missing batches from its live peers' logs and compare its rows
        with theirs (repair.remote.repair_self). Run it on each storage node to repair all."""
        assert self.control is not None
        control, view = self.control, self.runtime.topology
        live = view.live()
        deadline = asyncio.get_running_loop().time() + REPAIR_HINT_WAIT_S
        async for _ in attempts(HINT_DRAIN_RETRY, deadline=deadline):
            if not await control.hints_held_for(live):
                break
            await control.deliver_hints()
        peers = {n: control.stream_address(n) for n in live if n != self.runtime.node_name}
        report = await repair_self(self.service, control.transport, peers, view.placement)
        report["hints_left"] = await control.hints_held_for(live)
        report["node"] = self.runtime.node_name
        return report

    # -- release --------------------------------------------------------------------------------
    def _on_ring_change(self, ring: Ring) -> None:
        """Schedule a release when the committed ring changed (overrides come and go during a
        cutover; the ring changes once, at its end)."""
        digest = ring.digest()
        if digest == self._ring_seen:
            return
        self._ring_seen = digest
        if not ring.is_active(self.runtime.node_name):
            return  # standby (joining: keeps what it receives) or decommissioned (data dir)
        if self._release_task is not None:
            self._release_task.cancel()
        self._release_task = asyncio.get_running_loop().create_task(self._release_later(digest))

    async def _release_later(self, digest: int) -> None:
        delay = float(self.config.storage.release_delay_s)
        while True:
            await asyncio.sleep(delay)
            endpoint = self.endpoint
            quiet = endpoint is None or time.monotonic() - endpoint.last_activity >= delay
            busy = (self.runtime.topology.override is not None
                    or (endpoint is not None and endpoint.sources.active)
                    or (self.registry.current is not None
                        and self.registry.current.state not in ("done", "failed", "cancelled")))
            if self.runtime.ring.digest() != digest:
                return  # a newer change scheduled its own release
            if quiet and not busy:
                break
        try:
            result = await release_unowned(self.service)
        except (LookupError, RuntimeError, OSError) as exc:
            log.warning("release of unowned columns skipped: %s", exc)
            return
        self.released_rows += result.rows

    # -- health --------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.endpoint is not None:
            out["stream_address"] = self.endpoint.address
            if self.endpoint.idle_discarded:
                out["idle_streams_discarded"] = self.endpoint.idle_discarded
        op = self.registry.current
        if op is not None:
            out["topology_op"] = {"op": op.kind, "state": op.state}
        if self.released_rows:
            out["released_rows"] = self.released_rows
        if self.auto_repair is not None:
            out["auto_repair"] = self.auto_repair.health()
        return out
